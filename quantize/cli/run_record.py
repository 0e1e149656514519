"""convert's run record (DST/quantize-run.toml) and `--config` / `--from` files, and the
command line as the manifest and the card publish it."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import typer

from quantize.cli.params import value
from quantize.names import RUN_RECORD

# convert's parameters a run record / --config file may set, and the TOML types each takes
# (a float option also takes an integer; targets also a list of strings)
RUN_TYPES: dict[str, tuple[type, ...]] = {
    "src": (str,), "method": (str,), "group_size": (int,), "scheme": (str,), "mtp": (str,),
    "keep_fp8": (bool,), "targets": (str, list), "asymmetric": (bool,), "max_shard_size": (str, int),
    "calib": (str,), "num_samples": (int,), "seq_len": (int,), "seed": (int,),
    "calib_bos": (bool,),
    "expert_calibration": (str,), "min_expert_tokens": (int,), "expert_coverage": (int,),
    "percdamp": (float, int),
    "mse_clip": (bool,), "mse_norm": (int,), "mse_weight_power": (float, int),
    "mse_norm_routed": (int,), "mse_weight_power_routed": (float, int), "scale_refit": (int,),
    "gptaq": (float, int), "sequential_mlp": (bool,),
    "rtn_fallback": (bool,), "checkpoint_interval": (float, int),
    "max_gpu_memory": (float, int), "device": (str,), "tp": (int,), "revision": (str,),
    "base_model": (str,)}
RUN_KEYS = tuple(RUN_TYPES)
# Options whose default ConvertOptions resolves from others (method, group size): the record
# holds the value this run used, so a replay under a later version's defaults is the same run.
# (scale_refit is not: a value given applies to every target, its default differs by target.)
RESOLVED_KEYS = ("mse_clip", "mse_norm", "mse_weight_power", "mse_norm_routed",
                 "mse_weight_power_routed", "gptaq", "sequential_mlp")
RUN_FILE_MAX_BYTES = 1 << 20  # a run file is a few hundred bytes; /dev/zero is refused
_TOML = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
         list: "a list of strings", dict: "a table"}


def public_command(args: list[str], src: str, dst: Path, base_model: str | None) -> str:
    """The convert command line as the manifest and the card record it: every flag with its
    value, and no local path of this machine (the folder gets published). SRC becomes its repo
    id (or folder name), DST its name, any other argument naming an existing file or folder
    (--calib) its name."""
    from quantize.source.hub import source_identity

    src_name = source_identity(src, base_model)["name"] if Path(src).exists() else src

    def same(a: str, b: str) -> bool:  # one path however typed (a trailing /, //, /./)
        return bool(a) and os.path.abspath(a) == os.path.abspath(b)

    def shown(val: str) -> str:
        if val == src or (Path(src).exists() and same(val, src)):
            return src_name
        if same(val, str(dst)) or (val and Path(val).exists() and ("/" in val or "\\" in val)):
            return Path(os.path.abspath(val)).name
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

    def refuse(text: str):
        raise typer.BadParameter(f"{path}: {text}", param_hint=what)

    try:
        if not path.is_file():
            refuse("not a regular file (a TOML file of convert options)")
        if path.stat().st_size > RUN_FILE_MAX_BYTES:
            refuse(f"{path.stat().st_size:,} bytes; a run file is at most {RUN_FILE_MAX_BYTES:,}")
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        refuse(str(e))
    if "convert" in data:
        if not isinstance(data["convert"], dict):
            refuse(f"convert = {data['convert']!r}: expected a [convert] table of options")
        data = data["convert"]
    got: dict = {}
    for k, v in data.items():
        key = k.replace("-", "_")
        if key in got:
            refuse(f"the option {key} is given twice (as {k!r} and in another spelling); keep one")
        got[key] = v
    unknown = sorted(set(got) - set(RUN_KEYS))
    if unknown:
        refuse(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(RUN_KEYS)}")
    for key, v in got.items():
        want = RUN_TYPES[key]
        ok = isinstance(v, want) and not (isinstance(v, bool) and bool not in want)
        if ok and isinstance(v, list):
            ok = all(isinstance(x, str) for x in v)
        if not ok:
            found = next((n for t, n in _TOML.items() if isinstance(v, t)), type(v).__name__)
            if isinstance(v, bool):
                found = _TOML[bool]
            refuse(f"{key} = {v!r} is {found}; expected {' or '.join(_TOML[t] for t in want)}")
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
        got = read_run_file(rec, "--from")
        if got.get("method", "rtn") != "rtn":
            got.update(_recorded_elsewhere(value, got))
        ctx.default_map = {**got, **(ctx.default_map or {})}
    return value


def _recorded_elsewhere(dst: Path, got: dict) -> dict:
    """The options a calibrated run's record leaves out, as the run used them: a record from
    before an option (calib_bos) or from before records held the values ConvertOptions resolves
    (RESOLVED_KEYS, 4d3ba3e) would otherwise replay under today's defaults. The folder's
    manifest recorded every option the run resolved (`recorded_option`: a key it lacks too is
    the value runs before it used); without a manifest, the windows had no BOS."""
    from quantize.errors import QuantizeError
    from quantize.options import recorded_option
    from quantize.write.manifest import read_manifest

    keys = [k for k in (*RESOLVED_KEYS, "calib_bos") if k not in got]
    try:
        manifest = read_manifest(dst)
    except QuantizeError:  # (unreadable: as without one)
        manifest = None
    if manifest is None:
        return {"calib_bos": False} if "calib_bos" in keys else {}
    found = {k: recorded_option(manifest["options"], k) for k in keys}
    return {k: v for k, v in found.items() if v is not None}


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
    from quantize.write.shards import write_bytes_atomic

    lines = [f"# quantize convert's options for this folder, glm-int4-quantize {__version__}",
             "# replay: quantize convert --from DST NEW_DST  (or --config this-file SRC NEW_DST)",
             "[convert]"]
    lines += [f"{k} = {_toml_value(value(v))}" for k, v in values.items() if v is not None]
    write_bytes_atomic(dst / RUN_RECORD, ("\n".join(lines) + "\n").encode())
