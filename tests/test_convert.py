"""End-to-end conversion of tiny checkpoints in each release layout, checked tensor by tensor."""

import json
import re

import pytest
import torch
from safetensors import safe_open

from quantize.check.verify import verify
from quantize.options import ConvertOptions
from quantize.pipeline import convert, source_weight
from quantize.plan import make_plan
from quantize.rounding.int4 import Int4Weight, dequantize, quantize_rtn, unpack_int4
from quantize.source.checkpoint import open_checkpoint
from quantize.source.layout import fused_names, is_ignored, linear_role, module_of


def _load_all(folder):
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(idx["weight_map"].values())):
        with safe_open(str(folder / shard), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    assert set(out) == set(idx["weight_map"])
    return out


@pytest.fixture(scope="module")
def dsa_out(dsa_fp8, tmp_path_factory):
    out = tmp_path_factory.mktemp("dsa_out") / "int4"
    convert(dsa_fp8, out, ConvertOptions(max_shard_size=400_000), device="cpu")
    return out


def test_block_fp8_layout(dsa_fp8, dsa_out):
    src = open_checkpoint(dsa_fp8)
    got = _load_all(dsa_out)
    L = src.num_hidden_layers
    # no FP8 and no scales left; every routed expert (MTP layer's too) packed, nothing else
    assert not any(t.dtype == torch.float8_e4m3fn for t in got.values())
    assert not any(k.endswith("weight_scale_inv") for k in got)
    packed = {k[: -len(".weight_packed")] for k in got if k.endswith(".weight_packed")}
    routed = {module_of(n) for n in src.tensors if linear_role(module_of(n)) == "routed"}
    assert packed == routed
    assert any(f"layers.{L}.mlp.experts." in m for m in packed)
    for m in sorted(packed):
        W = source_weight(src, next(u for u in make_plan(src, ConvertOptions()).units
                                    if u.source == m + ".weight"), torch.device("cpu"))
        N, K = W.shape
        assert got[m + ".weight_packed"].dtype == torch.int32 and got[m + ".weight_packed"].shape == (N, K // 8)
        assert got[m + ".weight_scale"].dtype == torch.bfloat16 and got[m + ".weight_scale"].shape == (N, K // 32)
        assert got[m + ".weight_shape"].tolist() == [N, K]
        assert m + ".weight_zero_point" not in got
        ref = quantize_rtn(W, 32)
        assert torch.equal(unpack_int4(got[m + ".weight_packed"], K), ref.q)
        assert torch.equal(got[m + ".weight_scale"], ref.scale)
    # non-targets: FP8 -> exact BF16 dequant; BF16/F32 bit for bit
    for name, t in src.tensors.items():
        if name.endswith("weight_scale_inv") or module_of(name) in routed:
            continue
        if t.dtype == "F8_E4M3":
            s = src.read(name[: -len("weight")] + "weight_scale_inv")
            from quantize.source.fp8 import dequant_block
            assert torch.equal(got[name], dequant_block(src.read(name), s, (128, 128)).bfloat16()), name
        else:
            assert torch.equal(got[name], src.read(name)), name
    # one all-zero group (synth.py zeroes experts.0.down_proj row 1, first 32 columns)
    m = "model.layers.1.mlp.experts.0.down_proj"
    q = unpack_int4(got[m + ".weight_packed"], got[m + ".weight_shape"][1].item())
    assert q[1, :32].eq(0).all() and got[m + ".weight_scale"][1, 0] == torch.finfo(torch.bfloat16).eps


def test_scale_in_another_shard_was_used(dsa_fp8):
    src = open_checkpoint(dsa_fp8)
    w = "model.layers.1.mlp.experts.0.gate_proj.weight"
    assert src.tensors[w].file != src.tensors[w[: -len("weight")] + "weight_scale_inv"].file


def test_config_and_ignore_list(dsa_fp8, dsa_out):
    cfg = json.loads((dsa_out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed"
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"]
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (4, "int", True, "group", 32)
    assert w["actorder"] is None and group["input_activations"] is None
    for p in ("lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.gate$",
              r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", r"re:.*eh_proj.*", r"re:.*shared_head.*"):
        assert p in qc["ignore"]
    # every Linear is either a target or ignored, under the engines' fused names too
    src = open_checkpoint(dsa_fp8)
    for name, t in src.tensors.items():
        if not name.endswith(".weight") or len(t.shape) != 2 or "embed_tokens" in name:
            continue
        mod = module_of(name)
        target = linear_role(mod) == "routed"
        for n in fused_names(mod):
            assert is_ignored(n, qc["ignore"]) != target, n
    assert "fp8" not in json.dumps(qc)


def test_verify_passes_and_reports(dsa_fp8, dsa_out):
    rep = verify(dsa_fp8, dsa_out)
    assert rep.ok, rep.summary()
    s = rep.summary()
    # Gaussian weights, symmetric min-max group 32: ~20 dB (4 bits at ~5 dB/bit minus the
    # peak-to-RMS loss of absmax scaling); a scrambled layout would give < 3 dB
    assert 18 < s["min_sqnr_db"] < 23
    assert json.loads((dsa_out / "verify.json").read_text())["summary"]["ok"] is True


def test_verify_catches_a_wrong_scale(dsa_fp8, dsa_out, tmp_path):
    import shutil

    from quantize.write.shards import sha256_file

    bad = tmp_path / "bad"
    shutil.copytree(dsa_out, bad)
    idx = json.loads((bad / "model.safetensors.index.json").read_text())
    name = "model.layers.2.mlp.experts.3.up_proj.weight_scale"
    shard = bad / idx["weight_map"][name]
    tensors = {}
    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    tensors[name] = tensors[name] * 4  # a wrong scale
    from safetensors.torch import save_file
    save_file(tensors, str(shard), metadata=meta)
    rep = verify(dsa_fp8, bad)
    assert not rep.ok and any("sha256" in p for p in rep.problems)  # the manifest notices first
    # with the manifest updated (as if the tool itself had written it), the numerics catch it
    man = json.loads((bad / "quantize-manifest.json").read_text())
    man["files"][shard.name] = {"bytes": shard.stat().st_size, "sha256": sha256_file(shard)}
    (bad / "quantize-manifest.json").write_text(json.dumps(man))
    rep = verify(dsa_fp8, bad)
    failed = [t for t in rep.tensors if not t.ok]
    assert [t.name for t in failed] == ["model.layers.2.mlp.experts.3.up_proj.weight"]
    assert failed[0].sqnr_db < 5


def test_channel_fp8_glm4(glm4_fp8, tmp_path):
    out = tmp_path / "o"
    convert(glm4_fp8, out, ConvertOptions(targets=frozenset({"routed", "shared"})), device="cpu")
    got = _load_all(out)
    assert "model.layers.1.mlp.shared_experts.up_proj.weight_packed" in got
    assert "model.layers.1.self_attn.q_proj.bias" in got  # attention biases kept
    assert not any(k.endswith("weight_scale") and "packed" not in k and
                   (k[: -len("_scale")] + "_packed") not in got for k in got)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert r"re:.*shared_experts.*" not in qc["ignore"]
    assert verify(glm4_fp8, out).ok


@pytest.mark.parametrize("group_size,symmetric", [(64, False), (128, True)])
def test_bf16_source_other_group_sizes(dsa_bf16, tmp_path, group_size, symmetric):
    # experts of width 96 cannot be tiled by 64/128 at down_proj: the plan refuses with the fix
    from quantize.errors import QuantizeError
    with pytest.raises(QuantizeError, match="group size does not tile") as e:
        make_plan(open_checkpoint(dsa_bf16), ConvertOptions(group_size=group_size))
    assert "down_proj" in str(e.value) and "in_features 96" in str(e.value)
    # dense MLP (hidden 256 / intermediate 384 in-features) can be
    opts = ConvertOptions(group_size=group_size, symmetric=symmetric, targets=frozenset({"dense"}))
    convert(dsa_bf16, tmp_path / "o", opts, device="cpu")
    got = _load_all(tmp_path / "o")
    m = "model.layers.0.mlp.down_proj"
    assert got[m + ".weight_scale"].shape == (256, 384 // group_size)
    assert (m + ".weight_zero_point" in got) == (not symmetric)
    if not symmetric:
        assert got[m + ".weight_zero_point"].shape == (256 // 8, 384 // group_size)
        zp = unpack_int4(got[m + ".weight_zero_point"], 256, dim=0)
        W = open_checkpoint(dsa_bf16).read(m + ".weight").float()
        q = unpack_int4(got[m + ".weight_packed"], 384)
        Wq = dequantize(Int4Weight(q, got[m + ".weight_scale"], zp), torch.float32)
        assert ((Wq - W).norm() / W.norm()).item() < 0.1
    assert verify(dsa_bf16, tmp_path / "o").ok


def test_non_weight_files_copied_and_remote_code_not_run(dsa_fp8, tmp_path):
    import shutil
    src = tmp_path / "src"
    shutil.copytree(dsa_fp8, src)
    marker = tmp_path / "EXECUTED"
    (src / "modeling_glm.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    (src / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    cfg = json.loads((src / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_glm.GlmForCausalLM"}
    (src / "config.json").write_text(json.dumps(cfg))
    convert(src, tmp_path / "o", ConvertOptions(), device="cpu")
    for f in ("modeling_glm.py", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "o" / f).read_bytes() == (src / f).read_bytes()
    assert not marker.exists()
    assert json.loads((tmp_path / "o" / "config.json").read_text())["auto_map"] == cfg["auto_map"]


def test_shards_respect_max_size(dsa_fp8, tmp_path):
    """On the written files: each shard's tensor bytes (from its own header) at most
    --max-shard-size unless it holds a single source tensor's outputs; the names as the Hub
    expects; the planned files are the written ones."""
    from quantize.source.checkpoint import read_safetensors_header

    opts = ConvertOptions(max_shard_size=250_000)
    out = tmp_path / "o"
    convert(dsa_fp8, out, opts, device="cpu")
    plan = make_plan(open_checkpoint(dsa_fp8), opts)
    written = sorted(p.name for p in out.glob("*.safetensors"))
    assert written == sorted(s.file for s in plan.shards) and len(written) > 3
    for s in plan.shards:
        header, _ = read_safetensors_header(out / s.file, s.file)
        data = sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items()
                   if k != "__metadata__")
        assert data == s.data_bytes and (out / s.file).stat().st_size == s.file_bytes
        assert data <= 250_000 or len(s.units) == 1, (s.file, data)
        assert re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", s.file)


def test_a_plan_handed_in_is_used_and_must_match_the_options(dsa_fp8, dsa_out, tmp_path):
    """The CLI hands its plan to the pipeline (not made twice); the same bytes come out, and a
    plan made with other options or another TP is refused before anything is written."""
    ckpt = open_checkpoint(dsa_fp8)
    opts = ConvertOptions(max_shard_size=400_000)  # dsa_out's
    res = convert(dsa_fp8, tmp_path / "a", opts, device="cpu", planned=(ckpt, make_plan(ckpt, opts, 8)))
    assert res.written == [s.file for s in res.plan.shards]
    for f in sorted(p.name for p in dsa_out.glob("*.safetensors")):
        assert (tmp_path / "a" / f).read_bytes() == (dsa_out / f).read_bytes()
    for other, tp in ((ConvertOptions(max_shard_size=400_000, symmetric=False), 8), (opts, 4)):
        with pytest.raises(ValueError, match="other options or tp"):
            convert(dsa_fp8, tmp_path / "b", opts, device="cpu", planned=(ckpt, make_plan(ckpt, other, tp)))
        assert not (tmp_path / "b").exists()


def test_deterministic_bytes(dsa_fp8, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    convert(dsa_fp8, a, ConvertOptions(max_shard_size=400_000), device="cpu")
    convert(dsa_fp8, b, ConvertOptions(max_shard_size=400_000), device="cpu")
    for f in sorted(p.name for p in a.glob("*.safetensors")):
        assert (a / f).read_bytes() == (b / f).read_bytes()


@pytest.mark.parametrize("change", ["routed_scaling_factor", "rms_norm_eps", "added", "removed",
                                    "qc_group_size", "qc_ignore", "qc_unset_default"])
def test_verify_compares_every_config_field_with_the_source(dsa_fp8, dsa_out, tmp_path, change):
    """config.json edited in the output (and the manifest's checksum updated to match): the
    weights are intact but the engines would compute something else; verify names the field."""
    import shutil

    from quantize.write.shards import sha256_file

    bad = tmp_path / "bad"
    shutil.copytree(dsa_out, bad)
    cfg = json.loads((bad / "config.json").read_text())
    qc = cfg["quantization_config"]
    if change == "qc_group_size":  # what the engines would unpack the scales with
        qc["config_groups"]["group_0"]["weights"]["group_size"] *= 2
    elif change == "qc_ignore":  # a Linear left BF16 that the engines would take for INT4
        qc["ignore"] = qc["ignore"][1:]
    elif change == "qc_unset_default":  # written as compressed-tensors 0.17 writes it: same meaning
        qc["config_groups"]["group_0"]["weights"].update(observer_kwargs={}, zp_dtype=None, scale_dtype=None)
        qc["moe_sparsity_config"] = None
    elif change == "added":
        cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0}
    elif change == "removed":
        del cfg["num_experts_per_tok"]
    else:
        cfg[change] = cfg[change] * 2
    (bad / "config.json").write_text(json.dumps(cfg, indent=2))
    man = json.loads((bad / "quantize-manifest.json").read_text())
    man["files"]["config.json"] = {"bytes": (bad / "config.json").stat().st_size,
                                   "sha256": sha256_file(bad / "config.json")}
    (bad / "quantize-manifest.json").write_text(json.dumps(man))
    rep = verify(dsa_fp8, bad)
    if change == "qc_unset_default":
        assert rep.ok, rep.problems
        return
    if change.startswith("qc_"):
        field = {"qc_group_size": "config_groups.group_0.weights.group_size", "qc_ignore": "ignore"}[change]
        assert not rep.ok and any(p.startswith("config.json: quantization_config differs")
                                  and f"({field}: " in p for p in rep.problems), rep.problems
    else:
        field = {"added": "rope_scaling", "removed": "num_experts_per_tok"}.get(change, change)
        assert not rep.ok and any(p.startswith(f"config.json: {field} = ") for p in rep.problems), rep.problems
    assert len([p for p in rep.problems if p.startswith("config.json")]) == 1
    assert verify(dsa_fp8, dsa_out).ok  # the untouched output still passes


@pytest.mark.parametrize("scale", [1e-3, 1.0, 3e12, 1e20])
def test_error_stats_match_float64(scale):
    """verify's relative error and SQNR from float32 sums against the float64 formulas, on
    fresh random weights the size of a GLM-5.2 expert and their BF16 rounding plus noise:
    within 1e-6 relative (1e20: squares overflow float32, the float64 fallback); an exact
    copy gives 0 and infinite SQNR."""
    import math

    from quantize.check.verify import _error_stats

    g = torch.Generator().manual_seed(int(math.log10(scale) * 7) % 97)
    W = torch.randn(2048, 6144, generator=g) * scale
    Wq = W.bfloat16().float() + torch.randn(2048, 6144, generator=g) * scale * 1e-3
    W64, d64 = W.double(), Wq.double() - W.double()
    rel64 = (d64.norm() / W64.norm()).item()
    rel, sq = _error_stats(W, Wq)
    assert abs(rel / rel64 - 1) < 1e-6
    assert abs(sq - 20 * math.log10(1 / rel64)) < 1e-4
    assert _error_stats(W, W.clone()) == (0.0, float("inf"))
    for shape in [(5000,), (3, 7), (300, 130)]:  # a norm's vector; rows not a multiple of 128
        w = torch.randn(shape, generator=g) * scale
        wq = w + torch.randn(shape, generator=g) * scale * 1e-2
        rel64 = ((wq.double() - w.double()).norm() / w.double().norm()).item()
        assert abs(_error_stats(w, wq)[0] / rel64 - 1) < 1e-6


@pytest.mark.parametrize("symmetric", [True, False])
def test_subnormal_source_weights_convert_and_verify(dsa_bf16, tmp_path, symmetric):
    """A routed expert whose BF16 weights are all subnormal (|w| ~ 1e-39, below any bf16 group
    scale's resolution) converts to zero codes with finite scales, and verify, which compares
    relative errors, accepts exactly that (it rejected the tool's own output before)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(dsa_bf16, src)
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    f = src / idx["weight_map"][name]
    t = load_file(str(f))
    gen = torch.Generator().manual_seed(5)
    t[name] = (torch.randn(t[name].shape, generator=gen) * 1e-39).to(torch.bfloat16)
    assert t[name].float().abs().max() < torch.finfo(torch.float32).tiny and t[name].float().abs().max() > 0
    save_file(t, str(f), metadata={"format": "pt"})
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(symmetric=symmetric), device="cpu")
    got = _load_all(out)
    m = name[: -len(".weight")]
    N, K = (int(x) for x in got[m + ".weight_shape"])
    q = unpack_int4(got[m + ".weight_packed"], K)
    zp = None if symmetric else unpack_int4(got[m + ".weight_zero_point"], N, dim=0)
    Wq = dequantize(Int4Weight(q, got[m + ".weight_scale"], zp), torch.float32)
    assert torch.isfinite(got[m + ".weight_scale"].float()).all()
    assert (Wq.abs() <= torch.finfo(torch.float32).tiny).all()
    rep = verify(src, out)
    check = next(c for c in rep.tensors if c.name == name)
    assert rep.ok and check.ok and "subnormal source" in check.note, (rep.problems, check)


def test_verify_catches_a_few_doubled_group_scales(dsa_fp8, dsa_out, tmp_path):
    """4 groups of one tensor with their scale doubled (manifest updated to match, as a
    careful tamperer would): the tensor's SQNR stays above the floor, the group check fails
    it, naming how many groups and the first one."""
    import shutil

    from safetensors.torch import save_file

    from quantize.write.shards import sha256_file

    bad = tmp_path / "bad"
    shutil.copytree(dsa_out, bad)
    idx = json.loads((bad / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.experts.0.gate_proj.weight_scale"
    shard = bad / idx["weight_map"][name]
    with safe_open(str(shard), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    s = tensors[name].clone()
    s[[3, 17, 40, 71], 1] *= 2
    tensors[name] = s
    save_file(tensors, str(shard), metadata=meta)
    man = json.loads((bad / "quantize-manifest.json").read_text())  # re-vouched by the tamperer
    man["files"][shard.name] = {"bytes": shard.stat().st_size, "sha256": sha256_file(shard)}
    (bad / "quantize-manifest.json").write_text(json.dumps(man))
    failed = [t for t in verify(dsa_fp8, bad).tensors if not t.ok]
    assert [t.name for t in failed] == ["model.layers.1.mlp.experts.0.gate_proj.weight"]
    assert failed[0].sqnr_db > 12  # what the tensor-wide check alone would have passed
    assert f"4 of {s.numel():,} group scales differ" in failed[0].note and "row 3, group 1" in failed[0].note


@pytest.mark.parametrize("lag", [True, False])
def test_tensor_checks_go_on_while_the_layer_check_prepares(dsa_fp8, dsa_out, monkeypatch, lag):
    """While the layer check's classes are still being built on their thread, the tensor
    checks go on and the checked layers wait with their reads kept (up to a budget; with none,
    the next layer's checks wait for the classes instead); the layers' figures are those of a
    run in which nothing waited."""
    import threading

    from quantize.check import layercheck
    from quantize.check import verify as verify_module
    from quantize.source.layout import layer_of

    ref = verify(dsa_fp8, dsa_out, write=False)
    assert ref.ok and len(ref.layer_check["layers"]) >= 2

    go = threading.Event()
    real = layercheck.prepare

    def slow_prepare(src, seed=0):
        assert go.wait(timeout=60)
        return real(src, seed)

    monkeypatch.setattr(layercheck, "prepare", slow_prepare)
    if not lag:  # no budget: the first unit of layer 1 waits until layer 0 has run
        monkeypatch.setattr(verify_module, "_lag_bytes", lambda ahead, dev: 0)
        threading.Timer(0.5, go.set).start()
    events = []

    def on_unit(u):
        events.append(("unit", layer_of(u.source)))
        if lag and layer_of(u.source) == 1:
            go.set()

    def log(msg):
        if m := re.match(r"layer (\d+): output error", msg):
            events.append(("layer", int(m.group(1))))
        elif re.match(r"the layer check's transformers, layer classes and tokens loaded in [\d.]+ s$", msg):
            events.append(("loaded", None))  # (said from the loading thread)

    rep = verify(dsa_fp8, dsa_out, write=False, on_unit=on_unit, log=log)
    assert rep.ok, rep.problems
    first_unit_1 = events.index(("unit", 1))
    layer_0 = events.index(("layer", 0))
    assert events.count(("loaded", None)) == 1 and events.index(("loaded", None)) < layer_0
    assert (first_unit_1 < layer_0) if lag else (layer_0 < first_unit_1), events[:40]
    got = [(e["layer"], e["rel_error"], e.get("rtn_rel_error")) for e in rep.layer_check["layers"]]
    assert got == [(e["layer"], e["rel_error"], e.get("rtn_rel_error")) for e in ref.layer_check["layers"]]
    assert [t.sqnr_db for t in rep.tensors] == [t.sqnr_db for t in ref.tensors]
