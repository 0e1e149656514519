"""Which parts of the large calibration set help: GPTQ calibrated on shipped:large with each
part left out in turn, against the default set, scored on every part's held-out documents.

    PYTHONPATH=. python3 benchmarks/history/scripts/bench_calib_mix.py --source bench_out/gemma/gemma-3-270m \\
        --out benchmarks/local_calib_mix.json --variants default,large,-dialogue,-docs,-code,-zh \\
        --seeds 0,1 --num-samples 64 --seq-len 512 --group-size 128

The documents of calib_data/large.jsonl.xz split once: every EVAL_EVERY-th (the ones a
calibration on a shipped set never reads) are the held-out texts, grouped by part:

    default   the records of default.jsonl (prose, dialogue, language reference, stdlib code)
    dialogue  the Python and Debian FAQs as conversations (English and Chinese)
    docs      the Python tutorial, HOWTOs and library chapters
    code      SymPy modules
    prose     the Debian Administrator's Handbook (English)
    zh        the Debian Reference in Chinese, Tang and Song poems
    ood       calib_data/heldout_english.md (in no calibration set)

Variants calibrate on the other documents: `default` (default's only), `large` (all), `-PART`
(all but that part), `+PART` (all, that part's documents twice), `~PART` (all, that part's
documents at even positions of the calibration documents left out: about half of it). Each output (our gptq, dense MLP targets, the CLI's defaults otherwise) is
loaded back by transformers (compressed-tensors decompression) and scored against the source
(scripts/bench_quality.py's `score`: perplexity added, mean KL) on `--eval-windows` windows of
`--eval-len` tokens of each held-out text, chats rendered with the model's chat template.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))  # (kept in scripts/)
from bench_quality import commit, fingerprint, make_source, run_ours, score, windows_of

ROOT = Path(__file__).resolve().parents[3]
GROUPS = {"dialogue": ("python-faq", "debian-faq-en", "debian-faq-zh"), "docs": ("python-docs",),
          "code": ("sympy-code",), "prose": ("handbook-en",), "zh": ("debian-reference-zh", "poems-zh")}


def group_of(rec: dict) -> str:
    part = rec.get("part")
    return next((g for g, parts in GROUPS.items() if part in parts), "default")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, required=True,
                    help="a BF16 checkpoint with its tokenizer (built there from --gguf when given)")
    ap.add_argument("--gguf", type=Path, default=None, help="build --source from this GGUF first")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="with --gguf: the tokenizer folder to save beside it (e.g. one with a chat template)")
    ap.add_argument("--append", action="store_true", help="keep the runs already in --out")
    ap.add_argument("--split", action="store_true",
                    help="score each text's first half of windows as `val:TEXT` (to choose by), its second as TEXT")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench-calib-mix"))
    ap.add_argument("--variants", default="default,large,-dialogue,-docs,-code,-zh")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--eval-windows", type=int, default=6)
    ap.add_argument("--eval-len", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--label", default="Gemma-3-270M base (Q4_K_M GGUF, mostly Q5_0 blocks, dequantized to BF16)")
    a = ap.parse_args()

    import lzma

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.calib.data import EVAL_EVERY, SHIPPED_SETS, eval_reserved, tokenize_documents

    if a.gguf is not None:
        make_source(a.gguf, a.source, a.tokenizer)
    rows = [json.loads(line) for line in lzma.decompress(SHIPPED_SETS["large"].read_bytes()).decode().splitlines()]
    a.workdir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(a.source, trust_remote_code=False)
    held: dict[str, list] = {}
    for i, r in enumerate(rows):
        if eval_reserved(i):
            held.setdefault(group_of(r), []).append(r.get("text") or r["messages"])
    texts = {}
    for g, docs in sorted(held.items()):
        ids: list[int] = []
        for x in tokenize_documents(docs, tok)[0]:
            ids += x + [tok.eos_token_id]
        texts[g] = windows_of(ids, a.eval_windows, a.eval_len)
    ood = tok((ROOT / "calib_data" / "heldout_english.md").read_text(encoding="utf-8"),
              add_special_tokens=False)["input_ids"]
    texts["ood"] = windows_of(ood, a.eval_windows, a.eval_len)
    if a.split:  # the first half of each text's windows validates (a mix is chosen by it), the rest is reported
        texts = {k2: v2 for k, v in texts.items()
                 for k2, v2 in ((f"val:{k}", v[: len(v) // 2]), (k, v[len(v) // 2:]))}
    train = [r for i, r in enumerate(rows) if not eval_reserved(i)]

    def calib_file(variant: str) -> Path:
        keep = ([r for r in train if group_of(r) == "default"] if variant == "default" else
                train if variant == "large" else
                train + [r for r in train if group_of(r) == variant[1:]] if variant[0] == "+" else
                [r for i, r in enumerate(train) if group_of(r) != variant[1:] or i % 2]
                if variant[0] == "~" else
                [r for r in train if group_of(r) != variant[1:]])
        p = a.workdir / f"calib{variant}.jsonl"
        p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in keep), encoding="utf-8")
        return p

    dev = torch.device(a.device)
    src_model = AutoModelForCausalLM.from_pretrained(a.source, dtype=torch.float32).to(dev).eval()
    res = {"model": a.label, "source_fingerprint": fingerprint(a.source), "commit": commit(),
           "command": " ".join(sys.argv), "host": platform.node(), "torch": torch.__version__,
           "method": "gptq (the CLI's defaults), targets dense, group " + str(a.group_size),
           "calibration": {"num_samples": a.num_samples, "seq_len": a.seq_len, "eval_every": EVAL_EVERY},
           "large_sha256": hashlib.sha256(SHIPPED_SETS["large"].read_bytes()).hexdigest(),
           "device": a.device, "chat_template": bool(getattr(tok, "chat_template", None)),
           "eval": {k: list(v.shape) for k, v in texts.items()}, "runs": []}
    if a.append and a.out.exists():
        old = json.loads(a.out.read_text())
        if old.get("source_fingerprint") != res["source_fingerprint"] or old.get("eval") != res["eval"]:
            raise SystemExit(f"{a.out}: another source or other held-out windows; not appending")
        res["runs"] = old["runs"]
        res["command"] = old["command"] + " ; " + res["command"]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    for seed in [int(s) for s in a.seeds.split(",")]:
        for variant in a.variants.split(","):
            calib = calib_file(variant)
            t0 = time.perf_counter()
            out = a.workdir / "out"
            run_ours(a.source, out, "gptq", {}, a.group_size, calib, a.num_samples, a.seq_len, seed, a.device)
            q = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(dev).eval()
            row = {"variant": variant, "seed": seed, "calib_records": sum(1 for _ in calib.open()),
                   "seconds": round(time.perf_counter() - t0, 1),
                   "scores": {k: score(src_model, q, w, dev) for k, w in texts.items()}}
            del q
            res["runs"].append(row)
            a.out.write_text(json.dumps(res, indent=1))
            print(f"seed {seed} {variant}: {row['seconds']} s "
                  + " ".join(f"{k} {v['ppl_added'] * 100:.2f}%/{v['kl']:.4f}" for k, v in row["scores"].items()),
                  flush=True)


if __name__ == "__main__":
    main()
