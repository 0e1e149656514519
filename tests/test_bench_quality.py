"""scripts/bench_quality.py's bookkeeping, which decides what BENCHMARKS.md reports: each tool's
configuration is chosen on the validation texts only (never on the reported ones), among its
seed-0 runs of the same group size and calibration set; a seed repeated across result files is
counted once."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
bq = pytest.importorskip("bench_quality")


def _row(run: str, g: int, seed: int | None, val: float | None, rep: float,
         calib: str | None = "broad") -> dict:
    """A result row; `val` None: scored --reported-only (no validation halves)."""
    method = run.split(":")[0]
    score = {"ppl": 1.0, "ppl_source": 1.0, "tokens": 10}
    scores = {"in_domain": dict(score, kl=rep, ppl_added=rep), "ood:x.md": dict(score, kl=rep, ppl_added=rep)}
    if val is not None:
        scores = {"val:in_domain": dict(score, kl=val, ppl_added=val),
                  "val:ood:x.md": dict(score, kl=val, ppl_added=val), **scores}
    return {"run": run, "method": method, "options": {}, "group_size": g, "calib": calib,
            "seed": seed, "chosen_on_validation": False, "scores": scores}


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


def test_best_over_several_seeds_is_the_lowest_mean_validation_score():
    """--choose-seeds 0,1: the mean validation score over both seeds chooses; a spec that ran
    at one of them only, or whose rows there were scored --reported-only, is not a candidate."""
    rng = random.Random()
    a0, b0 = rng.uniform(0.10, 0.20), rng.uniform(0.20, 0.30)  # a wins seed 0 ...
    a1, b1 = rng.uniform(0.60, 0.70), rng.uniform(0.30, 0.40)  # ... b the mean
    reported = _row("gptq:gptaq=0.1", 32, 1, None, 0.0)
    rows = [_row("gptq:gptaq=0.25", 32, 0, a0, 0.1), _row("gptq:gptaq=0.5", 32, 0, b0, 0.1),
            _row("gptq:gptaq=0.25", 32, 1, a1, 0.1), _row("gptq:gptaq=0.5", 32, 1, b1, 0.1),
            _row("gptq:percdamp=0.2", 32, 0, 0.01, 0.0),  # seed 0 only
            _row("gptq:gptaq=0.1", 32, 0, 0.0, 0.0), reported]  # seed 1 without validation
    assert bq.resolve_best("ours-best", rows, 32, "broad") == "gptq:gptaq=0.1"  # (seed 0 alone)
    assert bq.resolve_best("ours-best", rows, 32, "broad", frozenset({0, 1})) == "gptq:gptaq=0.5"
    assert bq.resolve_best("llmc-best", rows, 32, "broad", frozenset({0, 1})) is None


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


def test_summary_of_a_grid_seed_and_reported_only_seeds(tmp_path, capsys):
    """A grid's seed 0 scores the validation halves too, the chosen run's later seeds only the
    reported ones (--reported-only): the summary averages every seed over the texts all of them
    scored, and the validation score over the seeds that have one."""
    head = {"command": "x", "device": "cpu", "torch": "t", "calibration": {}, "eval": {}}
    later = _row("gptq", 32, 1, None, 0.5)
    f = tmp_path / "a.json"
    f.write_text(json.dumps(dict(head, runs=[_row("gptq", 32, 0, 0.2, 0.3), later])))
    out = tmp_path / "s.json"
    bq.summarize([f], out)
    (row,) = json.loads(out.read_text())["summary"]
    assert row["n"] == 2 and "val:in_domain" not in row
    assert row["in_domain"]["ppl_added_pct_mean"] == pytest.approx(40.0)  # (30 + 50) / 2
    assert row["validation_score"] == pytest.approx(0.2) and row["validation_seeds"] == 1
    assert "| 32 | broad | gptq | 2 | 0.2000 |" in capsys.readouterr().out


def _tiny_lm(seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_pooled_scores_equal_the_score_of_the_texts_together():
    import torch

    src, q = _tiny_lm(1), _tiny_lm(2)  # two different models: KL and perplexities differ
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    a = torch.randint(0, 97, (3, 16), generator=gen)
    b = torch.randint(0, 97, (2, 16), generator=gen)
    dev = torch.device("cpu")
    scores = {"ood:a.md": bq.score(src, q, a, dev), "ood:b.md": bq.score(src, q, b, dev),
              "in_domain": bq.score(src, q, b[:1], dev)}
    got, want = bq.pooled(scores, "ood:"), bq.score(src, q, torch.cat([a, b]), dev)
    assert got["tokens"] == want["tokens"] == 5 * 15
    for k in ("ppl", "ppl_source", "ppl_added", "kl"):
        assert got[k] == pytest.approx(want[k], rel=1e-9), k
    assert got["kl"] > 0 and got["ppl_added"] != 0


def test_validation_weighs_in_domain_and_out_of_domain_equally():
    row = _row("gptq", 32, 0, 0.2, 0.3)
    one = bq.validation_score(row)
    assert one == pytest.approx(0.2)  # one file each: the plain mean, as before
    row["scores"]["val:ood:y.md"] = dict(row["scores"]["val:ood:x.md"], kl=0.8)  # same tokens
    assert bq.validation_score(row) == pytest.approx((0.2 + (0.2 + 0.8) / 2) / 2)


def _windowed(run: str, seed: int, per: list[list[float]], text: str = "ood:x.md") -> dict:
    row = _row(run, 32, seed, 0.1, 0.1)
    row["scores"][text] = dict(bq._totals(per), windows=per)
    return row


def test_paired_ratio_resamples_seeds_and_windows_together():
    rng = random.Random()
    seeds = [0, 1, 2]
    theirs = {s: [[rng.uniform(50, 60), rng.uniform(40, 49), rng.uniform(0.5, 2.0), 16] for _ in range(7)]
              for s in seeds}
    # ours: every window's KL exactly half of theirs, its perplexity added smaller too
    ours = {s: [[src + 0.5 * (nll - src), src, 0.5 * kl, n] for nll, src, kl, n in theirs[s]] for s in seeds}
    a = [_windowed("gptq", s, ours[s]) for s in seeds]
    b = [_windowed("llmc-gptq", s, theirs[s]) for s in seeds] + [_windowed("llmc-gptq", 9, theirs[0])]
    got = bq.paired_ratio(a, b, "ood:x.md", n_boot=300)
    assert got["seeds"] == seeds and got["windows"] == 7  # seed 9 has no partner
    assert got["kl_ratio"] == pytest.approx(0.5) and got["kl_ratio_90"] == pytest.approx([0.5, 0.5])
    # the point estimate is the summary's: mean over seeds of each tool's perplexity added
    mean = lambda rows: sum(r["scores"]["ood:x.md"]["ppl_added"] for r in rows) / len(rows)
    assert got["ppl_added_ratio"] == pytest.approx(mean(a) / mean(b[:3]), rel=1e-12)
    lo, hi = got["ppl_added_ratio_90"]
    assert lo < got["ppl_added_ratio"] < hi < 1  # noisy windows: an interval, below 1 throughout
    same = bq.paired_ratio(b, b, "ood:x.md", n_boot=50)  # a run against itself: exactly 1
    assert same["ppl_added_ratio_90"] == pytest.approx([1.0, 1.0]) and same["kl_ratio"] == pytest.approx(1.0)
    assert bq.paired_ratio([_row("gptq", 32, 5, 0.1, 0.1)], b, "ood:x.md") is None  # no common seed
    rtn = [_windowed("rtn", None, theirs[1])]  # no seed: paired with each of ours
    vs_rtn = bq.paired_ratio(a, rtn, "ood:x.md", n_boot=50)
    assert vs_rtn["seeds"] == seeds and vs_rtn["windows"] == 7
    # runs without windows (before they were kept): the seeds alone are redrawn
    old = [_row("gptq", 32, s, 0.1, r) for s, r in ((0, 0.2), (1, 0.3))]
    ref = [_row("llmc-gptq", 32, s, 0.1, r) for s, r in ((0, 0.4), (1, 0.3))]
    by_seed = bq.paired_ratio(old, ref, "ood:x.md", n_boot=400)
    assert by_seed["windows"] is None and by_seed["ppl_added_ratio"] == pytest.approx(0.5 / 0.7)
    lo, hi = by_seed["ppl_added_ratio_90"]  # draws of (0, 0), (0, 1), (1, 1): 0.5, 5/7, 1
    assert lo == pytest.approx(0.5) and hi == pytest.approx(1.0)


def test_pooled_windows_are_every_out_of_domain_texts_in_turn(tmp_path, capsys):
    per_x = [[5.0, 4.0, 0.3, 8], [6.0, 4.5, 0.2, 8]]
    per_y = [[7.0, 6.0, 0.4, 8]]
    rows = []
    for run, f in (("gptq", 1.0), ("llmc-gptq", 2.0)):
        for seed in (0, 1):
            r = _windowed(run, seed, [[s + f * (n - s), s, f * k, c] for n, s, k, c in per_x])
            y = [[s + f * (n - s), s, f * k, c] for n, s, k, c in per_y]
            r["scores"]["ood:y.md"] = dict(bq._totals(y), windows=y)
            r["scores"]["ood:all"] = bq.pooled(r["scores"], "ood:")
            rows.append(r)
    assert bq._windows(rows[0], "ood:all") == per_x + per_y
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"command": "x", "runs": rows}))
    out = tmp_path / "s.json"
    bq.summarize([f], out, pairs=(("gptq", "llmc-gptq"),))
    paired = {c["text"]: c for c in json.loads(out.read_text())["paired"]}
    assert paired["ood:all"]["windows"] == 3 and paired["ood:all"]["kl_ratio"] == pytest.approx(0.5)
    assert "| 32 | broad | gptq / llmc-gptq | ood:all | 2 x 3 |" in capsys.readouterr().out


def test_cached_source_logits_give_the_same_scores_without_the_source(tmp_path):
    """--cache-source: the first scoring keeps the source's logits per window; a later one reads
    them back (the source model is not run: a different model in its place changes nothing)
    and gives the same scores to the last bit; another tag (source) does not reuse them."""
    import torch

    src, q, other = _tiny_lm(1), _tiny_lm(2), _tiny_lm(3)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    w = torch.randint(0, 97, (3, 16), generator=gen)
    dev = torch.device("cpu")
    plain = bq.score(src, q, w, dev)
    first = bq.score(src, q, w, dev, cache=tmp_path / "c", tag="src")
    assert len(list((tmp_path / "c").glob("*.pt"))) == 3
    again = bq.score(other, q, w, dev, cache=tmp_path / "c", tag="src")
    assert plain == first == again
    assert bq.score(other, q, w, dev, cache=tmp_path / "c", tag="other") != plain
    assert len(list((tmp_path / "c").glob("*.pt"))) == 6


def test_reported_only_texts_are_the_full_sets_reported_windows(tmp_path):
    """--reported-only drops the validation halves before tokenizing them; the reported windows
    are the same token ids, in the same order, as when every text is built."""
    from transformers import AutoTokenizer

    from quantize.source.synth import write_tokenizer

    (tmp_path / "tok").mkdir()
    tok = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "tok", 512))
    split = bq.split_text(tmp_path)
    oods = [bq.ROOT / "calib_data" / n for n in bq.OOD_TEXTS[:2]]
    full = bq.eval_texts(tok, split, oods, 3, 64, 32)
    rep = bq.eval_texts(tok, split, oods, 3, 64, 32, reported_only=True)
    assert list(full) == ["val:in_domain", "in_domain", "val:ood:heldout_english.md", "ood:heldout_english.md",
                          "val:ood:heldout_english_2.md", "ood:heldout_english_2.md"]
    assert list(rep) == [k for k in full if not k.startswith("val:")]
    for k, v in rep.items():
        assert v.shape == (3, 64 if k == "in_domain" else 32) and v.equal(full[k])
    assert not full["ood:heldout_english.md"].equal(full["val:ood:heldout_english.md"])


def _confidence():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import bench_confidence

    return bench_confidence


def test_confidence_splits_perplexity_added_into_kl_and_the_texts_share():
    """bench_confidence: per window, log-perplexity added = KL + D, checked against a float64
    computation from the logits; the source against itself adds nothing; a sharp source on
    uniformly random tokens is over-confident, so its best temperature is the largest tried."""
    import torch

    bc = _confidence()
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    T, V = 40, 23
    ls = torch.log_softmax(torch.randn(T, V, generator=gen, dtype=torch.float64) * 4, -1)
    lq = torch.log_softmax(ls + 0.3 * torch.randn(T, V, generator=gen, dtype=torch.float64), -1)
    y = torch.randint(0, V, (T,), generator=gen)
    per = [bc.window_sums(ls[:20], lq[:20], y[:20], bc.TEMPERATURES),
           bc.window_sums(ls[20:], lq[20:], y[20:], bc.TEMPERATURES)]
    got = bc.totals(per)
    added = float((ls.gather(1, y[:, None]) - lq.gather(1, y[:, None])).mean())
    kl = float((ls.exp() * (ls - lq)).sum(-1).mean())
    assert got["log_ppl_added"] == pytest.approx(added, rel=1e-12)
    assert got["kl"] == pytest.approx(kl, rel=1e-12) and kl > 0
    assert got["d"] == pytest.approx(added - kl, rel=1e-9, abs=1e-12)
    assert got["entropy"] == pytest.approx(float(-(lq.exp() * lq).sum(-1).mean()), rel=1e-12)
    same = bc.totals([bc.window_sums(ls, ls, y, bc.TEMPERATURES)])
    assert same["ppl_added"] == 0 and same["kl"] == pytest.approx(0, abs=1e-12)
    src = bc.totals([bc.window_sums(ls, None, y, bc.TEMPERATURES)])
    assert src["ppl_source_at"]["1.0"] == pytest.approx(src["ppl_source"], rel=1e-12)
    assert src["best_temperature"] == max(bc.TEMPERATURES)


def test_confidence_gain_of_scaled_weights():
    """The least-squares gain of MLP weights scaled by c is c, their relative error |1 - c|;
    the source against itself: gain 1, error 0."""
    import torch

    bc = _confidence()
    src, q = _tiny_lm(1), _tiny_lm(1)
    with torch.no_grad():
        for name, p in q.named_parameters():
            if ".mlp." in name:
                p.mul_(0.9)
    got = bc.gains(src, q)
    assert got["linears"] == 3 and got["gain"] == pytest.approx(0.9, rel=1e-6)
    assert got["rel_error"] == pytest.approx(0.1, rel=1e-5)
    assert bc.gains(src, src)["gain"] == 1 and bc.gains(src, src)["rel_error"] == 0


def test_scores_with_a_bos_token_score_the_same_tokens_after_it():
    """score(bos=B): each window is run as [B, w0, w1, ...] and the same tokens w1.. are scored
    (the prediction of w0 from B dropped): equal to a float64 computation on that sequence, and
    not to the scores without B."""
    import torch

    src, q = _tiny_lm(1), _tiny_lm(2)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    w = torch.randint(3, 97, (2, 12), generator=gen)
    dev = torch.device("cpu")
    got = bq.score(src, q, w, dev, bos=1)
    nll = nll_src = kl = 0.0
    with torch.no_grad():
        for row in w:
            x = torch.cat([torch.tensor([1]), row])[None]
            ls = torch.log_softmax(src(x).logits.double()[0, 1:-1], -1)
            lq = torch.log_softmax(q(x).logits.double()[0, 1:-1], -1)
            y = row[1:, None]
            nll, nll_src = nll - float(lq.gather(1, y).sum()), nll_src - float(ls.gather(1, y).sum())
            kl += float((ls.exp() * (ls - lq)).sum())
    assert got["tokens"] == 2 * 11
    assert got["ppl"] == pytest.approx(math.exp(nll / 22), rel=1e-9)
    assert got["ppl_source"] == pytest.approx(math.exp(nll_src / 22), rel=1e-9)
    assert got["kl"] == pytest.approx(kl / 22, rel=1e-9)
    assert bq.score(src, q, w, dev)["ppl_source"] != pytest.approx(got["ppl_source"], rel=1e-6)


@pytest.mark.parametrize("prefix,ok", [(("<|begin|>",), True), ((), False),
                                       (("<|begin|>", "<|system|>"), False)])
def test_scoring_bos_is_the_start_the_tools_windows_get(tmp_path, prefix, ok):
    """`--bos` scores with the one token the tool's own calibration and eval windows begin with
    (quantize.calib.data.tokenizer_prefix); a tokenizer that puts nothing, or more than one
    token, before a text is refused by name; without --bos, None."""
    from transformers import AutoTokenizer

    from quantize.source.synth import write_tokenizer

    write_tokenizer(tmp_path, 512, prefix)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert bq.scoring_bos(tok, tmp_path, False) is None
    if ok:
        assert bq.scoring_bos(tok, tmp_path, True) == tok.convert_tokens_to_ids(prefix[0]) == 0
    else:
        with pytest.raises(SystemExit, match="not one BOS token"):
            bq.scoring_bos(tok, tmp_path, True)
