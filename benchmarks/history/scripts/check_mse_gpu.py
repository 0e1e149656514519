"""GPTQ's MSE clip search on the GPU: the Triton kernel (`gptq_triton.mse_clip_qparams`) against
the eager loop of `gptq._group_qparams`, on GLM-5.2 routed-expert batches.

    PYTHONPATH=. python3 benchmarks/history/scripts/check_mse_gpu.py --out mse_gpu.json [--experts 32]

Shapes: 32 experts of gate_up (N 4096, K 6144) and of down (N 6144, K 2048), group 32,
bf16-valued float32 weights (std 0.02, a few outliers), a positive Hessian diagonal spread over
two decades with 1 % dead (zero) inputs, symmetric and asymmetric. Writes seconds per call
(CUDA-synchronized, median), the fraction of (row, group) scales / zero points that agree
(the target is 1.0: bit-identical) and how many groups the search moved off the RTN scale.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from quantize.rounding import gptq
from quantize.rounding.int4 import rtn_qparams

ap = argparse.ArgumentParser()
ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
ap.add_argument("--experts", type=int, default=32)
ap.add_argument("--repeats", type=int, default=3, help="timed calls per path after one warm-up")
args = ap.parse_args()
dev = torch.device("cuda")
assert gptq.gptq_triton.available(torch.empty(1, device=dev)), "needs CUDA and triton"


def timed(fn, *a):
    out, ts = fn(*a), []  # the first call compiles the kernel
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*a)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return out, sorted(ts)[len(ts) // 2]


gen = torch.Generator(device=dev).manual_seed(0)
results = []
for name, N, K in (("gate_up", 4096, 6144), ("down", 6144, 2048)):
    B = args.experts
    W = torch.randn(B, N, K, device=dev, generator=gen) * 0.02
    W[torch.rand(B, N, K, device=dev, generator=gen) < 1e-3] *= 8  # outliers stretch some groups
    W = W.bfloat16().float()  # (B, N, K) bf16 values, as dequantized FP8 checkpoints give
    Hdiag = 10 ** (2 * torch.rand(B, K, device=dev, generator=gen))  # (B, K)
    Hdiag[torch.rand(B, K, device=dev, generator=gen) < 0.01] = 0.0
    for symmetric in (True, False):
        cfg = gptq.GPTQConfig(group_size=32, symmetric=symmetric, mse_clip=True)
        (s_k, z_k), t_k = timed(gptq._group_qparams, W, Hdiag, cfg)
        (s_e, z_e), t_e = timed(gptq._group_qparams, W, Hdiag, replace(cfg, fused=False))
        s_rtn, _ = rtn_qparams(W.reshape(B * N, K), 32, symmetric)
        res = {"proj": name, "B": B, "N": N, "K": K, "group_size": 32, "symmetric": symmetric,
               "seconds_eager": round(t_e, 4), "seconds_kernel": round(t_k, 4),
               "speedup": round(t_e / t_k, 1),
               "scale_equal_fraction": (s_k == s_e).double().mean().item(),
               "scale_bit_identical": torch.equal(s_k, s_e),
               "groups_moved_off_rtn": (s_e.reshape(B * N, -1) != s_rtn).double().mean().item()}
        if not symmetric:
            res["zero_point_equal_fraction"] = (z_k == z_e).double().mean().item()
            res["zero_point_bit_identical"] = torch.equal(z_k, z_e)
        print(json.dumps(res), flush=True)
        results.append(res)
        del s_k, z_k, s_e, z_e, s_rtn
    del W, Hdiag
    torch.cuda.empty_cache()

report = {"results": results, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
          "triton": gptq.gptq_triton.triton.__version__}
args.out.parent.mkdir(parents=True, exist_ok=True)
args.out.write_text(json.dumps(report, indent=1) + "\n")
print(json.dumps(report, indent=1))
