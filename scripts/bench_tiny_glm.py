"""Routed expert statistics with and without the routing weights (`--expert-calibration routed`
against `routed-weighted`) on the tiny synthetic GLM models, held-out text, CPU.

    PYTHONPATH=. python3 scripts/bench_expert_weighting.py --out benchmarks/local_expert_weighting.json

The protocol of tests/test_calibrate.py::test_gptq_and_awq_beat_rtn_on_held_out_text: tiny
glm_moe_dsa (block FP8) and glm4_moe (channel FP8), 3 layers + MTP, 8 experts top-2, every 64th
post-attention-norm channel x16; the shipped text split by document (even lines calibrate 8 x 64
tokens with --seed S, odd lines evaluate 16 x 64 tokens, the same windows for every run),
scored by `quantize eval` against the source: the hidden-state error after the last layer and
the mean KL. Several checkpoint seeds (random weights) and calibration seeds. The weights are
random: this says whether the option works as meant on a model with a router, not what it does
to a real model (none with experts can be built here).
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

from quantize.calib.data import DEFAULT_CALIB
from quantize.check.evaluate import EvalOptions, evaluate
from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer

ARCHS = {"glm_moe_dsa": "fp8-block", "glm4_moe": "fp8-channel"}


def outlier_norms(src: Path, cfg: dict) -> None:
    """Every (hidden/4)-th post-attention-norm channel x16, as the tests' fixture."""
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    for L in range(cfg["num_hidden_layers"]):
        name = f"model.layers.{L}.post_attention_layernorm.weight"
        f = src / index[name]
        t = load_file(f)
        w = t[name].clone()
        w[:: cfg["hidden_size"] // 4] *= 16
        t[name] = w
        save_file(t, f, metadata={"format": "pt"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench_out/expert_weighting.json"))
    ap.add_argument("--model-seeds", default="0,1,2")
    ap.add_argument("--calib-seeds", default="0,1")
    args = ap.parse_args()
    res = {"command": " ".join(sys.argv), "torch": torch.__version__, "host": platform.node(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        lines = DEFAULT_CALIB.read_text().splitlines()
        calib, held = tmp / "calib.jsonl", tmp / "held.jsonl"
        calib.write_text("\n".join(lines[::2]) + "\n")
        held.write_text("\n".join(lines[1::2]) + "\n")
        for arch, fmt in ARCHS.items():
            for ms in [int(s) for s in args.model_seeds.split(",")]:
                src = tmp / f"{arch}-{ms}"
                cfg = tiny_config(arch)
                write_checkpoint(src, cfg, fmt, seed=ms)
                write_tokenizer(src, cfg["vocab_size"])
                outlier_norms(src, cfg)
                for cs in [int(s) for s in args.calib_seeds.split(",")]:
                    for how in ("routed", "routed-weighted"):
                        out = tmp / "out"
                        t0 = time.perf_counter()
                        convert(src, out, ConvertOptions(method="gptq", expert_calibration=how, num_samples=8,
                                                         seq_len=64, seed=cs, calib=str(calib)),
                                device="cpu", overwrite=True)
                        r = evaluate(src, out, EvalOptions(num_samples=16, seq_len=64, data=str(held)),
                                     device="cpu", write=False)
                        row = {"arch": arch, "model_seed": ms, "calib_seed": cs, "expert_calibration": how,
                               "hidden_rel_error": r["layers"][-1]["rel_error"],
                               "kl_mean": r["summary"]["kl_mean"], "seconds": round(time.perf_counter() - t0, 1)}
                        res["runs"].append(row)
                        print(row, flush=True)
    summary = {}
    for arch in ARCHS:
        for how in ("routed", "routed-weighted"):
            rs = [r for r in res["runs"] if r["arch"] == arch and r["expert_calibration"] == how]
            summary[f"{arch} {how}"] = {k: sum(r[k] for r in rs) / len(rs) for k in ("hidden_rel_error", "kl_mean")}
        pairs = [(a, b) for a in res["runs"] for b in res["runs"]
                 if a["arch"] == b["arch"] == arch and a["model_seed"] == b["model_seed"]
                 and a["calib_seed"] == b["calib_seed"] and a["expert_calibration"] == "routed"
                 and b["expert_calibration"] == "routed-weighted"]
        summary[f"{arch} weighted better (KL)"] = f"{sum(b['kl_mean'] < a['kl_mean'] for a, b in pairs)} of {len(pairs)}"
    res["summary"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
