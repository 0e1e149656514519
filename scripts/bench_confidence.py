"""Why a rounded model's perplexity added and its KL can disagree: the bench_quality texts
scored again, with the perplexity added split into fidelity and the text's own share.

Per token, the log-perplexity a rounded model q adds over its source s on a text is

    nll_q(y) - nll_s(y) = KL(s || q) + D,   D = [log s(y) - log q(y)] - E_s[log s - log q]

KL is how far q's prediction is from the source's, whatever the text. D is zero on average
when the text is drawn from the source itself; on real text it is how much q's error happens
to point toward (D < 0) or away from the tokens that occur. A text on which the source is
over-confident rewards any error that flattens q's predictions (D < 0), however far q is from
the source. This script measures, on the windows bench_quality scores (the same token ids):
- the source's perplexity with its logits divided by a temperature T (T > 1 flattens): the
  temperature that minimises it says whether the source is over-confident on that text;
- per rounded model (`--model NAME=DIR`, any checkpoint transformers loads: ours, or
  llm-compressor's compressed-tensors output): perplexity added, KL, D, the mean entropy of its
  predictions against the source's, and the least-squares gain <Wq, W>/<W, W> of its MLP
  Linears against the source's weights (below 1: the rounding shrank them on the whole).

    PYTHONPATH=. python3 scripts/bench_confidence.py --workdir /tmp/bqc --source /tmp/bqc/source-bf16 \\
        --cache-source /tmp/bqc/srccache --model ours=/tmp/ours --model llmc=/tmp/llmc \\
        --out bench_out/confidence.json

The workdir must hold bench_quality's split of the texts (any bench_quality run there wrote it);
`--cache-source` reads (and fills) bench_quality's cache of the source's logits.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quality import (
    OOD_TEXTS,
    ROOT,
    _source_logits,
    eval_texts,
    fingerprint,
    model_input,
    scoring_bos,
    split_text,
)

TEMPERATURES = (0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.7, 2.0)


@torch.no_grad()
def window_sums(ls: torch.Tensor, lq: torch.Tensor | None, tgt: torch.Tensor, temps) -> dict:
    """Sums over one window's T tokens (float64 log-softmaxes `ls` of the source, `lq` of a
    rounded model, both (T, V); `tgt` (T,) the next tokens)."""
    out = {"tokens": tgt.numel(),
           "nll_source": -float(ls.gather(1, tgt[:, None]).sum()),
           "entropy_source": -float((ls.exp() * ls).sum())}
    if lq is None:  # the source's perplexity at each temperature
        logits = ls  # a log-softmax is its logits up to a constant per token
        out["nll_source_at"] = {str(t): -float(torch.log_softmax(logits / t, -1).gather(1, tgt[:, None]).sum())
                                for t in temps}
        return out
    ps = ls.exp()
    out["nll"] = -float(lq.gather(1, tgt[:, None]).sum())
    out["kl"] = float((ps * (ls - lq)).sum())
    out["entropy"] = -float((lq.exp() * lq).sum())
    return out


def totals(per: list[dict]) -> dict:
    n = sum(w["tokens"] for w in per)
    res = {"tokens": n, "ppl_source": math.exp(sum(w["nll_source"] for w in per) / n),
           "entropy_source": sum(w["entropy_source"] for w in per) / n}
    if "nll_source_at" in per[0]:
        at = {t: math.exp(sum(w["nll_source_at"][t] for w in per) / n) for t in per[0]["nll_source_at"]}
        res["ppl_source_at"] = at
        res["best_temperature"] = float(min(at, key=at.get))
        return res
    added = (sum(w["nll"] for w in per) - sum(w["nll_source"] for w in per)) / n  # log-ppl added
    kl = sum(w["kl"] for w in per) / n
    res.update(ppl_added=math.exp(added) - 1, log_ppl_added=added, kl=kl, d=added - kl,
               entropy=sum(w["entropy"] for w in per) / n)
    return res


@torch.no_grad()
def gains(src_model, q_model) -> dict:
    """Least-squares gain <Wq, W>/<W, W> and relative error |Wq - W|/|W| of the MLP Linears,
    pooled over all of them, and the gain's range over them (`q_model` loaded with its weights
    decompressed: `load_decompressed`)."""
    src = dict(src_model.named_modules())
    num = den = err = 0.0
    per = []
    for name, m in q_model.named_modules():
        if ".mlp." not in name or not name.endswith("proj") or name not in src:
            continue
        w, q = src[name].weight.double(), m.weight.double()
        a, b = float((w * q).sum()), float((w * w).sum())
        num, den, err = num + a, den + b, err + float(((q - w) ** 2).sum())
        per.append(a / b)
    if not per:
        raise SystemExit("no MLP Linears matched between the source and the rounded model")
    return {"gain": num / den, "rel_error": math.sqrt(err / den), "gain_min": min(per), "gain_max": max(per),
            "linears": len(per)}


def load_decompressed(d: str):
    """A checkpoint with its Linears' weights as the dequantized values (compressed-tensors
    otherwise keeps the packed codes and dequantizes inside each forward)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    quantized = "quantization_config" in json.loads((Path(d) / "config.json").read_text())
    kw = {"quantization_config": CompressedTensorsConfig(run_compressed=False)} if quantized else {}
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, trust_remote_code=False, **kw)


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True, help="bench_quality's workdir (its text split)")
    ap.add_argument("--source", type=Path, required=True, help="the source checkpoint (BF16)")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=DIR", help="a rounded model")
    ap.add_argument("--cache-source", type=Path, default=None, help="bench_quality's source-logit cache")
    ap.add_argument("--eval-windows", type=int, default=10)
    ap.add_argument("--eval-len", type=int, default=512)
    ap.add_argument("--ood-len", type=int, default=512)
    ap.add_argument("--bos", action="store_true",
                    help="begin every window with the tokenizer's BOS token (bench_quality's "
                         "`scoring_bos`; the same tokens are scored: the BOS position's prediction "
                         "is dropped)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    dev = torch.device(args.device)
    tok = AutoTokenizer.from_pretrained(args.source, trust_remote_code=False)
    bos = scoring_bos(tok, args.source, args.bos)
    oods = [ROOT / "calib_data" / n for n in OOD_TEXTS]
    texts = eval_texts(tok, split_text(args.workdir), oods, args.eval_windows, args.eval_len, args.ood_len,
                       reported_only=True)
    tag = fingerprint(args.source)
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                          trust_remote_code=False).to(dev).eval()
    src_model = load(args.source)
    models = dict(m.split("=", 1) for m in args.model)
    per: dict[str, dict[str, list]] = {name: {} for name in ["source", *models]}
    res: dict = {"command": " ".join(sys.argv), "bos": args.bos, "texts": {k: list(v.shape) for k, v in texts.items()},
                 "models": models, "weights": {}, "scores": {}}
    qs = {name: load(d) for name, d in models.items()}  # all at once: one source forward per window
    for name, d in models.items():
        res["weights"][name] = gains(src_model, load_decompressed(d))
    for text, windows in texts.items():
        for w in windows:
            x, cut = model_input(w, dev, bos)
            ls = _source_logits(src_model, x, args.cache_source, tag)  # (keyed by x: BOS or not)
            ls = torch.log_softmax(ls.double()[0, cut], -1)
            y = w[1:].to(dev)
            per["source"].setdefault(text, []).append(window_sums(ls, None, y, TEMPERATURES))
            for name, q in qs.items():
                lq = torch.log_softmax(q(x).logits.double()[0, cut], -1)
                per[name].setdefault(text, []).append(window_sums(ls, lq, y, TEMPERATURES))
        print(text, flush=True)
    for name, texts_rows in per.items():
        scores = {t: totals(rows) for t, rows in texts_rows.items()}
        scores["ood:all"] = totals([w for t, rows in texts_rows.items() if t.startswith("ood:") for w in rows])
        res["scores"][name] = scores
        brief = {t: {k: round(v, 4) for k, v in s.items() if isinstance(v, float) and k != "ppl_source"}
                 for t, s in scores.items() if t in ("in_domain", "ood:all")}
        print(name, res["weights"].get(name), json.dumps(brief), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
