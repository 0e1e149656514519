"""Where one GLM-5.2 MoE layer's calibration time goes, piece by piece, on one GPU.

    OUT=bench_out PYTHONPATH=. python3 benchmarks/history/scripts/profile_h200_layer.py [--chunks 4] [--experts 16]

No checkpoint: layer 1 of a GLM-5.2-shaped model (scripts' usual slice: hidden 6144, 256
experts of width 2048, MLA + DSA indexer) is built from transformers' own class with random
weights on the GPU. Times (CUDA-synchronized wall) of: pass 1 (the layer forward with the
routed statistics), pass 2 (the plain forward), the MoE block alone, the attention alone,
building a GPTQ batch's Hessians, the gate/up and down solves, and the factorization
variants of the Hessians. Writes OUT/profile_layer.json and the top kernels of each piece
(torch.profiler) to OUT/profile_layer_<piece>.txt. SMALL=1: tiny shapes (checks the script on
a CPU; figures meaningless).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from quantize.calib.capture import MLPStats, moe_forward
from quantize.calib.decoder import _mask, layer_inputs, run_layer
from quantize.rounding.gptq import (
    GPTQConfig,
    _factor_flipped_inplace,
    _factor_inplace,
    gptq_quantize,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from glm52_moe_layer import random_moe_layer, sync

ap = argparse.ArgumentParser()
ap.add_argument("--chunks", type=int, default=4)
ap.add_argument("--experts", type=int, default=16, help="experts per GPTQ batch")
args = ap.parse_args()
OUT = Path(os.environ.get("OUT", "/tmp/out"))
OUT.mkdir(parents=True, exist_ok=True)
SMALL = bool(os.environ.get("SMALL"))
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dt = torch.bfloat16
cfg, skeleton, layer, S = random_moe_layer(SMALL, dev, dt)
b = 2 if SMALL else 8  # samples per chunk: 16k tokens, as CHUNK_TOKENS["cuda"]
res: dict = {"config": {k: cfg[k] for k in ("hidden_size", "n_routed_experts", "moe_intermediate_size")},
             "chunk_tokens": b * S, "chunks": args.chunks, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}


def timed(name, fn, reps=1, profile=True):
    fn()  # warm-up (kernels compiled, caches)
    sync(dev)
    t = time.perf_counter()
    for _ in range(reps):
        out = fn()
    sync(dev)
    res[name] = round((time.perf_counter() - t) / reps, 4)
    if profile and dev.type == "cuda":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            fn()
            sync(dev)
        (OUT / f"profile_layer_{name}.txt").write_text(
            p.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    print(f"{name}: {res[name]} s", flush=True)
    return out


inputs = layer_inputs(skeleton, S, dev, dt)
H = cfg["hidden_size"]
hs = [torch.randn(b, S, H, device=dev, dtype=dt) for _ in range(args.chunks)]
topk = [None] * args.chunks
torch.set_grad_enabled(False)
if dev.type == "cuda":
    torch.cuda.reset_peak_memory_stats()

# ---- forwards
def pass2():
    for i in range(args.chunks):
        out, topk[i] = run_layer(skeleton, layer, inputs, hs[i], topk[i])
    return out


def pass1():
    st = MLPStats("moe", hessians=True, samples=False, all_experts=False,
                  num_experts=cfg["n_routed_experts"], store_tokens=True)
    mlp = layer.mlp
    mlp.forward = lambda x: moe_forward(mlp, x, st)
    try:
        for i in range(args.chunks):
            run_layer(skeleton, layer, inputs, hs[i], topk[i])
    finally:
        del mlp.forward
    return st


timed("pass2_forward", pass2)
stats = timed("pass1_forward_statistics", pass1)
xs = [layer.post_attention_layernorm(h) for h in hs]
timed("moe_block_only", lambda: [layer.mlp(x) for x in xs])
timed("moe_block_with_stats", lambda: [moe_forward(layer.mlp, x, MLPStats(
    "moe", hessians=True, samples=False, all_experts=False, num_experts=cfg["n_routed_experts"],
    store_tokens=True)) for x in xs])
xs = None  # (freed)


def attn():
    for i in range(args.chunks):
        h = layer.input_layernorm(hs[i])
        kw = {"prev_topk_indices": topk[i]} if "prev_topk_indices" in \
            __import__("inspect").signature(layer.self_attn.forward).parameters else {}
        layer.self_attn(h, attention_mask=_mask(skeleton, inputs, h), position_ids=inputs.position_ids.expand(b, -1),
                        position_embeddings=inputs.position_embeddings, **kw)


try:
    timed("attention_only", attn)
except Exception as e:  # noqa: BLE001 - a signature this script does not know: say so
    res["attention_only"] = f"{type(e).__name__}: {e}"
res["peak_gpu_gib_forwards"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None
hs = None  # (freed)

# ---- GPTQ of one batch of experts
nb = args.experts
es = list(range(nb))
K, I = H, cfg["moe_intermediate_size"]
counts = [stats.expert_tokens[e] for e in es]
res["expert_tokens_in_batch"] = counts


def build_H():
    Hb = torch.empty(nb, K, K, device=dev)
    saved = {e: list(stats.rows_e[e]) for e in es}
    stats.experts_H_in(es, Hb)
    stats.rows_e.update(saved)  # (expert_H_in releases them; the benchmark repeats)
    return Hb


Hb = timed("expert_H_in_batch", build_H)
Hb.diagonal(dim1=-2, dim2=-1).add_(1e-3)
Wgu = torch.randn(nb, 2 * I, K, device=dev) * 0.02
Wd = torch.randn(nb, K, I, device=dev) * 0.02
Hd = torch.stack([stats.S_down_e[e] * (2.0 / stats.n_down_e[e]) for e in es])
Hd.diagonal(dim1=-2, dim2=-1).add_(1e-3)
gcfg = GPTQConfig(group_size=32)
timed("gptq_gate_up_batch", lambda: gptq_quantize(Wgu, Hb, gcfg))
timed("gptq_down_batch", lambda: gptq_quantize(Wd, Hd, gcfg))
res["peak_gpu_gib_gptq"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None

# ---- factorization variants on the gate/up Hessians (copies; the batch as solved)
A0 = Hb + 0.01 * Hb.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(K, device=dev)
timed("factor_flipped_batch", lambda: _factor_flipped_inplace(A0.clone()), profile=False)
timed("factor_inverse_chol_batch", lambda: _factor_inplace(A0.clone()), profile=False)
timed("cholesky_batched", lambda: torch.linalg.cholesky_ex(A0), profile=False)
timed("cholesky_looped", lambda: [torch.linalg.cholesky_ex(A0[j]) for j in range(nb)], profile=False)
Lw = torch.linalg.cholesky_ex(A0)[0]
eye = torch.eye(K, device=dev)
timed("trsm_looped", lambda: [torch.linalg.solve_triangular(Lw[j], eye, upper=False) for j in range(nb)],
      profile=False)
timed("trsm_batched", lambda: torch.linalg.solve_triangular(Lw, eye.expand(nb, K, K), upper=False),
      profile=False)
timed("matmul_fp32_KxK_batched", lambda: Lw @ Lw, profile=False)
res["fp32_tflops_KxK"] = round(nb * 2 * K ** 3 / res["matmul_fp32_KxK_batched"] / 1e12, 1)
res["experts_per_layer_scale"] = cfg["n_routed_experts"] / nb
print(json.dumps(res, indent=1))
(OUT / "profile_layer.json").write_text(json.dumps(res, indent=1) + "\n")
