"""The source's tensors as the conversion sees them: read, FP8 dequantized, checked finite.

    dev = resolve_device("auto")                 the GPU when there is one
    raw = read_unit(ckpt, unit, dev)             a unit's weight (and its FP8 scale)
    w   = source_weight(ckpt, unit, dev)         float32, FP8 dequantized exactly

Every stage reads the source through here (the writer, the calibration's layers, verify, eval),
so none of them imports the conversion recipe (pipeline.py) to do it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantize.errors import Problem, QuantizeError
from quantize.names import (
    CALIB_REPORT,
    CALIB_STATE,
    CARD,
    EVAL_JSON,
    INDEX_NAME,
    MANIFEST,
    PARTIAL,
    PICTURES,
    RUN_RECORD,
    VERIFY_JSON,
    WEIGHT_SUFFIXES,
)
from quantize.plan import Unit
from quantize.source.checkpoint import Checkpoint, SourceFormat, link_problem
from quantize.source.fp8 import dequant_block, dequant_channel

__all__ = ["read_unit", "resolve_device", "source_weight"]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise QuantizeError("no GPU", [Problem("--device", None, device, "a visible CUDA device",
                                               "use --device cpu (same bytes, slower)")])
    return torch.device(device)


def read_unit(ckpt: Checkpoint, unit: Unit, device: torch.device | str = "cpu"
              ) -> dict[str, torch.Tensor]:
    """The source tensors a unit needs (weight, and its FP8 scale), read from disk onto
    `device` (a copied tensor always stays on the host: it goes straight back to disk)."""
    names = [unit.source] + ([unit.scale] if unit.scale else [])
    dev = "cpu" if unit.action in ("copy", "keep") else device
    return {n: ckpt.read(n, dev) for n in names}


def source_weight(ckpt: Checkpoint, unit: Unit, device: torch.device,
                  raw: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The unit's source weight as float32 on `device` (FP8 dequantized exactly). Read
    straight onto the device (a GPU: through the pinned staging buffers, not a pageable host
    copy that would also wait for the device's queue)."""
    raw = raw if raw is not None else read_unit(ckpt, unit, device)
    w = raw[unit.source].to(device)
    if unit.scale is None:
        return w.float()
    s = raw[unit.scale].to(device)
    if ckpt.source_format == SourceFormat.FP8_BLOCK:
        return dequant_block(w, s, ckpt.block_size)
    return dequant_channel(w, s)


def finite_hint(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor, read without a device sync: True proves every value of the float
    tensor `t` finite (a NaN or Inf makes its sum NaN or Inf). False is a NaN or Inf, or a
    finite tensor whose float sum overflows (values near 1e38): a caller re-checks with
    `torch.isfinite(t).all()` before it reports anything. One reduction and no |t|-sized
    mask: 1.5 against 28 ms for a GLM-5.2 expert on a 2-core CPU (BENCHMARKS.md)."""
    return torch.isfinite(t.sum())


def _nonfinite(ckpt: Checkpoint, name: str, t: torch.Tensor) -> QuantizeError:
    """Which non-finite values `t` holds, how many, and where the first one is.

    There is no `--allow-nonfinite`: a NaN or Inf makes its whole INT4 group's scale NaN/Inf
    (the absmax), and a copied NaN norm or embedding poisons every token that touches it, so
    passing them on would only move the failure into the serving engine.
    """
    nan, inf = torch.isnan(t), torch.isinf(t)
    if not (nan.any() or inf.any()):  # finite, but a group's range overflows float32
        return QuantizeError("weights too large for INT4 group scales", [Problem(
            ckpt.tensors[name].file, name, f"|w| up to {t.abs().max().item():.3g}",
            "group ranges that fit float32 (real weights are below ~1e4)",
            "the checkpoint is corrupt or not a model's weights: re-download this shard")])
    counts = [f"{int(m.sum())} {k}" for k, m in (("NaN", nan), ("Inf", inf)) if m.any()]
    first = [int(i) for i in (nan | inf).nonzero()[0]]
    return QuantizeError("non-finite values in the source", [Problem(
        ckpt.tensors[name].file, name, f"{' and '.join(counts)} value(s), the first at {first}",
        "finite numbers",
        "the checkpoint is corrupt: re-download this shard (a NaN weight would poison every "
        "token routed through it, so it is never passed on)")])


# Files never copied from the source: the weights we rewrite (any format an engine or a loader
# might pick up), our partial files, the source's card (we write our own), VCS / cache files,
# and every name our own tools write in an output folder (a report, run record or picture of
# the source's would pass for ours, a file `calibration` would stand where our folder goes).
SKIP_SUFFIXES = (*WEIGHT_SUFFIXES, PARTIAL)
SKIP_NAMES = {INDEX_NAME, CARD, MANIFEST, "config.json", ".gitattributes", CALIB_REPORT,
              VERIFY_JSON, EVAL_JSON, RUN_RECORD, *(Path(n).parts[0] for n in PICTURES),
              Path(CALIB_STATE).parts[0]}


def aux_files(src: Path) -> list[Path]:
    """The source's non-weight files we copy (tokenizer, generation config, remote code: copied,
    never imported). A link leading out of the model folder is refused, not followed."""
    files, problems = [], []
    for p in sorted(src.iterdir()):
        if p.name in SKIP_NAMES or p.name.startswith(".") or p.name.endswith(SKIP_SUFFIXES):
            continue
        if (link := link_problem(src, p)) is not None:
            problems.append(link)
        elif p.is_file():
            files.append(p)
    if problems:
        raise QuantizeError("the source links to files outside the model folder", problems)
    return files
