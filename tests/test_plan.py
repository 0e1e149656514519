"""`plan` from headers alone: exact against convert, and the published GLM-5.2 figures."""

import json

import pytest

from quantize.errors import QuantizeError
from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.plan import make_plan
from quantize.source.checkpoint import open_checkpoint
from quantize.source.synth import GLM52_CONFIG, release_tensors, tiny_config, write_checkpoint

GiB = 2**30


@pytest.fixture(scope="module")
def glm52_replica(tmp_path_factory):
    """Full-size GLM-5.2 FP8 release replica: real headers, sparse (empty) data."""
    return write_checkpoint(tmp_path_factory.mktemp("glm52"), GLM52_CONFIG, "fp8-block",
                            shard_bytes=5 * 10**9, sparse=True)


# What the GLM-5.2 FP8 release itself publishes, as far as public pages and code show it (found
# with the search tool; nothing here is derived from our replica):
# - microarch-flow/bpc_engine @ 4ca035f4ca66ab4c4917db678bf0b2792346c9ce,
#   configs/2026/glm_5_2_fp8_dsa_fp8kv.json and studies/decode_trend/models.json: zai-org/GLM-5.2-FP8
#   at revision ba978f7d347eaf65d22f1a86833408afdb953541, figures taken from that revision's
#   model.safetensors.index.json and config.json: payload 755,617,140,416 bytes, of which the MTP
#   layer (model.layers.78) 10,032,632,960; elements per dtype; parameters per group; the 21
#   layers with a full indexer (IndexShare).
# - A public Megatron-Bridge load audit of the same release (a script that reads the index and
#   every shard header and pins EXPECTED_FP8_* constants; the search index does not name its
#   repository): 118,629 tensors in 141 shards, tensors and bytes per dtype, routed-expert tensors
#   and bytes, 1,569 MTP tensors, the largest tensor 1,903,165,440 bytes.
# - vllm-project/vllm issue #46367 (GLM-5.2-FP8 on 8xB200): vLLM's loader counts 141 shards.
PUBLISHED_GLM52_FP8 = {
    "total_bytes": 755_617_140_416,
    "tensors": 118_629,
    "tensors_by_dtype": {"BF16": 465, "F32": 59_120, "F8_E4M3": 59_044},
    "bytes_by_dtype": {"BF16": 4_207_458_304, "F32": 183_490_240, "F8_E4M3": 751_226_191_872},
    "elements_by_dtype": {"BF16": 2_103_729_152, "F32": 45_872_560, "F8_E4M3": 751_226_191_872},
    "routed_expert_tensors": 116_736,  # weights + weight_scale_inv, MTP layer included
    "routed_expert_bytes": 734_618_714_112,
    "mtp_tensors": 1_569,
    "mtp_bytes": 10_032_632_960,
    "largest_tensor_bytes": 1_903_165_440,
    # parameters (weight elements) per group, the 78 decoder layers (MTP layer excluded)
    "params": {"mla": 12_871_532_544, "dense_mlp": 679_477_248, "shared_experts": 2_831_155_200,
               "indexer_wq_b_wk": 192_675_840, "indexer_weights_proj": 4_128_768,
               "routers": 117_964_800, "lm_head": 951_582_720, "per_routed_expert": 37_748_736},
    "full_indexer_layers": [0, 1, 2, *range(6, 78, 4)],
}


def test_glm52_replica_matches_what_the_release_publishes():
    """Our replica's tensor list (quantize.source.synth.release_tensors with GLM52_CONFIG) against the
    release's own published figures above: counts, bytes, dtypes, shapes by group."""
    import math
    import re

    pub = PUBLISHED_GLM52_FP8
    specs = release_tensors(GLM52_CONFIG, "fp8-block")
    width = {"F8_E4M3": 1, "BF16": 2, "F32": 4}
    nbytes = {n: math.prod(shape) * width[dt] for n, (dt, shape) in specs.items()}
    assert len(specs) == pub["tensors"]
    assert sum(nbytes.values()) == pub["total_bytes"]
    assert round(pub["total_bytes"] / GiB, 1) == 703.7  # the figure the README and plan quote
    for dt in width:
        of = [n for n in specs if specs[n][0] == dt]
        assert len(of) == pub["tensors_by_dtype"][dt], dt
        assert sum(nbytes[n] for n in of) == pub["bytes_by_dtype"][dt], dt
        assert sum(math.prod(specs[n][1]) for n in of) == pub["elements_by_dtype"][dt], dt
    # every FP8 weight has its 128x128-block F32 scale, and F32 is nothing else but the routers'
    # correction biases (as the audit requires of the release)
    fp8 = [n for n in specs if specs[n][0] == "F8_E4M3"]
    assert all(n.endswith(".weight") and specs[n + "_scale_inv"][0] == "F32" for n in fp8)
    assert all(specs[n + "_scale_inv"][1] == tuple(math.ceil(d / 128) for d in specs[n][1])
               for n in fp8)
    f32 = [n for n in specs if specs[n][0] == "F32" and not n.endswith("_scale_inv")]
    assert f32 and all(n.endswith(".mlp.gate.e_score_correction_bias") for n in f32)
    expert = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\."
                        r"(?:gate_proj|up_proj|down_proj)\.weight(?:_scale_inv)?$")
    routed = [n for n in specs if expert.match(n)]
    assert len(routed) == pub["routed_expert_tensors"]
    assert sum(nbytes[n] for n in routed) == pub["routed_expert_bytes"]
    mtp = [n for n in specs if n.startswith("model.layers.78.")]
    assert len(mtp) == pub["mtp_tensors"] and sum(nbytes[n] for n in mtp) == pub["mtp_bytes"]
    assert max(nbytes.values()) == pub["largest_tensor_bytes"]

    def params(pattern: str) -> int:
        rx = re.compile(pattern)
        return sum(math.prod(specs[n][1]) for n in specs
                   if rx.search(n) and n.endswith(".weight") and not n.startswith("model.layers.78."))

    p = pub["params"]
    assert params(r"self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.") == p["mla"]
    assert params(r"layers\.\d+\.mlp\.(gate|up|down)_proj\.") == p["dense_mlp"]
    assert params(r"mlp\.shared_experts\.") == p["shared_experts"]
    assert params(r"indexer\.(wq_b|wk)\.") == p["indexer_wq_b_wk"]
    assert params(r"indexer\.weights_proj\.") == p["indexer_weights_proj"]
    assert params(r"mlp\.gate\.weight$") == p["routers"]
    assert params(r"^lm_head\.") == p["lm_head"]
    assert params(r"^model\.layers\.3\.mlp\.experts\.0\.") == p["per_routed_expert"]
    indexed = sorted({int(n.split(".")[2]) for n in specs if ".indexer." in n})
    assert indexed == [*pub["full_indexer_layers"], 78]  # and the MTP layer's own indexer
    # not checked: the shard count (141). The release's split is its writer's; the replica's is set
    # by write_checkpoint's shard_bytes, and plan/convert never depend on the source's split.


@pytest.mark.slow
def test_plan_reproduces_published_glm52_figures(glm52_replica):
    ckpt = open_checkpoint(glm52_replica)
    plan = make_plan(ckpt, ConvertOptions(), tp=8)
    # published: 703.7 GiB FP8 -> 419.9 GiB (routed INT4 g32, rest BF16); 88.0 -> 52.5 per GPU
    assert plan.source_bytes == PUBLISHED_GLM52_FP8["total_bytes"]  # 703.7 GiB
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


def test_open_and_plan_hold_the_garbage_collector_off(dsa_fp8, monkeypatch):
    """GLM-5.2's headers and plan are ~300,000 long-lived objects: the collector's passes over
    them while they were made cost ~1 s (hundreds of collections, full ones among them).
    open_checkpoint and make_plan do their work with it paused, and leave it on afterwards,
    also when they raise; nested pauses keep it off."""
    import gc

    import quantize.plan as plan_mod
    import quantize.source.checkpoint as ck_mod
    from quantize.source.checkpoint import gc_paused

    seen: dict[str, bool] = {}

    def spy(mod, name):
        real = getattr(mod, name)

        def wrapped(*a, **kw):
            seen[name] = gc.isenabled()
            return real(*a, **kw)

        monkeypatch.setattr(mod, name, wrapped)

    spy(ck_mod, "read_tensor_table")
    spy(plan_mod, "_units")
    make_plan(open_checkpoint(dsa_fp8), ConvertOptions())
    assert seen == {"read_tensor_table": False, "_units": False} and gc.isenabled()
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(QuantizeError):
        open_checkpoint(dsa_fp8 / "no-such-folder")
    assert gc.isenabled()


def test_header_bytes_is_the_length_of_the_header_written(glm52_replica):
    """Shard.file_bytes counts each header's length without building its JSON: equal to
    len(shard_header(...)) (what ShardWriter writes) for every shard of GLM-5.2's plan and for
    names and shapes that JSON escapes or writes empty."""
    from quantize.plan import OutTensor, header_bytes, shard_header

    plan = make_plan(open_checkpoint(glm52_replica), ConvertOptions(group_size=128, symmetric=False))
    for s in plan.shards:
        assert header_bytes(s.tensors) == len(shard_header(s.tensors)), s.file
        assert s.file_bytes == len(shard_header(s.tensors)) + s.data_bytes
    odd = [OutTensor('a"b\\c', "F32", (3,)), OutTensor("é.weight", "BF16", (2, 5)),
           OutTensor("x", "I64", ()), OutTensor("t\tab\x7f", "I32", (0, 7)),
           OutTensor("", "F8_E4M3", (1, 1, 1)), OutTensor("w" * 300, "U8", (123456789,))]
    for k in range(len(odd) + 1):
        assert header_bytes(odd[:k]) == len(shard_header(odd[:k])), odd[:k]


def test_kv_cache_room_of_the_glm52_replica_beside_the_write_up(glm52_replica):
    """plan's KV-cache room per GPU (quantize/kvcache.py) on the GLM-5.2 replica at TP 8 on an
    H200: the sparse-MLA row counted from the config (kv_lora_rank 512 + rope 64; FP8: 512 e4m3
    + 4 fp32 scales + 64 BF16; + the indexer's 128 e4m3 + an fp32 scale), SGLang's default
    memory fraction, and the output's 52.5 GiB a GPU against the source's 88.0 GiB. The
    write-up reports "~1.18 M tokens of KV cache" with INT4 weights: ours is within 10 % of it
    (its engine flags and GPU memory figure are not published)."""
    from quantize.cli.report import plan_data
    from quantize.kvcache import gpu_bytes, kv_bytes_per_token, sglang_mem_fraction

    ckpt = open_checkpoint(glm52_replica)
    cfg = ckpt.config
    L = cfg["num_hidden_layers"]
    assert kv_bytes_per_token(cfg, 8, "fp8")[0] == L * (512 + 4 * 4 + 64 * 2 + 128 + 4) == 61_464
    assert kv_bytes_per_token(cfg, 8, "bf16")[0] == L * ((512 + 64) * 2 + 132)
    assert kv_bytes_per_token(cfg, 1, "fp8") == kv_bytes_per_token(cfg, 8, "fp8")  # MLA: whole row
    # SGLang's rule: 512 + 1.5 x 8192 + 1024 (TP 8) + 2 x 512 + 1536 (MLA) MiB reserved
    assert sglang_mem_fraction(143_771, 8, True) == round((143_771 - 16_384) / 143_771, 3)
    d = plan_data(make_plan(ckpt, ConvertOptions(), tp=8), gpu_bytes("h200"), None, cfg)
    kv = d["kv_cache"]
    budget = kv["mem_fraction"] * 143_771 * 2**20
    for side, w in (("source", 88.0), ("output", 52.5)):
        assert round(kv[f"weights_{side}"] / GiB, 1) == w
        for dt in ("bf16", "fp8"):
            assert kv["tokens"][side][dt] == int((budget - kv[f"weights_{side}"]) // kv["per_token"][dt])
    out_fp8 = kv["tokens"]["output"]["fp8"]
    assert 1.18e6 * 0.9 < out_fp8 < 1.18e6 * 1.1, out_fp8
    assert out_fp8 > 1.9 * kv["tokens"]["source"]["fp8"]  # INT4 weights: about twice the room
    ratio = kv["per_token"]["bf16"] / kv["per_token"]["fp8"]
    assert round(ratio, 2) == 1.63  # sparse MLA: not 2x (1.76x without the indexer)
    assert any("mem_fraction" in a or "fraction" in a for a in kv["assumptions"])


def test_kv_cache_room_of_a_gqa_model_splits_its_heads(tmp_path):
    """GLM-4.x (GQA): K and V of the KV heads each rank holds, a head replicated when there are
    fewer heads than ranks; the CLI prints the table and its assumptions."""
    from typer.testing import CliRunner

    from quantize.cli import app
    from quantize.kvcache import kv_bytes_per_token

    cfg = tiny_config("glm4_moe")  # 2 KV heads of 64, 3 layers
    assert kv_bytes_per_token(cfg, 1, "bf16")[0] == 3 * 2 * 2 * 64 * 2
    assert kv_bytes_per_token(cfg, 2, "bf16")[0] == 3 * 2 * 1 * 64 * 2
    assert kv_bytes_per_token(cfg, 8, "fp8")[0] == 3 * 2 * 1 * 64 * 1  # replicated past 2 ranks
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-channel")
    r = CliRunner().invoke(app, ["plan", str(src), "--tp", "2", "--gpu-memory", "80GiB",
                                 "--mem-fraction", "0.9"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "KV cache per GPU" in r.output and "GQA per layer" in r.output and "0.900 (given)" in r.output
    r = CliRunner().invoke(app, ["plan", str(src), "--gpu-memory", "lots"])
    assert r.exit_code == 2 and "--gpu-memory" in r.output
