"""How each MLP Linear's rounding holds on other text: the per-Linear view of issue 27's
out-of-domain gap (Gemma-3-270M, the source stream, no model written).

For every MLP Linear of the source model, the second moments of its inputs H = XᵀX / T are
taken on the calibration windows (`bench_quality.py`'s broad set and sampler, the BOS first)
and, with the BOS before every window as `bench_quality.py --bos` scores them, on its
validation and reported halves in domain (held-out Python-reference topics) and out of domain
(the five general-English texts, pooled). Each rounding variant is fitted on the calibration H
alone (`gptq_quantize`, the Linear's own inputs from the unquantized stream, so no GPTAQ and no
MLP order: those need the quantized stream) and scored on every set by the relative output error

    tr(E H Eᵀ) / tr(W H Wᵀ),  E = W - dequant(Q)

averaged over the Linears. It separates what the rounding of one Linear fits to the calibration
text from what the stream terms add, in minutes and without scoring a model.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=. python3 scripts/bench_linear_ood.py \\
        --source /tmp/bqc/source-bf16 --workdir /tmp/blo --group-size 128 \\
        --out benchmarks/local_linear_ood_gemma3_g128.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quality import OOD_TEXTS, ROOT, commit, eval_texts, scoring_bos, split_text

from quantize.calib.data import load_calibration
from quantize.rounding.gptq import GPTQConfig, gptq_quantize
from quantize.rounding.int4 import dequantize

SETS = ("cal", "val_id", "val_ood", "rep_id", "rep_ood")


def variants(g: int) -> dict[str, dict]:
    """The rounding variants: llm-compressor's GPTQ as its `imatrix_mse` choice runs it (our
    code: static groups, activation order, the clip weighted by diag H with power 3, dampening
    0.1), ours (the same plus the CLI's three scale re-fit rounds), and the settings around it."""
    clip = {"group_size": g, "percdamp": 0.1, "mse_clip": True, "mse_norm": 3, "mse_weight_power": 1.0}
    return {
        "rtn": {"group_size": g, "mse_clip": False, "percdamp": 0.1, "identity": True},
        "plain GPTQ, imatrix clip (llm-compressor's choice)": dict(clip),
        "ours: + scale re-fit x3 (the CLI's)": dict(clip, scale_refit=3),
        "re-fit x1": dict(clip, scale_refit=1),
        "re-fit x3, dampening 0.05": dict(clip, scale_refit=3, percdamp=0.05),
        "re-fit x3, dampening 0.2": dict(clip, scale_refit=3, percdamp=0.2),
        "re-fit x3, shrinkage 0.05": dict(clip, scale_refit=3, shrink=0.05),
    }


def capture(src: Path, work: Path, num_samples: int, seq_len: int, seed: int) -> dict:
    """float32 H per (set, Linear input) summed in float64, and the Linears' weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    split = split_text(work)
    texts = eval_texts(tok, split, [ROOT / "calib_data" / n for n in OOD_TEXTS], 10, 512, 512)
    bos = scoring_bos(tok, src, True)
    cal = load_calibration(work / "broad.jsonl", tok, num_samples, seq_len, seed, True).tokens
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    layers = model.model.layers
    sums: dict[tuple[str, str], list] = {}
    current = {"set": ""}

    def hook(name: str):
        def f(_mod, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            acc = sums.setdefault((current["set"], name),
                                  [torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64), 0])
            acc[0] += x.T @ x
            acc[1] += x.shape[0]
        return f

    for i, layer in enumerate(layers):  # gate_proj and up_proj share their input
        layer.mlp.gate_proj.register_forward_pre_hook(hook(f"{i}.gate"))
        layer.mlp.down_proj.register_forward_pre_hook(hook(f"{i}.down"))

    def run(name: str, windows: torch.Tensor, add_bos: bool) -> None:
        current["set"] = name
        with torch.no_grad():
            for w in windows:
                x = w.unsqueeze(0)
                if add_bos:
                    x = torch.cat([torch.full((1, 1), bos), x], 1)
                model(x)

    t0 = time.perf_counter()
    run("cal", cal, False)  # load_calibration's windows begin with the BOS already
    for k, w in texts.items():
        run(("val_" if k.startswith("val:") else "rep_") + ("ood" if "ood:" in k else "id"), w, True)
    print(f"statistics of {len(sums)} (set, input) pairs in {time.perf_counter() - t0:.0f} s", flush=True)
    H = {f"{s}|{n}": (h / c).float() for (s, n), (h, c) in sums.items()}
    W = {f"{i}.{n}": getattr(layer.mlp, p).weight.detach().float().clone()
         for i, layer in enumerate(layers)
         for n, p in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))}
    return {"H": H, "W": W, "tokens": {"cal": list(cal.shape), **{k: list(v.shape) for k, v in texts.items()}}}


def _key(lin: str) -> tuple[str, str]:
    """A Linear's layer and the input its H is of (gate_proj and up_proj share theirs)."""
    i, kind = lin.split(".")
    return i, "down" if kind == "down" else "gate"


def score(stats: dict, g: int, only: list[str] | None) -> dict:
    H, W = stats["H"], stats["W"]
    # tr(W H Wᵀ) per Linear and set: the same for every variant, computed once
    base = {(lin, s): torch.einsum("nk,kl,nl->", w.double(), H[f"{s}|{i}.{key}"].double(), w.double())
            for lin, w in W.items() for i, key in [_key(lin)] for s in SETS}
    out = {}
    for name, kw in variants(g).items():
        if only and name not in only:
            continue
        kw = dict(kw)
        identity = kw.pop("identity", False)
        cfg = GPTQConfig(**kw)
        t0 = time.perf_counter()
        per: dict[str, dict[str, float]] = {}
        for lin, w in W.items():
            i, key = _key(lin)
            Hc = H[f"cal|{i}.{key}"]
            r = gptq_quantize(w, torch.eye(Hc.shape[0]) if identity else Hc, cfg)
            E = (w - dequantize(r.weight, torch.float32)).double()
            per[lin] = {s: (torch.einsum("nk,kl,nl->", E, H[f"{s}|{i}.{key}"].double(), E)
                            / base[lin, s]).item() for s in SETS}
        kinds = {k: {s: sum(per[lin][s] for lin in per if lin.endswith(k)) / (len(per) // 3)
                     for s in SETS} for k in ("gate", "up", "down")}
        mean = {s: sum(p[s] for p in per.values()) / len(per) for s in SETS}
        out[name] = {"options": kw, "rtn": identity, "mean": mean, "by_kind": kinds, "per_linear": per,
                     "seconds": round(time.perf_counter() - t0, 1)}
        print(name, {s: f"{v:.5f}" for s, v in mean.items()}, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, required=True, help="the BF16 source bench_quality.py made")
    ap.add_argument("--workdir", type=Path, required=True, help="where the calibration sets are written")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None,
                    help="';'-separated variant names (they hold commas; default: all of them)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    only = [n.strip() for n in args.only.split(";")] if args.only else None
    unknown = sorted(set(only or ()) - set(variants(args.group_size)))
    if unknown:
        ap.error(f"--only: no variant {unknown}; the variants: {list(variants(args.group_size))}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    stats = capture(args.source, args.workdir, args.num_samples, args.seq_len, args.seed)
    res = {"source": str(args.source), "commit": commit(), "command": " ".join(sys.argv),
           "group_size": args.group_size, "calibration": {"num_samples": args.num_samples,
                                                          "seq_len": args.seq_len, "seed": args.seed},
           "tokens": stats["tokens"], "error": "tr(E H E^T) / tr(W H W^T), mean over the 54 MLP Linears",
           "variants": score(stats, args.group_size, only)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
