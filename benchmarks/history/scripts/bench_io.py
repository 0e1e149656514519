"""Round-to-nearest convert and verify against the disk: whole CLI processes, cold page cache,
on the GLM-5.2-shaped slice of scripts/bench_pipeline.py (~21 GB block FP8).

    PYTHONPATH=. python3 benchmarks/history/scripts/bench_io.py --out benchmarks/h200_io.json
    PYTHONPATH=. python3 benchmarks/history/scripts/bench_io.py --out x.json --profile DIR   # also under py-spy
    PYTHONPATH=. python3 benchmarks/history/scripts/bench_io.py --smoke --out /tmp/io.json    # tiny, CPU: checks the script
    PYTHONPATH=. python3 benchmarks/history/scripts/bench_io.py --host --layers 8 --out x.json  # GBs, CPU: a host's disk
    ... --cgroup /sys/fs/cgroup/qb   # the quantize runs in a memory cgroup the caller made and
                                     # limited (echo 6G > memory.max): the page cache smaller
                                     # than the output, as on the real model

Runs, each after `sync; echo 3 > /proc/sys/vm/drop_caches`:
  copy     cp -r SRC DST && sync                       the yardstick a user knows
  read     cat SRC/*.safetensors DST/*.safetensors     verify's cold read floor (after an rtn run)
  rtn      python3 -m quantize convert SRC DST --method rtn   (DST deleted before the clock starts)
  rtn-overwrite   the same into DST as the previous rtn run left it (--overwrite deletes it:
           the re-run a user makes)
  verify   python3 -m quantize verify SRC DST --no-layer-check   (and with the layer check)
Recorded: wall time, peak host RSS, the bytes read from and written to the disk, the disk's cold read / fsynced write rates, and every
time-stamped stderr line of the CLI as seconds since the process started (where the time goes:
start-up, streaming, the tail after the last tensor). With --profile, each quantize run once
more under `py-spy record --format raw` (its collapsed stacks written to DIR; --native adds the
C/C++ frames). With --pycache DIR, the imported packages' bytecode is compiled into DIR first
and the runs read it from there (an image without .pyc files otherwise compiles torch's
sources, ~3 s, in every process: a cost a pip-installed torch does not have).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))  # (kept in scripts/)
from bench_pipeline import STAMP, drop_caches, prepare_slice, seconds_of_day, slice_config


def timed(cmd: list[str], log: Path, cgroup: Path | None = None, code: Path | None = None,
          extra_env: dict | None = None) -> dict:
    """One cold run of `cmd`: wall, peak RSS, the bytes it read from and wrote to the disk
    (the kernel's count of block I/O, page-cache hits not counted), its stamped stderr lines
    (s since start); run inside `cgroup` (a memory cgroup's folder: its limit bounds the page
    cache the run may fill, as a model larger than the memory would) when given, with the
    quantize package of the tree `code` when given."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    if code is not None:  # that tree's quantize first on the path, not the working directory's
        env["PYTHONPATH"] = os.pathsep.join([str(code.resolve()), *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONSAFEPATH"] = "1"
    cold = drop_caches()
    now = time.localtime()
    start = now.tm_hour * 3600 + now.tm_min * 60 + now.tm_sec + time.time() % 1
    t0 = time.perf_counter()
    with open(log, "w") as f:
        if cgroup is not None:  # the shell joins the cgroup, then becomes the command
            cmd = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *cmd]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, env=env)
        _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    lines = []
    for line in log.read_text(errors="replace").splitlines():
        if (m := STAMP.match(line)) is not None:
            lines.append([round(seconds_of_day(m) - start, 2), line[m.end():][:160]])
    res = {"command": " ".join(cmd), "exit": os.waitstatus_to_exitcode(status), "wall_s": round(wall, 2),
           "peak_rss_gib": round(usage.ru_maxrss * 1024 / 2**30, 2), "cold_cache": cold,
           "disk_read_gb": round(usage.ru_inblock * 512 / 1e9, 2),  # (Linux counts 512-byte blocks)
           "disk_written_gb": round(usage.ru_oublock * 512 / 1e9, 2), "lines": lines}
    if cgroup is not None:
        res["cgroup"] = str(cgroup)
    if code is not None:
        res["code"] = str(code)
    if extra_env:
        res["env"] = extra_env
    if res["exit"] != 0:
        res["stderr_tail"] = log.read_text(errors="replace")[-3000:]
    return res


PACKAGES = ("torch", "numpy", "safetensors", "huggingface_hub", "filelock", "typer", "click", "rich",
            "quantize")


def precompile(prefix: Path, code: Path | None) -> dict:
    """Byte-compile the packages the CLI imports into `prefix` (PYTHONPYCACHEPREFIX, set here
    for the runs to come): the state a pip install leaves (pip compiles what it installs).
    `code`: the quantize tree the runs use, compiled too."""
    import importlib.util

    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix.resolve())
    dirs = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs += list(spec.submodule_search_locations)
    if code is not None:
        dirs.append(str((code / "quantize").resolve()))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *dirs], check=False,
                       capture_output=True, text=True)
    return {"prefix": str(prefix), "dirs": dirs, "compile_s": round(time.perf_counter() - t0, 1),
            "exit": p.returncode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench-pipeline"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (0 dense, the rest MoE), + MTP")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--extra", default="", help="more convert flags")
    ap.add_argument("--profile", type=Path, default=None, help="also run each under py-spy, stacks here")
    ap.add_argument("--profile-format", default="raw", choices=["raw", "chrometrace"],
                    help="py-spy's output format: raw (collapsed stacks, benchmarks/history/scripts/pyspy_summary.py), "
                         "chrometrace (every sample with its time: a timeline)")
    ap.add_argument("--native", action="store_true",
                    help="with --profile: py-spy's --native (C/C++ frames too: the CUDA driver, torch's ops)")
    ap.add_argument("--pycache", type=Path, default=None, metavar="DIR",
                    help="byte-compile the packages the CLI imports into DIR first and run with "
                         "PYTHONPYCACHEPREFIX=DIR: as a pip install leaves them (an image whose "
                         "site-packages hold no .pyc compiles torch's sources in every process)")
    ap.add_argument("--only", default="copy,rtn,verify,verify-layers",
                    help="which runs, comma list; NAME@VAR=VALUE runs NAME with that environment "
                         "variable set (an A/B of a switch on one machine)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (figures meaningless)")
    ap.add_argument("--host", action="store_true",
                    help="a glm_moe_dsa for the CPU (hidden 2048, 64 experts of width 768; --layers of "
                         "them, ~0.32 GB each): the disk's share measured on a machine without a GPU")
    ap.add_argument("--device", default=None, help="the slice's and the runs' device (default: cuda; "
                    "cpu on a machine without one: slower builds and runs, the disk's share the same)")
    ap.add_argument("--cgroup", type=Path, default=None,
                    help="a memory cgroup folder (made and limited by the caller) to run the "
                         "quantize commands in: a page cache smaller than the output, as on a real model")
    ap.add_argument("--code", type=Path, default=None, metavar="DIR",
                    help="run the quantize commands with the quantize package in DIR instead of "
                         "this tree's (an A/B on one machine): git archive REV quantize calib_data | tar -x -C DIR")
    args = ap.parse_args()

    cfg, device, src = slice_config(args)
    if args.host:  # a model for the CPU whose reads take seconds: the A/Bs of the disk's share
        from quantize.source.synth import tiny_config

        cfg = tiny_config("glm_moe_dsa", hidden_size=2048, intermediate_size=4096, moe_intermediate_size=768,
                          n_routed_experts=64, vocab_size=32768, num_hidden_layers=args.layers)
        device, src = "cpu", args.workdir / f"host-{args.layers}layer-fp8"
    device = args.device or device
    res: dict = {"source": str(src), "command": " ".join(sys.argv), "runs": {}}
    if args.pycache is not None:
        res["pycache"] = precompile(args.pycache, args.code)
    prepare_slice(args, cfg, device, src, res)
    dst, copy = args.workdir / "out-rtn", args.workdir / "copy"
    q = [sys.executable, "-m", "quantize"]
    cmds = {
        "copy": ["bash", "-c", f"rm -rf {copy} && cp -r {src} {copy} && sync"],
        # verify's yardstick: every byte it must read (the source's and the output's), cold
        "read": ["bash", "-c", f"cat {src}/*.safetensors {dst}/*.safetensors > /dev/null"],
        "rtn": [*q, "convert", str(src), str(dst), "--method", "rtn", "--device", device, "--overwrite",
                *args.extra.split()],
        "verify": [*q, "verify", str(src), str(dst), "--device", device, "--no-layer-check"],
        "verify-layers": [*q, "verify", str(src), str(dst), "--device", device],
    }
    cmds["rtn-overwrite"] = cmds["rtn"]  # (the same command; only the folder's state differs)
    for k, entry in enumerate(args.only.split(",")):
        name, *sets = entry.split("@")  # verify@QUANTIZE_X=1: that run with this variable set
        extra_env = dict(kv.split("=", 1) for kv in sets)
        key = entry if entry not in res["runs"] else f"{entry}-{k}"  # (a run asked for twice)
        ours = cmds[name][0] != "bash"
        if name == "rtn":  # into a new folder, as a user converts: an earlier run's output is
            shutil.rmtree(dst, ignore_errors=True)  # deleted before the clock (in it, 3.5-4 s)
        r = timed(cmds[name], args.workdir / f"{name}.log", args.cgroup if ours else None,
                  args.code if ours else None, extra_env)
        if name == "copy":
            subprocess.run(["rm", "-rf", str(copy)], check=False)
        if name.startswith("rtn") and dst.exists():
            r["output_bytes"] = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
        res["runs"][key] = r
        args.out.write_text(json.dumps(res, indent=2))
        print(f"{entry}: exit {r['exit']}, {r['wall_s']} s, RSS {r['peak_rss_gib']} GiB", flush=True)
        if args.profile is not None and name != "copy":
            args.profile.mkdir(parents=True, exist_ok=True)
            ext = {"raw": "txt", "chrometrace": "json"}[args.profile_format]
            spy = ["py-spy", "record", "--format", args.profile_format, "--threads", "--rate", "50", "-o",
                   str(args.profile / f"{name}.{ext}"), *(["--native"] if args.native else []), "--"]
            if name == "rtn":
                shutil.rmtree(dst, ignore_errors=True)  # (as above)
            rp = timed(spy + cmds[name], args.workdir / f"{name}-pyspy.log")
            res["runs"][key + "-pyspy"] = {f: rp[f] for f in ("exit", "wall_s")}
            args.out.write_text(json.dumps(res, indent=2))
    args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
