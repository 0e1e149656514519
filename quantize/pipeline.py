"""The conversion recipe.

    1. open the source: config, index, every shard header; validate (no data read)
    2. plan: every output tensor, shard and byte; refuse what the engines cannot serve
    3. prepare the output folder (never inside the source; resume or overwrite only on request)
    4. check every FP8 scale is finite (small: one float per 128x128 block)
    5. stream shard by shard: read a source tensor, dequantize / quantize / copy, append to the
       shard, commit the shard atomically and record its sha256 in the manifest
    6. write config.json (compressed-tensors quantization_config), the index, copy the
       tokenizer and other non-weight files, mark the manifest complete
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from quantize import __version__
from quantize.checkpoint import INDEX_NAME, Checkpoint, SourceFormat, open_checkpoint
from quantize.errors import Problem, QuantizeError
from quantize.fp8 import dequant_block, dequant_channel
from quantize.int4 import pack_int4, quantize_rtn
from quantize.manifest import MANIFEST, Manifest, read_manifest
from quantize.options import ConvertOptions
from quantize.plan import Plan, Unit, make_plan
from quantize.shards import PARTIAL, ShardWriter, copy_file_atomic, write_json_atomic

__all__ = ["ConvertResult", "convert", "quantization_config", "resolve_device", "source_weight"]

# Files never copied from the source: the weights we rewrite, the source's card (we write our
# own), and VCS / cache folders.
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", PARTIAL)
_SKIP_NAMES = {INDEX_NAME, "README.md", MANIFEST, "config.json", ".gitattributes"}


@dataclass(frozen=True)
class ConvertResult:
    out_dir: Path
    plan: Plan
    written: list[str]  # shards written by this run
    skipped: list[str]  # shards kept from an earlier run (resume)
    device: str


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise QuantizeError("no GPU", [Problem("--device", None, device, "a visible CUDA device",
                                               "use --device cpu (same bytes, slower)")])
    return torch.device(device)


def quantization_config(plan: Plan) -> dict:
    """config.json `quantization_config`, built with compressed-tensors' own classes."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    o = plan.options
    args = QuantizationArgs(num_bits=o.num_bits, type="int", symmetric=o.symmetric, strategy="group",
                            group_size=o.group_size, dynamic=False, actorder=None, observer="minmax")
    qc = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        format="pack-quantized",
        quantization_status="compressed",
        ignore=list(plan.ignore),
        kv_cache_scheme=None,
    ).model_dump()
    qc["config_groups"]["group_0"]["weights"]["actorder"] = None  # engines read it; be explicit
    qc["version"] = compressed_tensors.__version__
    qc["quantization_method"] = o.method  # which rounding produced the integers (informational)
    return qc


def source_weight(ckpt: Checkpoint, unit: Unit, device: torch.device) -> torch.Tensor:
    """The unit's source weight as float32 on `device` (FP8 dequantized exactly)."""
    w = ckpt.read(unit.source, device)
    if unit.scale is None:
        return w.float()
    s = ckpt.read(unit.scale, device)
    if ckpt.source_format == SourceFormat.FP8_BLOCK:
        return dequant_block(w, s, ckpt.block_size)
    return dequant_channel(w, s)


def _nonfinite(ckpt: Checkpoint, name: str, t: torch.Tensor) -> QuantizeError:
    bad = (~torch.isfinite(t)).sum().item()
    kinds = []
    if torch.isnan(t).any():
        kinds.append("NaN")
    if torch.isinf(t).any():
        kinds.append("Inf")
    return QuantizeError("non-finite values in the source", [Problem(
        ckpt.tensors[name].file, name, f"{bad} {'/'.join(kinds)} value(s)", "finite numbers",
        "the checkpoint is corrupt: re-download this shard (a NaN weight would poison every "
        "token routed through it, so it is never passed on)")])


def compute_unit(ckpt: Checkpoint, unit: Unit, opts: ConvertOptions, device: torch.device
                 ) -> list[torch.Tensor]:
    """The output tensors of one unit, in plan order."""
    if unit.action == "copy":
        t = ckpt.read(unit.source)
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise _nonfinite(ckpt, unit.source, t)
        return [t]
    W = source_weight(ckpt, unit, device)  # (N, K) float32
    if not torch.isfinite(W).all():
        raise _nonfinite(ckpt, unit.source, W)
    if unit.action == "dequant":
        return [W.to(torch.bfloat16)]
    N, K = W.shape
    q = quantize_rtn(W, opts.group_size, opts.symmetric)
    outs = [pack_int4(q.q), q.scale, torch.tensor([N, K], dtype=torch.int64)]
    if q.zero_point is not None:
        outs.append(pack_int4(q.zero_point, dim=0))
    return outs


def _prepare_out(src: Path, out: Path, resume: bool, overwrite: bool) -> dict | None:
    """Refuse dangerous output folders; return the previous manifest when resuming."""
    s, o = src.resolve(), out.resolve()
    if o == s or s in o.parents:
        raise QuantizeError("the output folder is inside the source", [Problem(
            str(out), None, f"inside {src}", "a folder outside the source checkpoint",
            "choose an output folder next to the source, e.g. ./MODEL-INT4")])
    if o in s.parents:
        raise QuantizeError("the output folder contains the source", [Problem(
            str(out), None, f"a parent of {src}", "a separate folder",
            "choose an empty output folder next to the source")])
    previous = read_manifest(out) if out.is_dir() else None
    if out.is_dir() and any(out.iterdir()):
        if overwrite:
            shutil.rmtree(out)
        elif previous is not None and resume:
            for p in out.glob(f"*{PARTIAL}"):
                p.unlink()  # half-written files of the interrupted run
            return previous
        elif previous is not None:
            state = previous.get("status")
            raise QuantizeError(f"the output folder holds a {state} conversion", [Problem(
                str(out), None, f"{MANIFEST} status {state!r}", "an empty folder",
                "add --resume to continue it, or --overwrite to start over")])
        else:
            raise QuantizeError("the output folder is not empty", [Problem(
                str(out), None, "existing files", "an empty or new folder",
                "choose a new folder, or pass --overwrite to delete its contents")])
    out.mkdir(parents=True, exist_ok=True)
    return None


def _check_scales(ckpt: Checkpoint, plan: Plan) -> None:
    problems = []
    for u in plan.units:
        if u.scale is None:
            continue
        s = ckpt.read(u.scale)
        if not torch.isfinite(s.float()).all():
            problems.append(Problem(ckpt.tensors[u.scale].file, u.scale, "NaN/Inf scale",
                                    "finite scales", "re-download this shard"))
    if problems:
        raise QuantizeError("non-finite FP8 scales in the source", problems)


def _copy_aux_files(src: Path, out: Path) -> list[str]:
    copied = []
    for p in sorted(src.iterdir()):
        if p.name in _SKIP_NAMES or p.name.startswith(".") or p.name.endswith(_SKIP_SUFFIXES):
            continue
        if p.is_symlink() and src.resolve() not in p.resolve().parents:
            continue  # never follow a link out of the model folder
        if p.is_file():
            copy_file_atomic(p, out / p.name)
            copied.append(p.name)
    return copied


def convert(
    src: str | Path,
    out: str | Path,
    opts: ConvertOptions,
    device: str = "auto",
    resume: bool = False,
    overwrite: bool = False,
    on_unit: Callable[[Unit], None] | None = None,
    command: str | None = None,
) -> ConvertResult:
    src, out = Path(src), Path(out)
    ckpt = open_checkpoint(src)
    plan = make_plan(ckpt, opts)
    dev = resolve_device(device)
    previous = _prepare_out(src, out, resume, overwrite)
    _check_scales(ckpt, plan)
    extra = {"command": command, "source_format": ckpt.source_format, "model_type": ckpt.model_type}
    if previous is not None:
        manifest = Manifest.resume(out, ckpt, plan, previous)
    else:
        manifest = Manifest.start(out, ckpt, plan, extra)

    written, skipped = [], []
    for shard in plan.shards:
        done = manifest.done(shard.file)
        if done is not None and (out / shard.file).is_file() and \
                (out / shard.file).stat().st_size == done["bytes"]:
            skipped.append(shard.file)
            if on_unit:
                for u in shard.units:
                    on_unit(u)
            continue
        with ShardWriter(out / shard.file, shard.tensors) as w:
            for unit in shard.units:
                for t in compute_unit(ckpt, unit, opts, dev):
                    w.write(t)
                if on_unit:
                    on_unit(unit)
        manifest.record(shard.file, w.nbytes, w.sha256)
        written.append(shard.file)

    weight_map = {t.name: s.file for s in plan.shards for t in s.tensors}
    write_json_atomic(out / INDEX_NAME, {
        "metadata": {"total_size": plan.output_bytes},
        "weight_map": dict(sorted(weight_map.items())),
    })
    config = dict(ckpt.config)
    config["quantization_config"] = quantization_config(plan)
    config.setdefault("torch_dtype", "bfloat16")
    write_json_atomic(out / "config.json", config)
    aux = _copy_aux_files(src, out)
    from quantize.shards import sha256_file

    for name in [INDEX_NAME, "config.json", *aux]:
        manifest.data["files"][name] = {"bytes": (out / name).stat().st_size,
                                        "sha256": sha256_file(out / name)}
    manifest.finish(tool_version=__version__)
    from quantize.readme import write_readme  # local: readme -> verify -> pipeline

    write_readme(out, plan)  # the model card; a report, so not among the manifest's files
    return ConvertResult(out, plan, written, skipped, str(dev))


def load_index(out: Path) -> dict:
    return json.loads((out / INDEX_NAME).read_text())
