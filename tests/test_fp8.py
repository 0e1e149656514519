"""FP8 dequantization against a float64 block-by-block reference, on ragged shapes."""

import math

import pytest
import torch

from quantize.source.fp8 import dequant_block, dequant_channel


@pytest.mark.parametrize("shape", [(576, 640), (160, 256), (80, 96), (300, 129), (128, 128),
                                   (256, 384)])
def test_block_dequant_matches_float64_reference(shape):
    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    N, K = shape
    w8 = (torch.randn(shape, generator=g) * 100).to(torch.float8_e4m3fn)
    s = torch.rand(math.ceil(N / 128), math.ceil(K / 128), generator=g) + 0.01
    ref = torch.empty(shape, dtype=torch.float64)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            ref[blk] = w8[blk].double() * s[i, j].double()
    out = dequant_block(w8, s, (128, 128))
    assert out.dtype == torch.float32
    # one correctly rounded float32 multiplication: within half an ulp (2^-24 relative)
    rel = ((out.double() - ref).abs() / ref.abs().clamp(min=1e-30)).max().item()
    assert rel <= 2**-24, f"max relative error {rel}"
    # fp8 x fp32 is exact in float64 (4 + 24 significant bits), so the float32 result is that
    # product rounded once: whole-block (broadcast) and ragged (expanded) paths alike
    assert torch.equal(out, ref.float())
    # multiplied in place in its own buffer: a float32 weight handed in (the fp8 values
    # widened) comes out the same and is left as it was
    wide = w8.float()
    kept = wide.clone()
    assert torch.equal(dequant_block(wide, s, (128, 128)), out) and torch.equal(wide, kept)


def test_block_dequant_ragged_last_block_is_not_stretched():
    # transformers 5.17 infers the block as rows // scale_rows (160 // 2 = 80 rows): wrong.
    w8 = torch.ones(160, 256).to(torch.float8_e4m3fn)
    s = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = dequant_block(w8, s, (128, 128))
    assert out[127, 0] == 1.0 and out[128, 0] == 3.0 and out[159, 255] == 4.0


def test_channel_dequant():
    g = torch.Generator().manual_seed(3)
    w8 = (torch.randn(48, 80, generator=g) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(48, 1, generator=g).to(torch.bfloat16)
    out = dequant_channel(w8, s)
    # 4-bit x 8-bit significands: the product is exact in float32
    assert torch.equal(out.double(), w8.double() * s.double())
    assert torch.equal(dequant_channel(w8, s.reshape(48)), out)
