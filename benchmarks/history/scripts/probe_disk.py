"""What the disk under a checkpoint can do: cold read, fsynced write and mixed read + write
rates at several queue depths (threads) and with / without the page cache (O_DIRECT).

    PYTHONPATH=. python3 benchmarks/history/scripts/probe_disk.py SRC_DIR --scratch DIR --out benchmarks/x.json

Reads the *.safetensors files of SRC_DIR (page cache dropped before each run; root), writes
`--write-gb` GB into --scratch (same disk as the output of a convert) and deletes it. Figures
are GB/s (1e9 bytes). This is the floor against which RTN convert and verify are judged
(BENCHMARKS.md, "RTN and verify against the disk").
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))  # (kept in scripts/)
from bench_pipeline import drop_caches

CHUNK = 16 * 2**20


def spans(files: list[Path], parts: int) -> list[list[tuple[Path, int, int]]]:
    """The files' bytes cut into `parts` lists of (file, offset, length), each a run of
    consecutive ranges (so every thread reads sequentially)."""
    total = sum(f.stat().st_size for f in files)
    per = -(-total // parts)
    per = -(-per // CHUNK) * CHUNK
    out: list[list[tuple[Path, int, int]]] = [[] for _ in range(parts)]
    i, room = 0, per
    for f in files:
        size, off = f.stat().st_size, 0
        while off < size:
            n = min(size - off, room)
            out[i].append((f, off, n))
            off += n
            room -= n
            if room == 0 and i + 1 < parts:
                i, room = i + 1, per
    return out


def _read(work: list[tuple[Path, int, int]], direct: bool, got: list[int]) -> None:
    buf = mmap.mmap(-1, CHUNK)
    view = memoryview(buf)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    for path, off, n in work:
        fd = os.open(path, flags)
        try:
            end = off + n
            while off < end:
                k = min(CHUNK, end - off)
                if direct:
                    k = -(-k // 4096) * 4096
                r = os.preadv(fd, [view[:k]], off)
                if r <= 0:
                    break
                got[0] += min(r, end - off)
                off += r
        finally:
            os.close(fd)


def _write(path: Path, nbytes: int, direct: bool, got: list[int]) -> None:
    buf = mmap.mmap(-1, CHUNK)
    buf.write(os.urandom(2**20) * (CHUNK // 2**20))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0))
    try:
        done = 0
        while done < nbytes:
            done += os.write(fd, buf)
            got[0] += CHUNK
        os.fsync(fd)
    finally:
        os.close(fd)


def run(files: list[Path], readers: int, writers: int, direct: bool, scratch: Path,
        write_gb: float) -> dict:
    cold = drop_caches()
    threads, counters = [], []
    for work in (spans(files, readers) if readers else []):
        c = [0]
        counters.append(("r", c))
        threads.append(threading.Thread(target=_read, args=(work, direct, c)))
    for j in range(writers):
        c = [0]
        counters.append(("w", c))
        threads.append(threading.Thread(
            target=_write, args=(scratch / f"probe-{j}.bin", int(write_gb * 1e9 / writers), direct, c)))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    r = sum(c[0] for k, c in counters if k == "r")
    w = sum(c[0] for k, c in counters if k == "w")
    for j in range(writers):
        (scratch / f"probe-{j}.bin").unlink(missing_ok=True)
    return {"readers": readers, "writers": writers, "direct": direct, "cold_cache": cold,
            "wall_s": round(wall, 2), "read_gb": round(r / 1e9, 2), "write_gb": round(w / 1e9, 2),
            "gb_s": round((r + w) / 1e9 / wall, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("--scratch", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--write-gb", type=float, default=8.0)
    ap.add_argument("--runs", default="r1,r4,r8,r4d,r8d,r16d,w1,w4d,r4w1,r8dw4d",
                    help="rN: N reader threads, wM: M writer threads, d: O_DIRECT")
    a = ap.parse_args()
    files = sorted(a.src.glob("*.safetensors"))
    a.scratch.mkdir(parents=True, exist_ok=True)
    results = []
    for spec in a.runs.split(","):
        readers = writers = 0
        direct = "d" in spec
        import re

        if m := re.search(r"r(\d+)", spec):
            readers = int(m.group(1))
        if m := re.search(r"w(\d+)", spec):
            writers = int(m.group(1))
        res = {"run": spec, **run(files, readers, writers, direct, a.scratch, a.write_gb)}
        print(json.dumps(res), flush=True)
        results.append(res)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"src": str(a.src), "source_gb": round(sum(f.stat().st_size for f in files) / 1e9, 2),
                                 "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
