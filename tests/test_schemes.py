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
