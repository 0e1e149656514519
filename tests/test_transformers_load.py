"""transformers loads our INT4 output (compressed-tensors path) and computes the right logits.

Three models of one tiny architecture, all in float32:
  int4     our converted folder, loaded by transformers + compressed-tensors (decompressed)
  ref_q    the same architecture loaded from a BF16 folder holding *our* dequantized INT4
           weights (everything else the BF16 dequant of the source)
  ref_src  loaded from the BF16 dequant of the FP8 source (no INT4 anywhere)
int4 must equal ref_q to float rounding (same weights, two loaders); int4 must be close to
ref_src within INT4 error.
"""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from quantize.options import ConvertOptions
from quantize.pipeline import convert, source_weight
from quantize.plan import make_plan
from quantize.rounding.int4 import Int4Weight, dequantize, unpack_int4
from quantize.source.checkpoint import open_checkpoint


def _bf16_folder(path, config, tensors):
    path.mkdir()
    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


def _load(path):
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return m.eval()


CASES = [("dsa_fp8", "rtn"), ("glm4_fp8", "rtn"), ("dsa_fp8", "gptq"), ("glm4_fp8", "awq+gptq")]


@pytest.mark.parametrize("fixture, method", CASES)
def test_transformers_loads_int4_and_logits_match(fixture, method, request, tmp_path):
    """ref_q holds what our output holds (INT4 dequantized by us; every other tensor as written,
    AWQ's folded norms and routers included), so calibrated outputs are checked as tightly as
    RTN ones."""
    src_dir = request.getfixturevalue(fixture)
    if method != "rtn":  # calibration needs a tokenizer: a copy of the fixture with one
        import shutil

        from quantize.source.synth import write_tokenizer

        shutil.copytree(src_dir, tmp_path / "src")
        src_dir = tmp_path / "src"
        write_tokenizer(src_dir, json.loads((src_dir / "config.json").read_text())["vocab_size"])
    opts = ConvertOptions(method=method, **({} if method == "rtn" else {"num_samples": 8, "seq_len": 64}))
    out = tmp_path / "int4"
    convert(src_dir, out, opts, device="cpu")
    src = open_checkpoint(src_dir)
    plan = make_plan(src, opts)
    L = src.num_hidden_layers
    ref_q, ref_src = {}, {}
    for u in plan.units:
        if f"layers.{L}." in u.source:
            continue  # transformers drops the MTP layer on load
        if u.action == "copy":
            ref_src[u.source] = src.read(u.source)  # BF16 / F32 as stored
        else:
            W = source_weight(src, u, torch.device("cpu"))
            ref_src[u.source] = W.to(torch.bfloat16)
        if u.action == "quantize":
            m = u.source[: -len(".weight")]
            from safetensors import safe_open
            shard = next(s.file for s in plan.shards if u in s.units)
            with safe_open(str(out / shard), "pt") as f:
                q = unpack_int4(f.get_tensor(m + ".weight_packed"), W.shape[1])
                scale = f.get_tensor(m + ".weight_scale")
            ref_q[u.source] = dequantize(Int4Weight(q, scale, None))  # bf16(q * scale)
        else:  # as written (for AWQ: the folded norm / router; else the source's BF16)
            from safetensors import safe_open
            shard = next(s.file for s in plan.shards if u in s.units)
            with safe_open(str(out / shard), "pt") as f:
                ref_q[u.source] = f.get_tensor(u.source)
            if "awq" not in method:
                assert torch.equal(ref_q[u.source], ref_src[u.source]), u.source
    m_int4 = _load(out)
    m_q = _load(_bf16_folder(tmp_path / "ref_q", src.config, ref_q))
    m_src = _load(_bf16_folder(tmp_path / "ref_src", src.config, ref_src))
    ids = torch.randint(0, src.config["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    # the decompressed weights are exactly our dequantized INT4 weights
    sd_int4, sd_q = m_int4.state_dict(), m_q.state_dict()
    assert sd_int4.keys() == sd_q.keys()
    for k in sd_int4:
        assert torch.equal(sd_int4[k].float(), sd_q[k].float()), k
    with torch.no_grad():
        a, b, c = (m(ids).logits for m in (m_int4, m_q, m_src))
    # same weights: transformers keeps decompressed experts in BF16 and computes them there,
    # the reference upcasts them to float32; the difference is BF16 activation rounding
    # (2^-8 relative per op), far below the INT4 effect asserted next
    # Per token: within 1 % but for at most 2 of the 48 tokens, where the BF16 rounding flips a
    # near-tie top-k choice of the tiny random routers (measured: every token <= 0.5 % for
    # RTN; GPTQ / AWQ+GPTQ one token at 0.06 / 0.46, the other 47 <= 0.55 %)
    per_tok = ((a - b).norm(dim=-1) / b.norm(dim=-1)).flatten()
    assert (per_tok > 0.01).sum().item() <= 2 and per_tok.median().item() < 0.005, per_tok
    if method == "rtn":
        assert ((a - b).norm() / b.norm()).item() < 0.01, (a - b).abs().max()
    # INT4 g32 on the routed experts only: each expert weight carries ~10% error (20 dB); with
    # random tiny routers some top-2 choices flip, so the logits move by ~0.2 of their norm
    # (measured 0.20-0.21 on these fixtures).
    rel = ((a - c).norm() / c.norm()).item()
    assert 1e-3 < rel < 0.3, rel
