"""scripts/project_glm52.py's arithmetic, which the GLM-5.2 figure in README and BENCHMARKS.md
comes from: a slice with two MoE decoder layers is counted kind by kind (the first MoE layer
once as measured, the later decoder layers' median 74 times, the MTP layer as measured); a
slice with one takes the median over its MoE layers, the kernels' compilation counted once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
pg = pytest.importorskip("project_glm52")

DISK = {"read_MBps": 1e6, "write_MBps": 1e6}  # (the disk bound far below the calibration's)


def _layer(L: int, at: float, wall: float, mtp: bool = False, gate_up: float | None = None) -> dict:
    lay = {"layer": L, "mtp": mtp, "at": at, "compute_s": wall, "wall_s": wall}
    if gate_up is not None:
        lay["rounding_sections_s"] = {"gpu": {"gptq_gate_up": gate_up}}
    return lay


def test_two_moe_decoder_layers_are_counted_kind_by_kind():
    layers = [{"layer": 0, "mtp": False, "at": 25.0, "compute_s": 4.0},
              _layer(1, 45.0, 19.0, gate_up=5.7), _layer(2, 57.0, 12.0, gate_up=2.5),
              _layer(3, 70.0, 13.0, mtp=True, gate_up=2.6)]
    run = {"tokens": [512, 2048], "wall_s": 80.0, "layers": layers}
    p = pg.project(run, DISK, 1, 1.0)
    assert p["rule"] == "per kind" and p["moe_wall_s"] == 12.0
    want = 25.0 + 2 * 4.0 + 19.0 + 74 * 12.0 + 13.0  # start, 2 more dense, first, 74, MTP
    assert p["calibration_min"] == round(want / 60, 1)
    assert p["total_min"] == round((want + 10.0) / 60, 1)  # + the tail after the last line
    assert p["first_call_compile_s"] == pytest.approx(3.2)  # reported, inside layer 1's wall


def test_one_moe_decoder_layer_takes_the_median_with_the_compilation_once():
    layers = [{"layer": 0, "mtp": False, "at": 25.0, "compute_s": 4.0},
              _layer(1, 45.0, 19.0, gate_up=5.7), _layer(2, 60.0, 15.0, mtp=True, gate_up=2.5)]
    run = {"tokens": [512, 2048], "wall_s": 70.0, "layers": layers}
    p = pg.project(run, DISK, 1, 1.0)
    once = 5.7 - 2.5
    assert p["rule"] == "median" and p["moe_wall_s"] == pytest.approx((19.0 - once + 15.0) / 2)
    want = 25.0 + 2 * 4.0 + 76 * (19.0 - once + 15.0) / 2 + once
    assert p["calibration_min"] == round(want / 60, 1)
