"""The sha256 of every file of tiny conversions (RTN, GPTQ, AWQ+GPTQ on GLM-5 block-FP8, GLM-4
channel-FP8 and a Gemma-3 dense model), as one JSON object: run it before and after a change
that must not change bytes (a restructuring) and compare the two files.

    .venv/bin/python scripts/output_hashes.py /tmp/before.json
    (change the code)
    .venv/bin/python scripts/output_hashes.py /tmp/after.json && cmp /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer

# per-run files whose bytes hold times or paths, not results
VARIABLE = {"calibration/timings.json", "quantize-manifest.json", "README.md"}


def _gemma(path: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, max_position_embeddings=128, bos_token_id=0,
                               eos_token_id=1, sliding_window=8, query_pre_attn_scalar=16,
                               layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n and p.dim() == 1:
                p.copy_(1 + 2 * torch.rand(p.shape))
    model.save_pretrained(path)
    write_tokenizer(path, 512)
    return path


def main(out: str) -> None:
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="quantize-hashes-"))
    sources = {"glm_moe_dsa": (tiny_config("glm_moe_dsa"), "fp8-block"),
               "glm4_moe": (tiny_config("glm4_moe"), "fp8-channel")}
    result: dict[str, dict[str, str]] = {}
    for name, (cfg, fmt) in sources.items():
        src = write_checkpoint(root / name, cfg, fmt, seed=1)
        write_tokenizer(src, cfg["vocab_size"])
        sources[name] = src
    sources["gemma3_text"] = _gemma(root / "gemma3_text")
    for name, src in sources.items():
        for method in ("rtn", "gptq", "awq+gptq"):
            opts = ConvertOptions(method=method, num_samples=4, seq_len=64,
                                  **({"targets": frozenset({"dense"})} if name == "gemma3_text" else {}))
            dst = root / f"{name}-{method}"
            convert(src, dst, opts, device="cpu", tp=1)
            result[f"{name} {method}"] = {
                str(p.relative_to(dst)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(dst.rglob("*")) if p.is_file()
                and str(p.relative_to(dst)) not in VARIABLE}
            print(name, method, len(result[f"{name} {method}"]), "files", flush=True)
    Path(out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
