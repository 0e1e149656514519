"""GPTQ's factorization and column updates on the GPU in float32, three-pass TF32 and plain TF32:
time per GLM-5.2 gate/up batch and error against float64.

    PYTHONPATH=. python3 benchmarks/history/scripts/check_factor_gpu.py --out bench_out/factor.json   # on the H200
    SMALL=1 PYTHONPATH=. python3 benchmarks/history/scripts/check_factor_gpu.py                        # CPU: checks the script

Hessians: H = 2 XᵀX / T of bf16 inputs X (T, K) with log-normal channel scales, a few outlier
channels (x20) and correlated columns (a random mixing), damped by percdamp x mean(diag H) as
GPTQ does (percdamp 0.1, the CLI's default, and 0.01). For each variant of
`quantize.rounding.gptq`'s settings (fp32: the recursive halves in float32; tf32: their matmuls
in TF32 (FACTOR_TF32); "+prop": the block update in TF32 (PROPAGATE_TF32); `--layouts`: other
experts per factorization call (FACTOR_BATCH) and leaf sizes (CHOL_LEAF), in TF32):
- the factorization of a batch of E experts (`_factor_flipped_inplace`), CUDA-event time, and
  the worst relative Frobenius error of the upper factor against float64 (`_factor_inplace` in
  float64) over the first 4 experts;
- `gptq_quantize` of a gate/up batch (W (E, 2I, K)): time, the share of integer codes that
  differ from the float32 run, and the output error tr(E H Eᵀ) / tr(W H Wᵀ) against float32's.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from synthetic_hessians import hessians

from quantize.rounding import gptq
from quantize.rounding.gptq import (
    GPTQConfig,
    _factor_flipped_inplace,
    _factor_inplace,
    gptq_quantize,
)

ap = argparse.ArgumentParser()
ap.add_argument("--experts", type=int, default=32)
ap.add_argument("--layouts", default="",
                help="more factorization layouts to time in TF32, e.g. '16:256,8:128' "
                     "(gptq.FACTOR_BATCH:gptq.CHOL_LEAF; the defaults are run as 'tf32')")
ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")) / "factor.json")
args = ap.parse_args()
SMALL = bool(os.environ.get("SMALL"))
dev = torch.device("cuda" if torch.cuda.is_available() and not SMALL else "cpu")
K, I = (384, 128) if SMALL else (6144, 2048)
E = 3 if SMALL else args.experts
T = 4 * K  # tokens per expert (synthetic_hessians.hessians)
torch.manual_seed(0)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps=3):
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        out = fn()
    sync()
    return out, (time.perf_counter() - t) / reps


def mode(name: str):
    """fp32: recursive halves in float32; tf32: their matmuls in TF32; "+prop": the block
    update in TF32 too (the defaults: tf32+prop)."""
    gptq.FACTOR_TF32 = name.startswith("tf32")
    gptq.PROPAGATE_TF32 = name.endswith("+prop")


res: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "K": K, "experts": E,
             "tokens_per_expert": T, "torch": torch.__version__, "factor": {}, "gptq": {}}
for percdamp in (0.1, 0.01):
    H = hessians(E, K, dev, percdamp)  # processing order = identity here
    ref = H[:4].double().clone()
    _factor_inplace(ref)  # float64 upper factor of H⁻¹
    default = (gptq.FACTOR_BATCH, gptq.CHOL_LEAF)
    layouts = [tuple(int(v) for v in x.split(":")) for x in args.layouts.split(",") if x]
    for name, (fb, leaf) in [("fp32", default), ("tf32", default)] + \
            [(f"tf32 batch {fb} leaf {leaf}", (fb, leaf)) for fb, leaf in layouts]:
        mode(name)
        gptq.FACTOR_BATCH, gptq.CHOL_LEAF = fb, leaf
        A = H.flip(-2, -1).contiguous()
        def factor(A=A):
            B = A.clone()
            _factor_flipped_inplace(B)
            return B

        U, sec = timed(factor)
        err = ((U[:4].double() - ref).norm(dim=(-2, -1)) / ref.norm(dim=(-2, -1))).max().item()
        res["factor"][f"{name} damp {percdamp}"] = {"seconds": round(sec, 4), "rel_err_vs_f64": err}
        print(f"factor {name} damp {percdamp}: {sec:.4f} s, rel err {err:.2e}", flush=True)
        del U, A
        gptq.FACTOR_BATCH, gptq.CHOL_LEAF = default
    del ref
    W = torch.randn(E, 2 * I, K, device=dev) * 0.02
    base = None
    for name, (fb, leaf) in [("fp32", default), ("fp32+prop", default), ("tf32+prop", default)] + \
            [(f"tf32+prop batch {fb} leaf {leaf}", (fb, leaf)) for fb, leaf in layouts]:
        mode(name)
        gptq.FACTOR_BATCH, gptq.CHOL_LEAF = fb, leaf
        cfg = GPTQConfig(group_size=32, percdamp=percdamp, mse_clip=True)
        r, sec = timed(lambda W=W, H=H, cfg=cfg: gptq_quantize(W, H, cfg), reps=1)
        w = r.weight
        Q = ((w.q.float() - (0 if w.zero_point is None else w.zero_point.float().repeat_interleave(32, -1)))
             * w.scale.float().repeat_interleave(32, -1))
        D = (W - Q).double()
        torch.backends.cuda.matmul.allow_tf32 = False
        obj = sum(float((D[e] @ H[e].double() * D[e]).sum() / (W[e].double() @ H[e].double() * W[e].double()).sum())
                  for e in range(E)) / E
        row = {"seconds": round(sec, 4), "out_err": obj}
        if base is None:
            base = w.q
        else:
            row["codes_differ"] = float((w.q != base).float().mean())
        res["gptq"][f"{name} damp {percdamp}"] = row
        print(f"gptq {name} damp {percdamp}: {row}", flush=True)
        gptq.FACTOR_BATCH, gptq.CHOL_LEAF = default
    del H, W
mode("tf32+prop")  # (the defaults back)
args.out.parent.mkdir(parents=True, exist_ok=True)
args.out.write_text(json.dumps(res, indent=1) + "\n")
print(json.dumps(res, indent=1))
