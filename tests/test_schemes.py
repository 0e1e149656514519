"""Serving schemes from one pass (issue 13, item 2): `--scheme w4afp8` writes the same packed
INT4 weights as W4A16 at group 128 and declares compressed-tensors' W4AFP8 activations; the
CUTLASS W4A8 MoE rules (group 128, symmetric, hidden and per-rank expert width multiples of 256)
are checked per TP size for the real GLM shapes."""

from __future__ import annotations

import json

import pytest
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from safetensors.torch import load_file

from quantize.check.verify import verify
from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.plan import tp_checks
from quantize.source.checkpoint import Checkpoint
from quantize.source.synth import tiny_config, write_checkpoint


def test_w4afp8_is_w4a16_g128_weights_with_fp8_activations_declared(tmp_path):
    src = write_checkpoint(tmp_path / "src", tiny_config(moe_intermediate_size=512), "fp8-block")
    a, b = tmp_path / "w4a16", tmp_path / "w4afp8"
    convert(src, a, ConvertOptions(group_size=128), device="cpu", tp=1)
    convert(src, b, ConvertOptions(group_size=128, scheme="w4afp8"), device="cpu", tp=1)
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    assert shards == sorted(p.name for p in b.glob("*.safetensors"))
    for n in shards:  # every tensor, bit for bit
        ta, tb = load_file(a / n), load_file(b / n)
        assert ta.keys() == tb.keys() and all(ta[k].equal(tb[k]) for k in ta)
    qa = json.loads((a / "config.json").read_text())["quantization_config"]
    qb = json.loads((b / "config.json").read_text())["quantization_config"]
    assert qa["config_groups"]["group_0"]["input_activations"] is None
    acts = qb["config_groups"]["group_0"]["input_activations"]
    preset = PRESET_SCHEMES["W4AFP8"]
    for k in ("num_bits", "type", "symmetric", "strategy", "dynamic"):
        assert acts[k] == getattr(preset["input_activations"], k), k
        assert qb["config_groups"]["group_0"]["weights"][k] == getattr(preset["weights"], k), k
    assert qb["config_groups"]["group_0"]["weights"]["group_size"] == preset["weights"].group_size
    qb_wo = {**qb, "config_groups": {"group_0": {**qb["config_groups"]["group_0"], "input_activations": None}}}
    assert qb_wo == qa  # nothing else differs
    parsed = QuantizationConfig.model_validate(qb)  # the library reads it back
    assert parsed.config_groups["group_0"].input_activations.dynamic is True
    assert verify(src, b).ok
    card = (b / "README.md").read_text()
    assert "w4afp8" in card and "CUTLASS W4A8" in card


@pytest.mark.parametrize("kw, flag", [({"group_size": 32}, "--group-size 32"),
                                      ({"group_size": 128, "symmetric": False}, "--asymmetric")])
def test_w4afp8_refuses_what_the_kernel_cannot_take(kw, flag):
    with pytest.raises(ValueError, match="w4afp8 needs --group-size 128") as e:
        ConvertOptions(scheme="w4afp8", **kw)
    assert flag in str(e.value)


# (model, hidden, routed expert width, TP sizes W4AFP8 serves at)
GLM_SHAPES = [("GLM-5.2", 6144, 2048, [1, 2, 4, 8]), ("GLM-4.6", 5120, 1536, [1, 2]),
              ("GLM-4.5-Air", 4096, 1408, [])]


@pytest.mark.parametrize("model, hidden, width, good", GLM_SHAPES)
def test_w4afp8_tp_sizes_of_the_real_glm_shapes(model, hidden, width, good):
    probe = Checkpoint(None, model, {"hidden_size": hidden, "moe_intermediate_size": width}, {}, [],
                       {}, "fp8-block")
    opts = ConvertOptions(group_size=128, scheme="w4afp8")
    served = [t for t in (1, 2, 4, 8, 16)
              if all(c.level != "fail" for c in tp_checks(probe, opts, t, width) if "w4afp8" in c.what)]
    assert served == good
    bad = next(c for c in tp_checks(probe, opts, 16, width) if "expert width" in c.what and "w4afp8" in c.what)
    assert bad.level == "fail"
    assert (f"w4afp8 serves at TP {', '.join(map(str, good))}" in bad.detail) if good else \
        ("use --scheme w4a16" in bad.detail)


@pytest.mark.parametrize("method,mse_clip,observer", [
    ("rtn", None, "minmax"), ("gptq", None, "mse"), ("gptq", False, "minmax"),
    ("awq+gptq", None, "mse"), ("awq", None, "minmax")])
def test_the_config_names_the_observer_that_chose_the_scales(dsa_fp8, method, mse_clip, observer):
    """quantization_config's weights observer says how the group scales were chosen: "mse" when
    GPTQ's MSE clip searched each group's range (the default of gptq and awq+gptq), else
    "minmax" (it said minmax for every method; issue 27)."""
    from quantize.plan import make_plan
    from quantize.source.checkpoint import open_checkpoint
    from quantize.write.qconfig import quantization_config

    opts = ConvertOptions(method=method, mse_clip=mse_clip)
    qc = quantization_config(make_plan(open_checkpoint(dsa_fp8), opts, 1))
    assert qc["config_groups"]["group_0"]["weights"]["observer"] == observer
    QuantizationConfig.model_validate(qc)  # compressed-tensors' own schema takes it


def _built_by_compressed_tensors(plan) -> QuantizationConfig:
    """The quantization_config of a plan built with compressed-tensors' own classes (what
    quantize.write.qconfig wrote before it stopped importing them)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from quantize.source.checkpoint import SourceFormat

    o = plan.options
    observer = "mse" if o.mse_clip and "gptq" in o.method else "minmax"
    args = QuantizationArgs(num_bits=o.num_bits, type="int", symmetric=o.symmetric, strategy="group",
                            group_size=o.group_size, dynamic=False, actorder=None, observer=observer)
    acts = None
    if o.scheme == "w4afp8":
        acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token",
                                dynamic=True, observer=None)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)}
    if plan.fp8_targets:
        if plan.source_format == SourceFormat.FP8_BLOCK:
            w8 = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block",
                                  block_structure=list(plan.block_size), dynamic=False, observer=None)
            a8 = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group",
                                  group_size=128, dynamic=True, observer=None)
        else:
            w8 = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel",
                                  dynamic=False, observer=None)
            a8 = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token",
                                  dynamic=True, observer=None)
        groups["group_0"].format = "pack-quantized"
        groups["group_1"] = QuantizationScheme(targets=list(plan.fp8_targets), weights=w8,
                                               input_activations=a8, format="float-quantized")
    return QuantizationConfig(config_groups=groups,
                              format="mixed-precision" if plan.fp8_targets else "pack-quantized",
                              quantization_status="compressed", ignore=list(plan.ignore),
                              kv_cache_scheme=None)


@pytest.fixture(scope="module")
def tiled_sources(tmp_path_factory):
    """Both FP8 layouts with every Linear's in_features a multiple of 128 (group 128, W4AFP8)."""
    d = tmp_path_factory.mktemp("tiled")
    return {"fp8-block": write_checkpoint(d / "dsa", tiny_config("glm_moe_dsa", intermediate_size=512,
                                                                 moe_intermediate_size=256), "fp8-block"),
            "fp8-channel": write_checkpoint(d / "glm4", tiny_config("glm4_moe", intermediate_size=512,
                                                                    moe_intermediate_size=256), "fp8-channel")}


@pytest.mark.parametrize("source", ["fp8-block", "fp8-channel"])
@pytest.mark.parametrize("kw", [
    {}, {"method": "gptq"}, {"method": "gptq", "mse_clip": False}, {"method": "awq"},
    {"method": "awq+gptq"}, {"symmetric": False}, {"group_size": 128}, {"group_size": 64},
    {"group_size": 128, "scheme": "w4afp8"}, {"keep_fp8": True}, {"keep_fp8": True, "method": "gptq"},
    {"mtp": "keep"}, {"targets": frozenset({"routed", "shared", "dense"})}])
def test_the_written_config_is_what_compressed_tensors_builds(tiled_sources, source, kw):
    """quantization_config is written without importing compressed-tensors (seconds of
    transformers' import): compressed-tensors' own schema parses it into the very model its
    classes build for the same plan, for every option that changes it (CI: the lowest and the
    newest compressed-tensors), and verify's comparison takes the one for the other."""
    import compressed_tensors

    from quantize.plan import make_plan
    from quantize.source.checkpoint import open_checkpoint
    from quantize.write.qconfig import quantization_config, quantization_config_difference

    ckpt = open_checkpoint(tiled_sources[source])
    try:
        opts = ConvertOptions(**kw)
    except ValueError as e:  # a pairing the options refuse has no config to write
        pytest.skip(str(e))
    plan = make_plan(ckpt, opts, 1)
    ours = quantization_config(plan)
    ref = _built_by_compressed_tensors(plan)
    assert QuantizationConfig.model_validate(ours).model_dump() == ref.model_dump()
    assert ours["version"] == compressed_tensors.__version__
    assert ours["quantization_method"] == opts.method
    dumped = ref.model_dump()
    dumped["config_groups"]["group_0"]["weights"]["actorder"] = None
    assert quantization_config_difference(dumped, ours) is None  # written by the classes: verifies
    changed = json.loads(json.dumps(ours))
    changed["config_groups"]["group_0"]["weights"]["group_size"] = opts.group_size * 2
    assert quantization_config_difference(changed, ours) is not None
