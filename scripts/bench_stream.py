"""Streaming benchmark: peak RSS does not grow with depth; throughput vs a plain copy.

Builds two synthetic GLM-5-layout block-FP8 checkpoints that differ only in depth (2 and 8
layers, same layer size), converts each in a fresh subprocess (RTN, group 32) and records
its peak RSS; then times a plain read+write of the same source bytes on the same disk and the
conversion of each (alternating, `--repeats` of each, medians), and writes everything as JSON. Both timed steps start after `os.sync()`,
with the source in the page cache (it was just written), as a re-run conversion finds it.

    python scripts/bench_stream.py --out bench_out/bench_stream.json [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time, torch
import compressed_tensors.quantization  # imported before the clock starts, like a warm CLI
from quantize.options import ConvertOptions
from quantize.pipeline import convert
src, dst, device, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.set_num_threads(threads)
t0 = time.perf_counter()
res = convert(src, dst, ConvertOptions(), device=device)
dt = time.perf_counter() - t0
peak_gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across fork+exec, so it would report the
# parent's peak (the parent just generated the synthetic checkpoint).
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"seconds": dt, "peak_rss_bytes": hwm,
                  "device": res.device, "output_bytes": res.plan.output_bytes, "peak_gpu_bytes": peak_gpu}))
"""


def _config(layers: int, hidden: int, experts: int, width: int) -> dict:
    from quantize.source.synth import tiny_config

    return tiny_config("glm_moe_dsa", num_hidden_layers=layers, hidden_size=hidden,
                       intermediate_size=2 * width, n_routed_experts=experts,
                       moe_intermediate_size=width, first_k_dense_replace=1, vocab_size=4096,
                       q_lora_rank=256, kv_lora_rank=128, num_attention_heads=8,
                       qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                       index_n_heads=4, index_head_dim=64)


def _convert(src: Path, dst: Path, device: str, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(src), str(dst), device, str(threads)],
                         check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _plain_copy(src: Path, dst: Path) -> float:
    """Read every shard and write it to `dst`, fsync at the end: the disk's read+write speed."""
    dst.mkdir()
    t0 = time.perf_counter()
    for f in sorted(src.glob("*.safetensors")):
        with open(f, "rb") as r, open(dst / f.name, "wb") as w:
            while b := r.read(2**24):
                w.write(b)
            w.flush()
            os.fsync(w.fileno())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3, help="copies and conversions per depth "
                    "(alternating; medians are compared)")
    ap.add_argument("--workdir", type=Path, default=None, help="disk to run on (default: a temp dir)")
    args = ap.parse_args()

    from quantize.source.synth import write_checkpoint

    work = Path(tempfile.mkdtemp(dir=args.workdir, prefix="bench_stream_"))
    result: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                "platform": platform.platform()},
                    "layer": {"hidden": args.hidden, "experts": args.experts, "width": args.width},
                    "device": args.device, "threads": args.threads, "runs": {}}
    try:
        for layers in (2, 8):
            src = work / f"src{layers}"
            write_checkpoint(src, _config(layers, args.hidden, args.experts, args.width), "fp8-block",
                             seed=layers, shard_bytes=512 * 2**20)
            src_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
            # Each timed step starts on a quiet disk: the kernel writes the checkpoint just
            # generated (or the copy just deleted) back in the background, and whichever step
            # ran next would otherwise share the disk with it. Copies and conversions
            # alternate, `--repeats` times each, and the medians are compared: a disk's speed
            # drifts by tens of percent between minutes (seen on the H200 host).
            copies, runs = [], []
            for _ in range(args.repeats):
                os.sync()
                copies.append(_plain_copy(src, work / f"copy{layers}"))
                shutil.rmtree(work / f"copy{layers}")
                os.sync()
                runs.append(_convert(src, work / f"dst{layers}", args.device, args.threads))
                shutil.rmtree(work / f"dst{layers}")
            copy_s = statistics.median(copies)
            run = dict(runs[0], seconds=statistics.median(r["seconds"] for r in runs),
                       peak_rss_bytes=max(r["peak_rss_bytes"] for r in runs),
                       all_seconds=[r["seconds"] for r in runs], all_plain_copy_seconds=copies)
            run.update(source_bytes=src_bytes, plain_copy_seconds=copy_s,
                       plain_copy_MBps=src_bytes / copy_s / 1e6,
                       convert_MBps=src_bytes / run["seconds"] / 1e6,
                       throughput_vs_copy=copy_s / run["seconds"])
            result["runs"][str(layers)] = run
            shutil.rmtree(src)
            print(json.dumps({layers: run}), file=sys.stderr)
        r2, r8 = result["runs"]["2"], result["runs"]["8"]
        result["rss_growth_8_vs_2"] = r8["peak_rss_bytes"] / r2["peak_rss_bytes"] - 1
        result["rss_within_10pct"] = abs(result["rss_growth_8_vs_2"]) <= 0.10
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
