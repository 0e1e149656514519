#!/usr/bin/env python3
"""What holds the GPU memory at the peak of one layer's rounding: runs a `quantize` command in
this process with torch's CUDA memory history on while layer L's MLP is rounded
(`LayerRounding.run`), replays the allocations it recorded and writes the blocks live at the
rounding's highest point, grouped by where in quantize/ they were allocated, as JSON.

    python3 scripts/gpu_memory_peak.py --layer 1 --out peak.json -- python3 -m quantize convert SRC DST ...
    # through bench_pipeline.py (its command follows the wrapper):
    python3 scripts/bench_pipeline.py ... --wrap "python3 scripts/gpu_memory_peak.py --layer 1 --out peak.json --"

Blocks allocated before the rounding started count in `before_gib` (the history has no stack
for them); a block counts as freed when its free was requested (as `memory_allocated` does).
"""

from __future__ import annotations

import argparse
import collections
import json
import runpy
import sys
from pathlib import Path


def summarize(trace: list[dict], before: int, top: int = 25) -> dict:
    """The live blocks at the trace's highest point over `before` bytes, grouped."""
    cur, peak, at = 0, 0, -1
    from_before = freed_before = 0  # blocks from before the history freed: so far, at the peak
    sizes: dict[int, int] = {}
    for i, e in enumerate(trace):
        a = e["action"]
        if a == "alloc":
            sizes[e["addr"]] = e["size"]
            cur += e["size"]
        elif a == "free_requested":
            if e["addr"] in sizes:
                cur -= sizes.pop(e["addr"])
            else:  # a block from before: it leaves `before`
                cur -= e["size"]
                from_before += e["size"]
        if cur > peak:
            peak, at, freed_before = cur, i, from_before
    live: dict[int, dict] = {}
    for e in trace[: at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for e in live.values():
        ours = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in e.get("frames", [])
                if "/quantize/" in f["filename"]][:3]
        key = " < ".join(ours) or "(no quantize/ frame)"
        groups[key][0] += e["size"]
        groups[key][1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {"before_gib": round(before / 2**30, 2), "peak_over_before_gib": round(peak / 2**30, 2),
            "blocks_from_before_freed_by_peak_gib": round(freed_before / 2**30, 2),
            "events": len(trace), "peak_event": at,
            "live_at_peak": [{"where": k, "gib": round(v[0] / 2**30, 3), "blocks": v[1]} for k, v in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layer", type=int, default=1, help="the layer whose rounding is recorded")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--entries", type=int, default=2_000_000, help="history entries kept")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- python -m quantize ...")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if "-m" not in cmd or cmd[cmd.index("-m") + 1] != "quantize":
        ap.error("the command must be `python -m quantize ...`")
    import torch

    from quantize.calib import round_layer

    orig = round_layer.LayerRounding.run

    def run(self, *args, **kw):
        if self.L != a.layer or not torch.cuda.is_available():
            return orig(self, *args, **kw)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=a.entries, stacks="python")
        try:
            return orig(self, *args, **kw)
        finally:
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            dev = torch.cuda.current_device()
            res = summarize(snap["device_traces"][dev], before)
            res.update(layer=a.layer, max_memory_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                       truncated=len(snap["device_traces"][dev]) >= a.entries)
            a.out.write_text(json.dumps(res, indent=1))

    round_layer.LayerRounding.run = run
    sys.argv = ["quantize", *cmd[cmd.index("-m") + 2:]]
    runpy.run_module("quantize", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
