"""The routed Hessians' GEMM on the GPU: `gptq.xtx` (bf16 GEMM, float32 output) against the TF32
path it replaced and a float64 reference, on one expert's routed MLP inputs at GLM-5.2's width.

    OUT=bench_out PYTHONPATH=. python3 benchmarks/history/scripts/check_xtx_gpu.py [--rows 32768] [--width 6144]

Writes OUT/xtx_gpu.json: seconds per GEMM (CUDA-synchronized, median of 5), the largest
difference of each path from float64 relative to max |XᵀX| and between the two paths.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from quantize.rounding import gptq

ap = argparse.ArgumentParser()
ap.add_argument("--rows", type=int, default=32768, help="routed tokens of one expert (512 x 2048 x 8 / 256)")
ap.add_argument("--width", type=int, default=6144)
args = ap.parse_args()
OUT = Path(os.environ.get("OUT", "/tmp/out"))
OUT.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
torch.manual_seed(0)
X = (torch.randn(args.rows, args.width, device=dev) * (1 + torch.rand(args.width, device=dev) * 4)).bfloat16()
ref = X.double().mT @ X.double()
scale = ref.abs().max().item()


def timed(fn):
    ts = []
    for _ in range(6):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return out, sorted(ts[1:])[2]


def tf32():
    gptq._BF16_OUT[0] = False
    try:
        return gptq.xtx(X, acc=torch.zeros(args.width, args.width, device=dev))
    finally:
        gptq._BF16_OUT[0] = True


new, t_new = timed(lambda: gptq.xtx(X, acc=torch.zeros(args.width, args.width, device=dev)))
old, t_old = timed(tf32)
flops = 2 * args.rows * args.width ** 2
res = {"rows": args.rows, "width": args.width, "bf16_out_path_taken": gptq._BF16_OUT[0],
       "seconds_bf16_out": round(t_new, 5), "seconds_tf32": round(t_old, 5),
       "tflops_bf16_out": round(flops / t_new / 1e12, 1), "tflops_tf32": round(flops / t_old / 1e12, 1),
       "max_rel_diff_bf16_out_vs_fp64": (new.double() - ref).abs().max().item() / scale,
       "max_rel_diff_tf32_vs_fp64": (old.double() - ref).abs().max().item() / scale,
       "max_rel_diff_between": (new - old).abs().max().item() / scale,
       "device": torch.cuda.get_device_name(), "torch": torch.__version__}
print(json.dumps(res, indent=1))
(OUT / "xtx_gpu.json").write_text(json.dumps(res, indent=1) + "\n")
