"""`quantize`: the command line. One function per command, no logic beyond argument plumbing.

Results go to stdout (tables, or JSON with --json); progress and messages to stderr.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from quantize.errors import Problem, QuantizeError
from quantize.names import RUN_RECORD
from quantize.options import EXPERT_CALIBRATION, METHODS, MTP_POLICIES, SCHEMES

app = typer.Typer(
    help="Stream FP8/BF16 GLM MoE checkpoints into compressed-tensors INT4 (W4A16) checkpoints.\n\n"
         "Typical run:  quantize inspect SRC; quantize plan SRC --tp 8; "
         "quantize convert SRC DST; quantize verify SRC DST",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish
    context_settings={"help_option_names": ["-h", "--help"]},
)
out = Console()
err = Console(stderr=True, soft_wrap=True)  # messages stay one line for logs and grep
# -q / -v (before the command): quiet drops progress bars and progress lines (results,
# warnings and errors stay); verbose shows tracebacks, as each command's --debug does
VERBOSITY = {"quiet": False, "verbose": False}


def _choices(name: str, values: tuple[str, ...]) -> type[Enum]:
    """A str Enum of the values options.py validates (one list: --help shows exactly those)."""
    return Enum(name, {v.replace("+", "_"): v for v in values}, type=str)


Method = _choices("Method", METHODS)
Scheme = _choices("Scheme", SCHEMES)
Mtp = _choices("Mtp", MTP_POLICIES)
ExpertCalibration = _choices("ExpertCalibration", EXPERT_CALIBRATION)

SchemeOpt = Annotated[Scheme, typer.Option(
    "--scheme", help="w4a16: INT4 weights, BF16 activations (Marlin/WNA16). w4afp8: the same INT4 "
                     "weights with dynamic per-token FP8 activations declared (CUTLASS W4A8 MoE on "
                     "Hopper; needs --group-size 128, symmetric; plan says which TP sizes work).")]
KeepFp8 = Annotated[bool, typer.Option(
    "--keep-fp8", help="Keep the non-target FP8 Linears FP8 with their scales (a second, "
                       "float-quantized config group; vLLM reads mixed-precision, SGLang does "
                       "not) instead of widening them to BF16: GLM-5.2 404.3 GiB instead of 419.9.")]
MtpOpt = Annotated[Mtp, typer.Option(
    "--mtp", help="The MTP (speculative decoding) layer's Linears: int4 like the others, or keep "
                  "them as in the source (BF16): published runs saw an INT4 MTP head collapse "
                  "the draft acceptance rate.")]


class EvalDtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


def _value(x):
    return x.value if isinstance(x, Enum) else x


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

Src = Annotated[str, typer.Argument(
    help="Source checkpoint: a folder (config.json + safetensors) or a Hub repo id org/name.")]
Revision = Annotated[str | None, typer.Option(
    "--revision", help="Hub source only: branch, tag or commit to read (default: main).")]
Dst = Annotated[Path, typer.Argument(help="Output folder for the INT4 checkpoint.")]
GroupSize = Annotated[int, typer.Option("--group-size", "-g", help="INT4 group size: 32, 64 or 128.")]
Targets = Annotated[str, typer.Option(
    "--targets", help="Comma list of Linear roles to quantize: routed, shared, dense.")]
Asym = Annotated[bool, typer.Option(
    "--asymmetric", help="Store zero points (vLLM Marlin reads them; SGLang MoE and transformers do not).")]
Tp = Annotated[int, typer.Option("--tp", help="Tensor-parallel size to check the layout against.")]
Json = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")]


def _print_json(d: dict) -> None:
    """--json output: the schema version first, strict JSON (non-finite numbers as null)."""
    from quantize import SCHEMA_VERSION
    from quantize.shards import json_text

    out.print_json(json_text({"schema_version": SCHEMA_VERSION, **d}, indent=None))


def _options(method: str, group_size: int, targets: str, asymmetric: bool, max_shard_size: str = "5GB",
             **calibration):
    from quantize.options import ConvertOptions, parse_size

    calibration = {k: _value(v) for k, v in calibration.items()}
    return ConvertOptions(method=_value(method), group_size=group_size, symmetric=not asymmetric,
                          targets=frozenset(t.strip() for t in targets.split(",") if t.strip()),
                          max_shard_size=parse_size(max_shard_size), **calibration)


def _fail(e: Exception, debug: bool, hint: str | None = None) -> None:
    if debug or VERBOSITY["verbose"]:
        raise e
    err.print(f"[red]error:[/] {e}", highlight=False)
    if hint:
        err.print(hint, highlight=False)
    raise typer.Exit(2)


def _progress(disable: bool = False) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
                    TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    console=err, transient=False, disable=disable or VERBOSITY["quiet"])


@app.command()
def inspect(src: Src, revision: Revision = None, json_: Json = False, debug: Debug = False) -> None:
    """What a checkpoint holds: format, layers, experts, bytes by category. Reads headers only.

    Examples:
      quantize inspect ./GLM-5.2-FP8
      quantize inspect zai-org/GLM-5.2-FP8       # Hub: config + safetensors headers, no weights
      quantize inspect ./GLM-5.2-INT4            # an INT4 output: scheme, INT4 Linears, bytes
    """
    from quantize.hub import resolve_source
    from quantize.report import (
        inspect_data,
        inspect_int4_data,
        inspect_int4_table,
        inspect_table,
        int4_folder,
    )

    try:
        if int4_folder(src):  # our own output (or any pack-quantized folder)
            d = inspect_int4_data(src)
            _print_json(d) if json_ else out.print(inspect_int4_table(d))
            return
        d = inspect_data(resolve_source(src, revision, headers_only=True))
    except (QuantizeError, ValueError) as e:
        _fail(e, debug)
    _print_json(d) if json_ else out.print(inspect_table(d))


@app.command()
def plan(
    src: Src,
    tp: Tp = 8,
    group_size: GroupSize = 32,
    targets: Targets = "routed",
    asymmetric: Asym = False,
    max_shard_size: Annotated[str, typer.Option(help="Largest output shard, e.g. 5GB, 512MiB.")] = "5GB",
    method: Annotated[Method, typer.Option(
        help="Calibrated methods add their resume checkpoints to the disk needed.")] = Method.rtn,
    scheme: SchemeOpt = Scheme.w4a16,
    mtp: MtpOpt = Mtp.int4,
    keep_fp8: KeepFp8 = False,
    num_samples: Annotated[int, typer.Option(help="Calibration sequences (calibrated methods).")] = 128,
    seq_len: Annotated[int, typer.Option(help="Tokens per calibration sequence.")] = 2048,
    json_: Json = False,
    strict: Annotated[bool, typer.Option(help="Exit 1 when a serving check fails.")] = False,
    revision: Revision = None,
    debug: Debug = False,
) -> None:
    """Predict the output size and per-GPU weight memory; check the serving kernels' rules.

    Reads only the index and safetensors headers. The prediction is the exact byte count
    `convert` writes.

    Examples:
      quantize plan ./GLM-5.2-FP8 --tp 8
      quantize plan ./GLM-4.6-FP8 --tp 8 --group-size 128     # warns: 1536/8 = 192
      quantize plan zai-org/GLM-5.2-FP8 --tp 8                # Hub: headers only
      quantize plan ./GLM-5.2-FP8 --method gptq --num-samples 512   # + checkpoint disk
      quantize plan ./GLM-5.2-INT4 --tp 8        # an INT4 output: the serving checks at TP 8
    """
    from quantize.hub import resolve_source
    from quantize.plan import make_plan
    from quantize.report import (
        inspect_int4_data,
        inspect_int4_table,
        int4_folder,
        plan_data,
        plan_tables,
    )

    if int4_folder(src):  # an INT4 output: where it can be served, nothing left to plan
        try:
            d = inspect_int4_data(src, tp)
        except (QuantizeError, ValueError) as e:
            _fail(e, debug)
        if json_:
            _print_json(d)
        else:
            out.print(inspect_int4_table(d))
            for c in d["checks_at_tp"]["checks"]:
                out.print(f"TP {tp}: {c['level']:4}  {c['what']}: {c['detail']}", highlight=False)
        failed = [c for c in d["checks_at_tp"]["checks"] if c["level"] == "fail"]
        for c in failed:
            err.print(f"[yellow]warning:[/] TP {tp}: {c['what']}: {c['detail']}", highlight=False)
        if failed and strict:
            raise typer.Exit(1)
        return
    try:
        ckpt = resolve_source(src, revision, headers_only=True)
        d = plan_data(make_plan(ckpt, _options(method, group_size, targets, asymmetric,
                                               max_shard_size, num_samples=num_samples,
                                               seq_len=seq_len, scheme=scheme, mtp=mtp,
                                               keep_fp8=keep_fp8), tp))
    except (QuantizeError, ValueError) as e:
        _fail(e, debug)
    if json_:
        _print_json(d)
    else:
        for t in plan_tables(d):
            out.print(t)
    failed = [c for c in d["checks"] if c["level"] == "fail"]
    for c in failed:
        err.print(f"[yellow]warning:[/] {c['what']}: {c['detail']}", highlight=False)
    if failed and strict:
        raise typer.Exit(1)


def _public_command(args: list[str], src: str, dst: Path, base_model: str | None) -> str:
    """The convert command line as the manifest and the card record it: no local path of this
    machine (the folder gets published). SRC becomes its repo id (or folder name), DST its
    name, any other argument naming an existing file or folder (--calib) its name."""
    from quantize.hub import source_identity

    src_name = source_identity(src, base_model)["name"] if Path(src).exists() else src
    out = []
    for a in args:
        flag, eq, val = a.partition("=") if a.startswith("--") else ("", "", a)
        if val == src:
            val = src_name
        elif val == str(dst) or (val and Path(val).exists() and ("/" in val or "\\" in val)):
            val = Path(val).name
        out.append(flag + eq + val if eq else val)
    return shlex.join(["quantize", *out])



# convert's parameters a run record / --config file may set
RUN_KEYS = ("src", "method", "group_size", "scheme", "mtp", "keep_fp8", "targets", "asymmetric", "max_shard_size", "calib",
            "num_samples", "seq_len", "seed", "expert_calibration", "min_expert_tokens",
            "percdamp", "mse_clip", "rtn_fallback", "checkpoint_interval", "max_gpu_memory",
            "device", "tp", "revision", "base_model")


def _read_run_file(path: Path, what: str) -> dict:
    """A TOML file of convert options (keys as the long flags, `-` or `_`; a [convert] table or
    top-level keys) -> {parameter: value}; unknown keys and bad TOML are refused by name."""
    import tomllib

    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise typer.BadParameter(f"{path}: {e}", param_hint=what) from None
    data = data.get("convert", data)
    got = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(got) - set(RUN_KEYS))
    if unknown:
        raise typer.BadParameter(f"{path}: unknown option(s) {', '.join(unknown)}; known: "
                                 f"{', '.join(RUN_KEYS)}", param_hint=what)
    if isinstance(got.get("targets"), list):
        got["targets"] = ",".join(got["targets"])
    return got


def _config_callback(ctx: typer.Context, value: Path | None) -> Path | None:
    if value is not None:  # defaults from the file; flags on the command line still win
        ctx.default_map = {**(ctx.default_map or {}), **_read_run_file(value, "--config")}
    return value


def _from_callback(ctx: typer.Context, value: Path | None) -> Path | None:
    if value is not None:
        rec = value / RUN_RECORD
        if not rec.is_file():
            raise typer.BadParameter(f"{rec} does not exist: not a folder `quantize convert` "
                                     "wrote (or one from before run records)", param_hint="--from")
        ctx.default_map = {**_read_run_file(rec, "--from"), **(ctx.default_map or {})}
    return value


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a TOML basic string: JSON's escapes are TOML's


def _write_run_record(dst: Path, values: dict) -> None:
    """DST/quantize-run.toml: every convert option as this run resolved it, replayable with
    `quantize convert --from DST` or `--config DST/quantize-run.toml`."""
    from quantize import __version__
    from quantize.shards import write_bytes_atomic

    lines = [f"# quantize convert's options for this folder, glm-int4-quantize {__version__}",
             "# replay: quantize convert --from DST NEW_DST  (or --config this-file SRC NEW_DST)",
             "[convert]"]
    lines += [f"{k} = {_toml_value(_value(v))}" for k, v in values.items() if v is not None]
    write_bytes_atomic(dst / RUN_RECORD, ("\n".join(lines) + "\n").encode())


@app.command()
def convert(
    src: Annotated[str | None, typer.Argument(
        help="Source checkpoint: a folder or a Hub repo id org/name (with --from: default the "
             "recorded one).", show_default=False)] = None,
    dst: Annotated[Path | None, typer.Argument(
        help="Output folder for the INT4 checkpoint.", show_default=False)] = None,
    method: Annotated[Method, typer.Option(
        help="Rounding: rtn (no data), gptq, awq or awq+gptq (calibrated, layer by layer).")] = Method.rtn,
    group_size: GroupSize = 32,
    scheme: SchemeOpt = Scheme.w4a16,
    mtp: MtpOpt = Mtp.int4,
    keep_fp8: KeepFp8 = False,
    targets: Targets = "routed",
    asymmetric: Asym = False,
    max_shard_size: Annotated[str, typer.Option(help="Largest output shard, e.g. 5GB, 512MiB.")] = "5GB",
    calib: Annotated[str | None, typer.Option(
        help="Calibration text: .jsonl (text or chat messages), .txt/.md, .parquet, a saved "
             "datasets folder, or a Hub dataset ORG/NAME[@REVISION][:SPLIT] (default split: "
             "train). Default: the shipped calib_data/default.jsonl.",
        rich_help_panel="Calibration (gptq, awq)")] = None,
    num_samples: Annotated[int, typer.Option(
        help="Calibration sequences.", rich_help_panel="Calibration (gptq, awq)")] = 128,
    seq_len: Annotated[int, typer.Option(
        help="Tokens per calibration sequence.", rich_help_panel="Calibration (gptq, awq)")] = 2048,
    seed: Annotated[int, typer.Option(
        help="Seed for sampling the calibration windows.", rich_help_panel="Calibration (gptq, awq)")] = 0,
    expert_calibration: Annotated[ExpertCalibration, typer.Option(
        help="routed: each expert's statistics from its routed tokens; all: every expert sees "
             "every token (llm-compressor's way).",
        rich_help_panel="Calibration (gptq, awq)")] = ExpertCalibration.routed,
    min_expert_tokens: Annotated[int, typer.Option(
        help="Experts routed fewer tokens use all-token statistics (reported).",
        rich_help_panel="Calibration (gptq, awq)")] = 16,
    percdamp: Annotated[float, typer.Option(
        help="GPTQ dampening, relative to the mean Hessian diagonal (0.01, the papers' value, "
             "overfits narrow calibration text: BENCHMARKS.md).",
        rich_help_panel="Calibration (gptq, awq)")] = 0.1,
    mse_clip: Annotated[bool | None, typer.Option(
        "--mse-clip/--no-mse-clip", help="GPTQ: search each group's clipping range (1.00-0.80 of "
        "min/max) for the least Hessian-weighted squared error instead of the full range. "
        "Default: on for gptq and awq+gptq (held-out perplexity added ~3x smaller on SmolLM2; "
        "on CUDA one Triton kernel, under 1 s per GLM-5.2 MoE layer).",
        show_default=False, rich_help_panel="Calibration (gptq, awq)")] = None,
    rtn_fallback: Annotated[bool, typer.Option(
        help="A calibrated layer whose output error on the calibration tokens exceeds "
             "round-to-nearest's by 1.5x stops the run by default; with this flag that layer is "
             "rounded to nearest instead (the calibration report and the card list it).",
        rich_help_panel="Calibration (gptq, awq)")] = False,
    checkpoint_interval: Annotated[float, typer.Option(
        help="Seconds between the calibration's resume checkpoints, at least (written in the "
             "background; a crash repeats about this much work; 0: after every layer; inf: "
             "none, a crash restarts the calibration).",
        rich_help_panel="Calibration (gptq, awq)")] = 300.0,
    max_gpu_memory: Annotated[float | None, typer.Option(
        help="GiB of GPU memory the calibration may hold (default: all of it): hidden states "
             "move to host memory and GPTQ solves fewer experts at once to stay under it; "
             "beyond it torch raises out-of-memory instead of exceeding it. 75 runs a GLM-5.2 "
             "calibration as on an 80 GB GPU.", rich_help_panel="Calibration (gptq, awq)")] = None,
    device: Annotated[str, typer.Option(help="auto (GPU when present), cpu or cuda[:N].")] = "auto",
    resume: Annotated[bool, typer.Option(
        help="Continue an interrupted conversion in DST (also automatic when DST has a manifest).")] = False,
    overwrite: Annotated[bool, typer.Option(help="Delete DST's contents and start over.")] = False,
    tp: Tp = 8,
    revision: Revision = None,
    base_model: Annotated[str | None, typer.Option(
        help="The Hub repo SRC is a copy of (ORG/NAME), for the card's base_model; default: the "
             "repo a Hub-cache source came from. Pass it for a local copy, e.g. after "
             "`hf download --local-dir`.")] = None,
    json_: Annotated[bool, typer.Option(
        "--json", help="At the end, print a JSON summary (shards, bytes, seconds) on stdout.")] = False,
    config: Annotated[Path | None, typer.Option(
        "--config", is_eager=True, callback=_config_callback, exists=False,
        help="A TOML file of convert options (keys as the long flags; flags given on the "
             "command line win), e.g. a run record DST/quantize-run.toml.")] = None,
    from_: Annotated[Path | None, typer.Option(
        "--from", is_eager=True, callback=_from_callback,
        help="Replay the run that made this output folder: its options (and SRC) from its "
             "quantize-run.toml; flags given here win.")] = None,
    debug: Debug = False,
) -> None:
    """Convert SRC to a compressed-tensors pack-quantized INT4 checkpoint in DST.

    Streams one tensor at a time: memory stays bounded by the largest tensor, not the model.
    Each shard is written atomically and recorded in DST/quantize-manifest.json, so an
    interrupted run continues with --resume.

    Examples:
      quantize convert ./GLM-5.2-FP8 ./GLM-5.2-INT4
      quantize convert ./GLM-4.6-FP8 ./GLM-4.6-INT4 --group-size 64 --targets routed,shared
      quantize convert ./GLM-5.2-FP8 ./GLM-5.2-W4AFP8 --scheme w4afp8 --group-size 128
      quantize convert ./GLM-5.2-FP8 ./GLM-5.2-INT4 --resume
      quantize convert zai-org/GLM-5.2-FP8 ./GLM-5.2-INT4     # downloads into HF_HOME first
      quantize convert ./GLM-5.2-FP8 ./GLM-5.2-INT4 --base-model zai-org/GLM-5.2-FP8
      quantize convert ./GLM-5.2-FP8 ./GLM-5.2-INT4 --method gptq --num-samples 512
      quantize convert ./GLM-5.2-FP8 ./GLM-5.2-INT4 --method awq+gptq --calib my.jsonl
      quantize convert ./GLM-5.2-FP8 ./GLM-5.2-INT4 --method awq+gptq --rtn-fallback
      quantize convert ./GLM-5.2-FP8 ./GLM-5.2-INT4 --method gptq --calib HuggingFaceH4/ultrachat_200k:train_sft
      torchrun --nproc-per-node 8 -m quantize convert ./GLM-5.2-FP8 ./GLM-5.2-INT4 --method gptq
      quantize convert --config run.toml ./GLM-5.2-FP8 ./GLM-5.2-INT4   # options from a file
      quantize convert --from ./GLM-5.2-INT4 ./GLM-5.2-INT4-again       # replay a recorded run

    Every run writes its resolved options to DST/quantize-run.toml (a local record: not among
    the files `push` uploads).
    """
    from quantize.checkpoint import open_checkpoint
    from quantize.distributed import init
    from quantize.hub import is_dataset_spec, resolve_source
    from quantize.manifest import read_manifest
    from quantize.pipeline import convert as run_convert
    from quantize.plan import make_plan
    from quantize.sizes import fmt_bytes

    if dst is None and from_ is not None and src is not None:  # `--from OLD NEW`: NEW is DST
        dst, src = Path(src), _read_run_file(from_ / RUN_RECORD, "--from").get("src")
    if src is None or dst is None:
        raise typer.BadParameter("SRC and DST are required (SRC may come from --from or --config)",
                                 param_hint="SRC DST")
    dst = Path(dst)
    record = {"src": src, "method": method, "group_size": group_size, "scheme": scheme, "mtp": mtp,
              "keep_fp8": keep_fp8,
              "targets": targets,
              "asymmetric": asymmetric, "max_shard_size": max_shard_size,
              "calib": None if calib is None or is_dataset_spec(calib) else str(Path(calib).resolve()),
              "num_samples": num_samples, "seq_len": seq_len, "seed": seed,
              "expert_calibration": expert_calibration, "min_expert_tokens": min_expert_tokens,
              "percdamp": percdamp, "mse_clip": mse_clip, "rtn_fallback": rtn_fallback,
              "checkpoint_interval": checkpoint_interval,
              "max_gpu_memory": max_gpu_memory, "device": device, "tp": tp, "revision": revision,
              "base_model": base_model}
    command = _public_command(sys.argv[1:], src, dst, base_model) \
        if sys.argv[0].endswith("quantize") else None
    d = init(device)  # under torchrun: this rank (rank 0 prints and writes, the others compute)
    quiet = d is not None and not d.leader
    try:
        opts = _options(method, group_size, targets, asymmetric, max_shard_size,
                        calib=calib, num_samples=num_samples, seq_len=seq_len, seed=seed,
                        expert_calibration=expert_calibration,
                        min_expert_tokens=min_expert_tokens, percdamp=percdamp,
                        mse_clip=mse_clip, scheme=scheme, mtp=mtp, keep_fp8=keep_fp8,
                        rtn_fallback=rtn_fallback)
        if base_model is not None:
            from quantize.hub import is_repo_id

            if not is_repo_id(base_model):
                raise QuantizeError("--base-model is not a Hub repo id", [Problem(
                    "--base-model", None, repr(base_model), "ORG/NAME, e.g. zai-org/GLM-5.2-FP8",
                    "pass the repo id the source was downloaded from")])
        local = resolve_source(src, revision, headers_only=False)
        ckpt = open_checkpoint(local)
        plan_ = make_plan(ckpt, opts, tp)
        for c in plan_.checks:
            if c.level != "ok" and not quiet:
                err.print(f"[yellow]warning:[/] {c.what}: {c.detail}", highlight=False)
        prev = read_manifest(dst) if dst.is_dir() and not overwrite and not quiet else None
        if prev is not None:
            done = sum(s.file in prev.get("files", {}) for s in plan_.shards)
            err.print(f"found {dst / 'quantize-manifest.json'} ({prev.get('status')}, {done} of "
                      f"{len(plan_.shards)} shards recorded): resuming it; finished shards are "
                      "re-hashed and kept (--overwrite starts over)", highlight=False)
        total = sum(u.source_bytes for u in plan_.units)
        t0 = time.perf_counter()
        with _progress(disable=quiet) as bar:
            task = bar.add_task("convert", total=total, rate="")

            logged = [0]  # the last 5 % step printed as a line (stderr not a terminal)

            def step(unit) -> None:
                bar.advance(task, unit.source_bytes)
                done = bar.tasks[0].completed
                spent = max(time.perf_counter() - t0, 1e-9)
                bar.update(task, rate=f"{done / spent / 2**20:,.0f} MiB/s")
                pct = int(100 * done / max(total, 1))
                if not err.is_terminal and pct // 5 > logged[0] // 5:  # nohup, Slurm, CI logs
                    logged[0] = pct
                    left = spent * (total - done) / max(done, 1)
                    line(f"{pct}% converted: {fmt_bytes(done)} of {fmt_bytes(total)} read, "
                         f"{done / spent / 2**20:,.0f} MiB/s, {spent / 60:.1f} min so far, "
                         f"~{left / 60:.1f} min left")

            def line(text: str) -> None:  # timestamped: per-layer wall times read off the log
                if quiet or VERBOSITY["quiet"]:
                    return
                now = time.time()
                stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
                bar.console.print(f"{stamp} {text}", highlight=False, markup=False)

            line(f"convert {src} -> {dst}: {fmt_bytes(total)} to read, {len(plan_.shards)} shard(s) "
                 f"of {fmt_bytes(plan_.output_bytes)}, method {_value(method)}"
                 + (f" (MSE clip {'on' if opts.mse_clip else 'off'}, dampening {opts.percdamp:g})"
                    if "gptq" in opts.method else "") + f", device {device}")
            if checkpoint_interval < 0:
                raise ValueError("--checkpoint-interval must be >= 0 seconds")
            res = run_convert(local, dst, opts, device=device, resume=resume, overwrite=overwrite,
                              on_unit=step, command=command, log=line, tp=tp,
                              checkpoint_interval=checkpoint_interval, dist=d,
                              base_model=base_model,
                              max_gpu_memory=None if max_gpu_memory is None
                              else int(max_gpu_memory * 2**30))
    except (QuantizeError, ValueError) as e:
        from quantize.manifest import output_state

        if quiet:
            _fail(e, debug, f"(rank {d.rank} of {d.world})")
        _fail(e, debug, output_state(dst))
    except KeyboardInterrupt:
        from quantize.manifest import output_state

        err.print(f"interrupted: {output_state(dst)}", highlight=False)
        raise typer.Exit(130) from None
    if d is not None:
        import torch.distributed

        torch.distributed.destroy_process_group()
    if res is None:  # a rank other than 0: its share is done, rank 0 reports
        return
    try:
        _write_run_record(dst, record)
    except QuantizeError as e:
        _fail(e, debug)
    dt = time.perf_counter() - t0
    if json_:
        _print_json({"output": dst.name, "device": str(res.device), "seconds": round(dt, 1),
                     "shards_written": res.written, "shards_kept": res.skipped,
                     "output_bytes": res.plan.output_bytes, "source_bytes": total,
                     "method": _value(method),
                     "calibration_layers": None if res.calibration is None
                     else len(res.calibration.get("layers", []))})
    err.print(f"[green]done[/] in {dt:.1f} s on {res.device}: {len(res.written)} shard(s) written, "
              f"{len(res.skipped)} kept from an earlier run; {fmt_bytes(res.plan.output_bytes)} "
              f"({fmt_bytes(total)} read, {total / dt / 2**20:,.0f} MiB/s)", highlight=False)
    if res.calibration is not None:  # a table: stdout, unless stdout is the JSON's
        _calibration_summary(res.calibration, dst, err if json_ else out)
    err.print(f"next: quantize verify {src} {dst}", highlight=False)


def _calibration_summary(rep: dict, dst: Path, console) -> None:
    """Per layer: Linears rounded, tokens, experts' routed-token range, fallbacks, time."""
    from rich.table import Table

    c = rep["calibration"]
    try:  # the times are beside the report (calibrate.CALIB_TIMINGS), not in it
        seconds = {lay["layer"]: lay.get("seconds", 0) for lay in json.loads(
            (dst / "calibration" / "timings.json").read_text())["layers"]}
    except (OSError, ValueError, KeyError, TypeError):
        seconds = {}
    t = Table(title=f"calibration: {rep['method']}, {c['num_samples']} x {c['seq_len']} tokens "
                    f"from {c['source']}, experts {rep['expert_calibration']}")
    for col in ("layer", "MLP", "Linears", "expert tokens min/median/max", "fallback experts", "s"):
        t.add_column(col, justify="left" if col in ("MLP", "fallback experts") else "right")
    for lay in rep["layers"]:
        et = sorted(lay.get("expert_tokens") or [])
        spread = f"{et[0]:,} / {et[len(et) // 2]:,} / {et[-1]:,}" if et else "-"
        fb = lay.get("fallback") or []
        t.add_row(str(lay["layer"]), str(lay.get("mlp", "-")), str(lay.get("quantized", 0)), spread,
                  (", ".join(str(f["expert"]) for f in fb[:12]) + (" ..." if len(fb) > 12 else ""))
                  if fb else "-", f"{seconds.get(lay['layer'], 0):.1f}")
    console.print(t)
    if c.get("overlapping"):
        err.print(f"[yellow]note:[/] the {c['num_samples']} calibration windows overlap: "
                  f"{c['source']} holds {c['stream_tokens']:,} tokens", highlight=False)
    n_fb = sum(len(lay.get("fallback") or []) for lay in rep["layers"])
    if n_fb:
        err.print(f"[yellow]note:[/] {n_fb} expert(s) had fewer than --min-expert-tokens "
                  f"{rep['min_expert_tokens']} routed tokens and used all-token statistics; "
                  f"see {dst / 'calibration-report.json'}", highlight=False)


@app.command()
def verify(
    src: Src,
    dst: Dst,
    min_sqnr: Annotated[float, typer.Option(help="Fail when an INT4 tensor's SQNR (dB) is below this.")] = 12.0,
    device: Annotated[str, typer.Option(help="auto (GPU when present), cpu or cuda[:N].")] = "auto",
    layer_check: Annotated[bool, typer.Option(
        "--layer-check/--no-layer-check",
        help="Also run every decoder layer of the source and of the output on the same 256 "
             "tokens' hidden states and fail a layer whose output error exceeds 3x "
             "round-to-nearest's (push refuses a report without it).")] = True,
    json_: Json = False,
    revision: Revision = None,
    debug: Debug = False,
) -> None:
    """Reload every output tensor and compare it with the source; write DST/verify.json.

    INT4 tensors: relative error and SQNR against the dequantized source; everything else must
    be bit-identical (or the exact BF16 dequant of its FP8 source); index, config, shapes and
    the manifest's checksums must agree. Then the function: each decoder layer of the output,
    as written, against the source's on the same hidden states, bounded by round-to-nearest's
    error (a wrong AWQ fold passes every weight check and fails this). Exit 1 when any check fails.

    Examples:
      quantize verify ./GLM-5.2-FP8 ./GLM-5.2-INT4
      quantize verify ./GLM-5.2-FP8 ./GLM-5.2-INT4 --min-sqnr 15 --json
      quantize verify ./GLM-5.2-FP8 ./GLM-5.2-INT4 --no-layer-check   # tensors only
    """
    from quantize.hub import resolve_source
    from quantize.manifest import finished_manifest
    from quantize.report import verify_table
    from quantize.verify import verify as run_verify

    try:
        finished_manifest(dst)  # an unfinished DST is said before SRC is resolved (or downloaded)
        local = resolve_source(src, revision, headers_only=False)
        with _progress() as bar:
            task = bar.add_task("verify", total=None, rate="")
            rep = run_verify(local, dst, min_sqnr, device,
                             on_start=lambda total: bar.update(task, total=total),
                             on_unit=lambda u: bar.advance(task, u.source_bytes),
                             layer_check=layer_check)
    except (QuantizeError, ValueError) as e:
        _fail(e, debug)
    if json_:
        _print_json(rep.to_json()["summary"])
    else:
        out.print(verify_table(rep))
    for p in rep.problems:
        err.print(f"[red]problem:[/] {p}", highlight=False)
    if not rep.ok:
        raise typer.Exit(1)


@app.command()
def push(
    dst: Annotated[Path, typer.Argument(help="A converted and verified output folder.")],
    repo_id: Annotated[str, typer.Argument(
        help="Hub repo id org/name (created if missing); a bare name goes into your own namespace.")],
    private: Annotated[bool, typer.Option(help="Create the repo private (an existing repo keeps "
                                               "its visibility).")] = False,
    revision: Annotated[str, typer.Option(help="Branch to push to (created from main if missing).")] = "main",
    dry_run: Annotated[bool, typer.Option(help="List the files and sizes and print the card; "
                                               "upload nothing.")] = False,
    skip_verify_check: Annotated[bool, typer.Option(
        help="Publish even without a passing verify.json (the manifest must still be complete).")] = False,
    base_model: Annotated[str | None, typer.Option(
        help="The card's base_model (default: the Hub repo the source was downloaded from).")] = None,
    token: Annotated[str | None, typer.Option(
        help="Hub token with write access (default: HF_TOKEN or `hf auth login`); never printed.",
        envvar=None)] = None,
    commit_message: Annotated[str | None, typer.Option(
        help="The commit's title (default: 'Upload INT4 checkpoint (N files) with glm-int4-quantize V').")] = None,
    create_pr: Annotated[bool, typer.Option(
        help="Open a pull request against --revision instead of committing to it (a repo you "
             "may not write to directly, or a review first).")] = False,
    json_: Json = False,
    debug: Debug = False,
) -> None:
    """Upload DST to the Hugging Face Hub with a model card (README.md), resumably.

    Refuses a folder whose manifest is not complete or that has no passing verify.json. Uploads
    exactly the manifest's files plus README.md, verify.json and the manifest. Re-running after an
    interruption sends only what is missing. The token comes from HF_TOKEN or `hf auth login`.

    Examples:
      quantize push ./GLM-5.2-INT4 my-org/GLM-5.2-INT4 --dry-run
      quantize push ./GLM-5.2-INT4 my-org/GLM-5.2-INT4 --private
      quantize push ./GLM-5.2-INT4 my-org/GLM-5.2-INT4 --commit-message "INT4 g32, GPTQ 512x2048"
      quantize push ./GLM-5.2-INT4 GLM-5.2-INT4                   # into your user namespace
      quantize push ./GLM-5.2-INT4 their-org/GLM-5.2-INT4 --create-pr
    """
    from quantize.push import prepare_push, resolve_repo_id, upload
    from quantize.sizes import fmt_bytes

    try:
        repo_id = resolve_repo_id(repo_id, token)
        p = prepare_push(dst, repo_id, revision, private, skip_verify_check, base_model,
                         write_card=not dry_run)
        if dry_run and json_:
            _print_json({"repo_id": p.repo_id, "revision": p.revision, "private": p.private,
                         "dry_run": True, "files": [{"name": f.name, "bytes": f.nbytes} for f in p.files],
                         "total_bytes": p.total_bytes})
            return
        if dry_run:
            for f in p.files:
                out.print(f"{f.nbytes:>16,}  {f.name}", highlight=False, soft_wrap=True)
            out.print(f"{p.total_bytes:>16,}  total: {len(p.files)} files ({fmt_bytes(p.total_bytes)}) "
                      f"-> {p.repo_id}@{p.revision}{' (private)' if p.private else ''}",
                      highlight=False, soft_wrap=True)
            out.print("\n" + p.card, markup=False, highlight=False, soft_wrap=True)
            return
        err.print(f"uploading {len(p.files)} files ({fmt_bytes(p.total_bytes)}) to {p.repo_id}"
                  f"@{p.revision}", highlight=False)
        url = upload(p, token=token, commit_message=commit_message, create_pr=create_pr)
    except (QuantizeError, ValueError) as e:
        _fail(e, debug)
    if json_:
        _print_json({"repo_id": p.repo_id, "revision": p.revision, "private": p.private,
                     "dry_run": False, "create_pr": create_pr, "url": url,
                     "files": [{"name": f.name, "bytes": f.nbytes} for f in p.files],
                     "total_bytes": p.total_bytes})
    else:
        out.print(url, highlight=False, soft_wrap=True)


def main() -> None:  # pragma: no cover - console entry point
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    app()


@app.command("eval")
def eval_(
    src: Src,
    dst: Annotated[Path, typer.Argument(help="A finished `quantize convert` output folder.")],
    data: Annotated[str | None, typer.Option(
        help="Eval text (.jsonl, .txt/.md, .parquet or a saved datasets folder). Default: the "
             "shipped calib_data/default.jsonl, minus every document under a calibration window.")] = None,
    num_samples: Annotated[int, typer.Option(help="Eval windows.")] = 16,
    seq_len: Annotated[int, typer.Option(
        help="Tokens per window (capped to max_position_embeddings).")] = 2048,
    ood: Annotated[str | None, typer.Option(
        help="Out-of-domain text scored beside --data, to show overfitting to the calibration "
             "text (any format --data reads; 'none' to skip). Default: the shipped general-English "
             "calib_data/heldout_english.md, in no calibration set.")] = None,
    ood_samples: Annotated[int, typer.Option(help="Out-of-domain windows, at most.")] = 4,
    seed: Annotated[int, typer.Option(help="Seed for shuffling the held-out documents.")] = 0,
    device: Annotated[str, typer.Option(help="auto (GPU when present), cpu or cuda[:N].")] = "auto",
    dtype: Annotated[EvalDtype, typer.Option(
        help="auto: bfloat16 on a GPU, float32 on the CPU.")] = EvalDtype.auto,
    max_ppl_ratio: Annotated[float, typer.Option(
        help="The output is broken (exit 1; push refuses it) when quantized / source perplexity "
             "exceeds this on the held-out or the out-of-domain text.")] = 2.0,
    max_kl: Annotated[float, typer.Option(
        help="... or when the mean per-token KL(source || quantized), in nats, exceeds this.")] = 1.0,
    json_: Json = False,
    revision: Revision = None,
    debug: Debug = False,
) -> None:
    """Measure DST against its source SRC on held-out text; write DST/eval.json.

    Runs both models side by side one decoder layer at a time (memory: one layer plus the
    hidden states), then reports source and quantized perplexity, their ratio, the mean
    per-token KL(source || quantized), top-1 agreement, and each layer's hidden-state error.
    Windows under the conversion's calibration are held out. The same figures on out-of-domain
    text (general English in no calibration set) follow: a method fitted too closely to its
    calibration text worsens them first. The model card shows the summary.

    Examples:
      quantize eval ./GLM-5.2-FP8 ./GLM-5.2-INT4
      quantize eval ./GLM-5.2-FP8 ./GLM-5.2-INT4 --data held-out.jsonl --num-samples 64
      quantize eval ./GLM-4.6-FP8 ./GLM-4.6-INT4 --max-ppl-ratio 1.05 --json
      quantize eval ./GLM-5.2-FP8 ./GLM-5.2-INT4 --max-kl 0.5
      quantize eval ./GLM-5.2-FP8 ./GLM-5.2-INT4 --ood my-other-domain.txt   # or --ood none
    """
    from quantize.evaluate import EvalOptions, evaluate
    from quantize.hub import resolve_source
    from quantize.report import eval_tables

    try:
        opts = EvalOptions(data=data, num_samples=num_samples, seq_len=seq_len, seed=seed,
                           dtype=_value(dtype), ood=ood, ood_samples=ood_samples,
                           max_ppl_ratio=max_ppl_ratio, max_kl=max_kl)
        local = resolve_source(src, revision, headers_only=False)
        rep = evaluate(local, dst, opts, device=device,
                       log=lambda text: err.print(text, highlight=False, markup=False))
    except (QuantizeError, ValueError) as e:
        _fail(e, debug)
    if json_:
        _print_json(rep)
    else:
        for t in eval_tables(rep):
            out.print(t)
    v = rep["verdict"]
    if not v["ok"]:
        err.print(f"[red]fail:[/] the output is broken: {'; '.join(v['failed'])} (eval.json; push "
                  "refuses it)", highlight=False)
        raise typer.Exit(1)
