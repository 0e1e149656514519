"""FP8 (e4m3) weights back to float: the two layouts the GLM releases use.

Block FP8 (GLM-5.x, DeepSeek-V3): one float32 `weight_scale_inv` per 128x128 block,
`W[i, j] = fp8[i, j] * scale_inv[i // 128, j // 128]`. The block grid rounds up, so a
[576, 6144] `kv_a_proj_with_mqa` has a [5, 48] scale and its last block row is 64 rows
tall. We expand the scale to whole blocks and slice, never infer the block from
`rows // scale_rows` (transformers 5.17 does, and dequantizes ragged shapes wrongly).
Worked number: fp8 0x40 = 2.0, scale_inv 0.5 -> 1.0.

Channel FP8 (GLM-4.x, compressed-tensors float-quantized): `weight_scale` [N, 1] (or
a scalar per tensor), `W[i, j] = fp8[i, j] * scale[i]`.

Both return float32: one correctly rounded multiplication of an e4m3 value (4 significant
bits) by the float32 scale, i.e. within 2^-24 relative of the exact product, and the same bits
on CPU and GPU.
"""

from __future__ import annotations

import torch

__all__ = ["dequant_block", "dequant_channel"]


def dequant_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(N, K) float8_e4m3fn, (ceil(N/bn), ceil(K/bk)) scale -> (N, K) float32."""
    N, K = weight.shape
    bn, bk = block
    s = scale_inv.float()
    W = weight.to(torch.float32, copy=True)  # multiplied in place: one (N, K) float32 buffer
    if N % bn == 0 and K % bk == 0:  # whole blocks: broadcast the scales (the same products)
        W.view(N // bn, bn, K // bk, bk).mul_(s[:, None, :, None])
        return W
    return W.mul_(s.repeat_interleave(bn, dim=0)[:N].repeat_interleave(bk, dim=1)[:, :K])


def dequant_channel(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(N, K) float8_e4m3fn, (N, 1) / (N,) / (1,) scale -> (N, K) float32."""
    s = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(1, 1)
    return weight.float() * s
