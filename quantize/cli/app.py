"""The CLI's shell: the Typer app, its consoles, `--version` / `-q` / `-v`, and the one place
that turns our errors into a one-line message and exit 2 (`App.command` wraps every command).

Results go to stdout (tables, or JSON with --json); progress and messages to stderr. Nothing
here imports torch, transformers or compressed-tensors: `--version` and `--help` answer at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from inspect import cleandoc
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from quantize.errors import QuantizeError

# Neither console reads markup or emoji codes in what it prints: paths, tensor names and
# messages are the user's text (a folder named `[/]` or `:train:` prints as itself); our own
# colours come as rich Text (`tag`).
out = Console(markup=False, emoji=False)
err = Console(stderr=True, soft_wrap=True, markup=False, emoji=False)  # one line a message


def tag(label: str, style: str) -> Text:
    """A coloured label (`error:`, `warning:`) to print before a message."""
    return Text(label, style=style)


# -q / -v (before the command): quiet drops progress bars and progress lines (results,
# warnings and errors stay); verbose shows tracebacks, as each command's --debug does
VERBOSITY = {"quiet": False, "verbose": False}


class Failed(Exception):
    """A command's error with a second line for the user (what the failure left behind)."""

    def __init__(self, error: Exception, hint: str | None) -> None:
        super().__init__(str(error))
        self.error, self.hint = error, hint


JSON_PRINTED = [False]  # whether this process has written its --json object to stdout


def _utf8(obj: object) -> object:
    """`obj` with every string valid UTF-8: a name's undecodable bytes (Python keeps them as
    lone surrogates) shown as `\\xff`, so the JSON on stdout is valid UTF-8."""
    if isinstance(obj, str):
        return obj.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if isinstance(obj, dict):
        return {_utf8(k): _utf8(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_utf8(v) for v in obj]
    return obj


def print_json(d: dict) -> None:
    """--json output: the schema version first, strict JSON (non-finite numbers as null)."""
    from quantize import SCHEMA_VERSION
    from quantize.write.shards import json_text

    out.print_json(json_text(_utf8({"schema_version": SCHEMA_VERSION, **d}), indent=None))
    JSON_PRINTED[0] = True


def run_json(argv: list[str]) -> int:
    """The CLI for a command line with --json: whatever ends it, stdout holds one JSON object.
    An error Typer / click raise before the command runs (an unknown option, a bad value) and
    an interrupt said as {"error": ...} besides their usual message on stderr; returns the exit
    status."""
    # click's usage errors' base class, however typer ships click (vendored in typer >= 0.2x as
    # typer._click, the click package in 0.16): the one in BadParameter's ancestry
    click_error = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    try:
        rc = app(args=argv, prog_name="quantize", standalone_mode=False)
    except click_error as e:
        show = getattr(e, "show", None)
        show() if show else err.print(str(e), highlight=False)
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        print_json({"error": message, "problems": [], "hint": "see --help"})
        return int(getattr(e, "exit_code", 2))
    except typer.Abort:
        err.print("aborted", highlight=False)
        print_json({"error": "aborted", "problems": [], "hint": None})
        return 1
    rc = rc if isinstance(rc, int) else 0
    if rc and not JSON_PRINTED[0]:
        what = "interrupted" if rc == 130 else f"exit status {rc}"
        print_json({"error": what, "problems": [], "hint": "rerun the same command (a conversion "
                    "resumes where it stopped)" if rc == 130 else None})
    return rc


# import name -> what to install, for the packages a command imports when it runs (`--help`,
# `--version`, `inspect` need none of them)
NEEDED = {"torch": "torch", "transformers": "transformers", "safetensors": "safetensors",
          "compressed_tensors": "compressed-tensors", "huggingface_hub": "huggingface_hub",
          "tokenizers": "tokenizers", "jinja2": "jinja2"}


def _one_line_errors(command: Callable) -> Callable:
    """`command` with our errors (QuantizeError, ValueError; `Failed` adds a hint) said as one
    line on stderr (and, with --json, as a JSON object on stdout) and exit 2; `--debug` or `-v`
    re-raises them with their traceback."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (QuantizeError, ValueError, Failed) as e:
            error, hint = (e.error, e.hint) if isinstance(e, Failed) else (e, None)
            if kwargs.get("debug") or VERBOSITY["verbose"]:
                raise error from None
            if kwargs.get("json_"):
                summary = error.summary if isinstance(error, QuantizeError) else str(error)
                problems = [str(p) for p in getattr(error, "problems", [])]
                print_json({"error": summary, "problems": problems, "hint": hint})
            err.print(tag("error:", "red"), f"{error}", highlight=False)
            if hint:
                err.print(hint, highlight=False)  # (markup off: the hint as written)
            raise typer.Exit(2) from None
        except ModuleNotFoundError as e:  # a dependency the command needs is not installed
            top = (e.name or "").split(".")[0]
            if kwargs.get("debug") or VERBOSITY["verbose"] or top not in NEEDED:
                raise
            what = f"this command needs {NEEDED[top]}, which is not installed"
            fix = f"pip install {NEEDED[top]} (or: make install, which pins every version)"
            if kwargs.get("json_"):
                print_json({"error": what, "problems": [], "hint": fix})
            err.print(tag("error:", "red"), f"{what}; {fix}", highlight=False)
            raise typer.Exit(2) from None

    return run


def reflow(doc: str | None) -> str:
    """A command's docstring as its --help text: each prose paragraph on one line, for the
    terminal to wrap at its own width (the docstring's line breaks, at ~95 columns, left ragged
    fragments on an 80-column terminal). A paragraph with an indented line or a "- " item (the
    examples, lists) keeps its lines."""
    paragraphs = cleandoc(doc or "").split("\n\n")
    return "\n\n".join(
        p if any(line[:1].isspace() or line.startswith("- ") for line in p.splitlines()[1:])
        else " ".join(line.strip() for line in p.splitlines())
        for p in paragraphs)


class App(typer.Typer):
    """typer.Typer whose every command goes through `_one_line_errors`, its help reflowed."""

    def command(self, *args, **kwargs):
        def decorate(f: Callable) -> Callable:
            kw = kwargs if "help" in kwargs else {**kwargs, "help": reflow(f.__doc__)}
            super(App, self).command(*args, **kw)(_one_line_errors(f))
            return f

        return decorate


app = App(
    help="Stream FP8/BF16 GLM MoE checkpoints into compressed-tensors INT4 (W4A16) checkpoints.\n\n"
         "Typical run:  quantize inspect SRC; quantize plan SRC --tp 8; "
         "quantize convert SRC DST; quantize verify SRC DST",
    no_args_is_help=True,
    rich_markup_mode="rich",  # the default, said: typer 0.16 otherwise joined the examples' lines
    pretty_exceptions_show_locals=False,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    """The versions as installed (package metadata): nothing of torch, transformers or
    compressed-tensors is imported, so it answers at once (it took ~11 s importing them)."""
    if value:
        from importlib.metadata import PackageNotFoundError, version

        from quantize import __version__

        def v(dist: str) -> str:
            try:
                return version(dist)
            except PackageNotFoundError:
                return "not installed"

        typer.echo(f"glm-int4-quantize {__version__} (torch {v('torch')}, transformers "
                   f"{v('transformers')}, compressed-tensors {v('compressed-tensors')})")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option(
        "--version", "-V", callback=_version, is_eager=True,
        help="Print the version (and torch / transformers / compressed-tensors) and exit.")] = False,
          quiet: Annotated[bool, typer.Option(
              "--quiet", "-q", help="No progress bars or progress lines; results, warnings and "
                                    "errors only.")] = False,
          verbose: Annotated[bool, typer.Option(
              "--verbose", "-v", help="Full tracebacks on errors (every command's --debug).")] = False,
          ) -> None:
    """Stream FP8/BF16 GLM MoE checkpoints into compressed-tensors INT4 (W4A16) checkpoints.

    Typical run:  quantize inspect SRC; quantize plan SRC --tp 8; quantize convert SRC DST;
    quantize verify SRC DST.  -q / -v go before the command: quantize -q convert SRC DST
    """
    VERBOSITY["quiet"], VERBOSITY["verbose"] = quiet, verbose


def progress(disable: bool = False, eta: bool = True) -> Progress:
    """The bar on a terminal only (a log file gets `reporters`' time-stamped lines instead of a
    bar drawn once at the end); `eta`: a time-left column from the bytes done (off where the
    bytes do not track the time: a calibrated run's layers)."""
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
               TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), *([TimeRemainingColumn()] if eta else [])]
    return Progress(*columns, console=err, transient=False,
                    disable=disable or VERBOSITY["quiet"] or not err.is_terminal)


def reporters(bar: Progress, verb: str, total: int | None = None, quiet: bool = False,
              eta: bool = True):
    """(step(unit): the bar advanced by the unit's source bytes, and every 5 % a timestamped
    line when stderr is not a terminal (nohup, Slurm, CI logs), with the time left from the
    bytes unless `eta` is off (a calibrated run says it per layer instead); line(text): a timestamped line,
    so the time of each step can be read off a log; step.start(total): the bytes to go, when
    known only later). `verb`: the bar's name ("N% converted: ..." in the lines)."""
    import time

    from quantize.sizes import fmt_bytes

    task = bar.add_task(verb, total=total, rate="")
    done_verb = {"convert": "converted", "verify": "verified"}.get(verb, verb + "ed")
    t0 = time.perf_counter()
    logged = [0]  # the last 5 % step printed as a line

    def line(text: str) -> None:
        if quiet or VERBOSITY["quiet"]:
            return
        now = time.time()
        stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
        bar.console.print(f"{stamp} {text}", highlight=False, markup=False)

    def start(nbytes: int) -> None:
        bar.update(task, total=nbytes)

    def step(unit) -> None:
        bar.advance(task, unit.source_bytes)
        done, to_go = bar.tasks[task].completed, bar.tasks[task].total or 1
        spent = max(time.perf_counter() - t0, 1e-9)
        bar.update(task, rate=f"{done / spent / 2**20:,.0f} MiB/s")
        pct = int(100 * done / max(to_go, 1))
        if not err.is_terminal and pct // 5 > logged[0] // 5:
            logged[0] = pct
            left = spent * (to_go - done) / max(done, 1)
            line(f"{pct}% {done_verb}: {fmt_bytes(done)} of {fmt_bytes(to_go)} read, "
                 f"{done / spent / 2**20:,.0f} MiB/s, {spent / 60:.1f} min so far"
                 + (f", ~{left / 60:.1f} min left" if eta else ""))

    step.start = start
    return step, line
