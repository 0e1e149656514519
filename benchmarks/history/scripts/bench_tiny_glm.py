"""Calibrated runs compared on the tiny synthetic GLM models with held-out text, CPU: any
`convert` options against each other (e.g. `--expert-calibration routed` against
`routed-weighted`, or one set of GPTQ defaults against another) on models with a router.

    PYTHONPATH=. python3 benchmarks/history/scripts/bench_tiny_glm.py --out benchmarks/local_expert_weighting.json
    PYTHONPATH=. python3 benchmarks/history/scripts/bench_tiny_glm.py --runs \\
        "rtn,gptq,gptq:mse_norm=3,mse_weight_power=1,gptaq=0.375" --out bench_out/g32.json

The protocol of tests/test_calibrate.py::test_gptq_and_awq_beat_rtn_on_held_out_text: tiny
glm_moe_dsa (block FP8) and glm4_moe (channel FP8), 3 layers + MTP, 8 experts top-2, every 64th
post-attention-norm channel x16; the small shipped text (default.jsonl) split by document (even
lines calibrate 8 x 64 tokens with --seed S, odd lines evaluate 16 x 64 tokens, the same windows
for every run), scored by `quantize eval` against the source: the hidden-state error after the
last layer and the mean KL. Several checkpoint seeds (random weights) and calibration seeds.

`--runs`: items separated by ";" or, where no option follows, ","; each `METHOD[:key=value,...]`
with ConvertOptions fields as keys (values JSON: 0.1, true, "routed-weighted"); the summary
counts, per run, how often its KL is below the first run's on the same model and seed.

The weights are random: this says whether an option works as meant on a model with a router
and routed experts, not what it does to a real model (none with experts can be built here).
`--routers kmeans` makes the experts specialise at least: each MoE layer's router is fitted to
k-means centroids of its inputs on the calibration half (`kmeans_routers`), so each expert is
sent its own cluster of inputs, with uneven loads, instead of a random router's split.

    PYTHONPATH=. python3 benchmarks/history/scripts/bench_tiny_glm.py --routers kmeans --num-samples 1 \
        --runs "gptq;gptq:expert_coverage=32" --out bench_out/kmeans.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))  # (kept in scripts/)
from bench_quality import parse_run  # METHOD[:key=value,...], values JSON

from quantize.calib.data import SHIPPED_SETS
from quantize.check.evaluate import EvalOptions, evaluate
from quantize.names import CALIB_REPORT
from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer

ARCHS = {"glm_moe_dsa": "fp8-block", "glm4_moe": "fp8-channel"}
ROUTED_PAIR = 'gptq:expert_calibration="routed";gptq:expert_calibration="routed-weighted"'


def outlier_norms(src: Path, cfg: dict, scale: float = 16.0) -> None:
    """Every (hidden/4)-th post-attention-norm channel x16 (`scale`), as the tests' fixture."""
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    for L in range(cfg["num_hidden_layers"]):
        name = f"model.layers.{L}.post_attention_layernorm.weight"
        f = src / index[name]
        t = load_file(f)
        w = t[name].clone()
        w[:: cfg["hidden_size"] // 4] *= scale
        t[name] = w
        save_file(t, f, metadata={"format": "pt"})


def kmeans_routers(src: Path, cfg: dict, text: Path, seed: int, tokens: int = 4096,
                   spread: float = 2.0) -> dict:
    """Routers whose experts specialise: each MoE layer's router rows set, layer by layer, to
    the k-means centroids (cosine, E clusters) of that layer's MLP inputs on `text` (its first
    `tokens` tokens, windows of 64), scaled so the logits spread `spread` (std) over those
    tokens, the correction bias zeroed. A random router splits tokens along one random
    direction; these send each cluster of inputs to its own expert, with the uneven loads of
    uneven clusters. Fitted on a float32 transformers model of the source's BF16 dequant;
    written into the source (routers are stored unquantized). Returns each layer's routed
    load (tokens per expert on `text`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.calib.data import read_documents, tokenize_documents
    from quantize.pipeline import source_weight
    from quantize.plan import make_plan
    from quantize.source.checkpoint import open_checkpoint

    ck = open_checkpoint(src)
    L_mtp = ck.num_hidden_layers
    sd = {u.source: (ck.read(u.source) if u.action == "copy" else source_weight(ck, u, torch.device("cpu")))
          for u in make_plan(ck, ConvertOptions()).units if f"layers.{L_mtp}." not in u.source}
    with tempfile.TemporaryDirectory() as tmp:
        save_file({k: v.to(torch.float32).contiguous() for k, v in sd.items()}, f"{tmp}/model.safetensors",
                  metadata={"format": "pt"})
        (Path(tmp) / "config.json").write_text(json.dumps(
            {k: v for k, v in ck.config.items() if k != "quantization_config"}))
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(src)
    doc_ids, _, _ = tokenize_documents(read_documents(text), tok)  # (chats rendered, as calibration)
    ids = torch.tensor([t for d in doc_ids for t in d][:tokens])
    ids = ids[: len(ids) // 64 * 64].reshape(-1, 64)
    gen = torch.Generator().manual_seed(seed)
    E = cfg["n_routed_experts"]
    fitted, loads = {}, {}
    for L in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        mlp = model.model.layers[L].mlp
        got: list[torch.Tensor] = []
        h = mlp.register_forward_pre_hook(lambda m, a, got=got: got.append(a[0].reshape(-1, a[0].shape[-1])))
        with torch.no_grad():
            model(ids)
        h.remove()
        X = torch.cat(got)
        Xn = X / X.norm(dim=-1, keepdim=True)
        C = Xn[torch.randperm(len(Xn), generator=gen)[:E]].clone()
        for _ in range(25):  # spherical k-means
            a = (Xn @ C.T).argmax(-1)
            for e in range(E):
                if (a == e).any():
                    c = Xn[a == e].mean(0)
                    C[e] = c / c.norm()
        W = C * (spread / (X @ C.T).std())
        with torch.no_grad():
            mlp.gate.weight.copy_(W)
            mlp.gate.e_score_correction_bias.zero_()
            _, _, top = mlp.gate(X)
        loads[L] = torch.bincount(top.reshape(-1), minlength=E).tolist()
        fitted[f"model.layers.{L}.mlp.gate.weight"] = W
        fitted[f"model.layers.{L}.mlp.gate.e_score_correction_bias"] = torch.zeros(E)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    for f in sorted({index[n] for n in fitted}):
        t = load_file(src / f)
        for n, v in fitted.items():
            if index[n] == f:
                t[n] = v.to(t[n].dtype).contiguous()
        save_file(t, src / f, metadata={"format": "pt"})
    return loads


def parse_runs(text: str) -> list[tuple[str, str, dict]]:
    """'rtn,gptq:percdamp=0.1,mse_clip=false;awq' -> [(label, method, options), ...]."""
    items: list[str] = []
    for part in filter(None, text.split(";")):
        head, colon, rest = part.partition(":")
        if colon:  # options follow: the commas belong to them, except before the method
            *plain, method = head.split(",")
            items += [*filter(None, plain), f"{method}:{rest}"]
        else:
            items += list(filter(None, part.split(",")))
    return [(item, *parse_run(item.strip())) for item in items]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench_out/tiny_glm.json"))
    ap.add_argument("--runs", default=ROUTED_PAIR)
    ap.add_argument("--model-seeds", default="0,1,2")
    ap.add_argument("--calib-seeds", default="0,1")
    ap.add_argument("--num-samples", type=int, default=8, help="calibration windows of 64 tokens")
    ap.add_argument("--outlier-scale", type=float, default=16.0,
                    help="every 64th post-attention-norm channel times this (1: none)")
    ap.add_argument("--routers", choices=("random", "kmeans"), default="random",
                    help="kmeans: each MoE layer's router set to k-means centroids of its inputs on "
                         "the calibration half, so experts specialise (kmeans_routers)")
    args = ap.parse_args()
    runs = parse_runs(args.runs)
    res = {"command": " ".join(sys.argv), "torch": torch.__version__, "host": platform.node(),
           "commit": os.environ.get("BENCH_COMMIT"), "outlier_scale": args.outlier_scale,
           "num_samples": args.num_samples, "routers": args.routers, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        lines = SHIPPED_SETS["small"].read_text().splitlines()  # as the test
        calib, held = tmp / "calib.jsonl", tmp / "held.jsonl"
        calib.write_text("\n".join(lines[::2]) + "\n")
        held.write_text("\n".join(lines[1::2]) + "\n")
        for arch, fmt in ARCHS.items():
            for ms in [int(s) for s in args.model_seeds.split(",")]:
                src = tmp / f"{arch}-{ms}"
                cfg = tiny_config(arch)
                write_checkpoint(src, cfg, fmt, seed=ms)
                write_tokenizer(src, cfg["vocab_size"])
                outlier_norms(src, cfg, args.outlier_scale)
                if args.routers == "kmeans":
                    loads = kmeans_routers(src, cfg, calib, seed=ms)
                    res.setdefault("router_loads", {})[f"{arch}-{ms}"] = loads
                    print(f"{arch} seed {ms}: k-means routers, tokens per expert {loads}", flush=True)
                for cs in [int(s) for s in args.calib_seeds.split(",")]:
                    for label, method, kw in runs:
                        out = tmp / "out"
                        t0 = time.perf_counter()
                        convert(src, out, ConvertOptions(method=method, num_samples=args.num_samples, seq_len=64, seed=cs,
                                                         calib=str(calib), **kw), device="cpu", overwrite=True)
                        r = evaluate(src, out, EvalOptions(num_samples=16, seq_len=64, data=str(held)),
                                     device="cpu", write=False)
                        rep = json.loads((out / CALIB_REPORT).read_text())
                        moe = [lay for lay in rep["layers"] if lay.get("expert_tokens")]
                        row = {"arch": arch, "model_seed": ms, "calib_seed": cs, "run": label,
                               "hidden_rel_error": r["layers"][-1]["rel_error"],
                               "kl_mean": r["summary"]["kl_mean"], "seconds": round(time.perf_counter() - t0, 1),
                               # the MoE layers' experts (MTP included): all-token fallbacks, topped up
                               "experts": sum(len(lay["expert_tokens"]) for lay in moe),
                               "fallback": sum(len(lay.get("fallback") or []) for lay in moe),
                               "topped_up": sum(len(lay.get("topped_up") or []) for lay in moe)}
                        res["runs"].append(row)
                        print(row, flush=True)
    summary = {}
    first = runs[0][0]
    for arch in ARCHS:
        base = {(r["model_seed"], r["calib_seed"]): r for r in res["runs"] if r["arch"] == arch and r["run"] == first}
        for label, _, _ in runs:
            rs = [r for r in res["runs"] if r["arch"] == arch and r["run"] == label]
            row = {k: sum(r[k] for r in rs) / len(rs) for k in ("hidden_rel_error", "kl_mean")}
            row["fallback_share"] = sum(r["fallback"] for r in rs) / max(1, sum(r["experts"] for r in rs))
            row["topped_up_share"] = sum(r["topped_up"] for r in rs) / max(1, sum(r["experts"] for r in rs))
            if label != first:
                below = sum(r["kl_mean"] < base[r["model_seed"], r["calib_seed"]]["kl_mean"] for r in rs)
                row["kl_below_first"] = f"{below} of {len(rs)}"
            summary[f"{arch} {label}"] = row
    res["summary"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
