"""scripts/gpu_memory_peak.py's replay of a CUDA memory history: the highest point over the
blocks that existed before, and which blocks were live there, grouped by their quantize/ frames.
The trace is written here in the shape torch.cuda.memory._snapshot() gives (CI has no GPU)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from gpu_memory_peak import summarize

GIB = 2**30


def frames(line: int) -> list[dict]:
    return [{"filename": "/site/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": "/x/quantize/rounding/gptq.py", "line": line, "name": "solve"},
            {"filename": "/x/quantize/calib/layer.py", "line": 7, "name": "run"}]


def test_the_peak_and_the_blocks_live_there():
    rng = random.Random()
    sizes = [rng.randint(1, 8) * GIB for _ in range(3)]
    a, b, c = sizes
    trace = [
        {"action": "alloc", "addr": 1, "size": a, "frames": frames(10)},
        {"action": "free_requested", "addr": 99, "size": GIB},  # a block from before the history
        {"action": "alloc", "addr": 2, "size": b, "frames": frames(20)},
        {"action": "alloc", "addr": 3, "size": c, "frames": frames(10)},
        {"action": "free_completed", "addr": 3, "size": c},  # (not the free: requested is)
        {"action": "free_requested", "addr": 3, "size": c},
        {"action": "free_requested", "addr": 1, "size": a},
        {"action": "alloc", "addr": 4, "size": 1, "frames": frames(30)},
    ]
    r = summarize(trace, before=5 * GIB)
    assert r["before_gib"] == 5.0
    assert r["peak_over_before_gib"] == round((a + b + c - GIB) / GIB, 2)
    assert r["peak_event"] == 3
    assert r["blocks_from_before_freed_by_peak_gib"] == 1.0
    live = {g["where"]: (g["gib"], g["blocks"]) for g in r["live_at_peak"]}
    assert live == {"gptq.py:10 solve < layer.py:7 run": (round((a + c) / GIB, 3), 2),
                    "gptq.py:20 solve < layer.py:7 run": (round(b / GIB, 3), 1)}
