"""The GPTQ inner loop as one Triton kernel per block of columns (CUDA only).

`gptq.gptq_quantize` processes K columns in blocks of `blocksize`; inside a block the columns
are sequential (each one's rounding error moves the later ones). In eager PyTorch that is
~14 small kernels per column, so a GLM-5.2 MoE layer (256 experts x (6144 + 2048) columns)
spends its time launching kernels, not computing. Here one program owns a tile of rows of the
block, W (BLOCK_N, BLOCK_C) kept in registers, and walks the columns itself:

    for i in block:   q_i = clamp(round(w_i / s_i [+ z_i]), QMIN, QMAX)
                      Q_i = float(bf16(bf16(q_i [- z_i]) * bf16(s_i)))     (the engines' value)
                      err_i = (w_i - Q_i) / Hinv[i, i]
                      W[:, j>i] -= err_i * Hinv[i, j]

Rows are independent, so tiles run in parallel over (rows, experts). The arithmetic is the
eager loop's op for op (IEEE division, round half to even, the same bf16 roundings), except
that the update may be contracted to a fused multiply-add: codes agree with the eager path
except at exact rounding ties (tests/test_gptq.py measures it on the GPU; CPU runs use the
eager loop).
"""

from __future__ import annotations

import torch

__all__ = ["available", "gptq_block"]

try:  # triton ships with CUDA builds of torch; CPU builds have none and never call this
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:

    @triton.jit
    def _bf16_rne(x):
        """float32 -> nearest bfloat16 (ties to even) -> float32, by bits: the rounding of torch's
        bf16 arithmetic, written out so that every backend (and the interpreter) agrees."""
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _block_kernel(W_ptr, S_ptr, Z_ptr, H_ptr, Q_ptr, E_ptr,
                      N, count, K, i1, q_stride_b, h_stride_b,
                      QMIN: tl.constexpr, QMAX: tl.constexpr, HAS_Z: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        RNE: tl.constexpr = 12582912.0  # 1.5 * 2**23: fp32 addition rounds to an integer
        pid_n = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_C)
        rmask = rows < N
        cmask = cols < count
        tile = b * N * count + rows[:, None] * count + cols[None, :]  # W1, S1, Z1, Err1 (B, N, count)
        m2 = rmask[:, None] & cmask[None, :]
        W = tl.load(W_ptr + tile, mask=m2, other=0.0)
        h_base = H_ptr + b * h_stride_b + i1 * K + i1  # Hinv[b, i1:, i1:], row stride K
        for i in range(count):
            sel = cols[None, :] == i
            w = tl.sum(tl.where(sel, W, 0.0), axis=1)  # (BLOCK_N,) column i
            s_bf = tl.load(S_ptr + b * N * count + rows * count + i, mask=rmask, other=1.0)
            s = s_bf.to(tl.float32)
            x = tl.math.div_rn(w, s)
            if HAS_Z:
                z_i = tl.load(Z_ptr + b * N * count + rows * count + i, mask=rmask, other=0)
                x = x + z_i.to(tl.float32)
            x = tl.where(x < QMIN, QMIN, x)
            x = tl.where(x > QMAX, QMAX, x)
            q = (x + RNE) - RNE  # round half to even, as torch.round (|x| <= 8)
            if HAS_Z:
                deq = _bf16_rne(q - z_i.to(tl.float32))
            else:
                deq = q
            Q = _bf16_rne(deq * s)  # the product is exact in fp32: one bf16 rounding
            d = tl.load(h_base + i * K + i)
            err = tl.math.div_rn(w - Q, d)
            h = tl.load(h_base + i * K + cols, mask=cmask & (cols >= i), other=0.0)
            W = W - err[:, None] * h[None, :]
            tl.store(Q_ptr + b * q_stride_b + rows * K + i1 + i, q.to(tl.int8), mask=rmask)
            tl.store(E_ptr + b * N * count + rows * count + i, err, mask=rmask)


def gptq_block(W1: torch.Tensor, s1: torch.Tensor, z1: torch.Tensor | None, Hinv: torch.Tensor,
               i1: int, q_perm: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """One block of GPTQ columns, in place of the eager loop.

    W1 (B, N, count) float32 contiguous, the block's working weights (left unspecified after);
    s1 / z1 (B, N, count) bf16 / int8 the scale (zero point) of each column's group; Hinv
    (Bh, K, K) float32 upper Cholesky factor, Bh = B or 1 (shared); codes go to
    q_perm[..., i1:i1+count] (B, N, K) int8. Returns Err1 (B, N, count) float32.
    """
    B, N, count = W1.shape
    K = Hinv.shape[-1]
    assert W1.is_contiguous() and s1.is_contiguous() and Hinv.is_contiguous() and q_perm.is_contiguous()
    assert count <= 128
    Err1 = torch.empty_like(W1)
    z = z1.contiguous() if z1 is not None else s1  # placeholder pointer when HAS_Z is off
    BLOCK_N = 32
    grid = (triton.cdiv(N, BLOCK_N), B)
    _block_kernel[grid](W1, s1, z, Hinv, q_perm, Err1, N, count, K, i1, N * K,
                        0 if Hinv.shape[0] == 1 else K * K,
                        QMIN=float(qmin), QMAX=float(qmax), HAS_Z=z1 is not None,
                        BLOCK_N=BLOCK_N, BLOCK_C=128, num_warps=4)
    return Err1
