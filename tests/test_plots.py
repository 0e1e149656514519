"""The pictures (issue 12, item 8): a calibrated convert draws routed tokens per expert and
layer, verify the SQNR of every INT4 tensor by layer, eval the error by layer; each is a real
PNG (decoded here with Pillow), the same numbers give the same bytes, the card embeds the ones
that exist and push uploads them."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from quantize.check.evaluate import EvalOptions, evaluate
from quantize.check.verify import verify
from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.publish import plots
from quantize.publish.push import prepare_push
from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer

pytestmark = pytest.mark.skipif(not plots.available(), reason="needs the plots extra (matplotlib)")


def test_pictures_of_a_calibrated_run(tmp_path):
    cfg = tiny_config("glm4_moe")
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-channel")
    write_tokenizer(src, cfg["vocab_size"])
    dst = tmp_path / "out"
    convert(src, dst, ConvertOptions(method="gptq", num_samples=8, seq_len=64, min_expert_tokens=40),
            device="cpu")
    assert verify(src, dst).ok
    evaluate(src, dst, EvalOptions(num_samples=2, seq_len=64), device="cpu")
    for name in plots.PICTURES:
        p = dst / name
        assert p.is_file() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        with Image.open(p) as im:
            assert im.width >= 400 and im.height >= 200
            assert sum(1 for c in im.convert("L").histogram() if c) > 8  # drawn, not blank
    card = (dst / "README.md").read_text()
    for name in plots.PICTURES:
        assert f"]({name})" in card
    uploaded = {f.name for f in prepare_push(dst, "me/x", write_card=False).files}
    assert set(plots.PICTURES) <= uploaded
    manifest = json.loads((dst / "quantize-manifest.json").read_text())
    assert not set(plots.PICTURES) & set(manifest["files"])  # reports, not checksummed weights

    # the same numbers give the same bytes; other numbers other bytes
    rep = json.loads((dst / "calibration-report.json").read_text())
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    plots.routed_tokens(rep, a)
    plots.routed_tokens(rep, b)
    assert a.read_bytes() == b.read_bytes()
    moe = next(lay for lay in rep["layers"] if lay.get("expert_tokens"))
    moe["expert_tokens"][0] = 0  # a dead expert: marked
    plots.routed_tokens(rep, b)
    assert a.read_bytes() != b.read_bytes()


def test_nothing_to_draw_gives_no_picture(tmp_path):
    assert plots.routed_tokens({"layers": [{"layer": 0}]}, tmp_path / "x.png") is None
    assert plots.sqnr_by_layer({"tensors": []}, tmp_path / "y.png") is None
    assert plots.errors_by_layer(None, None, tmp_path / "z.png") is None
    assert not list(tmp_path.iterdir())
