"""A summary of a `py-spy record --format raw --threads [--native]` profile (bench_io.py
--profile): per thread, the seconds sampled, waiting for the interpreter's lock (GIL), waiting
on a Python lock or condition, and inside preadv / write; then the main thread's time by
what it was doing (imports, of which compiling sources to bytecode; our package's frames).

    python3 benchmarks/history/scripts/pyspy_summary.py prof/rtn.txt --rate 50 --header "..." > benchmarks/x.txt
    python3 benchmarks/history/scripts/pyspy_summary.py prof/rtn.json --step 0.25   # chrometrace: a timeline
    python3 benchmarks/history/scripts/pyspy_summary.py prof/rtn.json --window 3 7  # chrometrace: stacks in a window

A chrometrace profile (bench_io.py --profile-format chrometrace) gives a timeline instead: per
`--step` seconds of the run, what each named thread spent most of it in (its innermost frame
in quantize/, or "import" inside an import, or its innermost frame); with `--window A B`, each
thread's innermost frames over those seconds instead. py-spy records no sample of a thread that
is blocked (on the disk, a lock or the GIL) unless it ran with --idle, so a frame's time runs
until that thread's next sample: a long one is a thread blocked in (or just after) it.

Classified by the frames of each sample (native frames need --native): a GIL wait is a
pthread condition wait that no Python lock or threading wait sits above; with the
interpreter's frames only (no --native), GIL waits are not visible and count as running.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def classify(frames: list[str]) -> str:
    tail = frames[-3:]
    if any("pthread_cond_timedwait" in f or "pthread_cond_wait" in f for f in tail):
        if any("PyThread_acquire_lock" in f or f.startswith("wait (threading") for f in frames):
            return "lock"
        return "gil"
    if any(f.split(" (")[0] in ("preadv64v2", "preadv", "write", "__libc_write", "pwrite64")
           for f in tail):
        return "io"
    return "run"


def label(stack: list[dict]) -> str:
    """What a chrometrace stack (outermost first) is doing, in a few words."""
    if any(f["name"] == "_find_and_load" for f in stack):
        return "import"
    ours = [f for f in stack if "quantize/" in f["args"].get("filename", "")]
    f = ours[-1] if ours else (stack[-1] if stack else None)
    return "-" if f is None else f"{f['name']}:{f['args'].get('line', '')}"


def timeline(path: Path, step: float, key=None) -> tuple[dict, dict]:
    """Per `step` seconds, each thread's seconds by label (chrometrace's B/E events, in µs);
    `key(stack)` gives the label (default `label`)."""
    key = key or label
    events = json.loads(path.read_text())
    by_tid: dict[int, list[dict]] = collections.defaultdict(list)
    names: dict[int, str] = {}
    for e in events:
        by_tid[e["tid"]].append(e)
    t0 = min(e["ts"] for e in events)
    spent: dict[int, dict[int, collections.Counter]] = {}
    for tid, evs in by_tid.items():
        stack: list[dict] = []
        last = None
        buckets: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        for e in sorted(evs, key=lambda e: e["ts"]):  # (stable: a sample's E before its B)
            if last is not None and stack:
                a, b = (last - t0) / 1e6, (e["ts"] - t0) / 1e6
                while a < b:
                    k = int(a / step)
                    if (k + 1) * step <= a:  # (float division rounded down a bucket)
                        k += 1
                    end = min(b, (k + 1) * step)
                    buckets[k][key(stack)] += end - a
                    a = end
            last = e["ts"]
            if e["ph"] == "B":
                if not stack:
                    names.setdefault(tid, e["name"])
                stack.append(e)
            elif e["ph"] == "E" and stack:
                stack.pop()
        spent[tid] = buckets
    return spent, names


def print_timeline(path: Path, step: float) -> None:
    spent, names = timeline(path, step)
    tids = sorted(spent, key=lambda t: -sum(sum(c.values()) for c in spent[t].values()))[:4]
    print("# s | " + " | ".join(names.get(t, str(t)) for t in tids))
    for k in range(max(max(spent[t], default=0) for t in tids) + 1):
        cells = [spent[t][k].most_common(1)[0][0] if spent[t].get(k) else "" for t in tids]
        print(f"{k * step:6.2f} | " + " | ".join(c[:48] for c in cells))


def window(path: Path, a: float, b: float, top: int = 4) -> None:
    """Each thread's innermost six frames (innermost first) by seconds within [a, b)."""
    step = 0.01
    spent, names = timeline(path, step, key=lambda st: " < ".join(
        f"{f['name']}:{f['args'].get('line', '')}" for f in st[-6:][::-1]))
    for tid, buckets in spent.items():
        c: collections.Counter = collections.Counter()
        for k, cnt in buckets.items():
            if a <= k * step < b:
                c.update(cnt)
        if c:
            print(f"# {names.get(tid, tid)}")
            for w, sec in c.most_common(top):
                print(f"{sec:7.2f}  {w[:240]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", type=Path)
    ap.add_argument("--rate", type=float, default=50.0, help="py-spy's --rate (samples per second)")
    ap.add_argument("--header", default="", help="lines to print first (what ran, where)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--step", type=float, default=0.25, help="chrometrace: seconds per timeline row")
    ap.add_argument("--window", type=float, nargs=2, metavar=("A", "B"),
                    help="chrometrace: each thread's innermost six frames between A and B seconds")
    args = ap.parse_args()
    if args.profile.suffix == ".json":
        if args.header:
            print(args.header)
        if args.window:
            window(args.profile, *args.window)
        else:
            print_timeline(args.profile, args.step)
        return
    per: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    main_what: collections.Counter = collections.Counter()
    ours: collections.Counter = collections.Counter()
    for line in args.profile.read_text(errors="replace").splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not n.isdigit():
            continue
        frames, k = stack.split(";"), int(n)
        thread = frames[0].split(": ")[-1].strip().strip('"')
        kind = classify(frames)
        per[thread][kind] += k
        per[thread]["all"] += k
        if thread != "MainThread":
            continue
        if any("_find_and_load" in f for f in frames):
            compiling = any("source_to_code" in f for f in frames)
            main_what["imports: compiling sources" if compiling else "imports: the rest"] += k
            continue
        q = [f"{f.split(' (')[0]}:{f.rsplit(':', 1)[-1].rstrip(')')}" for f in frames if "(quantize/" in f]
        ours[(" > ".join(q[-4:]) or "(no quantize frame)") + (f"   [{kind}]" if kind != "run" else "")] += k
    s = 1.0 / args.rate
    if args.header:
        print(args.header)
    print("# seconds of samples per thread: sampled | waiting for the GIL | on a Python lock | in preadv/write")
    for t, c in sorted(per.items(), key=lambda kv: -kv[1]["all"])[:16]:
        print(f"{c['all'] * s:8.2f} | {c['gil'] * s:6.2f} | {c['lock'] * s:6.2f} | {c['io'] * s:6.2f}  {t}")
    print("\n# the main thread")
    for w, k in main_what.most_common():
        print(f"{k * s:8.2f}  {w}")
    print(f"\n# the main thread outside imports, by its last four frames in quantize/ (top {args.top})")
    for w, k in ours.most_common(args.top):
        print(f"{k * s:8.2f}  {w}")


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # (piped into head)
        pass
