"""Where a GLM-5.2 MoE layer's routed expert Hessians and its MLP passes spend their time,
and how other ways of summing the same Hessians compare, on one GPU.

    OUT=bench_out PYTHONPATH=. python3 benchmarks/history/scripts/profile_routed_hessians.py [--tokens 1048576]

No checkpoint: layer 1 of a GLM-5.2-shaped model (hidden 6144, 256 experts of width 2048,
top-8, MLA + DSA) is built from transformers' own class with random weights on the GPU, its
attention split off (`SplitLayer`, checked bit for bit on chunk 0), and h1 (the residual after
the attention) drawn at random for `--tokens` tokens in 8k-token chunks, as the calibration's
pass 1 leaves them. Then, CUDA-synchronized wall times of:

- pass1_mlp_stats: the statistics forward (`moe_forward`, outputs off) over 64k-token calls;
- pass2_mlp: the layer's MLP half (`SplitLayer.mlp`) over every chunk, as pass 2 runs it;
- recompute_call: one call's MLP inputs recomputed from h1 (`SplitLayer.mlp_input` per chunk,
  as the rounding does per batch), and the bare post-attention norm on the same tokens;
- H_batch_*: one batch of `--experts` experts' gate/up Hessians (2 XᵀX / n of their routed
  rows), by the code (`MLPStats.experts_H_in`, recomputing or with the inputs kept) and by
  candidate ways, each checked against the code's result;
- xtx_rows_*: one accumulating XᵀX at width 6144 for several row counts.

Writes OUT/profile_routed_hessians.json. SMALL=1: tiny shapes (checks the script on a CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from quantize.calib import decoder as dec
from quantize.calib.capture import MLPStats, moe_forward
from quantize.calib.decoder import SplitLayer, every_key_indexer, layer_inputs
from quantize.rounding.gptq import GPTQConfig, gptq_quantize, xtx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from glm52_moe_layer import random_moe_layer, sync

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=512 * 2048)
ap.add_argument("--experts", type=int, default=32, help="experts per batch (GPTQ_BATCH)")
ap.add_argument("--batches", type=int, default=2, help="batches timed per variant")
args = ap.parse_args()
OUT = Path(os.environ.get("OUT", "/tmp/out"))
OUT.mkdir(parents=True, exist_ok=True)
SMALL = bool(os.environ.get("SMALL"))
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dt = torch.bfloat16
cfg, skeleton, layer, S = random_moe_layer(SMALL, dev, dt, norm_std=0.1)
CHUNK = 4 * S  # tokens per chunk (8192 on the GPU, as CHUNK_TOKENS)
CALL = 8 * CHUNK  # tokens per statistics call (65536, as MLP_GROUP_TOKENS["cuda"])
tokens = min(args.tokens, 16 * CALL) if SMALL else args.tokens
n_chunks = tokens // CHUNK
E, H, I = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
args.experts = min(args.experts, E // args.batches)
res: dict = {"tokens": n_chunks * CHUNK, "chunk_tokens": CHUNK, "call_tokens": CALL,
             "experts_per_batch": args.experts, "hidden": H, "experts": E,
             "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
             "torch": torch.__version__}
torch.set_grad_enabled(False)


def timed(name, fn, reps=1, warm=True):
    if warm:
        fn()
    sync(dev)
    t = time.perf_counter()
    for _ in range(reps):
        out = fn()
    sync(dev)
    res[name] = round((time.perf_counter() - t) / reps, 4)
    print(f"{name}: {res[name]} s", flush=True)
    return out


inputs = layer_inputs(skeleton, S, dev, dt)
halves = SplitLayer(skeleton, layer, inputs)
ok, _, _, _, _ = halves.check(torch.randn(CHUNK // S, S, H, device=dev, dtype=dt), None)
res["split_ok"] = bool(ok)
h1 = [torch.randn(CHUNK // S, S, H, device=dev, dtype=dt) for _ in range(n_chunks)]
calls = [list(range(c, min(c + CALL // CHUNK, n_chunks))) for c in range(0, n_chunks, CALL // CHUNK)]


def x_of(c):
    return torch.cat([halves.mlp_input(h1[i]).flatten(0, -2) for i in calls[c]])


timed("recompute_call", lambda: x_of(0), reps=3)  # (the norm alone, as check found it)
res["recompute_by_norm_module"] = halves._norm is not None
timed("recompute_call_by_layer_forward",
      lambda: torch.cat([halves._mlp_input_by_forward(h1[i]).flatten(0, -2) for i in calls[0]]), reps=3)
post = layer.post_attention_layernorm
res["post_norm_equals_mlp_input"] = bool(torch.equal(
    torch.cat([post(h1[i]).flatten(0, -2) for i in calls[0]]), x_of(0)))
timed("post_norm_call", lambda: torch.cat([post(h1[i]).flatten(0, -2) for i in calls[0]]), reps=3)


# the attention half on 8 chunks (64k tokens), the DSA indexer computed and answering "every
# key" (`run_layer`, where index_topk >= the sequence length: its top-k is then all of them)
n_att = min(8, n_chunks)


def attention_half():
    return [halves.attention(h1[i], None, lambda x: None) for i in range(n_att)]


dec.EVERY_KEY[0] = False
ref_att = timed("attention_8_chunks_indexer_computed", attention_half)
dec.EVERY_KEY[0] = True
if every_key_indexer(layer, S) is not None:
    got_att = timed("attention_8_chunks_indexer_every_key", attention_half)
    res["attention_all_keys_equal"] = all(torch.equal(a[0], b[0]) for a, b in zip(ref_att, got_att))
    res["attention_topk_same_sets"] = all(torch.equal(a[1].sort(-1).values.to(torch.int32),
                                                      b[1].sort(-1).values.to(torch.int32))
                                          for a, b in zip(ref_att, got_att))
    del got_att
del ref_att


def pass1():
    st = MLPStats("moe", hessians=True, samples=False, all_experts=False, num_experts=E,
                  store_tokens=True)
    st.x_of = x_of
    for c in range(len(calls)):
        x = x_of(c)
        moe_forward(layer.mlp, x, st, outputs=False)
        del x
    return st


stats = timed("pass1_mlp_stats_with_recompute", pass1, warm=False)
res["expert_tokens_min_mean_max"] = [min(stats.expert_tokens), sum(stats.expert_tokens) / E,
                                     max(stats.expert_tokens)]
timed("pass2_mlp", lambda: [halves.mlp(h) for h in h1][-1])
for g in (2, 4, 8):  # pass 2's MLP half on groups of g chunks (PASS2_GROUP_TOKENS: 2)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    timed(f"pass2_mlp_group_{g * CHUNK}", lambda g=g: [halves.mlp(torch.cat(h1[i:i + g]))
                                                        for i in range(0, n_chunks, g)][-1])
    if dev.type == "cuda":
        res[f"pass2_mlp_group_{g * CHUNK}_scratch_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
xs = [x_of(c) for c in range(len(calls))]  # the inputs kept (as x_store)
rows_saved = {e: list(v) for e, v in stats.rows_e.items()}


def restore():
    stats.rows_e.clear()
    stats.rows_e.update({e: list(v) for e, v in rows_saved.items()})


def code(kept: bool):
    def run():
        out = None
        for j in range(args.batches):
            es = list(range(j * args.experts, (j + 1) * args.experts))
            restore()
            stats.x_store = list(xs) if kept else [None] * len(calls)
            out = torch.empty(len(es), H, H, device=dev)
            stats.experts_H_in(es, out)
        return out
    return run


ref = timed("H_batches_code_recompute", code(False))
timed("H_batches_code_kept", code(True))


def by_call(es):
    want = {e: j for j, e in enumerate(es)}
    got: dict[int, list] = {}
    for e in es:
        for c, r, _w in rows_saved.get(e, []):
            got.setdefault(c, []).append((want[e], r))
    return got


def padded(kept: bool):
    """One gather and one batched GEMM per call: the batch's rows padded to the longest."""
    def run():
        out = None
        for j in range(args.batches):
            es = list(range(j * args.experts, (j + 1) * args.experts))
            out = torch.zeros(len(es), H, H, device=dev)
            for c, lst in sorted(by_call(es).items()):
                x = xs[c] if kept else x_of(c)
                n = max(r.numel() for _, r in lst)
                idx = torch.zeros(len(es), n, dtype=torch.long, device=dev)
                m = torch.zeros(len(es), n, 1, dtype=dt, device=dev)
                for jj, r in lst:
                    idx[jj, :r.numel()] = r
                    m[jj, :r.numel()] = 1
                X = x[idx] * m  # (e, n, H), pad rows 0
                xtx(X, acc=out)
            for e in es:
                out[e - es[0]].mul_(2.0 / stats.expert_tokens[e])
        return out
    return run


def concat(kept: bool, group: int):
    """Each expert's rows of `group` calls gathered into one block, one XᵀX per block."""
    def run():
        out = None
        for j in range(args.batches):
            es = list(range(j * args.experts, (j + 1) * args.experts))
            out = torch.zeros(len(es), H, H, device=dev)
            items = sorted(by_call(es).items())
            for g in range(0, len(items), group):
                parts: dict[int, list] = {}
                for c, lst in items[g:g + group]:
                    x = xs[c] if kept else x_of(c)
                    for jj, r in lst:
                        parts.setdefault(jj, []).append(x.index_select(0, r))
                for jj, ps in parts.items():
                    xtx(torch.cat(ps) if len(ps) > 1 else ps[0], acc=out[jj])
            for e in es:
                out[e - es[0]].mul_(2.0 / stats.expert_tokens[e])
        return out
    return run


for name, fn in [("H_batches_padded_kept", padded(True)), ("H_batches_padded_recompute", padded(False)),
                 ("H_batches_concat4_kept", concat(True, 4)), ("H_batches_concat16_kept", concat(True, 16)),
                 ("H_batches_concat4_recompute", concat(False, 4))]:
    got = timed(name, fn)
    res[name + "_maxrel"] = float(((got - ref).abs().max() / ref.abs().max()).item())
res["batches_timed"] = args.batches

# the GPTQ kernels' first call in a process (Triton's compilation) against the next
nw = min(8, ref.shape[0])
Wgu = torch.randn(nw, 2 * I, H, device=dev) * 0.02
gcfg = GPTQConfig(group_size=32, mse_clip=True, percdamp=0.1)
timed("gptq_gate_up_8_first_call", lambda: gptq_quantize(Wgu, ref[:nw], gcfg), warm=False)
timed("gptq_gate_up_8_second_call", lambda: gptq_quantize(Wgu, ref[:nw], gcfg), warm=False)
res["batches_per_layer"] = E / args.experts

for n in (512, 2048, 8192, 32768):
    X = torch.randn(n, H, device=dev, dtype=dt)
    acc = torch.zeros(H, H, device=dev)
    reps = 20
    timed(f"xtx_rows_{n}", lambda X=X, acc=acc: xtx(X, acc=acc), reps=reps)
    res[f"xtx_rows_{n}_tflops"] = round(2 * n * H * H / res[f"xtx_rows_{n}"] / 1e12, 1)
res["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None
print(json.dumps(res, indent=1))
(OUT / "profile_routed_hessians.json").write_text(json.dumps(res, indent=1) + "\n")
