"""The GPTQ inner loop as one Triton kernel per block of columns, and the MSE clip search as
one kernel (CUDA only).

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

The blocks are narrow (`gptq.FUSED_WIDTHS`, 32 columns): the kernel is bound by the
instructions it issues, and each column's per-row arithmetic (the divisions, roundings and
clamps) runs on every lane that holds a piece of that row, so a narrower tile repeats it on
fewer lanes. The errors go from block to block by GEMMs (`gptq._codes_fused`).

The MSE clip search (`gptq._group_qparams`, `mse_clip`) in eager PyTorch is 21 passes of ~15
elementwise ops over the whole (B, N, K) batch, one per shrink factor p. `_mse_clip_kernel`
loads each (row, group)'s g weights and Hessian diagonal once and tries all 21 factors in
registers:

    s_p = bf16(max(-p min_g, p max_g) / 7.5)             (asym: bf16((p max - p min) / 15),
    s_p = eps(bf16) where 0                                      z_p = round(clamp(-8 - p min / s_p)))
    err_p = sum_k H_kk (w_k - bf16((q_k [- z_p]) s_p))²   q_k = clamp(round(w_k / s_p [+ z_p]))
    keep p where err_p < best                             (strict: ties keep the larger range)

with `int4.rtn_qparams`' and `quantize_with_qparams`' arithmetic op for op (IEEE division, round
half to even, the same bf16 roundings; min and max commute with the multiplication by p since
rounding is monotone) and the eager loop's summation order (`gptq._tree_sum`: adjacent pairs,
zero-padded to a power of two). It is launched without FMA contraction, so the chosen scales
are bit-identical to the eager loop's (tests/test_mse_triton.py).
"""

from __future__ import annotations

import torch

from quantize.rounding.int4 import SCALE_DTYPE

__all__ = ["available", "gptq_block", "mse_clip_qparams"]

try:  # triton ships with CUDA builds of torch; CPU builds have none and never call this
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:

    @triton.jit
    def bf16_rne(x):
        """float32 -> nearest bfloat16 (ties to even) -> float32, by bits: the rounding of torch's
        bf16 arithmetic, written out so that every backend (and the interpreter) agrees."""
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _block_kernel(W_ptr, S_ptr, Z_ptr, G_ptr, H_ptr, Q_ptr, E_ptr,
                      N, K, NG, BN, i1, count, g_stride_b, h_stride_b,
                      QMIN: tl.constexpr, QMAX: tl.constexpr, HAS_Z: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        # W (B, N, K) the working weights, row-major: the block's columns i1..i1+count read in
        # place; S / Z (B, NG, N) the group scales / zero points, transposed (a group's values
        # for a tile of rows contiguous); G (Bh, K) int32 the group of each processed column;
        # Q (B, K, N) int8 the codes, E (count, B * N) float32 the errors (column j at j * BN):
        # a column's values for a tile of rows contiguous, so each column's loads and stores
        # are coalesced
        RNE: tl.constexpr = 12582912.0  # 1.5 * 2**23: fp32 addition rounds to an integer
        pid_n = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_C)
        rmask = rows < N
        cmask = cols < count
        tile = b * N * K + rows[:, None] * K + i1 + cols[None, :]
        W = tl.load(W_ptr + tile, mask=rmask[:, None] & cmask[None, :], other=0.0)
        h_base = H_ptr + b * h_stride_b + i1 * K + i1  # Hinv[b, i1:, i1:], row stride K
        g_base = G_ptr + b * g_stride_b + i1
        s_rows = b * NG * N + rows  # (BLOCK_N,) offsets of the rows' group 0
        q_rows = b * K * N + i1 * N + rows
        e_rows = b * N + rows
        for i in range(count):
            sel = cols[None, :] == i
            w = tl.sum(tl.where(sel, W, 0.0), axis=1)  # (BLOCK_N,) column i
            grp = tl.load(g_base + i)
            s = tl.load(S_ptr + s_rows + grp * N, mask=rmask, other=1.0).to(tl.float32)
            x = tl.math.div_rn(w, s)
            if HAS_Z:
                z_i = tl.load(Z_ptr + s_rows + grp * N, mask=rmask, other=0).to(tl.float32)
                x = x + z_i
            x = tl.where(x < QMIN, QMIN, x)
            x = tl.where(x > QMAX, QMAX, x)
            q = (x + RNE) - RNE  # round half to even, as torch.round (|x| <= 8)
            if HAS_Z:
                deq = bf16_rne(q - z_i)
            else:
                deq = q
            Q = bf16_rne(deq * s)  # the product is exact in fp32: one bf16 rounding
            d = tl.load(h_base + i * K + i)
            err = tl.math.div_rn(w - Q, d)
            h = tl.load(h_base + i * K + cols, mask=cmask & (cols >= i), other=0.0)
            W = W - err[:, None] * h[None, :]
            tl.store(Q_ptr + q_rows + i * N, q.to(tl.int8), mask=rmask)
            tl.store(E_ptr + e_rows + i * BN.to(tl.int64), err, mask=rmask)

    @triton.jit
    def _mse_clip_kernel(W_ptr, H_ptr, P_ptr, S_ptr, Z_ptr, M, G, NG, g, h_stride_b,
                         NSHRINK: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
                         EPS: tl.constexpr, SYMMETRIC: tl.constexpr, CUBE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, LEVELS: tl.constexpr):
        RNE: tl.constexpr = 12582912.0  # 1.5 * 2**23: fp32 addition rounds to an integer
        m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (row, group) index
        k = tl.arange(0, BLOCK_G)
        mask = (m < M)[:, None] & (k < g)[None, :]
        w = tl.load(W_ptr + m[:, None] * g + k[None, :], mask=mask, other=0.0)  # (BLOCK_M, BLOCK_G)
        b = m // NG  # expert of the row
        j = m % G  # group within the row
        h = tl.load(H_ptr + b[:, None] * h_stride_b + j[:, None] * g + k[None, :], mask=mask, other=0.0)
        # padding lanes hold 0: min / max are clamped through 0 anyway, and their error is 0
        wmin = tl.minimum(tl.min(w, axis=1), 0.0)  # (BLOCK_M,)
        wmax = tl.maximum(tl.max(w, axis=1), 0.0)
        best = tl.zeros((BLOCK_M,), tl.float32)
        s_best = tl.zeros((BLOCK_M,), tl.float32)
        z_best = tl.zeros((BLOCK_M,), tl.float32)
        for i in range(NSHRINK):
            p = tl.load(P_ptr + i)
            lo = wmin * p  # == clamp(min(p w), max=0): rounding is monotone
            hi = wmax * p
            if SYMMETRIC:
                s = bf16_rne(tl.math.div_rn(tl.maximum(-lo, hi), tl.full((BLOCK_M,), 7.5, tl.float32)))
            else:
                s = bf16_rne(tl.math.div_rn(hi - lo, tl.full((BLOCK_M,), 15.0, tl.float32)))
            s = tl.where(s == 0, EPS, s)
            x = tl.math.div_rn(w, s[:, None] + tl.zeros_like(w))
            if not SYMMETRIC:
                z = QMIN - tl.math.div_rn(lo, s)
                z = tl.where(z < QMIN, QMIN, z)
                z = tl.where(z > QMAX, QMAX, z)
                z = (z + RNE) - RNE
                x = x + z[:, None]
            x = tl.where(x < QMIN, QMIN, x)
            x = tl.where(x > QMAX, QMAX, x)
            q = (x + RNE) - RNE  # round half to even, as torch.round (|x| <= 8)
            if not SYMMETRIC:
                q = q - z[:, None]  # exact: an integer in [-15, 15], as in bf16
            d = w - bf16_rne(q * s[:, None])  # the product is exact in fp32: one bf16 rounding
            e = d * d
            if CUBE:  # GPTQConfig.mse_norm 3: |d|^3, in the eager path's order
                e = e * tl.abs(d)
            e = e * h
            for lvl in tl.static_range(LEVELS):  # gptq._tree_sum: adjacent pairs, halving
                e = tl.reshape(e, (BLOCK_M, BLOCK_G >> (lvl + 1), 2))
                e0, e1 = tl.split(e)
                e = e0 + e1
            err = tl.reshape(e, (BLOCK_M,))
            better = (err < best) | (i == 0)  # strict: ties keep the earlier, larger range
            best = tl.where(better, err, best)
            s_best = tl.where(better, s, s_best)
            if not SYMMETRIC:
                z_best = tl.where(better, z, z_best)
        mm = m < M
        tl.store(S_ptr + m, s_best, mask=mm)
        if not SYMMETRIC:
            tl.store(Z_ptr + m, z_best.to(tl.int8), mask=mm)


# `_block_kernel`'s launch: rows of W per program and warps per program. On an H200
# (benchmarks/history/scripts/check_block_kernel_gpu.py, benchmarks/h200_block_kernel_levels.json; ten launches
# and level widths) 16 rows with 2 warps and a kernel 32 columns wide (gptq.FUSED_WIDTHS) were
# the fastest for GLM-5.2's gate/up and down batches together.
BLOCK_ROWS = 16
BLOCK_WARPS = 2


def gptq_block(Ww: torch.Tensor, St: torch.Tensor, Zt: torch.Tensor | None, group_of: torch.Tensor,
               Hinv: torch.Tensor, Qt: torch.Tensor, E: torch.Tensor, i1: int, count: int,
               qmin: int, qmax: int) -> None:
    """One block of GPTQ columns (i1 .. i1 + count) in place of the eager loop.

    Ww (B, N, K) float32 the working weights in processing order (the block's columns read,
    nothing written); St / Zt (B, G, N) bf16 / int8 the group scales (zero points) transposed;
    group_of (Bh, K) int32 the group of each processed column; Hinv (Bh, K, K) float32 upper
    Cholesky factor (Bh = B or 1: shared). Writes the codes to Qt[:, i1:i1+count] ((B, K, N)
    int8) and the errors to E ((count, B * N) float32, contiguous).
    """
    B, N, K = Ww.shape
    assert Ww.is_contiguous() and Hinv.is_contiguous() and Qt.is_contiguous() and E.is_contiguous()
    assert St.is_contiguous() and group_of.is_contiguous() and group_of.dtype == torch.int32
    width = triton.next_power_of_2(count)
    assert count <= 128 and E.shape == (count, B * N)
    grid = (triton.cdiv(N, BLOCK_ROWS), B)
    _block_kernel[grid](Ww, St, St if Zt is None else Zt, group_of, Hinv, Qt, E,
                        N, K, St.shape[1], B * N, i1, count,
                        0 if group_of.shape[0] == 1 else K, 0 if Hinv.shape[0] == 1 else K * K,
                        QMIN=float(qmin), QMAX=float(qmax), HAS_Z=Zt is not None,
                        BLOCK_N=BLOCK_ROWS, BLOCK_C=max(16, width), num_warps=BLOCK_WARPS)


def mse_clip_qparams(W: torch.Tensor, Hdiag: torch.Tensor, shrink: tuple[float, ...],
                     group_size: int, symmetric: bool, qmin: int, qmax: int, cube: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The MSE clip search of `gptq._group_qparams` in one kernel, bit-identical to it.

    W (B, N, K) float32; Hdiag (Bh, K) float32, Bh = B or 1 (shared); shrink the factors p,
    first 1.0. Returns the chosen scale (B, N, G) bf16 and zero point (B, N, G) int8 (None
    when symmetric).
    """
    assert SCALE_DTYPE == torch.bfloat16  # the kernel rounds to bf16 by bits (bf16_rne)
    B, N, K = W.shape
    g = group_size
    G = K // g
    M = B * N * G  # (row, group) pairs, each g contiguous floats of W
    W = W.contiguous()
    Hd = Hdiag.to(torch.float32).contiguous()
    P = torch.tensor(shrink, dtype=torch.float32, device=W.device)
    S = torch.empty(M, dtype=torch.float32, device=W.device)
    Z = torch.empty(M, dtype=torch.int8, device=W.device) if not symmetric else S
    BLOCK_G = triton.next_power_of_2(g)
    BLOCK_M = max(1, 4096 // BLOCK_G)
    grid = (triton.cdiv(M, BLOCK_M),)
    _mse_clip_kernel[grid](W, Hd, P, S, Z, M, G, N * G, g, 0 if Hd.shape[0] == 1 else K,
                           NSHRINK=len(shrink), QMIN=float(qmin), QMAX=float(qmax), EPS=torch.finfo(SCALE_DTYPE).eps,
                           SYMMETRIC=symmetric, CUBE=cube, BLOCK_M=BLOCK_M, BLOCK_G=BLOCK_G,
                           LEVELS=BLOCK_G.bit_length() - 1, num_warps=4, enable_fp_fusion=False)
    scale = S.to(SCALE_DTYPE).reshape(B, N, G)  # exact: the kernel's values are bf16
    return scale, None if symmetric else Z.reshape(B, N, G)
