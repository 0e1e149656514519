"""`quantize eval`: the streamed forward against transformers' full models, the held-out windows,
the INT4 view of DST, and the refusals (tiny glm_moe_dsa / glm4_moe, CPU, offline)."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantize.calib.data import (
    HELDOUT_ENGLISH,
    load_calibration,
    read_documents,
    tokenize_documents,
)
from quantize.check.evaluate import (
    CalibWindows,
    EvalOptions,
    Evaluator,
    TokenScores,
    evaluate,
    open_output,
    score_logits,
    select_windows,
    summarize,
)
from quantize.check.verify import verify
from quantize.errors import QuantizeError
from quantize.names import CALIB_REPORT
from quantize.options import ConvertOptions
from quantize.pipeline import convert, source_weight
from quantize.plan import make_plan
from quantize.publish.card import _metric
from quantize.source.checkpoint import open_checkpoint
from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer
from quantize.write.manifest import MANIFEST

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

ARCHS = {"glm_moe_dsa": "fp8-block", "glm4_moe": "fp8-channel"}
SMALL = EvalOptions(num_samples=2, seq_len=48)
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=sorted(ARCHS))
def converted(request, tmp_path_factory):
    """(source, RTN output) of one tiny architecture, the source with its tokenizer."""
    mt = request.param
    d = tmp_path_factory.mktemp(f"eval-{mt}")
    cfg = tiny_config(mt)
    src = write_checkpoint(d / "src", cfg, ARCHS[mt], seed=5)
    write_tokenizer(src, cfg["vocab_size"])
    convert(src, d / "out", ConvertOptions(), device="cpu")
    return src, d / "out"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, 512)
    return AutoTokenizer.from_pretrained(str(d))


def _streams(src_dir, dst_dir, tokens: torch.Tensor, prefix: int = 0) -> Evaluator:
    """Both streams run through every layer, float32 on the CPU."""
    src = open_checkpoint(src_dir)
    units = {u.source: u for u in make_plan(src, ConvertOptions()).units}
    ev = Evaluator(src, units, open_output(dst_dir), tokens, CPU, torch.float32, prefix=prefix)
    ev.embed()
    for L in range(ev.num_layers):
        ev.run_layer(L)
    return ev


def _float_folder(path, src_dir):
    """The source with every FP8 weight dequantized to float32 (the exact values the streamed
    forward uses), as a plain checkpoint transformers loads without FP8 kernels."""
    src = open_checkpoint(src_dir)
    L = src.num_hidden_layers
    tensors = {u.source: source_weight(src, u, CPU) if u.scale else src.read(u.source)
               for u in make_plan(src, ConvertOptions()).units if f"layers.{L}." not in u.source}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(
        {k: v for k, v in src.config.items() if k != "quantization_config"}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_streamed_logits_equal_transformers(converted, tmp_path):
    """(1) the source stream is transformers' full model; (2) the quantized stream is
    transformers' full model loaded from DST (compressed-tensors decompression)."""
    from transformers import AutoModelForCausalLM

    src, dst = converted
    V = open_checkpoint(src).config["vocab_size"]
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(0))
    ev = _streams(src, dst, ids)
    ours_s, ours_q = ev.logits("source", 0), ev.logits("quantized", 0)  # (2, 24, V)
    with torch.no_grad():
        ref_s = AutoModelForCausalLM.from_pretrained(_float_folder(tmp_path / "f32", src),
                                                     dtype=torch.float32).eval()(ids).logits
        # transformers decompresses the experts to BF16 and keeps them so; .float() runs those
        # same BF16 values in float32, as we do (left in BF16, the DSA top-k and the routing flip
        # on rounding: 7% relative on glm_moe_dsa, all of it BF16 arithmetic)
        m_q = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
        for p in m_q.parameters():  # (transformers refuses .float() on a quantized model)
            p.data = p.data.float()
        ref_q = m_q(ids).logits
    # Same float32 weights, same layer classes, one layer at a time vs the whole model: only
    # summation order could differ (measured: bit-equal on both architectures).
    assert _rel(ours_s, ref_s) < 1e-5, (ours_s - ref_s).abs().max()
    assert _rel(ours_q, ref_q) < 1e-5, (ours_q - ref_q).abs().max()
    assert _rel(ours_q, ours_s) > 0.05  # and INT4 moved them (measured 0.20 and 0.23)


def test_eval_report_card_and_cli(converted):
    """(2) RTN costs perplexity and KL > 0; eval.json, the card and the CLI agree."""
    from typer.testing import CliRunner

    from quantize.cli import app

    src, dst = converted
    rep = evaluate(src, dst, SMALL, device="cpu")
    s = rep["summary"]
    # random tiny weights: ppl ~ vocab size; INT4 noise moves it by a few percent (measured
    # 1.01-1.03) and, being noise, could in principle lower it, so the bounds are loose
    assert 0.95 < s["ppl_ratio"] < 1.5 and s["ppl_source"] > 1 and s["kl_mean"] > 1e-4
    assert 0 < s["top1_agreement"] < 1 and s["tokens"] == 2 * 47
    assert "no calibration" in s["data"] and rep["data"]["disjoint"]
    layers = rep["layers"]
    assert [lay["layer"] for lay in layers] == [0, 1, 2]
    assert layers[0]["int4_linears"] == 0 and layers[1]["int4_linears"] == 24
    assert layers[2]["rel_error"] > layers[0]["rel_error"] > 0  # error accumulates with depth
    on_disk = json.loads((dst / "eval.json").read_text())
    assert on_disk["summary"] == s
    manifest = json.loads((dst / MANIFEST).read_text())
    assert "eval.json" not in manifest["files"]
    card = (dst / "README.md").read_text()
    assert "## Evaluation" in card and "| perplexity ratio (this / source) | " \
        f"{s['ppl_ratio']:.4f}".rstrip("0") in card  # rows a reader understands, not JSON keys
    assert f"({100 * (s['ppl_ratio'] - 1):+.2f} % perplexity)" in card
    assert f"| same top-1 next token as the source | {100 * s['top1_agreement']:.2f} % |" in card
    assert "| ppl_ratio |" not in card and "| kl_mean |" not in card
    # the verdict and the thresholds it used (a reader can tell what "pass" meant)
    v = rep["verdict"]
    assert v["ok"] and "Verdict: **pass**, by its thresholds: a perplexity ratio of at most " \
        f"{v['max_ppl_ratio']:g}" in card and f"mean KL of at most {v['max_kl']:g} nats" in card
    # out of domain, by default: the shipped general-English text, in no calibration set
    o = rep["out_of_domain"]
    assert o["data"] == "heldout_english.md, 4 x 48 tokens, in no calibration set"  # --ood-samples 4
    assert o["tokens"] == 4 * 47
    assert s["ood_ppl_ratio"] == o["ppl_ratio"] and s["ood_kl_mean"] == o["kl_mean"] > 1e-4
    assert o["ppl_ratio"] != s["ppl_ratio"]  # another text, another figure
    assert f"| out of domain: perplexity ratio | {_metric(o['ppl_ratio'])}" in card

    r = CliRunner().invoke(app, ["eval", str(src), str(dst), "--num-samples", "1", "--seq-len", "32",
                                 "--device", "cpu", "--json", "--max-ppl-ratio", "100"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["summary"]["tokens"] == 31
    r = CliRunner().invoke(app, ["eval", str(src), str(dst), "--num-samples", "1", "--seq-len", "32",
                                 "--device", "cpu", "--max-ppl-ratio", "0.5"])
    assert r.exit_code == 1 and "relative error" in r.stdout and "max-ppl-ratio" in r.output


def test_out_of_domain_scores_equal_an_eval_on_that_text(converted):
    """The out-of-domain figures are the ordinary eval on that text: `--data heldout_english.md`
    (one document, windows cut from its start, like the OOD windows) scores the same tokens
    and gives the same numbers; `--ood none` skips it; a missing file is refused by name."""
    src, dst = converted
    rep = evaluate(src, dst, EvalOptions(num_samples=1, seq_len=48, ood_samples=2), device="cpu",
                   write=False)
    direct = evaluate(src, dst, EvalOptions(data=str(HELDOUT_ENGLISH), num_samples=2, seq_len=48,
                                            ood="none"), device="cpu", write=False)
    assert direct["out_of_domain"] is None and "ood_ppl_ratio" not in direct["summary"]
    o, d = rep["out_of_domain"], direct["summary"]
    for k in ("ppl_source", "ppl_quantized", "ppl_ratio", "kl_mean", "top1_agreement", "tokens"):
        assert o[k] == pytest.approx(d[k], rel=1e-12, abs=0), k
    with pytest.raises(QuantizeError, match="out-of-domain text not found"):
        evaluate(src, dst, EvalOptions(num_samples=1, seq_len=32, ood=str(dst / "missing.txt")),
                 device="cpu", write=False)


def test_int4_view_equals_compressed_tensors_decompression(tmp_path):
    """The reader: every INT4 Linear of DST as compressed-tensors decompresses it (asymmetric,
    zero points included); other tensors as stored."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    cfg = tiny_config("glm4_moe", num_hidden_layers=2)
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-channel")
    convert(src, tmp_path / "out", ConvertOptions(symmetric=False, group_size=32), device="cpu")
    view = open_output(tmp_path / "out")
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=32))
    assert len(view.packed) == 2 * 3 * cfg["n_routed_experts"]  # layer 1 and the MTP layer
    for name, m in list(view.packed.items())[::7]:
        with safe_open(str(view.root / view.tensors[name].file), "pt") as f:
            state = {k: f.get_tensor(f"{m}.{k}") for k in
                     ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")}
        want = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
        assert torch.equal(view.read(name), want.float()), name
    norm = "model.layers.1.post_attention_layernorm.weight"
    assert torch.equal(view.read(norm), open_checkpoint(src).read(norm))


def _random_docs(path, n: int, words: int, seed: int = 0):
    rng = random.Random(seed)
    vocab = [f"{a}{b}" for a in "bcdfghklmnprstvz" for b in ("ao", "ei", "ou", "ia", "ue")]
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(words))})
                            + "\n" for _ in range(n)))
    return path


def _ngrams(t: torch.Tensor, n: int) -> set[tuple[int, ...]]:
    return {tuple(r[i: i + n].tolist()) for r in t for i in range(t.shape[1] - n + 1)}


@pytest.mark.parametrize("bos", [None, "<|begin|>"])
def test_eval_windows_are_disjoint_from_calibration(tok, tmp_path, bos):
    """(3) The calibration windows as calib_data cuts them (with the tokenizer's BOS first when
    it adds one) share no text with the eval windows, which begin with the same BOS; a
    calibration that covers the whole file is reported as an unavoidable overlap."""
    if bos is not None:
        from transformers import AutoTokenizer

        write_tokenizer(tmp_path, 512, (bos,))
        tok = AutoTokenizer.from_pretrained(str(tmp_path))
    head = [tok.convert_tokens_to_ids(bos)] if bos else []
    p = _random_docs(tmp_path / "words.jsonl", 60, 40)  # random words: no n-gram repeats by chance
    doc_ids, _, _ = tokenize_documents(read_documents(p), tok)
    eos = tok.eos_token_id
    for n_c, S_c, seed_c in ((4, 64, 0), (3, 100, 7)):
        calib = load_calibration(p, tok, n_c, S_c, seed_c).tokens
        es = select_windows(doc_ids, eos, 8, 32, seed_c, CalibWindows(n_c, S_c, seed_c, len(head)),
                            str(p), prefix=head)
        assert es.disjoint and es.overlap_avoidable is None and es.tokens.shape == (8, 32)
        assert es.prefix == len(head) and es.tokens[:, : len(head)].eq(torch.tensor(head)).all()
        assert 0 < es.held_out < es.documents
        # 12 random-word tokens in a row never recur by chance; shared ones would be shared text
        assert not _ngrams(calib, 12) & _ngrams(es.tokens, 12)
        same_seed_all_docs = select_windows(doc_ids, eos, 8, 32, seed_c, None, str(p), prefix=head)
        assert _ngrams(calib, 12) & _ngrams(same_seed_all_docs.tokens, 12)  # the test can see overlap
    # overlapping (random-start) calibration windows covering every document
    es = select_windows(doc_ids, eos, 4, 32, 0, CalibWindows(400, 64, 0), str(p))
    assert not es.disjoint and es.overlap_avoidable is False and "overlap" in es.calibration


def test_prefix_targets_and_hidden_states_are_not_scored(converted):
    """Windows that begin with a two-token prefix ([gMASK]<sop>-like): the scores are
    score_logits of the streamed logits (equal to transformers': the test above) on the targets
    after the prefix only, and the per-layer error leaves the prefix's hidden states out."""
    src, dst = converted
    V = open_checkpoint(src).config["vocab_size"]
    ids = torch.randint(4, V, (2, 20), generator=torch.Generator().manual_seed(3))
    ids[:, :2] = torch.tensor([0, 2])  # the same two tokens before every window
    plain = _streams(src, dst, ids)
    ev = _streams(src, dst, ids, prefix=2)
    e = ev.layers[-1]
    hs = plain.hidden["source"].on_device(0)  # (both ran every layer: the last layer's states)
    got = ev.score()
    ls, lq = plain.logits("source", 0), plain.logits("quantized", 0)  # (2, 20, V)
    want = score_logits(ls[:, 1:-1].reshape(-1, V), lq[:, 1:-1].reshape(-1, V), ids[:, 2:].reshape(-1))
    assert got.tokens == 2 * 18 and plain.score().tokens == 2 * 19
    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=1e-9)
    hq = plain.hidden["quantized"].on_device(0)
    rel = float((hq[:, 2:] - hs[:, 2:]).double().norm() / hs[:, 2:].double().norm())
    assert e["rel_error"] == pytest.approx(rel, rel=1e-9)
    assert e["rel_error"] != pytest.approx(plain.layers[-1]["rel_error"], rel=1e-6)


@pytest.mark.parametrize("model_type, tok, prefix", [
    ("glm4_moe", {}, ()),
    ("glm4_moe", {"prefix": ("<|begin|>",)}, ("<|begin|>",)),  # the tokenizer's BOS (Gemma, Llama)
    # GLM-5: the chat template's two special tokens before any message ([gMASK]<sop>), which
    # the tokenizer does not add; the MTP layer and the DSA indexer run on those windows
    ("glm_moe_dsa", {"chat_start": "<|begin|><|system|>"}, ("<|begin|>", "<|system|>")),
])
def test_calibrated_conversion_is_held_out(tmp_path, model_type, tok, prefix):
    """evaluate reads the conversion's calibration options from the manifest (with a tokenizer
    that puts a BOS first, or a chat template that begins every request with special tokens:
    calibration and eval windows begin with them, and the report says so)."""
    from transformers import AutoTokenizer

    from quantize.calib.data import HELDOUT_ENGLISH, tokenizer_prefix
    from quantize.check.layercheck import _text_tokens

    cfg = tiny_config(model_type, num_hidden_layers=2)
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-channel" if model_type == "glm4_moe" else "fp8-block")
    write_tokenizer(src, cfg["vocab_size"], **tok)
    data = _random_docs(tmp_path / "words.jsonl", 40, 40, seed=1)
    lines: list[str] = []
    convert(src, tmp_path / "out", ConvertOptions(method="gptq", calib=str(data), num_samples=2,
                                                  seq_len=64, seed=3), device="cpu", log=lines.append)
    said = [x for x in lines if x.startswith("calibration windows")]
    start = "".join(prefix)
    assert len(said) == 1 and ((f"begin with {start} (" in said[0]) if prefix else ("text alone" in said[0]))
    calib_rep = json.loads((tmp_path / "out" / CALIB_REPORT).read_text())
    assert calib_rep["calibration"]["prefix"] == list(prefix)
    card = (tmp_path / "out" / "README.md").read_text()
    cell = start.replace("|", "\\|")  # (a pipe in a table's cell is escaped)
    assert (f"each beginning with `{cell}` as every served request does" in card) == bool(prefix)
    (row,) = [x for x in card.splitlines() if x.startswith("| calibration tokens |")]
    assert len(re.split(r"(?<!\\)\|", row)) == 4  # two cells: the pipes inside are escaped
    v = verify(src, tmp_path / "out")
    assert v.ok and v.layer_check["prefix"] == list(prefix)
    # verify's layer check reads the tokenizer with the `tokenizers` library (not transformers):
    # the same prefix as the calibration's, before every window, then the text without it
    tokens, text, got = _text_tokens(open_checkpoint(src), 2, 32)
    ids = AutoTokenizer.from_pretrained(str(src))
    head = tokenizer_prefix(ids)
    assert got == prefix and len(head) == len(prefix) and text == "heldout_english.md"
    assert tokens[:, : len(head)].tolist() == [head] * 2
    body = ids(HELDOUT_ENGLISH.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    assert tokens[:, len(head):].flatten().tolist() == body[: 2 * (32 - len(head))]
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["options"]["calib_bos"] is True
    rep = evaluate(src, tmp_path / "out", EvalOptions(data=str(data), num_samples=2, seq_len=32),
                   device="cpu", write=False)
    d = rep["data"]
    assert d["prefix_tokens"] == len(prefix) and rep["options"]["bos"] is True
    assert d["disjoint"] and d["held_out_documents"] < d["documents"] and "held out" in d["calibration"]
    assert "disjoint from the calibration" in rep["summary"]["data"]
    other = evaluate(src, tmp_path / "out", EvalOptions(num_samples=1, seq_len=32), device="cpu",
                     write=False)  # the default set: another file than the calibration's
    assert "another file" in other["data"]["calibration"] and other["data"]["disjoint"]


def test_default_eval_is_held_out_from_a_calibration_on_the_shipped_set(tmp_path):
    """eval's default text is the shipped set's eval reserve, which a calibration on the shipped
    set never reads: held out at any recipe. A report from before the reserve (no
    `eval_reserve`) gets the replay of its calibration windows instead."""
    from quantize.calib.data import DEFAULT_CALIB, EVAL_EVERY

    cfg = tiny_config("glm4_moe", num_hidden_layers=2)
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-channel")
    write_tokenizer(src, cfg["vocab_size"])
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(method="gptq", num_samples=2, seq_len=64), device="cpu")
    report = json.loads((out / "calibration-report.json").read_text())
    reserved = len(read_documents(DEFAULT_CALIB)) // EVAL_EVERY
    assert report["calibration"]["eval_reserve"] == reserved
    rep = evaluate(src, out, EvalOptions(num_samples=2, seq_len=32, ood="none"), device="cpu", write=False)
    d = rep["data"]
    assert d["disjoint"] and d["held_out_documents"] == reserved, d
    assert "never reads" in d["calibration"] and "disjoint from the calibration" in rep["summary"]["data"]
    del report["calibration"]["eval_reserve"]  # as a conversion before the reserve wrote it
    (out / "calibration-report.json").write_text(json.dumps(report))
    old = evaluate(src, out, EvalOptions(num_samples=2, seq_len=32, ood="none"), device="cpu", write=False)
    assert old["data"]["disjoint"] and "were under calibration windows" in old["data"]["calibration"]
    assert old["data"]["held_out_documents"] <= reserved


def test_eval_on_the_large_set_after_a_calibration_on_it(tmp_path):
    """`--calib shipped:large` then `eval --data shipped:large`: eval scores the large set's
    reserved sixth, which that calibration never read; eval's default text after that
    calibration is default.jsonl's sixth, the same documents (large begins with them)."""
    from quantize.calib.data import EVAL_EVERY, SHIPPED_SETS

    cfg = tiny_config("glm4_moe", num_hidden_layers=2)
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-channel")
    write_tokenizer(src, cfg["vocab_size"])
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(method="gptq", calib="shipped:large", num_samples=2, seq_len=64),
            device="cpu")
    reserved = len(read_documents(SHIPPED_SETS["large"])) // EVAL_EVERY
    assert json.loads((out / "calibration-report.json").read_text())["calibration"]["eval_reserve"] == reserved
    rep = evaluate(src, out, EvalOptions(data="shipped:large", num_samples=2, seq_len=32, ood="none"),
                   device="cpu", write=False)
    d = rep["data"]
    assert d["disjoint"] and d["held_out_documents"] == reserved and "never reads" in d["calibration"], d
    assert rep["options"]["data"] == "large.jsonl.xz"


def test_refusals(converted, tmp_path):
    """(4) An unfinished DST, a folder that is no conversion, a missing tokenizer."""
    src, dst = converted
    half = tmp_path / "half"
    shutil.copytree(dst, half, ignore=shutil.ignore_patterns("eval.json"))
    m = json.loads((half / MANIFEST).read_text())
    m["status"] = "in-progress"
    (half / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(QuantizeError, match="not a finished conversion") as e:
        evaluate(src, half, SMALL, device="cpu")
    assert "--resume" in str(e.value) and not (half / "eval.json").exists()
    with pytest.raises(QuantizeError, match="not a finished conversion"):
        evaluate(src, tmp_path / "nothing-here", SMALL, device="cpu")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (half / f).unlink()
    m["status"] = "complete"
    (half / MANIFEST).write_text(json.dumps(m))
    nosrc_tok = tmp_path / "src"
    shutil.copytree(src, nosrc_tok, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(QuantizeError, match="tokenizer"):
        evaluate(nosrc_tok, half, SMALL, device="cpu")
    other = write_checkpoint(tmp_path / "other", tiny_config("glm4_moe", num_hidden_layers=2),
                             "fp8-channel")
    write_tokenizer(other, 512)
    # another model as SRC: refused (same architecture: "not converted from SRC"; another
    # architecture: the configs differ before the weights are looked at)
    same_arch = open_checkpoint(src).model_type == "glm4_moe"
    with pytest.raises(QuantizeError, match="not converted from SRC" if same_arch else "."):
        evaluate(other, dst, SMALL, device="cpu")


def test_scores_of_identical_models():
    logits = torch.randn(10, 50, generator=torch.Generator().manual_seed(0))
    t = torch.arange(10) % 50
    s = score_logits(logits, logits, t)
    assert s.kl == 0 and s.top1_agree == 10 and s.nll_source == s.nll_quantized
    both = s + TokenScores(1, 1.0, 2.0, 0.5, 0)
    assert both.tokens == 11 and both.nll_quantized == s.nll_quantized + 2.0


def test_scores_of_different_models_against_float64():
    """score_logits on two different sets of logits, against an independent float64
    computation written from the definitions: NLL = -sum log softmax at the target,
    KL(p_s || p_q) = sum_v p_s (log p_s - log p_q), top-1 agreement of the argmaxes; then the
    perplexity / KL summary from those sums (fresh inputs; float32 vs float64: 1e-5)."""
    gen = torch.Generator().manual_seed(3)
    T, V = 64, 300
    ls = torch.randn(T, V, generator=gen) * 3
    lq = ls + 0.7 * torch.randn(T, V, generator=gen)  # a perturbed model: KL well above 0
    t = torch.randint(0, V, (T,), generator=gen)
    s = score_logits(ls, lq, t)
    a, b = ls.double(), lq.double()
    log_ps = a - torch.logsumexp(a, dim=-1, keepdim=True)
    log_pq = b - torch.logsumexp(b, dim=-1, keepdim=True)
    nll_s = -log_ps[torch.arange(T), t].sum().item()
    nll_q = -log_pq[torch.arange(T), t].sum().item()
    kl = (log_ps.exp() * (log_ps - log_pq)).sum().item()
    agree = int((a.argmax(-1) == b.argmax(-1)).sum())
    assert s.tokens == T and 0 < agree < T and kl > 0.1 * T
    assert s.nll_source == pytest.approx(nll_s, rel=1e-5)
    assert s.nll_quantized == pytest.approx(nll_q, rel=1e-5)
    assert s.kl == pytest.approx(kl, rel=1e-5)
    assert s.top1_agree == agree
    summ = summarize(s)
    assert summ["ppl_source"] == pytest.approx(math.exp(nll_s / T), rel=1e-5)
    assert summ["ppl_ratio"] == pytest.approx(math.exp((nll_q - nll_s) / T), rel=1e-5)
    assert summ["kl_mean"] == pytest.approx(kl / T, rel=1e-5)


def test_seq_len_is_capped_to_the_models_context(tmp_path):
    """--seq-len beyond max_position_embeddings: eval says so and scores windows of the
    model's context instead (the windows' length is what the report records)."""
    cfg = tiny_config("glm4_moe", max_position_embeddings=48)
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-channel")
    write_tokenizer(src, cfg["vocab_size"])
    dst = tmp_path / "out"
    convert(src, dst, ConvertOptions(), device="cpu")
    said = []
    rep = evaluate(src, dst, EvalOptions(num_samples=2, seq_len=2048), device="cpu",
                   log=said.append, write=False)
    assert any("--seq-len 2048 is beyond max_position_embeddings 48" in s for s in said), said
    assert rep["data"]["seq_len"] == 48 and rep["summary"]["tokens"] == 2 * 47
