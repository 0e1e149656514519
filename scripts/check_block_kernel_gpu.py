"""GPTQ's column kernel (`gptq_triton._block_kernel`) in several launch layouts: the time of a
whole `gptq_quantize` of a GLM-5.2 gate/up batch and of a down batch, and whether the codes
equal the first layout's.

    PYTHONPATH=. python3 scripts/check_block_kernel_gpu.py --layouts 32:4:row,32:4:col,16:4:col \\
        --out benchmarks/h200_block_kernel.json                     # on the H200
    SMALL=1 TRITON_INTERPRET=1 PYTHONPATH=. python3 scripts/check_block_kernel_gpu.py   # CPU: checks the script

A layout is ROWS:WARPS:row|col: rows of W per program (`BLOCK_ROWS`), warps per program
(`BLOCK_WARPS`), and the per-column arrays (scales, errors, codes) row-major as the caller
holds them or column-major (`COLUMN_MAJOR`). Hessians from scripts/synthetic_hessians.py
(as scripts/check_factor_gpu.py uses them; GPTQ damps them by 0.1); the CLI's GPTQ
settings (group 32, MSE clip power 3, TF32 factorization).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from synthetic_hessians import hessians

from quantize.rounding import gptq_triton
from quantize.rounding.gptq import GPTQConfig, gptq_quantize

ap = argparse.ArgumentParser()
ap.add_argument("--experts", type=int, default=32)
ap.add_argument("--layouts", default="32:4:row,32:4:col")
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")) / "block_kernel.json")
args = ap.parse_args()
SMALL = bool(os.environ.get("SMALL"))
dev = torch.device("cuda" if torch.cuda.is_available() and not SMALL else "cpu")
if dev.type == "cpu":  # the interpreter (TRITON_INTERPRET=1) runs the kernel on CPU tensors
    gptq_triton.available = lambda t: True
H_dim, I_dim = (256, 128) if SMALL else (6144, 2048)
E = 2 if SMALL else args.experts
torch.manual_seed(0)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


default = (gptq_triton.BLOCK_ROWS, gptq_triton.BLOCK_WARPS, gptq_triton.COLUMN_MAJOR)
cfg = GPTQConfig(group_size=32, percdamp=0.1, mse_clip=True, mse_norm=3)
res: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
             "experts": E, "torch": torch.__version__, "batches": {}}
for what, (N, K) in {"gate_up": (2 * I_dim, H_dim), "down": (H_dim, I_dim)}.items():
    H = hessians(E, K, dev)
    W = torch.randn(E, N, K, device=dev) * 0.02
    first = None
    rows = {}
    for spec in args.layouts.split(","):
        r_, w_, layout = spec.split(":")
        gptq_triton.BLOCK_ROWS, gptq_triton.BLOCK_WARPS = int(r_), int(w_)
        gptq_triton.COLUMN_MAJOR = layout == "col"
        out = gptq_quantize(W, H, cfg)  # compile + warm-up
        sync()
        best = float("inf")
        for _ in range(1 if SMALL else args.reps):
            t = time.perf_counter()
            out = gptq_quantize(W, H, cfg)
            sync()
            best = min(best, time.perf_counter() - t)
        row = {"seconds": round(best, 4)}
        if first is None:
            first = out.weight.q
        else:
            row["codes_equal_to_first"] = float((out.weight.q == first).float().mean())
        rows[spec] = row
        print(what, spec, row, flush=True)
    res["batches"][f"{what} (E {E}, N {N}, K {K})"] = rows
    del H, W, first
gptq_triton.BLOCK_ROWS, gptq_triton.BLOCK_WARPS, gptq_triton.COLUMN_MAJOR = default
args.out.parent.mkdir(parents=True, exist_ok=True)
args.out.write_text(json.dumps(res, indent=1) + "\n")
