"""The disk a conversion needs in its output folder, from the plan alone (no torch: `plan`
reports it from headers): the shards still to write and the calibration's resume checkpoints."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from quantize.errors import Problem, QuantizeError
from quantize.plan import Plan
from quantize.sizes import fmt_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_CHECKPOINTS", "check_disk", "checkpoint_bytes", "disk_needed", "plan_checkpoint_bytes",
           "plan_topk_bytes", "topk_bytes", "topk_itemsize"]

MAX_CHECKPOINTS = 3  # calibration checkpoints on disk at once, at most


def checkpoint_bytes(num_samples: int, seq_len: int, hidden: int, itemsize: int,
                     index_topk: int = 0) -> int:
    """Bytes of one checkpoint: the hidden states, and a DSA model's top-k key indices
    (min(index_topk, seq_len) per token, kept as `layers.topk_dtype` says: int16 up to 32,768
    positions); the rest is a few KB. Where the top-k holds every key (index_topk >= seq_len:
    GLM-5.2's 2048 at the recommended 2,048-token samples) the calibration carries it as one
    row per chunk (decoder.run_layer) and a checkpoint writes that row (state.py): a few KB
    too. GLM-5.2 at 512 x 2048 on a GPU: 12.9 GB (it was 12.9 + 4.3 GB of top-k written whole);
    at 256 x 4096 (2,048 of 4,096 keys), 12.9 + 4.3 GB."""
    return num_samples * seq_len * hidden * itemsize + topk_bytes(num_samples, seq_len, index_topk)


def topk_bytes(num_samples: int, seq_len: int, index_topk: int) -> int:
    """Bytes of a checkpoint's DSA top-k indices (`checkpoint_bytes`): 0 where they hold
    every key (one row per chunk is written, a few KB)."""
    if index_topk >= seq_len:
        return 0
    return num_samples * seq_len * index_topk * topk_itemsize(seq_len)


def plan_checkpoint_bytes(plan: Plan, device: torch.device | str) -> int:
    """Bytes of one calibration checkpoint of `plan` computed on `device` (bf16 hidden states
    on a GPU, float32 on the CPU; twice that with `--gptaq`, which carries the unrounded
    model's stream too); 0 for round-to-nearest."""
    o = plan.options
    if o.method == "rtn":
        return 0
    itemsize = 2 if str(device).startswith("cuda") else 4
    return _streams(plan) * checkpoint_bytes(o.num_samples, o.seq_len, plan.hidden_size, itemsize,
                                             plan.index_topk)


def plan_topk_bytes(plan: Plan) -> int:
    """The DSA top-k bytes of one calibration checkpoint of `plan` (`topk_bytes`, both streams
    with `--gptaq`): what `plan_checkpoint_bytes` counts for them."""
    o = plan.options
    return _streams(plan) * topk_bytes(o.num_samples, o.seq_len, plan.index_topk)


def _streams(plan: Plan) -> int:
    """Hidden-state streams a checkpoint holds: 2 with `--gptaq` (the unrounded model's too)."""
    return 2 if plan.gptaq_active else 1


def topk_itemsize(seq_len: int) -> int:
    """Bytes per DSA top-k key position as `layers.topk_dtype` keeps them: int16 while
    positions fit (< 2**15), else int32."""
    return 2 if seq_len <= 2**15 else 4


def disk_needed(plan: Plan, device: torch.device | str, previous: dict | None = None,
                checkpoint_interval: float = 300.0, free: int | None = None) -> dict:
    """Bytes a conversion still has to write into its output folder: the shards the
    manifest does not hold yet, and for calibrated methods the resume checkpoints (each the
    hidden states of every calibration token: bf16 on a GPU, float32 on the CPU; none with an
    infinite `checkpoint_interval`; twice that with `--gptaq`, which carries the unrounded
    model's hidden states too). `at_once`: how many checkpoints are kept on disk at once,
    MAX_CHECKPOINTS, or with `free` bytes known as many as fit beside the shards (at least 1:
    `total` is then the least the run needs)."""
    held = set((previous or {}).get("files", {}))
    shards = sum(s.file_bytes for s in plan.shards if s.file not in held)
    one = 0 if math.isinf(checkpoint_interval) else plan_checkpoint_bytes(plan, device)
    at_once = MAX_CHECKPOINTS if one else 0
    if one and free is not None:
        at_once = max(1, min(MAX_CHECKPOINTS, (free - shards) // one))
    return {"shards": shards, "checkpoint": one, "at_once": at_once,
            "checkpoints": at_once * one, "total": shards + at_once * one}


def check_disk(out: Path, plan: Plan, previous: dict | None, device: torch.device,
               checkpoint_interval: float, log: Callable[[str], None] | None = None,
               least: int = 1) -> int:
    """Refuse to start when the output's file system lacks the room for the shards and `least`
    calibration checkpoints (several processes: 2, each rank's share of them in its folder);
    the checkpoints to keep at once (0: none), as many as fit up to MAX_CHECKPOINTS (said
    through `log` when fewer)."""
    free = shutil.disk_usage(out).free
    need = disk_needed(plan, device, previous, checkpoint_interval, free)
    if need["checkpoint"] and need["at_once"] < least:
        need["at_once"], need["checkpoints"] = least, least * need["checkpoint"]
        need["total"] = need["shards"] + need["checkpoints"]
    if need["total"] <= free:
        if 0 < need["at_once"] < MAX_CHECKPOINTS and log is not None:
            one = need["checkpoint"]
            log(f"note: {fmt_bytes(free)} free beside {fmt_bytes(need['shards'])} of shards: room "
                f"for {need['at_once']} calibration checkpoint(s) of {fmt_bytes(one)} at once "
                f"({MAX_CHECKPOINTS} with {fmt_bytes(need['shards'] + MAX_CHECKPOINTS * one - free)} "
                "more); " + ("each replaces the last, so a crash while one is written (seconds) "
                             "restarts the calibration at layer 0" if need["at_once"] == 1 else
                             "a checkpoint is skipped while they are all still needed"))
        return need["at_once"]
    parts = f"{fmt_bytes(need['shards'])} of shards"
    if need["checkpoints"]:
        parts += (f" + {fmt_bytes(need['checkpoints'])}: {need['at_once']} calibration "
                  f"checkpoint(s) of {fmt_bytes(need['checkpoint'])} (resume)")
    raise QuantizeError("not enough free disk space for the output", [Problem(
        str(out), None, f"{fmt_bytes(free)} free", f"{fmt_bytes(need['total'])}: {parts}",
        "free space or choose an output folder on a larger disk"
        + (", or lower --num-samples (the checkpoints grow with the calibration tokens), or "
           "pass --checkpoint-interval inf (no checkpoints: a crash restarts the calibration)"
           if need["checkpoints"] else ""))])
