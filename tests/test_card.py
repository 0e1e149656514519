"""The model card: its figures are the conversion's own, and it never breaks verify."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantize.card import render_card
from quantize.checkpoint import open_checkpoint
from quantize.manifest import MANIFEST
from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.plan import make_plan
from quantize.readme import card_facts, hub_source, write_readme
from quantize.synth import tiny_config, write_checkpoint
from quantize.verify import VERIFY_JSON, verify


@pytest.fixture(scope="module")
def done(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("card")
    src, dst = d / "src", d / "out"
    write_checkpoint(src, tiny_config())
    convert(src, dst, ConvertOptions(group_size=32), device="cpu")
    return src, dst


def _front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    block = text.split("---\n")[1]
    out: dict = {}
    key = None
    for line in block.splitlines():
        if line.startswith("- "):
            out[key].append(line[2:])
        else:
            key, _, v = line.partition(": ")
            key = key.rstrip(":")
            out[key] = v if v else []
    return out


def test_convert_writes_card_with_plan_figures(done):
    src, dst = done
    card = (dst / "README.md").read_text()
    plan = make_plan(open_checkpoint(src), ConvertOptions(group_size=32))
    for n in (plan.source_bytes, plan.output_bytes, plan.output_file_bytes):
        assert f"{n:,} bytes" in card, n
    n_int4 = sum(u.action == "quantize" for u in plan.units)
    assert f"{n_int4:,} Linear layers of role(s): routed" in card
    assert "| group size | 32 |" in card and "| method | `rtn` |" in card
    assert "Not verified yet" in card
    fm = _front_matter(card)
    assert fm["library_name"] == "transformers"
    assert {"compressed-tensors", "int4", "w4a16"} <= set(fm["tags"])
    for p in plan.ignore:
        assert f"- `{p}`" in card
    assert "vllm serve" in card and "sglang.launch_server" in card


def test_verify_refreshes_card_and_ignores_reports(done):
    src, dst = done
    rep = verify(src, dst)
    assert rep.ok  # README.md (written by convert) is not among the checksummed files
    manifest = json.loads((dst / MANIFEST).read_text())
    assert "README.md" not in manifest["files"] and VERIFY_JSON not in manifest["files"]
    s = rep.summary()
    card = (dst / "README.md").read_text()
    assert "**PASS**" in card
    assert f"| SQNR min / mean (dB) | {s['min_sqnr_db']:.2f} / {s['mean_sqnr_db']:.2f} |" in card
    assert f"| INT4 tensors checked | {s['quantized']:,} |" in card
    assert rep.worst(1)[0].name in card
    assert verify(src, dst).ok  # the refreshed card does not break a second verify either


def test_card_without_source_uses_output_figures(done, tmp_path):
    src, dst = done
    copy = tmp_path / "out"
    copy.mkdir()
    for p in dst.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    m = json.loads((copy / MANIFEST).read_text())
    m["source"]["path"] = str(tmp_path / "gone")  # the source was deleted after conversion
    (copy / MANIFEST).write_text(json.dumps(m))
    f = card_facts(copy)
    plan = make_plan(open_checkpoint(src), ConvertOptions(group_size=32))
    assert f.sizes.source_bytes is None
    assert f.sizes.output_bytes == plan.output_bytes
    assert f.sizes.output_file_bytes == plan.output_file_bytes
    assert f.sizes.shards == len(plan.shards)


def test_hub_snapshot_names_base_model_and_revision(done):
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert hub_source(f"/h/hub/models--zai-org--GLM-5.2-FP8/snapshots/{sha}") == ("zai-org/GLM-5.2-FP8", sha)
    assert hub_source("/data/GLM-5.2-FP8") == (None, None)
    _, dst = done
    f = card_facts(dst, repo_id="me/GLM-tiny-INT4", base_model="zai-org/GLM-5.2-FP8", tp=4)
    card = render_card(f)
    fm = _front_matter(card)
    assert fm["base_model"] == "zai-org/GLM-5.2-FP8"
    assert fm["base_model_relation"] == "quantized"
    assert "vllm serve me/GLM-tiny-INT4 --tensor-parallel-size 4" in card
    assert "--model-path me/GLM-tiny-INT4 --tp 4" in card
    assert card.splitlines()[card.splitlines().index("---", 1) + 1] == "# GLM-tiny-INT4"


def test_card_serves_at_the_recorded_tp(tmp_path):
    """The serving commands use convert's --tp, not the default 8 (which is valid here too)."""
    src, dst = tmp_path / "src", tmp_path / "out"
    # expert width 512: 512 / TP is a multiple of 64 for TP 1, 2, 4 and 8
    write_checkpoint(src, tiny_config(moe_intermediate_size=512))
    convert(src, dst, ConvertOptions(group_size=32), device="cpu", tp=2)
    assert json.loads((dst / MANIFEST).read_text())["tp"] == 2
    f = card_facts(dst)
    assert f.tp == 2 and 8 in f.valid_tp
    card = (dst / "README.md").read_text()
    assert "vllm serve PATH_OR_REPO_ID --tensor-parallel-size 2" in card
    assert "--model-path PATH_OR_REPO_ID --tp 2" in card
    assert f"| weights per GPU at TP2 (even split) | {f.sizes.output_bytes // 2:,} bytes" in card
    convert(src, dst, ConvertOptions(group_size=32), device="cpu", tp=4)  # resumed: TP is no option
    assert "--tensor-parallel-size 4" in (dst / "README.md").read_text()


def test_card_records_calibration_eval_and_command(done, tmp_path):
    _, dst = done
    copy = tmp_path / "out"
    copy.mkdir()
    for p in dst.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    m = json.loads((copy / MANIFEST).read_text())
    m["command"] = "quantize convert zai-org/GLM-5.2-FP8 ./out --group-size 32"
    m["calibration"] = {"dataset": "ultrachat-200k", "samples": 512, "seq_len": 2048}
    (copy / MANIFEST).write_text(json.dumps(m))
    (copy / "eval.json").write_text(json.dumps({"summary": {"gsm8k": 0.91, "ppl": 5.4}}))
    card = write_readme(copy).read_text()
    assert "quantize convert zai-org/GLM-5.2-FP8 ./out --group-size 32" in card
    assert "dataset: ultrachat-200k, samples: 512, seq_len: 2048" in card
    assert "| gsm8k | 0.91 |" in card and "| ppl | 5.40 |" in card
