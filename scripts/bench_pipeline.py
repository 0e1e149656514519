"""A calibrated conversion as the user runs it: the whole `quantize convert` process on a
GLM-5.2-shaped slice, page cache dropped first, per-layer wall time read off its log.

    PYTHONPATH=. python3 scripts/bench_pipeline.py --tokens 64,256,512 --out benchmarks/h200_pipeline.json
    PYTHONPATH=. python3 scripts/bench_pipeline.py --smoke      # tiny, on the CPU: checks the script

The slice (`--layers 3`, the default): a `glm_moe_dsa` with GLM-5.2's shapes (hidden 6144, MLA +
DSA indexer, 256 experts of width 2048, top-8), layer 0 dense, MoE layers 1 and 2, the MTP
layer (an MoE layer, index 3), vocab cut to 32768; block FP8 as released; ~31 GB. Layer 2 is
a steady MoE layer as GLM-5.2's other 74 run (its read ahead of it, the kernels compiled:
layer 1 pays both once), which scripts/project_glm52.py counts as such. `--layers 2` (~21 GB)
is the issue's slice, without it.

For each token count (N x 2048, `--seq-len`), one run of
    python3 -m quantize convert SRC DST --method gptq --device cuda --num-samples N --tp 1 ...
with `sync; echo 3 > /proc/sys/vm/drop_caches` before it (needs root; recorded if refused).
From the process: wall time, peak host RSS (wait4); from its stderr (each line time-stamped
by the CLI): the time of every `layer N: ..., X s` line, so a layer's wall time is the gap
between its line and the previous one, against X, its own compute time; from
calibration/timings.json: peak GPU memory per layer. The disk's cold read rate and fsynced
write rate are measured once (for scripts/project_glm52.py). `--run-timeout S` stops a convert
after S seconds (SIGTERM, then SIGKILL) and still records it ("timed_out", the layer lines its
log has): put the limit here rather than around this script, whose JSON would be lost.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

LAYER = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) layer (\d+)( \(MTP\))?: .*, ([0-9.]+) s$")
STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) ")


def seconds_of_day(m: re.Match) -> float:
    h, mi, s, ms = (int(m.group(i)) for i in range(1, 5))
    return h * 3600 + mi * 60 + s + ms / 1000


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def disk_rates(src: Path, scratch: Path, write_bytes: int) -> dict:
    """Cold sequential read of the source's shards, and an fsynced write of `write_bytes`."""
    cold = drop_caches()
    buf = bytearray(64 * 2**20)
    n, t0 = 0, time.perf_counter()
    for f in sorted(src.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while got := fh.readinto(buf):
                n += got
    read_s = time.perf_counter() - t0
    scratch.mkdir(parents=True, exist_ok=True)
    p = scratch / "write-rate.bin"
    block = os.urandom(64 * 2**20)
    t0 = time.perf_counter()
    with open(p, "wb") as fh:
        fh.writelines(block for _ in range(max(1, write_bytes // len(block))))
        fh.flush()
        os.fsync(fh.fileno())
    write_s = time.perf_counter() - t0
    written = p.stat().st_size
    p.unlink()
    return {"read_bytes": n, "read_s": round(read_s, 2), "read_MBps": round(n / read_s / 1e6),
            "write_bytes": written, "write_s": round(write_s, 2),
            "write_MBps": round(written / write_s / 1e6), "cold": cold}


def parse_log(text: str, start: float) -> dict:
    """Per-layer lines and the gaps between them (wall time per layer); `at`: seconds since
    the process started (`start`, seconds of the local day)."""
    stamps = [seconds_of_day(m) for line in text.splitlines() if (m := STAMP.match(line))]
    layers = []
    for line in text.splitlines():
        if m := LAYER.match(line):
            layers.append({"layer": int(m.group(5)), "mtp": bool(m.group(6)),
                           "at": seconds_of_day(m), "compute_s": float(m.group(7))})
    for prev, cur in itertools.pairwise(layers):
        cur["wall_s"] = round(cur["at"] - prev["at"], 3)
        cur["wall_over_compute"] = round(cur["wall_s"] / max(cur["compute_s"], 1e-9), 3)
    for lay in layers:
        lay["at"] = round(lay["at"] - start, 3)
    return {"layers": layers, "first_line_s": round(stamps[0] - start, 3) if stamps else None}


def run_convert(src: Path, dst: Path, n: int, seq_len: int, device: str, extra: list[str],
                log: Path, wrap: list[str], limit: float | None = None, code: Path | None = None) -> dict:
    cmd = [*wrap, sys.executable, "-m", "quantize", "convert", str(src), str(dst), "--method", "gptq",
           "--device", device, "--num-samples", str(n), "--seq-len", str(seq_len), "--tp", "1",
           "--overwrite", *extra]
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    if code is not None:  # that tree's quantize first on the path, not the working directory's
        env["PYTHONPATH"] = os.pathsep.join([str(code.resolve()), *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONSAFEPATH"] = "1"
    cold = drop_caches()
    t0 = time.perf_counter()
    now = time.localtime()
    start = now.tm_hour * 3600 + now.tm_min * 60 + now.tm_sec + time.time() % 1
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, env=env)
        fired, stopped = threading.Event(), threading.Event()

        def stop() -> None:  # the limit: SIGTERM, then SIGKILL if it is still there 10 s on
            fired.set()
            p.terminate()
            if not stopped.wait(10):
                p.kill()

        timer = threading.Timer(limit, stop) if limit else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        _, status, usage = os.wait4(p.pid, 0)
        stopped.set()
        if timer is not None:
            timer.cancel()
    wall = time.perf_counter() - t0
    text = log.read_text()
    res = {"command": " ".join(cmd), "code": str(code) if code else None, "tokens": [n, seq_len], "exit": os.waitstatus_to_exitcode(status),
           "wall_s": round(wall, 2), "peak_rss_gib": round(usage.ru_maxrss * 1024 / 2**30, 2),
           "cold_cache": cold, **parse_log(text, start)}
    if fired.is_set():
        res["timed_out"] = limit
    rep = dst / "calibration" / "timings.json"  # (calibration-report.json holds no timings)
    if rep.exists():
        r = json.loads(rep.read_text())
        peaks = {e["layer"]: e.get("peak_gpu_gib") for e in r["layers"] if "peak_gpu_gib" in e}
        for lay in res["layers"]:
            lay["peak_gpu_gib"] = peaks.get(lay["layer"])
            entry = next((e for e in r["layers"] if e["layer"] == lay["layer"]), {})
            if entry.get("timing_s"):
                lay["phases_s"] = entry["timing_s"]
            for k in ("load_s", "finish_s"):  # outside the phases: load_layer, the copies' tail
                if k in entry:
                    lay[k] = entry[k]
            if entry.get("peak_gpu_gib_by_phase"):
                lay["peak_gpu_gib_by_phase"] = entry["peak_gpu_gib_by_phase"]
            if entry.get("rounding_sections_s"):
                lay["rounding_sections_s"] = entry["rounding_sections_s"]
        res["peak_gpu_gib"] = max([v for v in peaks.values() if v is not None], default=None)
    if res["exit"] != 0:
        res["stderr_tail"] = text[-3000:]
    return res


def slice_config(args) -> tuple[dict, str, Path]:
    """(config, device, folder) of the slice `args` asks for: `--smoke` a tiny model on the CPU,
    else GLM-5.2's shapes with `--layers` decoder layers and `--vocab` on CUDA."""
    from quantize.source.synth import GLM52_CONFIG, tiny_config

    if args.smoke:
        return tiny_config("glm_moe_dsa"), "cpu", args.workdir / "smoke-fp8"
    cfg = {**tiny_config("glm_moe_dsa"), **GLM52_CONFIG}
    cfg.update(num_hidden_layers=args.layers, first_k_dense_replace=1, num_nextn_predict_layers=1,
               vocab_size=args.vocab, max_position_embeddings=4096)
    return cfg, "cuda", args.workdir / f"glm52-{args.layers}layer-mtp-fp8"


def prepare_slice(args, cfg: dict, device: str, src: Path, res: dict) -> None:
    """Write the slice unless it exists, then measure the disk (into `res`: build_s,
    source_bytes, disk)."""
    from quantize.source.synth import write_checkpoint, write_tokenizer

    if not (src / "config.json").exists():
        t0 = time.perf_counter()
        write_checkpoint(src, cfg, "fp8-block", shard_bytes=4 * 10**9, device=device)
        write_tokenizer(src, cfg["vocab_size"])
        res["build_s"] = round(time.perf_counter() - t0, 1)
        print(f"wrote {src} in {res['build_s']} s", flush=True)
    res["source_bytes"] = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    res["disk"] = disk_rates(src, args.workdir, min(res["source_bytes"] // 4, 4 * 10**9))
    print(json.dumps(res["disk"]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench-pipeline"))
    ap.add_argument("--out", type=Path, default=Path("bench_out/pipeline.json"))
    ap.add_argument("--tokens", default="64,256,512", help="calibration samples per run, comma list")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=3, help="decoder layers (0 dense, the rest MoE), + MTP")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--extra", default="", help="more convert flags, e.g. '--checkpoint-interval 0'")
    ap.add_argument("--run", action="append", default=[], metavar="N:FLAGS",
                    help="one more run after --tokens: N samples with these extra flags, e.g. "
                         "'512:--max-gpu-memory 75' (repeatable)")
    ap.add_argument("--wrap", default="", help="a command the convert runs under, e.g. "
                    "'py-spy record --format raw --threads -o prof.txt --'")
    ap.add_argument("--run-timeout", type=float, default=None, metavar="S",
                    help="stop each convert after S seconds and record what its log has")
    ap.add_argument("--code", type=Path, default=None, metavar="DIR",
                    help="convert with the quantize package in DIR instead of this tree's, to time "
                         "another commit on the same machine (the slice is built by this tree): "
                         "git archive REV quantize calib_data | tar -x -C DIR")
    ap.add_argument("--keep-output", action="store_true", help="keep each run's output folder")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (figures meaningless)")
    args = ap.parse_args()

    if args.smoke:
        args.seq_len = 64
    cfg, device, src = slice_config(args)
    res = {"source": str(src), "config": {k: cfg[k] for k in ("hidden_size", "num_hidden_layers",
                                                              "n_routed_experts", "moe_intermediate_size",
                                                              "num_experts_per_tok", "vocab_size")},
           "command": " ".join(sys.argv), "runs": []}
    prepare_slice(args, cfg, device, src, res)
    runs = [(int(x), "") for x in args.tokens.split(",") if x] + \
        [(int(r.split(":", 1)[0]), r.split(":", 1)[1] if ":" in r else "") for r in args.run]
    for k, (n, flags) in enumerate(runs):
        if args.smoke:
            n = min(n, 8)
        dst = args.workdir / f"out-{n}"
        tag = f"-{n}x{args.seq_len}" + (f"-run{k}" if flags else "")
        log = args.out.with_name(args.out.stem + tag + ".log")
        wrap = args.wrap.replace("{n}", str(n)).split()
        r = run_convert(src, dst, n, args.seq_len, device, args.extra.split() + flags.split(), log, wrap,
                        args.run_timeout, args.code)
        if not args.keep_output:
            subprocess.run(["rm", "-rf", str(dst)], check=False)
        res["runs"].append(r)
        args.out.write_text(json.dumps(res, indent=2))
        brief = [(lay["layer"], lay["compute_s"], lay.get("wall_s")) for lay in r["layers"]]
        print(f"{n} x {args.seq_len}: exit {r['exit']}, {r['wall_s']} s, RSS {r['peak_rss_gib']} GiB, "
              f"GPU {r.get('peak_gpu_gib')} GiB; (layer, compute s, wall s): {brief}", flush=True)
    args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
