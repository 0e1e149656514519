"""The lint of known-bad layouts (issue 13, item 4): each rule on a layout that breaks it, by
name, and not on the layouts we write; verify runs it on a real output, plan on the planned one,
and the card's SGLang command carries --disable-shared-experts-fusion where the lint asks."""

from __future__ import annotations

import json

from quantize.check.verify import verify
from quantize.lint import lint
from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.write.shards import sha256_file

GOOD_QC = {"config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                         "weights": {"type": "int", "group_size": 32, "symmetric": True}}}}
ROUTED = [f"model.layers.1.mlp.experts.{e}.{p}_proj.weight_packed" for e in range(2) for p in ("gate", "up")]
SHARED_BF16 = ["model.layers.1.mlp.shared_experts.gate_proj.weight"]


def _what(checks, level="fail"):
    return [c.what for c in checks if c.level == level]


def test_each_rule_by_name():
    assert lint(GOOD_QC, ROUTED) == []
    no_linear = {"config_groups": {"group_0": {**GOOD_QC["config_groups"]["group_0"],
                                               "targets": ["re:.*experts.*"]}}}
    assert _what(lint(no_linear, ROUTED)) == ["layout: a config group targeting Linear"]
    idx = ROUTED + ["model.layers.0.self_attn.indexer.weights_proj.weight_packed"]
    assert _what(lint(GOOD_QC, idx)) == ["layout: INT4 indexer.weights_proj"]
    for bad in ("model.layers.1.mlp.gate.weight_packed", "model.layers.1.post_attention_layernorm.weight_packed"):
        checks = lint(GOOD_QC, ROUTED + [bad])
        assert _what(checks) == ["layout: INT4 router or norm"] and bad[:-14] in checks[0].detail
    g32_fp8 = {"config_groups": {"group_0": {**GOOD_QC["config_groups"]["group_0"],
                                             "input_activations": {"num_bits": 8, "type": "float"}}}}
    assert _what(lint(g32_fp8, ROUTED)) == ["layout: W4AFP8 group"]
    w = lint(GOOD_QC, ROUTED + SHARED_BF16)
    assert _what(w, "warn") == ["layout: shared experts not INT4"]
    assert "--disable-shared-experts-fusion" in w[0].detail
    shared_int4 = ROUTED + ["model.layers.1.mlp.shared_experts.gate_proj.weight_packed"]
    assert lint(GOOD_QC, shared_int4) == []
    # SGLang loads neither under any flag (tests/engine_sglang): the fix, and no fusion advice
    fp8 = ROUTED + [f"model.layers.1.mlp.shared_experts.gate_proj.{s}" for s in ("weight", "weight_scale")]
    w = lint(GOOD_QC, fp8)
    assert _what(w, "warn") == ["layout: FP8 Linears kept (mixed-precision)"]
    assert "model.layers.1.mlp.shared_experts.gate_proj (+0)" in w[0].detail
    assert "For SGLang, convert without --keep-fp8" in w[0].detail
    mixed = {**GOOD_QC, "format": "mixed-precision"}  # (verify's view: the config says it)
    assert _what(lint(mixed, ROUTED), "warn") == ["layout: FP8 Linears kept (mixed-precision)"]
    zp = ROUTED + ["model.layers.1.mlp.experts.0.gate_proj.weight_zero_point"] + SHARED_BF16
    w = lint(GOOD_QC, zp)
    assert _what(w, "warn") == ["layout: zero points on the routed experts"]
    assert "For SGLang, convert without --asymmetric" in w[0].detail
    # zero points outside the routed experts: not the MoE loader's
    assert lint(GOOD_QC, ROUTED + ["model.layers.0.mlp.down_proj.weight_zero_point"]) == []


def test_plan_verify_and_card_apply_it(dsa_fp8, tmp_path):
    out = tmp_path / "o"
    convert(dsa_fp8, out, ConvertOptions(), device="cpu", tp=1)  # routed INT4, shared BF16
    card = (out / "README.md").read_text()
    assert "--disable-shared-experts-fusion" in card
    both = tmp_path / "both"
    convert(dsa_fp8, both, ConvertOptions(targets=frozenset({"routed", "shared"})), device="cpu", tp=1)
    assert "--disable-shared-experts-fusion" not in (both / "README.md").read_text()
    assert verify(dsa_fp8, out).ok

    # an output whose config lost its Linear group (the manifest agreeing): verify names the rule
    cp = out / "config.json"
    cfg = json.loads(cp.read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["targets"] = ["re:.*mlp\\.experts.*"]
    cp.write_text(json.dumps(cfg))
    mp = out / "quantize-manifest.json"
    m = json.loads(mp.read_text())
    m["files"]["config.json"] = {"bytes": cp.stat().st_size, "sha256": sha256_file(cp)}
    mp.write_text(json.dumps(m))
    rep = verify(dsa_fp8, out, write=False)
    assert not rep.ok and any("a config group targeting Linear" in p for p in rep.problems)
