"""Group-wise INT4 weights in compressed-tensors' `pack-quantized` layout.

Names: N = out_features, K = in_features, g = group_size, G = K // g.

Symmetric round-to-nearest (the library's min-max rule, compressed-tensors
`quantization/utils/helpers.py::calculate_qparams`):

    scale[n, j] = bf16( max|W[n, jg:(j+1)g]| / 7.5 )      # bit range 15, halved
    scale       = eps(bf16) where it is 0                 # an all-zero group
    q[n, k]     = clamp(round(W[n, k] / scale[n, k // g]), -8, 7)
    W_q         = bf16( q * scale )                       # what the engines compute

e.g. a group whose largest magnitude is 3.0 gets scale 0.4; 1.0 / 0.4 = 2.5 rounds (half
to even) to 2 and dequantizes to 0.8. The division uses the bf16-rounded scale that is
stored, so dequantization reproduces the integers exactly.

Asymmetric: scale = (max - min) / 15 with min <= 0 <= max, zero_point =
round(clamp(-8 - min / scale, -8, 7)), q = clamp(round(W / scale + zp), -8, 7),
W_q = (q - zp) * scale.

On disk, per quantized Linear `<m>`:

    <m>.weight_packed      int32 (N, K/8)   value + 8 as nibbles, element j of each 8 in
                                             bits 4j..4j+3 (low nibble first)
    <m>.weight_scale       bf16  (N, G)
    <m>.weight_shape       int64 (2,)       [N, K]
    <m>.weight_zero_point  int32 (ceil(N/8), G)  only when asymmetric, packed along dim 0

Golden bytes: q = [-8, -7, ..., -1] -> nibbles 0..7 -> int32 0x76543210.
Packing goes through bytes (two nibbles per uint8, four bytes per little-endian int32),
which tests/test_int4.py proves bit-identical to compressed-tensors' `pack_to_int32`.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

__all__ = [
    "Int4Weight",
    "dequantize",
    "int4_outputs",
    "pack_int4",
    "quantize_rtn",
    "quantize_with_qparams",
    "rtn_qparams",
    "unpack_int4",
]

QMIN, QMAX = -8, 7
SCALE_DTYPE = torch.bfloat16
# gptq.refit_scales keeps each scale within these multiples of the rounding rule's (rtn_qparams
# of the weight): the range `verify` accepts from a run with --scale-refit
REFIT_RANGE = (0.75, 1.25)


class Int4Weight(NamedTuple):
    q: torch.Tensor  # int8 (N, K) in [-8, 7]
    scale: torch.Tensor  # bf16 (N, G)
    zero_point: torch.Tensor | None  # int8 (N, G) in [-8, 7], None when symmetric


def rtn_qparams(W: torch.Tensor, group_size: int, symmetric: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min-max scale (bf16, (N, G)) and zero point (int8 or None) of a float (N, K) weight."""
    N, K = W.shape
    Wg = W.float().reshape(N, K // group_size, group_size)  # (N, G, g)
    wmin = Wg.amin(dim=-1).clamp(max=0)
    wmax = Wg.amax(dim=-1).clamp(min=0)
    eps = torch.finfo(SCALE_DTYPE).eps
    # Divide by a tensor, not a Python scalar: CUDA turns `x / 7.5` into `x * (1 / 7.5)`, which
    # is not correctly rounded and made ~1% of GPU scales differ from the CPU's by one bf16 step.
    if symmetric:
        scale = (torch.maximum(-wmin, wmax) / torch.full_like(wmax, 7.5)).to(SCALE_DTYPE)
        scale = torch.where(scale == 0, torch.full_like(scale, eps), scale)
        return scale, None
    scale = ((wmax - wmin) / torch.full_like(wmax, 15.0)).to(SCALE_DTYPE)
    scale = torch.where(scale == 0, torch.full_like(scale, eps), scale)
    zp = torch.clamp(QMIN - wmin / scale.float(), QMIN, QMAX).round().to(torch.int8)
    return scale, zp


def quantize_with_qparams(W: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                          group_size: int) -> torch.Tensor:
    """int8 (N, K) codes of float W for the given per-group scale / zero point."""
    N, K = W.shape
    Wg = W.float().reshape(N, K // group_size, group_size)  # (N, G, g)
    x = Wg / scale.float().unsqueeze(-1)
    if zero_point is not None:
        x = x + zero_point.float().unsqueeze(-1)
    return torch.clamp(x, QMIN, QMAX).round().to(torch.int8).reshape(N, K)


def quantize_rtn(W: torch.Tensor, group_size: int, symmetric: bool = True) -> Int4Weight:
    """Round-to-nearest group quantization of a float (N, K) weight; K % group_size == 0."""
    scale, zp = rtn_qparams(W, group_size, symmetric)
    return Int4Weight(quantize_with_qparams(W, scale, zp, group_size), scale, zp)


def dequantize(w: Int4Weight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(N, K) weight as the serving engines reconstruct it: (q - zp) * scale in the scale dtype."""
    N, K = w.q.shape
    G = w.scale.shape[1]
    q = w.q.reshape(N, G, K // G).to(w.scale.dtype)  # (N, G, g)
    if w.zero_point is not None:
        q = q - w.zero_point.to(w.scale.dtype).unsqueeze(-1)
    return (q * w.scale.unsqueeze(-1)).reshape(N, K).to(dtype)


def pack_int4(q: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """int8 codes in [-8, 7] -> int32 words of 8 nibbles along `dim` (padded with code 0)."""
    if q.dtype != torch.int8:
        raise TypeError(f"pack_int4 expects int8 codes, got {q.dtype}")
    if dim == 0:
        return pack_int4(q.t().contiguous(), 1).t().contiguous()
    N, K = q.shape
    pad = (-K) % 8
    u = (q.to(torch.int16) + 8).to(torch.uint8)  # (N, K) nibbles 0..15
    if pad:
        u = torch.nn.functional.pad(u, (0, pad), value=0)  # padding nibbles are 0, as the library pads
    u = u.reshape(N, -1, 2)  # (N, K/2, 2)
    b = u[..., 0] | (u[..., 1] << 4)  # (N, K/2) uint8, element 2i in the low nibble
    if sys.byteorder != "little":
        b = b.reshape(N, -1, 4).flip(-1)
    return b.contiguous().view(torch.int32).reshape(N, -1)  # (N, K/8) one word per 8 nibbles


def unpack_int4(packed: torch.Tensor, K: int, dim: int = 1) -> torch.Tensor:
    """int32 words -> int8 codes (rows, K) along `dim`; inverse of pack_int4."""
    if packed.dtype != torch.int32:
        raise TypeError(f"unpack_int4 expects int32 words, got {packed.dtype}")
    if dim == 0:
        return unpack_int4(packed.t().contiguous(), K, 1).t().contiguous()
    N = packed.shape[0]
    b = packed.contiguous().view(torch.uint8).reshape(N, -1, 4)  # (N, K/8, 4) bytes
    if sys.byteorder != "little":
        b = b.flip(-1)
    b = b.reshape(N, -1)  # (N, K/2)
    u = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(N, -1)[:, :K]  # (N, K) nibbles
    return (u.to(torch.int16) - 8).to(torch.int8)


def int4_outputs(q: Int4Weight, packed: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The tensors written for one quantized Linear, in the layout's order: weight_packed,
    weight_scale, weight_shape (on the host) and, when asymmetric, weight_zero_point. Packed
    on q's device, unless `packed` holds q's codes packed already (a view of a batch's)."""
    N, K = q.q.shape
    outs = [pack_int4(q.q) if packed is None else packed, q.scale, torch.tensor([N, K], dtype=torch.int64)]
    if q.zero_point is not None:
        outs.append(pack_int4(q.zero_point, dim=0))
    return outs
