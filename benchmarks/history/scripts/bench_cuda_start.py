"""What a fresh process pays before RTN's first tensor on a GPU: torch's import, the CUDA
driver's start-up and the first kernels, each with its wall time, the bytes it read from the
disk, and the longest time it kept every other Python thread waiting (the GIL).

    python3 benchmarks/history/scripts/bench_cuda_start.py --out benchmarks/h200_cuda_start.json

Each measurement is one child process, run twice cold (`sync; echo 3 > drop_caches`, root)
and twice warm. In the child: `import torch`; then a ticker thread that wakes every 2 ms and
records the gaps between its wake-ups (a gap far above 2 ms: another thread held the GIL);
then `torch.empty(1, device="cuda")` (the driver's start-up, as convert's `_init_cuda` thread
does it), then RTN of one GLM-5.2-sized block-FP8 expert matrix (2048 x 6144, the arithmetic of
`quantize.pipeline._compute`: dequant_block, quantize_rtn, int4_outputs) on the GPU, twice (the first call
loads the kernels), and the same on the CPU, twice, for the host's rate. Disk bytes are the
kernel's count for the process (/proc/self/io read_bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_pipeline import drop_caches

CHILD = r"""
import json, os, sys, threading, time
T0 = time.perf_counter()

def disk():
    for line in open("/proc/self/io"):
        if line.startswith("read_bytes"):
            return int(line.split()[1])

out, gaps, stop = {}, [], threading.Event()

def ticker():
    last = time.perf_counter()
    while not stop.is_set():
        time.sleep(0.002)
        now = time.perf_counter()
        gaps.append((now - last, now))
        last = now

def step(name, fn):
    del gaps[:]
    r0, t = disk(), time.perf_counter()
    v = fn()
    wall = time.perf_counter() - t
    held = max((g for g, at in gaps if at >= t), default=0.0)
    out[name] = {"wall_s": round(wall, 4), "disk_read_mb": round((disk() - r0) / 1e6, 1),
                 "longest_gil_wait_s": round(held, 4)}
    return v

r0 = disk()
import torch
out["import_torch"] = {"wall_s": round(time.perf_counter() - T0, 4), "disk_read_mb": round((disk() - r0) / 1e6, 1)}
from quantize.rounding.int4 import int4_outputs, quantize_rtn
from quantize.source.fp8 import dequant_block
threading.Thread(target=ticker, daemon=True).start()
time.sleep(0.05)
dev = torch.device("cuda")
step("cuda_start", lambda: (torch.empty(1, device=dev), torch.cuda.synchronize()))
g = torch.Generator().manual_seed(0)
w8 = (torch.randn(2048, 6144, generator=g) * 0.5).to(torch.float8_e4m3fn)
sc = torch.rand(16, 48, generator=g) + 0.5
def rtn(d):
    W = dequant_block(w8.to(d), sc.to(d), (128, 128))
    q = int4_outputs(quantize_rtn(W, 128, True))
    if d.type == "cuda":
        torch.cuda.synchronize()
    return q
step("rtn_gpu_first", lambda: rtn(dev))
step("rtn_gpu_second", lambda: rtn(dev))
step("rtn_cpu_first", lambda: rtn(torch.device("cpu")))
step("rtn_cpu_second", lambda: rtn(torch.device("cpu")))
out["rtn_cpu_mb_per_s"] = round(w8.numel() / 1e6 / out["rtn_cpu_second"]["wall_s"], 1)
out["rtn_gpu_mb_per_s"] = round(w8.numel() / 1e6 / out["rtn_gpu_second"]["wall_s"], 1)
out["cpu_threads"] = torch.get_num_threads()
stop.set()
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    res: dict = {"command": " ".join(sys.argv), "runs": []}
    for mode in ["cold"] * args.repeats + ["warm"] * args.repeats:
        cold = drop_caches() if mode == "cold" else None
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", CHILD], check=False, capture_output=True, text=True,
                           env=env)
        run = {"mode": mode, "cache_dropped": cold, "process_wall_s": round(time.perf_counter() - t0, 3)}
        if p.returncode != 0:
            run["error"] = p.stderr[-2000:]
        else:
            run.update(json.loads(p.stdout.strip().splitlines()[-1]))
        res["runs"].append(run)
        print(json.dumps(run), flush=True)
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
