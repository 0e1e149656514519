"""scripts/bench_sglang_moe.py's parts that need neither SGLang nor a GPU: the plain-torch
moe-align (the GPU run's fallback, and what its check compares SGLang's against), our tensors
through a safetensors shard and back, the Triton W4A16 kernel's reading of SGLang's repacked
layout against our dequantize, the float64 reference, the strict JSON and the import-only stubs.
The SGLang layer itself runs in the script's own `--device cpu --tiny` mode (Triton's
interpreter, SGLang installed) and on the GPU."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_sglang_moe as bsm

from quantize.rounding.int4 import dequantize, quantize_rtn

SHAPE = bsm.MoEShape(E=4, H=256, I=128, top_k=2)


def _align_loop(ids: torch.Tensor, E: int, block: int) -> tuple[list[int], list[int]]:
    """The "+1 offset" alignment written out: pairs bucket by bucket in flat order, each bucket
    padded to a multiple of `block` with numel; one expert id (bucket - 1) per block."""
    flat = ids.reshape(-1).tolist()
    buckets: list[list[int]] = [[] for _ in range(E + 1)]
    for i, e in enumerate(flat):
        buckets[e + 1].append(i)
    sorted_ids, expert_ids = [], []
    for b, members in enumerate(buckets):
        padded = -(-len(members) // block) * block
        sorted_ids += members + [len(flat)] * (padded - len(members))
        expert_ids += [b - 1] * (padded // block)
    return sorted_ids, expert_ids


def _align_torch(ids: torch.Tensor, E: int, block: int) -> tuple:
    bufs = bsm.align_buffers(ids, E, block)
    bsm.moe_align_block_size_torch(ids, E + 1, block, *bufs, True)
    return bufs


@pytest.mark.parametrize("E,T,top_k,block", [(4, 1, 2, 2), (16, 7, 4, 16), (256, 8, 8, 16),
                                             (256, 64, 8, 64), (33, 50, 3, 5)])
def test_moe_align_torch_equals_the_loop(E, T, top_k, block):
    gen = torch.Generator().manual_seed(E * 1000 + T)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)]).int()
    ids[0, 0] = -1  # an EP-filtered pair: bucket 0, expert id -1
    sorted_ids, expert_ids, total, cumsum = _align_torch(ids, E, block)
    want_sorted, want_experts = _align_loop(ids, E, block)
    n = len(want_sorted)
    assert int(total[0]) == n
    assert sorted_ids[:n].tolist() == want_sorted
    assert (sorted_ids[n:] == ids.numel()).all()  # past the total: padding only
    assert expert_ids[:n // block].tolist() == want_experts
    assert (expert_ids[n // block:] == -1).all()
    assert cumsum[E + 1] == n


def test_moe_align_torch_docstring_example():
    ids = torch.tensor([[2, 3], [1, 2]], dtype=torch.int32)
    sorted_ids, expert_ids, total, _ = _align_torch(ids, 4, 2)
    assert int(total[0]) == 6
    assert sorted_ids[:6].tolist() == [2, 4, 0, 3, 1, 4]
    assert expert_ids[:3].tolist() == [1, 2, 3]


def test_align_semantics_differ_ignores_order_in_a_block_and_sees_the_rest():
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(9)]).int()
    a = _align_torch(ids, 16, 4)[:3]
    total = int(a[2][0])
    b = [t.clone() for t in a]
    b[0][:4] = b[0][:4].flip(0)  # the first block's pairs in another order: same block content
    assert bsm.align_semantics_differ(a, b, ids.numel(), 4) is None
    c = [t.clone() for t in a]
    c[0][[0, total - 1]] = c[0][[total - 1, 0]]  # a pair moved to another block
    assert "block holds" in bsm.align_semantics_differ(a, c, ids.numel(), 4)
    d = [t.clone() for t in a]
    d[1][0] += 1
    assert "expert_ids" in bsm.align_semantics_differ(a, d, ids.numel(), 4)
    e = [t.clone() for t in a]
    e[2][0] += 4
    assert "num_tokens_post_pad" in bsm.align_semantics_differ(a, e, ids.numel(), 4)


def test_fp8_source_and_its_dequantization():
    src = bsm.make_fp8_experts(SHAPE, torch.device("cpu"), seed=0)
    assert src.w13.shape == (4, 256, 256) and src.w13_scale_inv.shape == (4, 2, 2)
    assert src.w2.shape == (4, 256, 128) and src.w2_scale_inv.shape == (4, 2, 1)
    # every 128x128 block's largest magnitude lands on e4m3's largest value
    blocks = src.w13[1].float().abs().reshape(2, 128, 2, 128).amax(dim=(1, 3))
    assert torch.equal(blocks, torch.full_like(blocks, bsm.E4M3_MAX))
    gate, up, down = src.dequantized(1)
    w, s = src.source(1, "up_proj")
    assert torch.equal(w.view(torch.uint8), src.w13[1, 128:].view(torch.uint8))
    assert torch.equal(s, src.w13_scale_inv[1, 1:])
    # one float32 product per element (quantize.source.fp8), widened
    assert torch.equal(up, (src.w13[1, 128:].float().reshape(128, 2, 128)
                            * src.w13_scale_inv[1, 1][None, :, None]).reshape(128, 256).double())
    assert gate.dtype == down.dtype == torch.float64 and down.shape == (256, 128)


def test_our_tensors_through_a_shard_and_back(tmp_path):
    src = bsm.make_fp8_experts(SHAPE, torch.device("cpu"), seed=1)
    ckpt = bsm.convert_experts(src, 32)
    assert len(ckpt) == SHAPE.E * 3 * 3
    name = f"{bsm.PREFIX}.3.down_proj"
    assert ckpt[f"{name}.weight_packed"].dtype == torch.int32
    assert ckpt[f"{name}.weight_packed"].shape == (256, 128 // 8)
    assert ckpt[f"{name}.weight_scale"].shape == (256, 128 // 32)
    assert ckpt[f"{name}.weight_shape"].tolist() == [256, 128]
    kept = {k: v.clone() for k, v in ckpt.items()}
    names = [n for n in ckpt if ".1." in n or ".2." in n]
    rt = bsm.shard_round_trip(ckpt, names, tmp_path)
    assert rt["equal"] and rt["tensors"] == 18 and not rt["unequal"]
    assert rt["file_bytes"] > sum(kept[n].numel() * kept[n].element_size() for n in names)
    assert not any(tmp_path.iterdir())  # the shard is removed once read back
    for n, t in kept.items():
        assert ckpt[n].dtype == t.dtype and torch.equal(ckpt[n], t)


def _sglang_layout(ckpt: dict, E: int, I: int):
    """What FusedMoE.weight_loader and CompressedTensorsWNA16TritonMoE leave for the Triton
    kernel, in plain torch (sglang 0.5.23: layer.py loads w13 = [gate; up] transposed, the
    repack transposes back and views the int32 words as bytes)."""
    def t(proj, s, e):
        return ckpt[f"{bsm.PREFIX}.{e}.{proj}.{s}"]
    loaded = types.SimpleNamespace()
    for s in ("weight_packed", "weight_scale"):
        w13 = torch.stack([torch.cat([t("gate_proj", s, e), t("up_proj", s, e)]).t() for e in range(E)])
        w2 = torch.stack([t("down_proj", s, e).t() for e in range(E)])
        setattr(loaded, f"w13_{s}", w13)  # (E, H/8 or H/g, 2I)
        setattr(loaded, f"w2_{s}", w2)  # (E, I/8 or I/g, H)
    repacked = types.SimpleNamespace(
        w13_weight_packed=loaded.w13_weight_packed.transpose(1, 2).contiguous().view(torch.uint8),
        w2_weight_packed=loaded.w2_weight_packed.transpose(1, 2).contiguous().view(torch.uint8),
        w13_weight_scale=loaded.w13_weight_scale.transpose(1, 2).contiguous(),
        w2_weight_scale=loaded.w2_weight_scale.transpose(1, 2).contiguous())
    return loaded, repacked


@pytest.mark.parametrize("g", [32, 128])
def test_the_triton_kernels_reading_of_the_repacked_layout_is_our_dequantize(g):
    src = bsm.make_fp8_experts(SHAPE, torch.device("cpu"), seed=2)
    ckpt = bsm.convert_experts(src, g)
    loaded, repacked = _sglang_layout(ckpt, SHAPE.E, SHAPE.I)
    assert repacked.w13_weight_packed.shape == (SHAPE.E, 2 * SHAPE.I, SHAPE.H // 2)
    assert bsm.loaded_equal_file(loaded, ckpt, SHAPE.E) == []
    assert bsm.repacked_equal_ours(repacked, ckpt, SHAPE.E, SHAPE.I, g) == []
    # the same check sees a swapped nibble order, gate/up order, and a file tensor changed
    kept = repacked.w2_weight_packed[1].clone()
    repacked.w2_weight_packed[1] = (kept >> 4) | (kept << 4)
    assert bsm.repacked_equal_ours(repacked, ckpt, SHAPE.E, SHAPE.I, g) == ["1.down_proj"]
    repacked.w2_weight_packed[1] = kept
    w13 = repacked.w13_weight_packed[2].clone()
    repacked.w13_weight_packed[2] = torch.cat([w13[SHAPE.I:], w13[:SHAPE.I]])
    assert bsm.repacked_equal_ours(repacked, ckpt, SHAPE.E, SHAPE.I, g) == ["2.gate_proj", "2.up_proj"]
    ckpt[f"{bsm.PREFIX}.0.up_proj.weight_scale"] = ckpt[f"{bsm.PREFIX}.0.up_proj.weight_scale"] * 2
    assert bsm.loaded_equal_file(loaded, ckpt, SHAPE.E) == ["w13_weight_scale[0]"]


def test_triton_w4a16_weight_on_the_edge_codes():
    """Codes -8 and 7 and a group of zeros: the kernel's (nibble - 8) * scale, in bf16."""
    W = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    W[:, :32] = 0.0
    W[3, 40], W[3, 41] = -1.0, 7 / 8  # scale 1/7.5 rounds: -8 and 7 after clamping
    q = quantize_rtn(W, 32)
    assert q.q.min() == -8 and q.q.max() == 7
    u8 = (q.q.to(torch.int16) + 8).to(torch.uint8).reshape(64, 128, 2)
    b = u8[..., 0] | (u8[..., 1] << 4)  # (N, K/2): element 2j in the low nibble
    assert torch.equal(bsm.triton_w4a16_weight(b, q.scale, 32), dequantize(q, torch.bfloat16))


def test_moe_reference_equals_a_per_token_loop():
    gen = torch.Generator().manual_seed(5)
    E, H, I, T, k = 5, 16, 8, 6, 2
    experts = [tuple(torch.randn(*s, generator=gen, dtype=torch.float64)
                     for s in ((I, H), (I, H), (H, I))) for _ in range(E)]
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).int()
    w = torch.rand(T, k, generator=gen)
    y = bsm.moe_reference(x, w, ids, lambda e: experts[e])
    for t in range(T):
        want = torch.zeros(H, dtype=torch.float64)
        for j in range(k):
            Wg, Wu, Wd = experts[int(ids[t, j])]
            xt = x[t].double()
            want += float(w[t, j]) * (Wd @ (F.silu(Wg @ xt) * (Wu @ xt)))
        assert torch.allclose(y[t], want, rtol=1e-12, atol=1e-12)


def test_rel_errors():
    ref = torch.tensor([[3.0, 4.0], [1.0, 0.0]], dtype=torch.float64)
    y = ref + torch.tensor([[0.0, 0.05], [0.0, 0.2]], dtype=torch.float64)
    e = bsm.rel_errors(y, ref)
    assert math.isclose(e["max_rel"], 0.2) and math.isclose(e["mean_rel"], (0.01 + 0.2) / 2)
    assert math.isclose(e["frob_rel"], math.hypot(0.05, 0.2) / math.sqrt(26))


def test_weight_bytes_per_expert():
    # INT4: 3 H I / 2 bytes of nibbles + bf16 scales; FP8: 3 H I bytes + f32 block scales
    assert bsm.weight_bytes(bsm.GLM52, "int4_g32") == 18874368 + 2 * (4096 * 192 + 6144 * 64)
    assert bsm.weight_bytes(bsm.GLM52, "int4_g128") == 18874368 + 2 * (4096 * 48 + 6144 * 16)
    assert bsm.weight_bytes(bsm.GLM52, "fp8_block") == 37748736 + 4 * (32 * 48 + 48 * 16)


def test_the_result_json_is_strict(tmp_path):
    run = bsm.Run(tmp_path / "r.json", {"stubs": {}, "x": float("nan"), "y": [float("inf"), 1.5]})
    run.fail("why")
    run.save()
    text = (tmp_path / "r.json").read_text()

    def refuse(c):
        raise ValueError(c)
    r = json.loads(text, parse_constant=refuse)  # NaN / Infinity would raise
    assert r["x"] is None and r["y"] == [None, 1.5] and r["failures"] == ["why"]


@pytest.fixture
def clean_imports():
    meta, mods = list(sys.meta_path), set(sys.modules)
    yield
    sys.meta_path[:] = meta
    for m in set(sys.modules) - mods:
        del sys.modules[m]


def test_import_only_stubs(clean_imports):
    sys.meta_path.insert(0, bsm._StubFinder({"zz_bench_stub"}))
    from zz_bench_stub.core.options import Allow  # a class, its members too

    assert Allow.ALL is Allow
    with pytest.raises(RuntimeError, match="import-only"):
        Allow()
    assert "zz_bench_stub.core.options.Allow" in bsm.STUB_TOUCHED


def test_sgl_kernel_stand_in_serves_the_two_calls(clean_imports):
    sys.meta_path.insert(0, bsm._SglKernelFinder({"sgl_kernel"}))
    import sgl_kernel

    with pytest.raises(ImportError):  # absent: SGLang then takes its own mock scalar types
        import sgl_kernel.scalar_type
    from sgl_kernel.quantization import ggml_dequantize

    with pytest.raises(RuntimeError):
        ggml_dequantize()
    ids = torch.tensor([[2, 3], [1, 2]], dtype=torch.int32)
    bufs = bsm.align_buffers(ids, 4, 2)
    old, bsm.Kernels.align = bsm.Kernels.align, bsm.moe_align_block_size_torch
    try:
        sgl_kernel.moe_align_block_size(ids, 5, 2, *bufs, True)
    finally:
        bsm.Kernels.align = old
    assert bufs[0][:6].tolist() == [2, 4, 0, 3, 1, 4]
