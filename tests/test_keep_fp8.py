"""`--keep-fp8` (issue 13, item 1): the non-target FP8 Linears stay FP8 with their scales in a
second, float-quantized config group (`format: mixed-precision`) instead of being widened to
BF16. Block FP8 (GLM-5.x) and channel FP8 (GLM-4.x): every kept weight and scale byte for byte,
compressed-tensors' own dequantization of them equal to ours, every Linear either INT4, in the
FP8 group (fused names too) or ignored, the plan's bytes the written bytes, verify passes, and
eval reading the kept FP8 weights as their exact values."""

from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.utils.match import match_name
from safetensors.torch import load_file

from quantize.check.evaluate import open_output
from quantize.check.verify import verify
from quantize.options import ConvertOptions
from quantize.pipeline import convert, source_weight
from quantize.plan import make_plan
from quantize.source.checkpoint import open_checkpoint
from quantize.source.layout import fused_names, is_ignored, linear_role


def _tensors(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("fixture", ["dsa_fp8", "glm4_fp8"])
def test_keep_fp8_keeps_the_fp8_linears_as_they_are(fixture, request, tmp_path):
    src = request.getfixturevalue(fixture)
    ckpt = open_checkpoint(src)
    out, wide = tmp_path / "keep", tmp_path / "bf16"
    convert(src, out, ConvertOptions(keep_fp8=True), device="cpu", tp=1)
    convert(src, wide, ConvertOptions(), device="cpu", tp=1)
    plan = make_plan(ckpt, ConvertOptions(keep_fp8=True), tp=1)
    got, srct = _tensors(out), _tensors(src)
    assert sum(t.numel() * t.element_size() for t in got.values()) == plan.output_bytes
    assert plan.output_bytes < make_plan(ckpt, ConvertOptions(), tp=1).output_bytes

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)  # compressed-tensors reads it back
    assert qc["format"] == "mixed-precision"
    g0, g1 = qc["config_groups"]["group_0"], qc["config_groups"]["group_1"]
    assert g0["format"] == "pack-quantized" and g1["format"] == "float-quantized"
    block = ckpt.block_size is not None
    assert g1["weights"]["strategy"] == ("block" if block else "channel")
    args = parsed.config_groups["group_1"].weights

    kept = [u for u in plan.units if u.action == "keep"]
    assert kept and {u.role for u in kept} >= {"attention", "shared"}
    for u in kept:
        w, s = got[u.source], got[u.source[: -len("weight")] + "weight_scale"]
        assert w.dtype == torch.float8_e4m3fn
        assert torch.equal(w.view(torch.uint8), srct[u.source].view(torch.uint8))
        assert torch.equal(s, srct[u.scale])
        ct = dequantize(w, s if block else s.reshape(-1, 1), args=args, dtype=torch.float32)
        ours = source_weight(ckpt, u, torch.device("cpu"))
        # block (float32 scales): the same float32 products; channel (BF16 scales): the library
        # multiplies in BF16, one correct rounding of the exact product, as ours rounded to BF16
        assert torch.equal(ct.float(), ours) if block else \
            torch.equal(ct.to(torch.bfloat16), ours.to(torch.bfloat16)), u.source
    # every Linear of the output: INT4 (group_0 by class), in group_1 (first-match, fused
    # names too), or ignored; never two of these
    for name in {n.rsplit(".", 1)[0] for n in got if n.endswith((".weight", ".weight_packed"))}:
        if "embed_tokens" in name or "norm" in name.rsplit(".", 1)[-1]:
            continue
        int4 = name + ".weight_packed" in got
        for n in fused_names(name):
            fp8 = any(match_name(n, t) for t in g1["targets"])
            ign = is_ignored(n, qc["ignore"])
            assert int4 + fp8 + ign == 1, (n, int4, fp8, ign, linear_role(name))
    assert verify(src, out).ok

    # eval's view of the output reads the FP8 weights dequantized exactly (the source's values,
    # which the BF16-widened output only approximates)
    a, b = open_output(out), open_output(wide)
    for u in kept:
        W = source_weight(ckpt, u, torch.device("cpu"))
        assert torch.equal(a.read(u.source), W), u.source
        assert torch.equal(b.read(u.source), W.to(torch.bfloat16))


def test_keep_fp8_refusals(tmp_path):
    with pytest.raises(ValueError, match="--keep-fp8 keeps the FP8 tensors"):
        ConvertOptions(keep_fp8=True, method="awq+gptq")
    from quantize.errors import QuantizeError
    from quantize.source.synth import tiny_config, write_checkpoint

    src = write_checkpoint(tmp_path / "bf16", tiny_config(), "bf16")
    with pytest.raises(QuantizeError, match="nothing to keep"):
        make_plan(open_checkpoint(src), ConvertOptions(keep_fp8=True))


def test_transformers_and_a_keep_fp8_moe(glm4_fp8, tmp_path):
    """transformers 5.x's compressed-tensors loader decompresses MoE experts for `pack-quantized`
    only; a `mixed-precision` MoE checkpoint fails in its expert mapping. Recorded as an expected
    failure of the library (vLLM reads mixed-precision; SGLang does not): when a transformers
    release loads it, this test says so and compares the logits with the BF16-widened output."""
    from transformers import AutoModelForCausalLM

    out, wide = tmp_path / "keep", tmp_path / "bf16"
    convert(glm4_fp8, out, ConvertOptions(keep_fp8=True), device="cpu", tp=1)
    convert(glm4_fp8, wide, ConvertOptions(), device="cpu", tp=1)
    try:
        m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    except (AttributeError, RuntimeError) as e:  # 5.23: AttributeError; 5.17: RuntimeError
        # ("issues during automatic conversion of the weights"), both in the expert mapping
        pytest.xfail(f"transformers cannot load a mixed-precision MoE checkpoint: {type(e).__name__}: "
                     f"{str(e)[:200]}")
    ref = AutoModelForCausalLM.from_pretrained(wide, dtype=torch.float32)
    ids = torch.randint(0, m.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)


def test_the_serving_options_together(tmp_path):
    """--keep-fp8, --scheme w4afp8, --mtp keep and GPTQ in one run (expert width 512, so W4AFP8
    serves at TP 1-2): it verifies, the MTP experts are FP8-kept (not INT4), and inspect reads
    the scheme, the FP8 group and the TP sizes back."""
    from quantize.cli.report import inspect_int4_data
    from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer

    cfg = tiny_config("glm_moe_dsa", moe_intermediate_size=512)
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-block")
    write_tokenizer(src, cfg["vocab_size"])
    out = tmp_path / "out"
    opts = ConvertOptions(method="gptq", num_samples=8, seq_len=64, group_size=128,
                          scheme="w4afp8", keep_fp8=True, mtp="keep")
    convert(src, out, opts, device="cpu", tp=1)
    rep = verify(src, out)
    assert rep.ok and not rep.problems
    mtp = cfg["num_hidden_layers"]
    got = _tensors(out)
    assert f"model.layers.{mtp}.mlp.experts.0.gate_proj.weight_scale" in got
    assert got[f"model.layers.{mtp}.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    d = inspect_int4_data(out, tp=1)
    n_int4 = (cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]) * cfg["n_routed_experts"] * 3
    assert d["scheme"] == "w4afp8" and d["int4_linears"] == {"routed": n_int4}
    assert d["fp8_kept"]["weights"]["strategy"] == "block" and d["valid_tp"] == [1, 2]
