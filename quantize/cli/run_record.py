"""convert's run record (DST/quantize-run.toml) and `--config` / `--from` files, and the
command line as the manifest and the card publish it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import typer

from quantize.cli.params import value
from quantize.names import RUN_RECORD

# convert's parameters a run record / --config file may set
RUN_KEYS = ("src", "method", "group_size", "scheme", "mtp", "keep_fp8", "targets", "asymmetric",
            "max_shard_size", "calib", "num_samples", "seq_len", "seed", "expert_calibration",
            "min_expert_tokens", "percdamp", "mse_clip", "rtn_fallback", "checkpoint_interval",
            "max_gpu_memory", "device", "tp", "revision", "base_model")


def public_command(args: list[str], src: str, dst: Path, base_model: str | None) -> str:
    """The convert command line as the manifest and the card record it: every flag with its
    value, and no local path of this machine (the folder gets published). SRC becomes its repo
    id (or folder name), DST its name, any other argument naming an existing file or folder
    (--calib) its name."""
    from quantize.hub import source_identity

    src_name = source_identity(src, base_model)["name"] if Path(src).exists() else src

    def shown(val: str) -> str:
        if val == src:
            return src_name
        if val == str(dst) or (val and Path(val).exists() and ("/" in val or "\\" in val)):
            return Path(val).name
        return val

    words = []
    for a in args:
        if a.startswith("--") and "=" in a:  # --flag=value
            flag, _, val = a.partition("=")
            words.append(f"{flag}={shown(val)}")
        elif a.startswith("-") and len(a) > 1 and not a[1:2].isdigit():  # a flag: as typed
            words.append(a)
        else:  # SRC, DST, or a flag's value
            words.append(shown(a))
    return shlex.join(["quantize", *words])


def read_run_file(path: Path, what: str) -> dict:
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


def config_callback(ctx: typer.Context, value: Path | None) -> Path | None:
    if value is not None:  # defaults from the file; flags on the command line still win
        ctx.default_map = {**(ctx.default_map or {}), **read_run_file(value, "--config")}
    return value


def from_callback(ctx: typer.Context, value: Path | None) -> Path | None:
    if value is not None:
        rec = value / RUN_RECORD
        if not rec.is_file():
            raise typer.BadParameter(f"{rec} does not exist: not a folder `quantize convert` "
                                     "wrote (or one from before run records)", param_hint="--from")
        ctx.default_map = {**read_run_file(rec, "--from"), **(ctx.default_map or {})}
    return value


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a TOML basic string: JSON's escapes are TOML's


def write_run_record(dst: Path, values: dict) -> None:
    """DST/quantize-run.toml: every convert option as this run resolved it, replayable with
    `quantize convert --from DST` or `--config DST/quantize-run.toml`."""
    from quantize import __version__
    from quantize.shards import write_bytes_atomic

    lines = [f"# quantize convert's options for this folder, glm-int4-quantize {__version__}",
             "# replay: quantize convert --from DST NEW_DST  (or --config this-file SRC NEW_DST)",
             "[convert]"]
    lines += [f"{k} = {_toml_value(value(v))}" for k, v in values.items() if v is not None]
    write_bytes_atomic(dst / RUN_RECORD, ("\n".join(lines) + "\n").encode())
