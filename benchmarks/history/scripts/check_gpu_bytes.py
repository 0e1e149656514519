"""Same bytes out on CPU and GPU: convert one checkpoint on both devices and compare every file.

    python benchmarks/history/scripts/check_gpu_bytes.py --out bench_out/gpu_bytes.json

Needs a CUDA device. Uses a GLM-5-layout block-FP8 checkpoint with ragged dimensions, the
MTP layer and a zero group, in group 32 symmetric and group 64 asymmetric (dense targets).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

import torch

from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.source.synth import tiny_config, write_checkpoint


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.suffix in (".safetensors", ".json")
            and p.name != "quantize-manifest.json"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    work = Path(tempfile.mkdtemp())
    cfg = tiny_config("glm_moe_dsa", num_hidden_layers=4, hidden_size=512, n_routed_experts=32,
                      moe_intermediate_size=256, intermediate_size=768)
    src = write_checkpoint(work / "src", cfg, "fp8-block", seed=5, shard_bytes=8 * 2**20)
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cases": []}
    for opts in (ConvertOptions(max_shard_size=4 * 10**6),
                 ConvertOptions(group_size=64, symmetric=False, targets=frozenset({"routed", "dense"}),
                                max_shard_size=4 * 10**6)):
        d = {}
        for dev in ("cpu", "cuda"):
            t0 = time.perf_counter()
            convert(src, work / f"{dev}-{opts.group_size}", opts, device=dev)
            d[dev] = (_digests(work / f"{dev}-{opts.group_size}"), time.perf_counter() - t0)
        same = d["cpu"][0] == d["cuda"][0]
        differ = sorted(k for k in d["cpu"][0] if d["cpu"][0][k] != d["cuda"][0].get(k))
        result["cases"].append({"options": opts.to_json(), "files": len(d["cpu"][0]),
                                "identical": same, "differing_files": differ,
                                "seconds_cpu": d["cpu"][1], "seconds_cuda": d["cuda"][1]})
    result["all_identical"] = all(c["identical"] for c in result["cases"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
