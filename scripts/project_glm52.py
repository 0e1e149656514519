"""Full GLM-5.2 conversion time from measured per-layer wall times and disk rates.

    python3 scripts/project_glm52.py benchmarks/h200_pipeline.json [--gpus 8 --scaling 6.0]

GLM-5.2: 3 dense decoder layers, 75 MoE decoder layers and the MTP layer (an MoE layer);
704 GiB of FP8 read, 420 GiB of INT4/BF16 written. The benchmark's slice measures a dense layer
(layer 0) and MoE layers (layer 1 and the MTP layer) through the whole CLI; the projection for
each token count is

    calibration  = start-up (until layer 0's line) + 3 x dense wall + 76 x MoE wall
                   (the MoE wall time divided by --scaling on --gpus GPUs, unmeasured here)

where a slice with two MoE decoder layers or more (`bench_pipeline.py --layers 3`) gives the
76 MoE layers as they run: the first MoE layer as measured (the kernels' compilation and the
cold read it cannot hide behind a 4 s dense layer: paid once), 74 x the later MoE decoder
layers' median (2,048-token samples, their reads ahead of them) and the MTP layer as measured
(its 2,047-token samples; `"rule": "per kind"`); a slice with one MoE decoder layer takes the
median over the MoE layers, the MTP layer included, with the compilation counted once
(`"rule": "median"`).
    disk         = 704 GiB / read rate + 420 GiB / write rate (the benchmark's cold read
                   and fsynced write of this machine's disk)
    total        = max(calibration, disk) + the last layer's write-out

since reading runs ahead of the layers and writing behind them (the overlapped pipeline), the
longer of the two bounds the run. The MoE wall time is the median over the slice's MoE layers;
start-up includes tokenization and the first layer's cold read.

The first MoE layer of a process also compiles the GPTQ kernels (Triton, ~3 s on an H200:
benchmarks/h200_profile_routed_hessians.json, first call 3.05 s, second 0.09 s), which a
78-layer run pays once, not per layer. Where the run's layers carry `rounding_sections_s`, that
one-time cost is the first MoE layer's gate/up GPU seconds beyond the least of the later MoE
layers'; it is taken off that layer's wall time before the median and counted once.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

GIB = 2**30
READ_BYTES, WRITE_BYTES = 703.7 * GIB, 419.9 * GIB
DENSE, MOE = 3, 76  # 75 MoE decoder layers + the MTP layer


def project(run: dict, disk: dict, gpus: int, scaling: float) -> dict:
    layers = run["layers"]
    dense = next((lay for lay in layers if lay["layer"] == 0), None)
    moe = [lay for lay in layers if lay["layer"] > 0 and "wall_s" in lay]
    if dense is None or not moe:
        return {"tokens": run["tokens"], "error": "the run has no dense and MoE layer lines"}
    once = first_call_cost(moe)
    start = dense["at"]  # process start to layer 0's line: start-up, tokenization, layer 0
    tail = max(run["wall_s"] - (layers[-1]["at"] or 0), 0)  # after the last layer line
    speed = scaling if gpus > 1 else 1
    decoder = [lay for lay in moe if not lay.get("mtp")]
    mtp = [lay for lay in moe if lay.get("mtp")]
    if len(decoder) >= 2:  # a steady MoE decoder layer measured: each kind as it runs
        rule = "per kind"
        moe_wall = statistics.median(lay["wall_s"] for lay in decoder[1:])
        moe_compute = statistics.median(lay["compute_s"] for lay in decoder[1:])
        last = mtp[0]["wall_s"] if mtp else moe_wall
        moe_total = (decoder[0]["wall_s"] + (MOE - 2) * moe_wall + last) / speed
    else:
        rule = "median"
        walls = [lay["wall_s"] - (once if i == 0 else 0) for i, lay in enumerate(moe)]
        moe_wall = statistics.median(walls)
        moe_compute = statistics.median(lay["compute_s"] - (once if i == 0 else 0) for i, lay in enumerate(moe))
        moe_total = MOE * moe_wall / speed + once
    calib = start + (DENSE - 1) * dense["compute_s"] + moe_total
    io = READ_BYTES / (disk["read_MBps"] * 1e6) + WRITE_BYTES / (disk["write_MBps"] * 1e6)
    total = max(calib, io) + tail
    return {"tokens": run["tokens"], "gpus": gpus, "scaling": scaling if gpus > 1 else 1.0,
            "rule": rule, "moe_wall_s": round(moe_wall, 3), "moe_compute_s": round(moe_compute, 3),
            "moe_wall_over_compute": round(moe_wall / moe_compute, 3),
            "first_call_compile_s": round(once, 2),
            "startup_s": round(start, 1), "tail_s": round(tail, 1),
            "calibration_min": round(calib / 60, 1), "disk_min": round(io / 60, 1),
            "total_min": round(total / 60, 1)}


def first_call_cost(moe: list[dict]) -> float:
    """Seconds of the first MoE layer's gate/up solves beyond the least of the later MoE
    layers' (the kernels' compilation, once per process); 0 without per-section times."""
    gu = [lay.get("rounding_sections_s", {}).get("gpu", {}).get("gptq_gate_up") for lay in moe]
    if len(gu) < 2 or any(g is None for g in gu):
        return 0.0
    return max(0.0, gu[0] - min(gu[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", type=Path, help="JSON written by scripts/bench_pipeline.py")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--scaling", type=float, default=1.0, help="speed-up of the MoE layer on --gpus")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    b = json.loads(args.bench.read_text())
    rows = [project(r, b["disk"], args.gpus, args.scaling) for r in b["runs"] if r.get("exit") == 0]
    res = {"bench": str(args.bench), "disk": b["disk"], "projections": rows}
    for r in rows:
        print(json.dumps(r))
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
