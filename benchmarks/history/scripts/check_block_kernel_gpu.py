"""GPTQ's column loop (`gptq_triton._block_kernel` and the updates between its blocks) in
several layouts: the time of a whole `gptq_quantize` of a GLM-5.2 gate/up batch and of a down
batch, and whether the codes equal the first layout's, and the output error of each (float64).

    PYTHONPATH=. python3 benchmarks/history/scripts/check_block_kernel_gpu.py --layouts 16:4:128,16:4:128/512,16:4:32/128/512 \\
        --phases --out benchmarks/h200_block_kernel.json            # on the H200
    SMALL=1 TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/history/scripts/check_block_kernel_gpu.py   # CPU: checks the script

A layout is ROWS:WARPS:WIDTHS: rows of W per program (`BLOCK_ROWS`), warps per program
(`BLOCK_WARPS`), and the widths of the column loop's levels, /-separated (`gptq.FUSED_WIDTHS`:
the kernel's block first; 128 alone: every block's errors onto the rest of W). `--phases`
times the MSE clip, the factorization and the column loop apart; `--profile DIR` writes a
torch.profiler table of one batch of each shape. Hessians from benchmarks/history/scripts/synthetic_hessians.py
(as benchmarks/history/scripts/check_factor_gpu.py uses them; GPTQ damps them by 0.1); the CLI's GPTQ settings
(group 32, MSE clip power 3, TF32 factorization).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import torch
from synthetic_hessians import hessians

from quantize.rounding import gptq, gptq_triton
from quantize.rounding.gptq import GPTQConfig, gptq_quantize
from quantize.rounding.int4 import Int4Weight, dequantize

ap = argparse.ArgumentParser()
ap.add_argument("--experts", type=int, default=32)
ap.add_argument("--layouts", default="16:4:128,16:4:128/512")
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--phases", action="store_true",
                help="also time the batch's phases apart (MSE clip, factorization, column loop)")
ap.add_argument("--profile", type=Path, default=None,
                help="write a torch.profiler table of one batch per shape (default layout) here")
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


def timed(fn):
    """(result, best seconds of `args.reps`) of fn() after one warm-up call."""
    out = fn()
    sync()
    best = float("inf")
    for _ in range(1 if SMALL else args.reps):
        t = time.perf_counter()
        out = fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return out, round(best, 4)


def phases(W, H) -> dict:
    """gptq_quantize's steps (as it runs them with `cfg`) timed one by one."""
    Wb, Hb = W.float(), H.float()
    Hdiag = torch.diagonal(Hb, dim1=-2, dim2=-1)
    K = W.shape[-1]
    (scale, zp), t_clip = timed(lambda: gptq._group_qparams(Wb, Hdiag, cfg))
    perm = (torch.argsort(Hdiag, dim=-1, descending=True, stable=True) if cfg.actorder
            else torch.arange(K, device=W.device).expand(Hb.shape[0], K))
    fused = gptq_triton.available(Wb)
    (Hinv, dead, _, _), t_factor = timed(lambda: gptq._inverse_cholesky(Hb, perm, cfg.percdamp, flipped=fused))
    _, t_codes = timed(lambda: gptq._codes(Wb, scale, zp, Hinv, perm, dead, cfg.group_size,
                                           cfg.blocksize, fused))
    return {"mse_clip": t_clip, "factorization": t_factor, "column_loop": t_codes}


def out_error(W, H, w) -> float:
    """The rounding's output error relative to the output, sum_b tr(E H Eᵀ) / tr(W H Wᵀ) with
    E = W - the engines' dequantized weight, in float64 expert by expert."""
    num = den = 0.0
    for b in range(W.shape[0]):
        zp = None if w.zero_point is None else w.zero_point[b]
        E = W[b].double() - dequantize(Int4Weight(w.q[b], w.scale[b], zp), torch.float64)
        Hb, Wb = H[b].double(), W[b].double()
        num += float(((E @ Hb) * E).sum())
        den += float(((Wb @ Hb) * Wb).sum())
    return num / den


def set_layout(layout: tuple) -> None:
    gptq_triton.BLOCK_ROWS, gptq_triton.BLOCK_WARPS, gptq.FUSED_WIDTHS = layout


def parse(spec: str) -> tuple:
    rows, warps, widths = spec.split(":")
    return int(rows), int(warps), tuple(int(w) for w in widths.split("/"))


default = (gptq_triton.BLOCK_ROWS, gptq_triton.BLOCK_WARPS, gptq.FUSED_WIDTHS)
cfg = GPTQConfig(group_size=32, percdamp=0.1, mse_clip=True, mse_norm=3)
res: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
             "experts": E, "torch": torch.__version__, "batches": {}}
for what, (N, K) in {"gate_up": (2 * I_dim, H_dim), "down": (H_dim, I_dim)}.items():
    H = hessians(E, K, dev)
    W = torch.randn(E, N, K, device=dev) * 0.02
    first = None
    rows = {}
    for spec in args.layouts.split(","):
        set_layout(parse(spec))
        out, best = timed(functools.partial(gptq_quantize, W, H, cfg))  # (the warm-up compiles)
        row = {"seconds": best, "output_error": out_error(W, H, out.weight)}
        if first is None:
            first = out.weight.q
        else:
            row["codes_equal_to_first"] = float((out.weight.q == first).float().mean())
        rows[spec] = row
        print(what, spec, row, flush=True)
    res["batches"][f"{what} (E {E}, N {N}, K {K})"] = rows
    set_layout(default)
    if args.phases:
        rows["phases"] = phases(W, H)
        print(what, "phases", rows["phases"], flush=True)
    if args.profile is not None and dev.type == "cuda":
        args.profile.mkdir(parents=True, exist_ok=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            gptq_quantize(W, H, cfg)
            sync()
        (args.profile / f"{what}.txt").write_text(
            prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    del H, W, first
set_layout(default)
args.out.parent.mkdir(parents=True, exist_ok=True)
args.out.write_text(json.dumps(res, indent=1) + "\n")
