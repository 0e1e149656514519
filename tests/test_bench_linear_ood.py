"""scripts/bench_linear_ood.py's arithmetic, which BENCHMARKS.md's per-Linear figures rest on:
each variant's relative output error tr(E H Eᵀ) / tr(W H Wᵀ) on every set, against float64
computed here from the weights' own RTN, and GPTQ fitted on the calibration set only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
blo = pytest.importorskip("bench_linear_ood")

from quantize.rounding.int4 import dequantize, quantize_rtn

HIDDEN, INTER, G = 64, 96, 32


def _stats(layers: int = 2) -> dict:
    """Random weights and per-set second moments of correlated random inputs; the out-of-domain
    sets' inputs drawn from another mixing than the calibration's."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    H, W = {}, {}
    mix = {k: torch.randn(k, k, generator=gen, dtype=torch.float64) for k in (HIDDEN, INTER)}
    other = {k: torch.randn(k, k, generator=gen, dtype=torch.float64) for k in (HIDDEN, INTER)}
    for i in range(layers):
        W[f"{i}.gate"] = torch.randn(INTER, HIDDEN, generator=gen)
        W[f"{i}.up"] = torch.randn(INTER, HIDDEN, generator=gen)
        W[f"{i}.down"] = torch.randn(HIDDEN, INTER, generator=gen)
        for s in blo.SETS:
            for name, k in (("gate", HIDDEN), ("down", INTER)):
                m = other[k] if s.endswith("ood") else mix[k]
                X = torch.randn(512, k, generator=gen, dtype=torch.float64) @ m
                H[f"{s}|{i}.{name}"] = (X.T @ X / X.shape[0]).float()
    return {"H": H, "W": W}


def _rel(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> float:
    E, Wd, Hd = (W - Q).double(), W.double(), H.double()
    return float(torch.trace(E @ Hd @ E.T) / torch.trace(Wd @ Hd @ Wd.T))


def test_rtn_row_is_the_relative_output_error_of_the_weights_own_rtn():
    stats = _stats()
    out = blo.score(stats, G, ["rtn"])["rtn"]
    for lin, w in stats["W"].items():
        i, kind = lin.split(".")
        q = dequantize(quantize_rtn(w, G), torch.float32)
        for s in blo.SETS:
            H = stats["H"][f"{s}|{i}.{'down' if kind == 'down' else 'gate'}"]
            assert out["per_linear"][lin][s] == pytest.approx(_rel(w, q, H), rel=1e-9)
    for s in blo.SETS:  # the mean and the per-kind means are those of the per-Linear figures
        assert out["mean"][s] == pytest.approx(sum(p[s] for p in out["per_linear"].values()) / 6)
        assert out["by_kind"]["down"][s] == pytest.approx(
            (out["per_linear"]["0.down"][s] + out["per_linear"]["1.down"][s]) / 2)


def test_gptq_is_fitted_on_the_calibration_set_only():
    stats = _stats()
    name = "plain GPTQ, imatrix clip (llm-compressor's choice)"
    res = blo.score(stats, G, ["rtn", name])
    gptq, rtn = res[name]["mean"], res["rtn"]["mean"]
    # on the calibration statistics (and the in-domain sets, drawn alike) GPTQ is far below RTN
    for s in ("cal", "val_id", "rep_id"):
        assert gptq[s] < 0.7 * rtn[s]
    # the result depends on the calibration H alone: every other set's statistics replaced by
    # fresh ones, the calibration figure (the codes' error there) is the same to the bit
    fresh = _stats()["H"]
    moved = {"H": {k: (v if k.startswith("cal|") else fresh[k]) for k, v in stats["H"].items()},
             "W": stats["W"]}
    again = blo.score(moved, G, [name])[name]["per_linear"]
    for lin, p in res[name]["per_linear"].items():
        assert again[lin]["cal"] == p["cal"]
        assert again[lin]["val_ood"] != p["val_ood"]
