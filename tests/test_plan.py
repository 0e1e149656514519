"""`plan` from headers alone: exact against convert, and the published GLM-5.2 figures."""

import json

import pytest

from quantize.checkpoint import open_checkpoint
from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.plan import make_plan
from quantize.synth import GLM52_CONFIG, release_tensors, tiny_config, write_checkpoint

GiB = 2**30


@pytest.fixture(scope="module")
def glm52_replica(tmp_path_factory):
    """Full-size GLM-5.2 FP8 release replica: real headers, sparse (empty) data."""
    return write_checkpoint(tmp_path_factory.mktemp("glm52"), GLM52_CONFIG, "fp8-block",
                            shard_bytes=5 * 10**9, sparse=True)


def test_glm52_release_layout_counts():
    specs = release_tensors(GLM52_CONFIG, "fp8-block")
    assert len(specs) == 118_629
    assert sum(n.endswith("weight_scale_inv") for n in specs) == 59_044


def test_plan_reproduces_published_glm52_figures(glm52_replica):
    ckpt = open_checkpoint(glm52_replica)
    plan = make_plan(ckpt, ConvertOptions(), tp=8)
    # published: 703.7 GiB FP8 -> 419.9 GiB (routed INT4 g32, rest BF16); 88.0 -> 52.5 per GPU
    assert round(plan.source_bytes / GiB, 1) == 703.7
    assert round(plan.output_bytes / GiB, 1) == 419.9
    assert round(plan.source_bytes / 8 / GiB, 1) == 88.0
    assert round(plan.output_bytes / 8 / GiB, 1) == 52.5
    # every routed expert of the 75 MoE layers + the MTP layer is a target, nothing else
    quantized = [u for u in plan.units if u.action == "quantize"]
    assert len(quantized) == 76 * 256 * 3
    assert {u.role for u in quantized} == {"routed"}
    assert any(".layers.78.mlp.experts.255.down_proj" in u.source for u in quantized)
    # 2048/8 = 256, % 64 == 0; the one warning: SGLang needs --disable-shared-experts-fusion
    # with BF16 shared experts beside INT4 routed ones (quantize/lint.py)
    assert [c.what for c in plan.checks if c.level != "ok"] == ["layout: shared experts not INT4"]
    both = make_plan(ckpt, ConvertOptions(targets=frozenset({"routed", "shared"})))
    assert all(c.level == "ok" for c in both.checks)
    assert max(s.data_bytes for s in plan.shards) <= 5 * 10**9
    # group 128 (published 387.9 GiB)
    assert round(make_plan(ckpt, ConvertOptions(group_size=128)).output_bytes / GiB, 1) == 387.9
    # --keep-fp8: routed INT4 g32, every other FP8 Linear kept FP8 (published 404.3 GiB); the
    # FP8 group's regexes cover every kept Linear and nothing INT4 (make_plan checks both)
    keep = make_plan(ckpt, ConvertOptions(keep_fp8=True))
    assert round(keep.output_bytes / GiB, 1) == 404.3
    assert round(keep.output_bytes / 8 / GiB, 1) == 50.5  # per GPU at TP 8 (even split)
    assert sum(u.action == "keep" for u in keep.units) > 0 and len(keep.fp8_targets) < 40


def test_glm4_tp8_group128_fails_marlin_rule(tmp_path):
    cfg = tiny_config("glm4_moe", moe_intermediate_size=1536, n_routed_experts=2,
                      num_hidden_layers=2, hidden_size=128, intermediate_size=256)
    src = write_checkpoint(tmp_path / "g4", cfg, "fp8-channel", sparse=True)
    ckpt = open_checkpoint(src)
    bad = make_plan(ckpt, ConvertOptions(group_size=128), tp=8)
    fail = [c for c in bad.checks if c.level == "fail"]
    assert len(fail) == 1 and "1536/8 = 192" in fail[0].detail and "--group-size 64" in fail[0].detail
    assert all(c.level == "ok" for c in make_plan(ckpt, ConvertOptions(group_size=64), tp=8).checks
               if not c.what.startswith("layout:"))


@pytest.mark.parametrize("fixture", ["dsa_fp8", "glm4_fp8", "dsa_bf16"])
def test_prediction_equals_written_bytes(fixture, request, tmp_path):
    src = request.getfixturevalue(fixture)
    opts = ConvertOptions(max_shard_size=300_000)
    plan = make_plan(open_checkpoint(src), opts)
    res = convert(src, tmp_path / "out", opts, device="cpu")
    assert len(plan.shards) > 2
    for shard in plan.shards:
        assert (tmp_path / "out" / shard.file).stat().st_size == shard.file_bytes
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == plan.output_bytes == res.plan.output_bytes


def test_shared_and_dense_targets_get_the_per_rank_group_check(tmp_path):
    """Shared-expert width 1536 / TP8 = 192 is not tiled by group 128: refused with the TP
    sizes that work; dense width 2048 / 8 = 256 is fine. Routed experts not targeted: one
    regex in `ignore`, not a name per expert."""
    cfg = tiny_config("glm4_moe", moe_intermediate_size=1536, n_routed_experts=4,
                      num_hidden_layers=2, hidden_size=128, intermediate_size=2048)
    ckpt = open_checkpoint(write_checkpoint(tmp_path / "g4", cfg, "fp8-channel", sparse=True))
    plan = make_plan(ckpt, ConvertOptions(group_size=128, targets=frozenset({"shared", "dense"})),
                     tp=8)
    by = {c.what: c for c in plan.checks}
    shared, dense = by["shared down_proj K / TP8 % group"], by["dense down_proj K / TP8 % group"]
    assert shared.level == "fail" and "1536/8 = 192" in shared.detail
    assert "fix: serve at TP 1, 2, 4" in shared.detail
    assert dense.level == "ok" and "2048/8 = 256" in dense.detail
    assert r"re:.*mlp\.experts.*" in plan.ignore
    assert not any(".experts.0." in p for p in plan.ignore), plan.ignore


def test_untileable_expert_width_fix_message_reads_well(tmp_path):
    cfg = tiny_config("glm4_moe", moe_intermediate_size=256, n_routed_experts=2,
                      num_hidden_layers=2, hidden_size=128, intermediate_size=256)
    ckpt = open_checkpoint(write_checkpoint(tmp_path / "g4", cfg, "fp8-channel", sparse=True))
    fail = [c for c in make_plan(ckpt, ConvertOptions(group_size=64), tp=8).checks
            if c.level == "fail"]
    assert len(fail) == 1 and fail[0].detail.endswith("; fix: serve at TP 1, 2, 4"), fail[0].detail
