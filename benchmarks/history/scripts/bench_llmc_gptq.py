"""Our GPTQ solve against llm-compressor's on identical (W, H), and our kernels' CPU times.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv-llmc/bin/python benchmarks/history/scripts/bench_llmc_gptq.py \
        --out benchmarks/local_llmc_gptq.json

Needs llm-compressor (`make test-llmc` builds `.venv-llmc`). E=8 experts of N=256 x K=1024,
T=4096 correlated tokens with 16 loud channels, bf16-valued weights, group 32, three seeds, both
schemes, actorder static. Per case: how many of llm-compressor's scales (from their
`calculate_qparams` on the bf16 weight's group min/max) equal ours; how many integer codes of
their `quantize_weight` equal ours with their scales, with our scales, and with activation order
off; experts with tied diag(H) (where the sort orders may differ); each solve's output error
||(W-Q)X|| relative to RTN's; one-thread CPU seconds. Then the failed-Cholesky case (an
indefinite Hessian: theirs falls back to RTN, ours retries with more dampening), and the CPU
times of our gptq_quantize (plain and with MSE clip) and awq_search. Writes OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

from quantize.rounding.awq import AWQConfig, awq_search
from quantize.rounding.gptq import GPTQConfig, accumulate_hessian, gptq_quantize
from quantize.rounding.int4 import Int4Weight, dequantize, quantize_rtn


def _ints(W_fq, scale, zp, sym, g):
    """Integer codes of a fake-quantized (dequantized) W under (scale, zero point)."""
    E, N, K = W_fq.shape
    zc = 0.0 if sym else zp.float().unsqueeze(-1)
    return (W_fq.reshape(E, N, K // g, g) / scale.float().unsqueeze(-1) + zc).round().reshape(E, N, K)


def _timed(f):
    t = time.perf_counter()
    r = f()
    return r, round(time.perf_counter() - t, 3)


def case(seed: int, sym: bool, E=8, N=256, K=1024, T=4096, g=32) -> dict:
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(E, N, K, generator=gen).bfloat16().float()
    A = torch.randn(K, K, generator=gen) / K**0.5 + torch.eye(K)
    X = torch.randn(E, T, K, generator=gen) @ A
    X[..., :16] *= 8
    H, _ = accumulate_hessian(torch.zeros(E, K, K), X, 0)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy="group", group_size=g,
                            actorder="static")
    cfg = GPTQConfig(group_size=g, symmetric=sym)  # percdamp 0.01, no MSE clip: their choices
    ours, t_ours = _timed(lambda: gptq_quantize(W, H, cfg))
    Wg = W.bfloat16().reshape(E, N, K // g, g)
    s_l, z_l = calculate_qparams(Wg.amin(-1), Wg.amax(-1), args)
    sd = (s_l.float() - ours.weight.scale.float()).abs()
    (W_fq, _, fb), t_l = _timed(lambda: quantize_weight(W.clone(), H.clone(), s_l, z_l, None, args))
    ours_zp = None if sym else ours.weight.zero_point
    W_fq2, _, _ = quantize_weight(W.clone(), H.clone(), ours.weight.scale,
                                  z_l if sym else ours_zp, None, args)
    noact = gptq_quantize(W, H, GPTQConfig(group_size=g, symmetric=sym, actorder=False))
    args0 = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy="group", group_size=g)
    W_fq3, _, _ = quantize_weight(W.clone(), H.clone(), noact.weight.scale,
                                  z_l if sym else noact.weight.zero_point, None, args0)

    def oerr(Wq):
        return sum(((W[e] - Wq[e]) @ X[e].T).norm() ** 2 for e in range(E)).sqrt().item()

    rtn = torch.stack([dequantize(quantize_rtn(W[e], g, sym)).float() for e in range(E)])
    ours_dq = torch.stack([dequantize(Int4Weight(ours.weight.q[e], ours.weight.scale[e],
                                                 None if sym else ours.weight.zero_point[e])).float()
                           for e in range(E)])
    q = ours.weight.q.float()
    d = torch.diagonal(H, dim1=-2, dim2=-1)
    out = {
        "seed": seed, "scheme": "symmetric" if sym else "asymmetric",
        "scales_identical": (sd == 0).float().mean().item(),
        "scales_max_abs_diff": sd.max().item(),
        "scales_max_rel_diff": (sd / ours.weight.scale.float()).max().item(),
        "ints_identical_their_scales": (_ints(W_fq, s_l, z_l, sym, g) == q).float().mean().item(),
        "ints_identical_our_scales": (_ints(W_fq2, ours.weight.scale, ours_zp, sym, g) == q
                                      ).float().mean().item(),
        "ints_identical_actorder_off": (_ints(W_fq3, noact.weight.scale,
                                              None if sym else noact.weight.zero_point, sym, g)
                                        == noact.weight.q.float()).float().mean().item(),
        "experts_with_tied_diag_H": sum(int(ds.unique().numel() < K) for ds in d),
        "output_error_vs_rtn_ours": oerr(ours_dq) / oerr(rtn),
        "output_error_vs_rtn_llmc": oerr(W_fq) / oerr(rtn),
        "llmc_rtn_fallback": bool(fb.any()),
        "cpu_seconds_ours": t_ours, "cpu_seconds_llmc": t_l,
    }
    if not sym:
        out["zero_points_identical"] = (z_l.to(torch.int8) == ours.weight.zero_point
                                        ).float().mean().item()
    print(json.dumps(out), flush=True)
    return out


def failed_cholesky() -> dict:
    gen = torch.Generator().manual_seed(7)
    K = 256
    W = torch.randn(2, 64, K, generator=gen).bfloat16().float()
    X = torch.randn(2, 1024, K, generator=gen) @ (torch.randn(K, K, generator=gen) / K**0.5
                                                 + torch.eye(K))
    H, _ = accumulate_hessian(torch.zeros(2, K, K), X, 0)
    Z = torch.randn(16, K, generator=gen)
    H1 = 2 * Z.T @ Z / 16
    H[1] = H1 - 0.05 * H1.diagonal().mean() * torch.eye(K)  # rank 16, shifted: indefinite
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=32, actorder="static")
    ours = gptq_quantize(W, H)
    W_fq, _, fb = quantize_weight(W.clone(), H.clone(), ours.weight.scale,
                                  torch.zeros_like(ours.weight.scale, dtype=torch.int8), None, args)
    q_l = _ints(W_fq, ours.weight.scale, None, True, 32)
    out = {"ours_damp": ours.damp.tolist(), "ours_retries": int(ours.retries),
           "llmc_rtn_fallback": fb.tolist(),
           "llmc_expert1_equals_rtn": torch.equal(q_l[1], quantize_rtn(W[1], 32).q.float()),
           "expert0_ints_identical": (q_l[0] == ours.weight.q[0].float()).float().mean().item()}
    print(json.dumps(out), flush=True)
    return out


def own_times(E=8, N=256, K=1024, T=4096, g=32) -> dict:
    gen = torch.Generator().manual_seed(11)
    W = torch.randn(E, N, K, generator=gen).bfloat16().float()
    X = torch.randn(E, T, K, generator=gen) @ (torch.randn(K, K, generator=gen) / K**0.5
                                               + torch.eye(K))
    X[..., :16] *= 8
    H, _ = accumulate_hessian(torch.zeros(E, K, K), X, 0)
    gptq_quantize(W, H)  # warm-up
    _, t_plain = _timed(lambda: gptq_quantize(W, H, GPTQConfig(group_size=g)))
    _, t_clip = _timed(lambda: gptq_quantize(W, H, GPTQConfig(group_size=g, mse_clip=True)))
    gate = torch.randn(E, N, K, generator=gen).bfloat16().float()
    up = torch.randn(E, N, K, generator=gen).bfloat16().float()
    Xa = torch.randn(E, 512, K, generator=gen)
    Xa[..., :8] *= 10  # 8 loud channels
    r, t_awq = _timed(lambda: awq_search([gate, up], Xa, AWQConfig(group_size=g)))
    ratio = (r.err_after / r.err_before).tolist()
    out = {"shape": {"E": E, "N": N, "K": K, "T": T, "group": g},
           "gptq_quantize_seconds": t_plain, "gptq_quantize_mse_clip_seconds": t_clip,
           "awq_search_seconds": t_awq, "awq_search_tokens": 512, "awq_loud_channels": 8,
           "awq_error_vs_rtn_min_max": [min(ratio), max(ratio)]}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    import llmcompressor

    res = {"command": "python benchmarks/history/scripts/bench_llmc_gptq.py --out " + str(a.out),
           "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                       "python": platform.python_version(),
                       "platform": platform.platform()},
           "torch": torch.__version__, "llmcompressor": llmcompressor.__version__,
           "cases": [case(s, sym) for sym in (True, False) for s in range(a.seeds)],
           "failed_cholesky": failed_cholesky(), "own_cpu_times": own_times()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
