"""The disk a conversion needs in its output folder, from the plan alone (no torch: `plan`
reports it from headers): the shards still to write and the calibration's resume checkpoints."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from quantize.errors import Problem, QuantizeError
from quantize.plan import Plan
from quantize.sizes import fmt_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_CHECKPOINTS", "check_disk", "checkpoint_bytes", "disk_needed", "topk_itemsize"]

MAX_CHECKPOINTS = 3  # calibration checkpoints on disk at once, at most


def checkpoint_bytes(num_samples: int, seq_len: int, hidden: int, itemsize: int,
                     index_topk: int = 0) -> int:
    """Bytes of one checkpoint: the hidden states, and a DSA model's top-k key indices
    (min(index_topk, seq_len) per token, kept as `layers.topk_dtype` says: int16 up to 32,768
    positions); the rest is a few KB. GLM-5.2 at 512 x 2048 on a GPU: 12.9 GB of hidden states
    + 4.3 GB of top-k = 17.2 GB."""
    k = min(index_topk, seq_len) * topk_itemsize(seq_len)
    return num_samples * seq_len * (hidden * itemsize + k)



def topk_itemsize(seq_len: int) -> int:
    """Bytes per DSA top-k key position as `layers.topk_dtype` keeps them: int16 while
    positions fit (< 2**15), else int32."""
    return 2 if seq_len <= 2**15 else 4


def disk_needed(plan: Plan, device: torch.device | str, previous: dict | None = None,
                checkpoint_interval: float = 300.0) -> dict:
    """Bytes a conversion still has to write into its output folder: the shards the
    manifest does not hold yet, and for calibrated methods the resume checkpoints (at most
    MAX_CHECKPOINTS at once, each the hidden states of every calibration token:
    bf16 on a GPU, float32 on the CPU; none with an infinite `checkpoint_interval`)."""
    held = set((previous or {}).get("files", {}))
    shards = sum(s.file_bytes for s in plan.shards if s.file not in held)
    o = plan.options
    one = 0
    if o.method != "rtn" and not math.isinf(checkpoint_interval):
        itemsize = 2 if str(device).startswith("cuda") else 4
        one = checkpoint_bytes(o.num_samples, o.seq_len, plan.hidden_size, itemsize,
                               plan.index_topk)
    return {"shards": shards, "checkpoint": one, "at_once": MAX_CHECKPOINTS,
            "checkpoints": MAX_CHECKPOINTS * one, "total": shards + MAX_CHECKPOINTS * one}


def check_disk(out: Path, plan: Plan, previous: dict | None, device: torch.device,
               checkpoint_interval: float) -> None:
    """Refuse to start when the output's file system lacks the room `disk_needed` says."""
    need = disk_needed(plan, device, previous, checkpoint_interval)
    free = shutil.disk_usage(out).free
    if need["total"] <= free:
        return
    parts = f"{fmt_bytes(need['shards'])} of shards"
    if need["checkpoints"]:
        parts += (f" + {fmt_bytes(need['checkpoints'])} of calibration checkpoints (up to "
                  f"{need['at_once']} at once, {fmt_bytes(need['checkpoint'])} each)")
    raise QuantizeError("not enough free disk space for the output", [Problem(
        str(out), None, f"{fmt_bytes(free)} free", f"{fmt_bytes(need['total'])}: {parts}",
        "free space or choose an output folder on a larger disk"
        + (", or lower --num-samples (the checkpoints grow with the calibration tokens), or "
           "pass --checkpoint-interval inf (no checkpoints: a crash restarts the calibration)"
           if need["checkpoints"] else ""))])
