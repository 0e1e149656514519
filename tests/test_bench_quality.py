"""scripts/bench_quality.py's bookkeeping, which decides what BENCHMARKS.md reports: each tool's
configuration is chosen on the validation texts only (never on the reported ones), among its
seed-0 runs of the same group size and calibration set; a seed repeated across result files is
counted once."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
bq = pytest.importorskip("bench_quality")


def _row(run: str, g: int, seed: int | None, val: float, rep: float, calib: str | None = "broad") -> dict:
    method = run.split(":")[0]
    score = {"ppl": 1.0, "ppl_source": 1.0, "tokens": 10}
    return {"run": run, "method": method, "options": {}, "group_size": g, "calib": calib,
            "seed": seed, "chosen_on_validation": False,
            "scores": {"val:in_domain": dict(score, kl=val, ppl_added=val),
                       "val:ood:x.md": dict(score, kl=val, ppl_added=val),
                       "in_domain": dict(score, kl=rep, ppl_added=rep),
                       "ood:x.md": dict(score, kl=rep, ppl_added=rep)}}


def test_best_is_chosen_on_validation_among_its_own_seed0_runs():
    rng = random.Random()
    vals = [rng.uniform(0.1, 0.9) for _ in range(4)]
    rows = [
        _row("gptq", 32, 0, vals[0], 0.01),  # best reported figure, not the best validation
        _row("gptq:mse_clip=false", 32, 0, vals[1], 0.9),
        _row("llmc-gptq", 32, 0, vals[2], 0.5),
        _row("llmc-gptq:dampening_frac=0.1", 32, 0, vals[3], 0.5),
        _row("gptq:percdamp=0.01", 32, 1, 0.0, 0.0),  # seed 1: not a candidate
        _row("gptq:percdamp=0.02", 128, 0, 0.0, 0.0),  # other group
        _row("gptq:percdamp=0.03", 32, 0, 0.0, 0.0, calib="narrow"),  # other calibration set
        _row("rtn", 32, None, 0.0, 0.0, calib=None),
    ]
    ours = min(rows[:2], key=lambda r: r["scores"]["val:in_domain"]["kl"])["run"]
    theirs = min(rows[2:4], key=lambda r: r["scores"]["val:in_domain"]["kl"])["run"]
    assert bq.resolve_best("ours-best", rows, 32, "broad") == ours
    assert bq.resolve_best("llmc-best", rows, 32, "broad") == theirs
    assert bq.resolve_best("ours-best", rows, 64, "broad") is None
    assert bq.validation_score(rows[0]) == pytest.approx(vals[0])


def test_summary_counts_a_repeated_seed_once(tmp_path, capsys):
    head = {"command": "x", "device": "cpu", "torch": "t", "calibration": {}, "eval": {}}
    a = dict(head, runs=[_row("gptq", 32, 0, 0.2, 0.3), _row("gptq", 32, 1, 0.2, 0.5)])
    b = dict(head, runs=[_row("gptq", 32, 0, 0.2, 0.3), _row("gptq", 32, 2, 0.2, 0.7)])
    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    fa.write_text(json.dumps(a))
    fb.write_text(json.dumps(b))
    out = tmp_path / "s.json"
    bq.summarize([fa, fb], out)
    (row,) = json.loads(out.read_text())["summary"]
    assert row["seeds"] == [0, 1, 2] and row["n"] == 3
    assert row["in_domain"]["ppl_added_pct_mean"] == pytest.approx(50.0)  # (30 + 50 + 70) / 3
    assert "| 32 | broad | gptq | 3 |" in capsys.readouterr().out
