"""verify (and RTN convert) under a memory limit smaller than their reads: how many bytes they
read from the disk, this tree's quantize against another tree's, whole processes with the page
cache dropped.

    mkdir -p .dev/old && git archive e4b8a9b quantize calib_data | tar -x -C .dev/old
    mkdir /sys/fs/cgroup/memory/qb && echo 1500M > /sys/fs/cgroup/memory/qb/memory.limit_in_bytes  # cgroup v1
    #   (v2: mkdir /sys/fs/cgroup/qb && echo 1500M > /sys/fs/cgroup/qb/memory.max)
    PYTHONPATH=. python3 benchmarks/history/scripts/bench_verify_memory.py --cgroup /sys/fs/cgroup/memory/qb \\
        --old .dev/old --out benchmarks/local_verify_cgroup.json

Builds a block-FP8 glm_moe_dsa of ~0.8 GB (hidden 2048, 32 experts of width 768, 3 layers + MTP,
a 32k vocabulary) on the CPU, converts it with RTN (0.64 GB in 6 shards), then runs `quantize
verify --device cpu --no-layer-check` `--rounds` times per tree, with and without the cgroup
(whose limit, made by the caller, should hold the process, ~1.1 GiB, but not its output as well).
`--runs verify,convert` also times `quantize convert --method rtn` of the same source into a
second folder the same way. Recorded per run (benchmarks/history/scripts/bench_io.py's `timed`): wall, peak RSS,
GB read from and written to the disk.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cgroup", type=Path, required=True, help="a memory cgroup folder, limited by the caller")
    ap.add_argument("--old", type=Path, default=None, help="another tree's quantize (git archive REV quantize calib_data)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench-verify-memory"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runs", default="verify", help="verify, convert or both (comma list)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer

    args.workdir.mkdir(parents=True, exist_ok=True)
    src, dst = args.workdir / "src", args.workdir / "out"
    cfg = tiny_config("glm_moe_dsa", hidden_size=2048, intermediate_size=4096, moe_intermediate_size=768,
                      n_routed_experts=32, vocab_size=32768, num_hidden_layers=3)
    if not (src / "config.json").exists():
        write_checkpoint(src, cfg, "fp8-block", shard_bytes=200 * 10**6, device="cpu")
        write_tokenizer(src, cfg["vocab_size"])
    q = [sys.executable, "-m", "quantize"]
    if not (dst / "quantize-manifest.json").exists():
        subprocess.run([*q, "convert", str(src), str(dst), "--method", "rtn", "--device", "cpu",
                        "--overwrite", "--max-shard-size", "100MB"], check=True)
    res = {"command": " ".join(sys.argv), "cgroup": str(args.cgroup),
           "source_bytes": sum(f.stat().st_size for f in src.glob("*.safetensors")),
           "output_bytes": sum(f.stat().st_size for f in dst.glob("*.safetensors")), "runs": []}
    trees = [Path(".")] + ([args.old] if args.old else [])
    cmds = {"verify": [*q, "verify", str(src), str(dst), "--device", "cpu", "--no-layer-check"],
            "convert": [*q, "convert", str(src), str(args.workdir / "out-again"), "--method", "rtn",
                        "--device", "cpu", "--overwrite", "--max-shard-size", "100MB"]}
    for _ in range(args.rounds):
        for code in reversed(trees):
            for run, cgroup in ((run, cg) for run in args.runs.split(",") for cg in (None, args.cgroup)):
                r = timed(cmds[run], args.workdir / f"{run}.log", cgroup, code)
                r["code"], r["run"] = str(code), run
                res["runs"].append(r)
                print(f"{run} {code} {'in the cgroup' if cgroup else 'no limit'}: exit {r['exit']}, "
                      f"{r['wall_s']} s, {r['disk_read_gb']} GB read, RSS {r['peak_rss_gib']} GiB", flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
