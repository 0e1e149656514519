"""The model card: its figures are the conversion's own, and it never breaks verify."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantize.check.verify import VERIFY_JSON, verify
from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.plan import make_plan
from quantize.publish.card import render_card
from quantize.publish.push import prepare_push
from quantize.publish.readme import card_facts, hub_source, write_readme
from quantize.source.checkpoint import open_checkpoint
from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer
from quantize.write.manifest import MANIFEST


@pytest.fixture(scope="module")
def done(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("card")
    src, dst = d / "src", d / "out"
    write_checkpoint(src, tiny_config())
    convert(src, dst, ConvertOptions(group_size=32), device="cpu")
    return src, dst


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(source, output, calibration file) of a real GPTQ conversion of a tiny glm_moe_dsa with
    its own calibration text; layer 1's router never picks expert 7, so it must fall back."""
    d = tmp_path_factory.mktemp("calibrated")
    src, dst, calib = d / "src", d / "out", d / "data" / "my-calib.txt"
    cfg = tiny_config("glm_moe_dsa")
    write_checkpoint(src, cfg, "fp8-block")
    write_tokenizer(src, cfg["vocab_size"])
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    shard = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensors[name].clone().index_fill_(0, torch.tensor([7]), -100.0)  # scores in (0, 1)
    save_file(tensors, shard, metadata={"format": "pt"})
    calib.parent.mkdir()
    calib.write_text("\n".join(f"Note {i}: the router sends token {i * 7 % 97} to two of eight "
                               "experts, and each expert sees the tokens it is sent." for i in range(200)))
    opts = ConvertOptions(method="gptq", calib=str(calib), num_samples=8, seq_len=64)
    convert(src, dst, opts, device="cpu")
    return src, dst, calib


def _front_matter(text: str) -> dict:
    """The card's metadata as the Hub reads it (huggingface_hub's own parser)."""
    from huggingface_hub import ModelCard

    assert text.startswith("---\n")
    return ModelCard(text).data.to_dict()


def test_convert_writes_card_with_plan_figures(done):
    src, dst = done
    card = (dst / "README.md").read_text()
    plan = make_plan(open_checkpoint(src), ConvertOptions(group_size=32))
    for n in (plan.source_bytes, plan.output_bytes, plan.output_file_bytes):
        assert f"{n:,} bytes" in card, n
    n_int4 = sum(u.action == "quantize" for u in plan.units)
    assert f"{n_int4:,} Linear layers of role(s): routed" in card
    assert "| group size | 32 |" in card and "| method | `rtn` |" in card
    assert "| calibration data | none (round-to-nearest needs no calibration data) |" in card
    assert "Not verified yet" in card
    fm = _front_matter(card)
    assert fm["library_name"] == "transformers"
    assert {"compressed-tensors", "int4", "w4a16"} <= set(fm["tags"])
    for p in plan.ignore:
        assert f"- `{p}`" in card
    assert "vllm serve" in card and "sglang.launch_server" in card


def test_card_gives_sglang_only_the_command_its_loader_proved(tmp_path):
    """tests/engine_sglang runs SGLang 0.5.23's own loader under the card's command: --keep-fp8
    (mixed-precision) and --asymmetric routed experts load under no flag, so the card names
    the fix instead of a command; GLM-4.x INT4 shared experts load only fused, so its card says
    to keep the fusion on (GLM-5.x's DeepSeek path builds them unfused too)."""
    from dataclasses import replace

    src = write_checkpoint(tmp_path / "src", tiny_config("glm4_moe"), "fp8-channel")
    for opts, fix in ((ConvertOptions(keep_fp8=True), "--keep-fp8"),
                      (ConvertOptions(symmetric=False), "--asymmetric")):
        out = tmp_path / fix
        convert(src, out, opts, device="cpu")
        card = (out / "README.md").read_text()
        assert "vllm serve" in card and "sglang.launch_server" not in card
        assert "SGLang 0.5.23 does not load this checkpoint" in card
        assert f"convert without {fix}" in card and "--disable-shared-experts-fusion" not in card
    out = tmp_path / "shared"
    convert(src, out, ConvertOptions(targets=frozenset({"routed", "shared"})), device="cpu")
    card = (out / "README.md").read_text()
    (command,) = [ln for ln in card.splitlines() if ln.startswith("python -m sglang.launch_server")]
    assert "--disable-shared-experts-fusion" not in command
    assert "keep its shared-experts fusion on" in card
    assert "keep its shared-experts fusion on" not in render_card(
        replace(card_facts(out), model_type="glm_moe_dsa"))


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
    plan = make_plan(open_checkpoint(src), ConvertOptions(group_size=32))
    # the manifest records the plan's figures: the card needs no source
    f = card_facts(copy)
    assert f.sizes.source_bytes == plan.source_bytes and f.sizes.by_role
    assert f.sizes.output_file_bytes == plan.output_file_bytes
    m = json.loads((copy / MANIFEST).read_text())
    del m["sizes"]  # a manifest from before the sizes were recorded, its source deleted since
    m["source"]["path"] = str(tmp_path / "gone")
    (copy / MANIFEST).write_text(json.dumps(m))
    f = card_facts(copy)
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


def test_card_calibration_is_the_reports(calibrated):
    """A real gptq run: the card's calibration rows are calibration-report.json's figures, and
    neither the report (uploaded by push) nor the card holds a local path."""
    src, dst, calib = calibrated
    text = (dst / "calibration-report.json").read_text()
    report = json.loads(text)
    c = report["calibration"]
    assert c["source"] == "my-calib.txt"
    assert c["sha256"] == hashlib.sha256(calib.read_bytes()).hexdigest()
    assert str(calib.parent) not in text and str(src.parent) not in text  # no local path at all

    assert verify(src, dst).ok
    push = prepare_push(dst, "me/GLM-tiny-gptq", write_card=False)  # what push --dry-run prints
    assert "calibration-report.json" in {f.name for f in push.files}
    for card in (push.card, (dst / "README.md").read_text()):  # and the card verify rewrote
        assert str(calib.parent) not in card
        assert "| method | `gptq` |" in card
        # routed targets only: neither GPTAQ nor the default re-fit applies, and the card says so;
        # routed experts keep the activation-weighted clip of power 3 at group 32
        assert ("| GPTQ settings | MSE clip of error power 3, channels weighted by their activations; "
                "dampening 0.1 |") in card
        assert (f"| calibration data | `my-calib.txt`, sha256 `{c['sha256']}`; "
                "1 document |") in card  # a .txt file is one document
        assert (f"| calibration tokens | {c['num_samples']} samples x {c['seq_len']} tokens = "
                f"{c['num_samples'] * c['seq_len']:,} tokens") in card
        assert (c["num_samples"], c["seq_len"]) == (8, 64)
        assert "| expert calibration | routed: each expert's statistics from the tokens" in card
        moe = [lay for lay in report["layers"] if lay.get("expert_tokens")]
        counts = sorted(n for lay in moe for n in lay["expert_tokens"])
        assert (f"| routed tokens per expert | min {counts[0]:,} / median {counts[len(counts) // 2]:,}"
                f" / max {counts[-1]:,} ({len(counts)} experts in {len(moe)} MoE layers) |") in card
        fallback = [(lay["layer"], f["expert"], f["tokens"]) for lay in moe for f in lay["fallback"]]
        assert (1, 7, 0) in fallback and counts[0] == 0
        assert (f"| expert fallbacks | {len(fallback)} of {len(counts)} experts had fewer than "
                f"{report['min_expert_tokens']} routed tokens and used all-token statistics") in card
        assert "layer 1 expert 7 (0)" in card


def test_card_records_eval_and_command(done, tmp_path):
    _, dst = done
    copy = tmp_path / "out"
    copy.mkdir()
    for p in dst.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    m = json.loads((copy / MANIFEST).read_text())
    m["command"] = "quantize convert zai-org/GLM-5.2-FP8 ./out --group-size 32"
    (copy / MANIFEST).write_text(json.dumps(m))
    (copy / "eval.json").write_text(json.dumps({"summary": {"gsm8k": 0.91, "ppl": 5.4}}))
    card = write_readme(copy).read_text()
    assert "quantize convert zai-org/GLM-5.2-FP8 ./out --group-size 32" in card
    assert "| gsm8k | 0.91 |" in card and "| ppl | 5.40 |" in card


def test_card_metadata_is_what_the_hub_understands(tmp_path):
    """Front matter through huggingface_hub's parser: the source card's license inherited,
    base_model + relation, pipeline_tag, library_name, and tags that are valid Hub tags
    (`awq+gptq` becomes `awq-gptq`); the license is recorded at convert time (the source may
    be deleted after); a source without a card gives no license key."""
    import re

    cfg = tiny_config("glm4_moe")
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-channel")
    write_tokenizer(src, cfg["vocab_size"])
    (src / "README.md").write_text("---\nlicense: mit\nlanguage:\n- en\n---\n# GLM-tiny\n")
    dst = tmp_path / "out"
    convert(src, dst, ConvertOptions(method="awq+gptq", num_samples=8, seq_len=64), device="cpu")
    fm = _front_matter((dst / "README.md").read_text())
    assert fm["license"] == "mit" and fm["pipeline_tag"] == "text-generation"
    assert fm["library_name"] == "transformers"
    assert "awq-gptq" in fm["tags"] and all(re.fullmatch(r"[a-z0-9-]+", t) for t in fm["tags"])
    f = card_facts(dst, base_model="zai-org/GLM-4.6-FP8")
    fm = _front_matter(render_card(f))
    assert fm["base_model"] == "zai-org/GLM-4.6-FP8" and fm["base_model_relation"] == "quantized"
    (src / "README.md").unlink()  # recorded at convert: the card no longer needs the source
    assert _front_matter(render_card(card_facts(dst)))["license"] == "mit"
    convert(src, dst, ConvertOptions(method="rtn"), device="cpu", overwrite=True)
    assert "license" not in _front_matter((dst / "README.md").read_text())


def test_card_names_gptqs_settings_as_the_report_records_them():
    """The card's "GPTQ settings" row from calibration-report.json: GPTAQ only where it was
    active, the scale re-fit per kind of target present, --sequential-mlp where active, keys an
    older report lacks left out."""
    from quantize.publish.readme import _gptq_settings

    base = {"mse_clip": True, "mse_norm": 3, "percdamp": 0.1}
    assert _gptq_settings({**base, "gptaq": 0.25, "gptaq_active": True,
                           "scale_refits": {"dense/shared": 3}}) == (
        "MSE clip of error power 3, channels weighted by their activations; dampening 0.1; "
        "GPTAQ 0.25 on dense and shared-expert "
        "Linears; dense and shared-expert scales re-fitted x3")
    assert _gptq_settings({**base, "gptaq": 0.25, "gptaq_active": False, "scale_refits": {}}) == \
        "MSE clip of error power 3, channels weighted by their activations; dampening 0.1"
    assert _gptq_settings({**base, "scale_refits": {"dense/shared": 2, "routed": 2}}).endswith(
        "; scales re-fitted x2")
    assert _gptq_settings({"mse_clip": False, "percdamp": 0.01}) == "min-max range (no MSE clip); dampening 0.01"
    assert _gptq_settings({**base, "mse_norm": 2, "mse_weight_power": 0.0, "scale_refits": {}}) == \
        "MSE clip of error power 2, channels alike; dampening 0.1"
    assert _gptq_settings({**base, "mse_weight_power": 0.5, "scale_refits": {}}).startswith(
        "MSE clip of error power 3, channels weighted by their activations^0.5;")
    # a report with the clip per kind of target present (clip_settings) names each kind's
    assert _gptq_settings({**base, "scale_refits": {},
                           "clip_settings": {"dense/shared": [2, 0.0], "routed": [3, 1.0]}}) == (
        "MSE clip of error power 2, channels alike (dense and shared-expert Linears), of error "
        "power 3, channels weighted by their activations (routed experts); dampening 0.1")
    assert _gptq_settings({**base, "scale_refits": {}, "clip_settings": {"routed": [3, 1.0]}}) == \
        "MSE clip of error power 3, channels weighted by their activations; dampening 0.1"
    assert _gptq_settings({**base, "sequential_mlp_active": True, "scale_refits": {}}).endswith(
        "; down_proj fitted after the rounded gate/up (dense and shared-expert MLPs)")
