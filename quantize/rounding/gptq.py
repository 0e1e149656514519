"""GPTQ: INT4 rounding that compensates each column's error on the columns not yet quantized.

Names: N = out_features, K = in_features, g = group_size, G = K // g, B = experts (any
leading dims of W, flattened). Frantar et al. 2022, "GPTQ", Algorithm 1 with the lazy batch
updates of section 3.4; the variable names follow IST-DASLab `gptq.py`.

The layer's inputs X (T, K) enter only through H = 2 XᵀX / T (`accumulate_hessian`). The output
error of a weight change E = W - Q is tr(E H Eᵀ), and quantizing column i while letting the later
columns F absorb its error is optimal when they move by

    delta_F = -(w_i - q_i) / [H_F⁻¹]_ii · [H_F⁻¹]_{i,F}

which the algorithm reads off one upper Cholesky factor Hinv = chol(H⁻¹)ᵀ, processed in
blocks of `blocksize` columns (the updates inside a block are rank-1, the block's accumulated
Err (N, blocksize) reaches the rest of W in one matmul).

Worked number: H = [[1, .5], [.5, 1]] (two inputs with correlation .5), one row w = [0.34, 0.24],
scale 0.1. Hinv = [[1.155, -0.577], [0, 1]]. Column 0 rounds to 0.3, Err = 0.04 / 1.155, and
column 1 moves by +0.04 / 1.155 · 0.577 = +0.02 to 0.26, which rounds to 0.3. Output error
eHeᵀ: RTN's e = [.04, .04] gives 0.0048, GPTQ's e = [.04, -.06] gives 0.0028.

Choices, each where llm-compressor 0.14 (`modifiers/gptq/gptq_quantize.py`) makes the same one
unless it says otherwise:

- Static groups. Every group's scale (and zero point) is computed from the ORIGINAL W up front by
  the RTN rule of `quantize.rounding.int4.rtn_qparams` (bf16 scale = absmax / 7.5), optionally shrunk by
  the MSE clip search. Taking them at group start instead (IST-DASLab's `static_groups=False`)
  would tie a group to the columns processed before it, which under activation order are
  scattered across groups, and would need a `g_idx` on disk. With static groups the order of
  processing is free: `actorder` processes columns by descending diag(H) while the groups stay in
  the original order, so nothing new is stored and the serving kernels are unchanged. Tied
  diagonals keep column order (a stable sort, the same on CPU and GPU; llm-compressor's unstable
  sort may order them otherwise, the one source of differing integers measured against it in
  BENCHMARKS.md). Static groups also make H = I give RTN exactly: Hinv is then diagonal, no error propagates, and each column is
  rounded with the very scales and arithmetic of `quantize_with_qparams`.
- Q inside the loop is the engines' reconstruction bf16((q - zp) * scale), so the error that is
  compensated is the error that is served.
- Dampening: H + percdamp · mean(diag H) · I. Where a Cholesky fails (an indefinite H from a
  rank-deficient calibration set, rounding), that expert alone is retried with percdamp × 10, up
  to `MAX_DAMP_RETRIES` times; `GPTQResult.damp` holds the fraction each expert ended with.
  (llm-compressor instead falls back to RTN for that module.)
- Dead columns (diag H = 0: the input is always 0): H_ii = 1 and W[:, i] = 0, so q = 0 there, as
  in the reference. An expert that saw no token at all has H = 0 and would come out all-zero:
  the caller must give it a fallback (all-token statistics or RTN) before calling.
- `mse_clip`: per group, the scale from the shrunk range p · [min, max], p in 1.00, 0.99, ...,
  0.80, that minimises sum_k H_kk |w_k - q_k|^n, n = `mse_norm` 2 (the output error without
  cross terms; plain MSE when H = I) or 3 (llm-compressor's imatrix_mse exponent: large errors
  weigh more, so less is clipped). Ties keep p = 1, the RTN scale. Each group's errors are added in one fixed
  order (`_tree_sum`), so CPU, CUDA and the CUDA path's single Triton kernel
  (`gptq_triton.mse_clip_qparams`, 30x the eager loop on an H200) pick the same scales bit
  for bit.
- `scale_refit` (ours; off in GPTQConfig, options.py sets the CLI's defaults from BENCHMARKS.md):
  once the codes are chosen, each row's group scales are re-fitted by least squares against
  the same damped Hessian (`refit_scales`); with n > 1 rounds the column loop runs again under
  the re-fitted scales. The codes of round 1 are plain GPTQ's; the format and the kernels are
  unchanged.
- `descend` (ours; off in GPTQConfig): passes of cyclic coordinate descent on the codes once
  GPTQ has chosen them (`descend_codes`; the idea of QuantEase, Behdin et al. 2023, and
  CDQuant, Nair and Suggala 2024). GPTQ rounds each column once, in order, and never revisits
  it; a later column's rounding can make an earlier choice no longer the best. A pass visits
  every column and moves each row's code to the grid point nearest the exact 1-D optimum of
  e Hd eᵀ (the damped Hessian, as the re-fit), when that lowers the error. The scales stay;
  the error never rises.
- `gptaq` (asymmetric calibration, Li et al. 2025 "GPTAQ"; off in GPTQConfig, as above): the layer's
  inputs in the rounded model, X̃, differ from the unrounded model's, X, by the error of the
  layers before. Fitting Ŵ X̃ to the unrounded model's outputs W X instead of to W X̃ moves the
  target: with D = 2 (X - X̃) X̃ᵀ / T beside H = 2 X̃ X̃ᵀ / T,

      |W X - Ŵ X̃|² + λ|Ŵ - W|²  =  |(W* - Ŵ) X̃|² + λ'|W* - Ŵ|² + const,   W* = W + W D Hd⁻¹

  (Hd = H + λ I, the damped Hessian GPTQ factors; the cross terms vanish because W* solves the
  ridge problem). So GPTQ's column loop run on W* minimises the asymmetric error; the group
  scales stay those of W (static groups, what verify checks), W* being a small step from it;
  `gptaq` = a in W + a · W D Hd⁻¹ takes a fraction of the step (the GPTAQ authors' code scales
  their term by 0.25). D = 0 gives plain GPTQ exactly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import torch

from quantize.rounding import gptq_triton
from quantize.rounding.int4 import (
    QMAX,
    QMIN,
    REFIT_RANGE,
    SCALE_DTYPE,
    Int4Weight,
    quantize_with_qparams,
    rtn_qparams,
)

__all__ = [
    "MAX_DAMP_RETRIES",
    "GPTQConfig",
    "GPTQResult",
    "accumulate_hessian",
    "descend_codes",
    "gptaq_target",
    "gptq_quantize",
    "xtx",
]

MAX_DAMP_RETRIES = 4  # 0.01 -> 100: past a dampening of 100x the mean diagonal H is not the problem
# 1.00, 0.99, ..., 0.80: the range of llm-compressor's mse observer (maxshrink 0.2, step 0.01)
MSE_SHRINK = tuple(1.0 - i / 100 for i in range(21))
REFIT_CHUNK_BYTES = 1 << 28  # refit_scales: experts per pass so that one float64 (b, N, K) is <= 256 MiB


@dataclass(frozen=True)
class GPTQConfig:
    # 32: the layout of the published GLM INT4 checkpoints; 64 / 128 also serve (options.py).
    group_size: int = 32
    # Symmetric is what SGLang's MoE WNA16 path asserts.
    symmetric: bool = True
    # 128: the paper's lazy-batch width; the result does not depend on it beyond float rounding.
    blocksize: int = 128
    # 1% of the mean diagonal: the default of IST-DASLab's code and of llm-compressor.
    percdamp: float = 0.01
    # Quantize the columns with the most input energy first (their errors get the most room to
    # be absorbed); free with static groups: no g_idx, nothing new for the kernels.
    actorder: bool = True
    # Off by default so H = I reproduces RTN; on trades ~21 RTN passes for smaller group errors.
    mse_clip: bool = False
    # the error the clip search minimises: sum_k H_kk |w_k - q_k|^mse_norm, 2 or 3 (a higher
    # power weighs a group's largest errors more, so it clips less; llm-compressor's
    # imatrix_mse observer uses 3; the CLI's default is 3: options.py)
    mse_norm: int = 2
    # the power a of each input channel's weight in that sum, sum_k H_kk^a |w_k - q_k|^mse_norm:
    # 1 the output error without cross terms, 0 the plain (unweighted) error of
    # llm-compressor's `mse` observer, between them the calibration's activations tempered
    # (H_kk^a for a other than 0 and 1 is a pow whose last bit may differ between CPU and CUDA,
    # so a near-tie group may pick another scale there)
    mse_weight_power: float = 1.0
    # Rounds of re-fitting: each row's group scales fitted by least squares to the codes GPTQ
    # chose, against the same damped Hessian (`refit_scales`). 1: the codes stay, the scales
    # are re-fitted; n > 1: the column loop is run again with the re-fitted scales, and they are
    # re-fitted to its codes, n times in all. 0: off (options.py: the CLI's defaults).
    scale_refit: int = 0
    # Asymmetric calibration: GPTQ fits W* = W + gptaq · W D Hd⁻¹ (the module docstring) when the
    # caller passes D; 0: off (options.py: the CLI's default), 1: the whole step.
    gptaq: float = 0.0
    # Passes of coordinate descent on the codes after each column loop (`descend_codes`): each
    # column's codes moved to the grid point that lowers e Hd eᵀ most, scales kept. 0: off.
    descend: int = 0
    # Hessian shrinkage toward its diagonal: the off-diagonal terms times (1 - shrink) before
    # dampening, i.e. GPTQ against (1 - shrink) H + shrink diag(H). The cross-channel
    # correlations are what GPTQ's compensation learns from the calibration text, and the
    # part least likely to hold on other text; 0: off (plain GPTQ), 1: RTN with H's weights.
    shrink: float = 0.0
    # CUDA: run the MSE clip search as one Triton kernel (bit-identical scales), each block's
    # column loop as one Triton kernel (same arithmetic; the update may be fused into an FMA)
    # with the errors handed on in levels (FUSED_WIDTHS: the same sums regrouped), and factor H by a
    # blocked inverse Cholesky in batched matmuls (`_factor_flipped_inplace`): the same factor
    # up to float rounding, so a code can differ where a value sits at a rounding boundary.
    # CPU: the reference path, always.
    fused: bool = True

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size must be positive, got {self.group_size}")
        if self.blocksize < 1:
            raise ValueError(f"blocksize must be positive, got {self.blocksize}")
        if self.mse_norm not in (2, 3):
            raise ValueError(f"mse_norm must be 2 or 3, got {self.mse_norm}")
        if not 0 <= self.gptaq <= 1:
            raise ValueError(f"gptaq must be in [0, 1], got {self.gptaq}")
        if not 0 <= self.mse_weight_power <= 1:
            raise ValueError(f"mse_weight_power must be in [0, 1], got {self.mse_weight_power}")
        if not self.percdamp > 0:
            raise ValueError(f"percdamp must be > 0 (a retry multiplies it), got {self.percdamp}")
        if not 0 <= self.shrink < 1:
            raise ValueError(f"shrink must be in [0, 1), got {self.shrink}")
        if not 0 <= self.descend <= 8:
            raise ValueError(f"descend must be 0 (off) to 8 passes, got {self.descend}")


class GPTQResult(NamedTuple):
    weight: Int4Weight  # q int8 (..., N, K), scale bf16 (..., N, G), zero_point int8 or None
    damp: torch.Tensor  # float32 (...H,) the percdamp fraction used per Hessian (H's lead dims)
    retries: int  # rounds of raised dampening that were needed, 0 when none


def accumulate_hessian(H: torch.Tensor, X: torch.Tensor, n_seen: torch.Tensor | int,
                       n_new: torch.Tensor | int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | int]:
    """Running mean H = 2 XᵀX / n over all tokens seen, updated with a new batch X.

    H (..., K, K) float32, X (..., T, K). `n_new` counts the real rows of X per batch element
    (default T); zero rows that pad experts to a common T add nothing to XᵀX, so passing the
    true counts keeps every expert's mean exact. Returns new (H, n_seen); inputs are untouched.
    """
    if X.shape[-1] != H.shape[-1] or H.shape[-1] != H.shape[-2]:
        raise ValueError(f"accumulate_hessian: H {tuple(H.shape)} does not fit X {tuple(X.shape)}"
                         " (need H (..., K, K) and X (..., T, K))")
    T = X.shape[-2]
    n_new = T if n_new is None else n_new
    n_total = n_seen + n_new
    XtX = xtx(X)  # (..., K, K)
    if isinstance(n_total, torch.Tensor):
        n_f = n_total.to(torch.float32).clamp(min=1)[..., None, None]
        old = torch.as_tensor(n_seen, dtype=torch.float32, device=H.device)
        old = old[..., None, None] if old.ndim else old
        H_new = H * (old / n_f) + XtX * (2.0 / n_f)
    else:
        n_f = max(n_total, 1)
        H_new = H * (n_seen / n_f) + XtX * (2.0 / n_f)
    return H_new, n_total


def xtx(X: torch.Tensor, acc: torch.Tensor | None = None, Y: torch.Tensor | None = None
        ) -> torch.Tensor:
    """float32 XᵀX of X (..., T, K), added into `acc` (..., K, K) in place when given; with
    `Y` (X's shape and dtype) the cross product XᵀY instead.

    bf16 values (8-bit mantissa) are exact products in fp32, so for bf16 inputs on CUDA the
    sums are computed by a bf16 GEMM with float32 output and float32 accumulation
    (`out_dtype`, no float32 copy of X, 2x the TF32 rate), the same sums as a float32 matmul
    up to summation order; where torch lacks that op, TF32 of a float32 copy (also exact
    products: bf16 fits TF32's 10-bit mantissa)."""
    Y = X if Y is None else Y
    if Y.shape != X.shape or Y.dtype != X.dtype:
        raise ValueError(f"xtx: Y {tuple(Y.shape)} {Y.dtype} must match X {tuple(X.shape)} {X.dtype}")
    if X.dtype == torch.bfloat16 and X.is_cuda and X.ndim in (2, 3) and _BF16_OUT[0]:
        prev = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        try:
            Xt = X.mT
            if acc is None:
                mm = torch.bmm if X.ndim == 3 else torch.mm
                return mm(Xt, Y, out_dtype=torch.float32)
            if acc.ndim == 3:
                return torch.baddbmm(acc, Xt, Y, out_dtype=torch.float32, out=acc)
            return torch.addmm(acc, Xt, Y, out_dtype=torch.float32, out=acc)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, NotImplementedError):
            _BF16_OUT[0] = False  # this torch / GPU has no bf16 -> fp32 GEMM: TF32 below
        finally:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = prev
    Xf = X.to(torch.float32)
    Yf = Xf if Y is X else Y.to(torch.float32)
    with _tf32(X.dtype == torch.bfloat16 and X.is_cuda):
        if acc is None:
            return Xf.mT @ Yf
        return acc.baddbmm_(Xf.mT, Yf) if acc.ndim == 3 else acc.addmm_(Xf.mT, Yf)


_BF16_OUT = [True]  # bf16 GEMMs with float32 output available (cleared at the first refusal)


def _group_qparams(W: torch.Tensor, Hdiag: torch.Tensor, cfg: GPTQConfig
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Static group params of W (B, N, K) from the original weight: RTN rule, optional MSE clip."""
    B, N, K = W.shape
    if cfg.mse_clip and cfg.mse_weight_power != 1.0:  # the channels' weights tempered (0: all 1)
        Hdiag = Hdiag.clamp_min(0).pow(cfg.mse_weight_power)
    if cfg.mse_clip and cfg.fused and gptq_triton.available(W):  # CUDA: one kernel, same result
        return gptq_triton.mse_clip_qparams(W, Hdiag, MSE_SHRINK, cfg.group_size, cfg.symmetric,
                                            QMIN, QMAX, cube=cfg.mse_norm == 3)
    W2 = W.reshape(B * N, K)  # rows are independent for the group rule
    scale, zp = rtn_qparams(W2, cfg.group_size, cfg.symmetric)  # (B*N, G)
    if cfg.mse_clip:
        g = cfg.group_size
        # (B, 1, G, g) per-column weights of the output error, broadcast over rows
        weight = Hdiag.expand(B, K).reshape(B, 1, K // g, g)
        best = None
        for p in MSE_SHRINK:
            # amax(p * W) == p * amax(W) in floats (rounding is monotone), so this is the RTN
            # rule on the range p * [min, max]
            s_p, z_p = rtn_qparams(W2 * p, g, cfg.symmetric) if p != 1.0 else (scale, zp)
            q = quantize_with_qparams(W2, s_p, z_p, g)
            Wq = _dequant(q.reshape(B * N, K // g, g), s_p.unsqueeze(-1),
                          None if z_p is None else z_p.unsqueeze(-1))
            d = W2.reshape(B * N, K // g, g) - Wq
            err = d.square() if cfg.mse_norm == 2 else d.square() * d.abs()  # the kernel's order
            err = _tree_sum(err.reshape(B, N, K // g, g) * weight).reshape(B * N, K // g)
            if best is None:
                best, scale_b, zp_b = err, s_p, z_p
                continue
            better = err < best  # strict: ties keep the larger (RTN) range
            best = torch.where(better, err, best)
            scale_b = torch.where(better, s_p, scale_b)
            if zp_b is not None:
                zp_b = torch.where(better, z_p, zp_b)
        scale, zp = scale_b, zp_b
    G = K // cfg.group_size
    return scale.reshape(B, N, G), None if zp is None else zp.reshape(B, N, G)


def _tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in one fixed order: adjacent pairs, halving, zero-padded to a power
    of two (adding 0 is exact). `x.sum(-1)`'s order differs between CPU and CUDA; this one is
    the same on both and is the order the Triton kernel (`gptq_triton._mse_clip_kernel`) adds
    in, so near-tie groups pick the same scale everywhere."""
    n = x.shape[-1]
    pad = (1 << (n - 1).bit_length()) - n
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def _dequant(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None) -> torch.Tensor:
    """float32 bf16((q - zp) * scale): the value the engines compute, as `int4.dequantize`."""
    x = q.to(SCALE_DTYPE)
    if zp is not None:
        x = x - zp.to(SCALE_DTYPE)
    return (x * scale.to(SCALE_DTYPE)).float()


def _quantize_column(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
    """Codes of one column, with the exact arithmetic of `int4.quantize_with_qparams`."""
    x = w / s
    if z is not None:
        x = x + z
    return torch.clamp(x, QMIN, QMAX).round()


def _factor_inplace(A: torch.Tensor) -> torch.Tensor:
    """A (b, K, K) damped Hessians -> upper Cholesky factors of their inverses, in place.

    Returns ok (b,): False where a factorization failed (those slices hold garbage).
    """
    b, K, _ = A.shape
    info = torch.empty(b, dtype=torch.int32, device=A.device)
    torch.linalg.cholesky_ex(A, out=(A, info))  # A = L, lower
    ok = info == 0
    if not ok.all():
        A[~ok] = torch.eye(K, dtype=A.dtype, device=A.device)  # keep the rest of the batch sane
    torch.cholesky_inverse(A, out=A)  # A = H⁻¹
    torch.linalg.cholesky_ex(A, upper=True, out=(A, info))  # A = Hinv, upper
    return ok & (info == 0) & torch.isfinite(A.sum((-2, -1)))


def _factor_flipped_inplace(A: torch.Tensor) -> torch.Tensor:
    """A (b, K, K) damped Hessians in REVERSED processing order -> the same upper factors as
    `_factor_inplace` of the unreversed ones, in place, from the inverse Cholesky factor alone
    (`_inverse_cholesky_lower`: batched matmuls, ~4/3 K^3 flops per expert at the GPU's fp32
    matmul rate, instead of a Cholesky, an inverse and a Cholesky again).

    With J the reversal, J H J = L Lᵀ gives H⁻¹ = J L⁻ᵀ L⁻¹ J = Uᵀ U for U = J L⁻¹ J, which is
    upper triangular: the unique upper Cholesky factor of H⁻¹, what GPTQ reads. Equal to
    `_factor_inplace` up to float rounding. Returns ok (b,) as that function does.
    """
    oks = []
    for j in range(0, A.shape[0], FACTOR_BATCH):  # scratch of a few experts, not of the batch
        Linv, ok = _inverse_cholesky_lower(A[j: j + FACTOR_BATCH])
        A[j: j + FACTOR_BATCH].copy_(Linv.flip(-2, -1))  # J L⁻¹ J, upper
        oks.append(ok)
        del Linv
    return torch.cat(oks) & torch.isfinite(A.sum((-2, -1)))


# Up to CHOL_LEAF, the library's Cholesky and triangular solve; FACTOR_BATCH experts factored at
# once (~3 (K, K) float32 of scratch each: GLM-5.2 gate/up, 7.2 GB). torch solves a batch of at
# most 8 triangular systems of size >= 64 by a loop of cuBLAS calls, a larger batch by one
# batched call: on an H200, GLM-5.2 gate/up batches (32 experts, K 6144) factor in 0.074 s
# at 16 / 512 against 0.149 s at 8 / 256, and a steady MoE layer's solves take 2.50 + 0.77 s
# instead of 3.39 + 1.00 (benchmarks/history/scripts/check_factor_gpu.py --layouts; benchmarks/h200_factor_layouts.json,
# h200_pipeline_3layer_layout.json). The factor's error against float64 is unchanged (1.7e-3).
CHOL_LEAF = 512
FACTOR_BATCH = 16


def _inverse_cholesky_lower(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """L⁻¹ of the lower Cholesky factor L of SPD A (b, n, n), and ok (b,): False where A (or a
    Schur complement of it) is not positive definite (those slices hold garbage).

    Recursive on halves, everything but the leaves batched matmuls:

        A = [[A11, A21ᵀ], [A21, A22]]   L11⁻¹ = rec(A11)
        L21 = A21 L11⁻ᵀ                  L22⁻¹ = rec(A22 - L21 L21ᵀ)
        L⁻¹ = [[L11⁻¹, 0], [-L22⁻¹ L21 L11⁻¹, L22⁻¹]]

    This is the blocked Cholesky with its triangular solves done by the inverse it builds
    anyway; errors grow with cond(L) like a triangular inverse's (tests/test_gptq.py bounds
    them against float64 on damped, correlated Hessians)."""
    b, n, _ = A.shape
    if n <= CHOL_LEAF:
        L, info = torch.linalg.cholesky_ex(A)
        ok = info == 0
        if not ok.all():
            L = torch.where(ok[:, None, None], L, torch.eye(n, dtype=A.dtype, device=A.device))
        eye = torch.eye(n, dtype=A.dtype, device=A.device).expand(b, n, n)
        return torch.linalg.solve_triangular(L, eye, upper=False), ok
    m = (n // 2 + 127) // 128 * 128 if n > 256 else n // 2  # tile-aligned split
    L11i, ok1 = _inverse_cholesky_lower(A[:, :m, :m])
    L21 = _mm(A[:, m:, :m], L11i.mT)  # (b, n-m, m)
    L22i, ok2 = _inverse_cholesky_lower(A[:, m:, m:] - _mm(L21, L21.mT))
    out = torch.zeros_like(A)
    out[:, :m, :m] = L11i
    out[:, m:, m:] = L22i
    out[:, m:, :m] = -_mm(L22i, _mm(L21, L11i))
    return out, ok1 & ok2


@contextlib.contextmanager
def _tf32(on: bool):
    """CUDA float32 matmuls on TF32 tensor cores inside the block when `on`."""
    prev = torch.backends.cuda.matmul.allow_tf32
    if on:
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        if on:
            torch.backends.cuda.matmul.allow_tf32 = prev


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of the factorization: float32, in TF32 on CUDA where FACTOR_TF32."""
    with _tf32(FACTOR_TF32 and a.is_cuda):
        return a @ b


# CUDA: the factorization's matmuls (`_mm`) and the block update of the later columns
# (`_propagate`) on TF32 tensor cores. On GLM-5.2 gate/up batches (K 6144, 32 experts, an
# H200; benchmarks/history/scripts/check_factor_gpu.py): the factorization 0.32 -> 0.16 s, the whole solve
# 0.59 -> 0.36 s; the factor's error against float64 1e-5 -> 2-3e-3 (relative Frobenius),
# the output error tr(E H Eᵀ) the same to 3e-6 of itself, 0.5-4 % of the codes moved by one
# step (ties at a rounding boundary). tests/test_gptq.py bounds the factor with TF32 emulated
# on the CPU; tests/test_gptq_triton.py the output error where a GPU runs it.
FACTOR_TF32 = True
PROPAGATE_TF32 = True


def _damp(diag: torch.Tensor, frac: torch.Tensor) -> torch.Tensor:
    """Damped Hessian diagonals: diag (b, K) (dead inputs already 1) + frac (b,) · their mean."""
    return diag + (frac * diag.mean(-1))[:, None]


def _inverse_cholesky(H: torch.Tensor, perm: torch.Tensor, percdamp: float, flipped: bool = False,
                      shrink: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Hinv = chol((P H Pᵀ + damp I)⁻¹)ᵀ for H (Bh, K, K) in the processing order perm (Bh, K)
    (`shrink`: H's off-diagonal terms times 1 - shrink first).

    Dead columns get H_ii = 1 first. A failed expert is rebuilt from H (left untouched) and
    retried with percdamp x 10. Memory: one (Bh, K, K) buffer beyond H, factored in place.
    Returns (Hinv (Bh, K, K), dead (Bh, K) in processing order, fraction used (Bh,), retries).
    """
    Bh, K = H.shape[0], H.shape[-1]
    diag = torch.diagonal(H, dim1=-2, dim2=-1).gather(-1, perm)  # (Bh, K) processing order
    dead = diag == 0
    diag = diag.masked_fill(dead, 1.0)  # the damping's mean is taken after this, as the reference
    frac = torch.full((Bh,), percdamp, dtype=torch.float32, device=H.device)
    todo = torch.arange(Bh, device=H.device)
    Hinv = None
    retries = 0
    while True:
        p = perm[todo]  # (b, K)
        if flipped:
            p = p.flip(-1)
        A = torch.empty(len(todo), K, K, dtype=H.dtype, device=H.device)  # permuted copies
        for j, (h, pj) in enumerate(zip(todo.tolist(), p)):  # (advanced indexing of the whole
            A[j] = H[h].index_select(0, pj).index_select(1, pj)  # batch builds batch-sized indices)
        if shrink:
            A.mul_(1 - shrink)  # (the diagonal is set below)
        d = _damp(diag[todo], frac[todo])
        torch.diagonal(A, dim1=-2, dim2=-1).copy_(d.flip(-1) if flipped else d)
        ok = _factor_flipped_inplace(A) if flipped else _factor_inplace(A)
        if Hinv is None:
            Hinv = A  # the first round covers every expert
        else:
            Hinv[todo[ok]] = A[ok]
        todo = todo[~ok]
        if todo.numel() == 0:
            return Hinv, dead, frac, retries
        if retries == MAX_DAMP_RETRIES:
            raise ValueError(
                f"GPTQ: Cholesky of the Hessian failed for expert(s) {todo.tolist()[:20]} even "
                f"with percdamp {frac[todo[0]].item():g} x mean(diag H); the Hessian is not "
                "positive semi-definite (NaN/inf inputs?). Fix: check the calibration inputs of "
                "those experts, or quantize them with RTN.")
        frac[todo] *= 10
        retries += 1


def _propagate(Ww: torch.Tensor, Err1: torch.Tensor, Hinv: torch.Tensor, i1: int, i2: int,
               end: int | None = None) -> None:
    """W[..., i2:end] -= Err1 @ Hinv[:, i1:i2, i2:end]: the errors of columns i1..i2 onto the
    later columns (to the end by default), (B, N, count) @ (Bh, count, end - i2), as one GEMM
    accumulating into W (no product tensor and no separate subtraction pass over the rest of W).
    Err1 may be any strided view whose rows flatten to (B * N, count) without a copy."""
    B, N, K = Ww.shape
    end = K if end is None else end
    if i2 >= end:
        return
    # TF32: the update's own error (2^-11 of it) is far below the 4-bit rounding it carries
    with _tf32(PROPAGATE_TF32 and Ww.is_cuda):
        if Hinv.shape[0] == B:
            Ww[..., i2:end].baddbmm_(Err1, Hinv[:, i1:i2, i2:end], alpha=-1)
        else:  # one shared H: every expert's rows against the same block
            Ww.view(B * N, K)[:, i2:end].addmm_(Err1.reshape(B * N, -1), Hinv[0, i1:i2, i2:end], alpha=-1)


def _damped(H: torch.Tensor, frac: torch.Tensor, shrink: float = 0.0) -> torch.Tensor:
    """H (Bh, K, K) + frac · mean(diag H) · I per Hessian, dead inputs' H_ii = 1 first, its
    off-diagonal terms times 1 - shrink: the matrix `_inverse_cholesky` factors (in the
    original column order)."""
    diag = torch.diagonal(H, dim1=-2, dim2=-1)
    Hd = H.clone()
    if shrink:
        Hd.mul_(1 - shrink)
    torch.diagonal(Hd, dim1=-2, dim2=-1).copy_(_damp(diag.masked_fill(diag == 0, 1.0), frac))
    return Hd


def _row_error(W: torch.Tensor, R: torch.Tensor, Hd: torch.Tensor) -> torch.Tensor:
    """(w - r) Hd (w - r)ᵀ per row of W, R (B, N, K) against Hd (Bh, K, K), all float64: (B, N)."""
    E = W - R
    return ((E @ Hd) * E).sum(-1)


def refit_scales(W: torch.Tensor, H: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                 zp: torch.Tensor | None, group_size: int, frac: torch.Tensor,
                 rule_of: torch.Tensor | None = None, shrink: float = 0.0) -> torch.Tensor:
    """Group scales (B, N, G) re-fitted to fixed codes q (B, N, K): per row w, the scales s that
    minimise e Hd eᵀ, e = w - Σ_g s_g q̂_g (q̂ = q - zp, group g's columns), Hd = H damped as
    GPTQ factored it (`frac` per Hessian). That is the G x G system A s = b with
    A_gh = q̂_g Hd_gh q̂_hᵀ and b_g = q̂_g (Hd wᵀ)_g, solved per row in float64. GPTQ's scales
    come from the weights before rounding; once the codes are chosen, other scales can fit the
    layer's output better. Each scale is clamped to REFIT_RANGE x the rounding rule's (what
    verify checks), a group whose codes are all 0 keeps its scale, and a row keeps all of its
    scales when the bf16 re-fit does not lower its error (or is not finite and positive).
    Experts in chunks of at most REFIT_CHUNK_BYTES per float64 (b, N, K) tensor. `rule_of`: the
    weight whose rounding rule bounds the scales (default W)."""
    B, N, K = W.shape
    Hd = _damped(H, frac.to(H.dtype), shrink).double()  # (Bh, K, K)
    ref = W if rule_of is None else rule_of  # (`gptaq`: the source's rule, not the target's)
    rule = rtn_qparams(ref.reshape(B * N, K), group_size, zp is None)[0].reshape(B, N, K // group_size)
    step = max(1, REFIT_CHUNK_BYTES // (N * K * 8))
    out = []
    for b0 in range(0, B, step):
        b1 = min(b0 + step, B)
        out.append(_refit_chunk(W[b0:b1], Hd if Hd.shape[0] == 1 else Hd[b0:b1], q[b0:b1],
                                scale[b0:b1], None if zp is None else zp[b0:b1], group_size,
                                rule[b0:b1]))
    return torch.cat(out)


def _refit_chunk(W: torch.Tensor, Hd: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                 zp: torch.Tensor | None, g: int, rule: torch.Tensor) -> torch.Tensor:
    """`refit_scales` for one chunk of experts (Hd float64, already damped)."""
    B, N, K = W.shape
    G = K // g
    Qh = q.double()
    if zp is not None:
        Qh = Qh - zp.double().repeat_interleave(g, -1)
    Wd = W.double()
    b = (Qh * (Wd @ Hd)).reshape(B, N, G, g).sum(-1)  # (B, N, G)
    A = torch.empty(B, N, G, G, dtype=torch.float64, device=W.device)
    for j in range(G):  # A[..., j, :]: group j's codes through Hd's rows of group j
        M = Qh[..., j * g:(j + 1) * g] @ Hd[:, j * g:(j + 1) * g, :]  # (B, N, K)
        A[..., j, :] = (M * Qh).reshape(B, N, G, g).sum(-1)
    s0 = scale.double()
    dA = torch.diagonal(A, dim1=-2, dim2=-1)  # (B, N, G)
    # a ridge towards the old scales: 1e-9 of the row's mean diagonal (numerics only); a group of
    # zero codes has an empty row and column in A, and the ridge alone pins it to its old scale
    ridge = 1e-9 * dA.mean(-1, keepdim=True) + (dA == 0).double()
    dA += ridge
    s = torch.linalg.solve(A, b + ridge * s0)  # (B, N, G)
    r = rule.double()
    s = torch.minimum(torch.maximum(s, REFIT_RANGE[0] * r), REFIT_RANGE[1] * r).to(scale.dtype)
    s = torch.where(torch.isfinite(s) & (s > 0), s, scale)

    def served(sc: torch.Tensor) -> torch.Tensor:  # bf16((q - zp) · scale), as `_dequant`
        return (Qh * sc.double().repeat_interleave(g, -1)).to(SCALE_DTYPE).double()

    better = _row_error(Wd, served(s), Hd) < _row_error(Wd, served(scale), Hd)  # (B, N)
    return torch.where(better[..., None], s, scale)


def descend_codes(W: torch.Tensor, H: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                  zp: torch.Tensor | None, group_size: int, frac: torch.Tensor, passes: int,
                  shrink: float = 0.0, blocksize: int = 128) -> torch.Tensor:
    """Codes (B, N, K) int8 improved by `passes` of cyclic coordinate descent on e Hd eᵀ,
    e = w - bf16((q - zp) · s) per row, Hd = H (Bh, K, K) damped as GPTQ factored it (`frac`
    per Hessian, `shrink`), the scales fixed. With R = E Hd (the error's gradient, halved),
    moving column j's served value by d changes a row's error by d (d Hd_jj - 2 R_j): exactly
    minimised over the grid by the code nearest v_j + R_j / Hd_jj (a 1-D quadratic; that code's
    neighbours are tried too, the served levels being bf16-rounded), taken only when the change
    is negative, so no pass raises any row's error (up to float32
    rounding of R; a row whose float64 error rose all the same keeps its old codes). Columns
    in blocks of `blocksize`: the updates of R inside a block are rank-1 on the block's
    columns, the block's moves reach the rest of R in one matmul (as GPTQ's lazy batches).
    With a diagonal H one pass gives each weight's nearest served level. Experts in chunks of
    at most REFIT_CHUNK_BYTES per float32 (b, N, K) tensor (a GLM-5.2 gate batch whole would
    need ~100 GB)."""
    B, N, K = W.shape
    step = max(1, REFIT_CHUNK_BYTES // (N * K * 4))
    one = H.shape[0] == 1  # one shared Hessian: every chunk takes it whole
    out = []
    for b0 in range(0, B, step):
        b1 = min(b0 + step, B)
        out.append(_descend_chunk(W[b0:b1], H if one else H[b0:b1], q[b0:b1], scale[b0:b1],
                                  None if zp is None else zp[b0:b1], group_size,
                                  frac if one else frac[b0:b1], passes, shrink, blocksize))
    return torch.cat(out)


def _descend_chunk(W: torch.Tensor, H: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   zp: torch.Tensor | None, g: int, frac: torch.Tensor, passes: int,
                   shrink: float, blocksize: int) -> torch.Tensor:
    """`descend_codes` for one chunk of experts."""
    B, N, K = W.shape
    Hd = _damped(H, frac.to(H.dtype), shrink)  # (Bh, K, K) float32
    hdiag = torch.diagonal(Hd, dim1=-2, dim2=-1)  # (Bh, K)
    s_col = scale.repeat_interleave(g, -1)  # (B, N, K) bf16, each column's group scale
    z_col = None if zp is None else zp.repeat_interleave(g, -1)
    Wf = W.to(torch.float32)
    q0 = q
    q = q.clone()
    V = _dequant(q, s_col, z_col)  # (B, N, K) served values
    sf = s_col.float()
    zf = None if z_col is None else z_col.float()
    for _ in range(passes):
        R = (Wf - V) @ Hd  # (B, N, K) (a shared Hd broadcasts), afresh each pass: no drift carried over
        moved = torch.zeros((), dtype=torch.int64, device=W.device)  # (one sync per pass)
        for i1 in range(0, K, blocksize):
            i2 = min(i1 + blocksize, K)
            dV = torch.zeros(B, N, i2 - i1, dtype=torch.float32, device=W.device)
            for j in range(i1, i2):
                h = hdiag[:, j][:, None]  # (Bh, 1)
                v = V[..., j]
                r = R[..., j]
                near = _quantize_column(v + r / h, sf[..., j], None if zf is None else zf[..., j])
                best_c, best_d, best = q[..., j], torch.zeros_like(v), torch.zeros_like(v)
                for off in (0, -1, 1):  # the served levels are bf16-rounded: a neighbour of the
                    c = (near + off).clamp(QMIN, QMAX)  # rounded optimum may be the nearer one
                    dc = _dequant(c, s_col[..., j], None if z_col is None else z_col[..., j]) - v
                    gain = dc * (dc * h - 2 * r)  # the row's change of error, < 0: lower
                    better = gain < best
                    best = torch.where(better, gain, best)
                    best_d = torch.where(better, dc, best_d)
                    best_c = torch.where(better, c.to(torch.int8), best_c)
                d = best_d  # (B, N), 0 where no level lowers the error
                moved += (best < 0).sum()
                q[..., j] = best_c
                V[..., j] += d
                dV[..., j - i1] = d
                # e = w - v moves by -d: R's block columns at once (rank 1), the rest below
                R[..., j:i2] -= d[..., None] * (Hd[:, None, j, j:i2])
            # the block's moves onto the columns outside it, and onto the block's columns
            # before each mover (the rank-1 updates reached only those from the mover on)
            rest = dV @ Hd[:, i1:i2, :]  # (B, N, K)
            R[..., :i1] -= rest[..., :i1]
            R[..., i2:] -= rest[..., i2:]
            R[..., i1:i2] -= dV @ torch.tril(Hd[:, i1:i2, i1:i2], -1)
        if not bool(moved):
            break
    Wd, Hdd = W.double(), Hd.double()
    worse = _row_error(Wd, _dequant(q, s_col, z_col).double(), Hdd) > \
        _row_error(Wd, _dequant(q0, s_col, z_col).double(), Hdd)  # (B, N)
    return torch.where(worse[..., None], q0, q)


def _codes(Wb: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, Hinv: torch.Tensor,
           perm: torch.Tensor, dead: torch.Tensor, g: int, blocksize: int, fused: bool) -> torch.Tensor:
    """GPTQ's column loop: the codes (B, N, K) int8 of Wb (B, N, K) float32 under the static group
    scale / zp (B, N, G), processed in the order perm (Bh, K) with Hinv = `_inverse_cholesky`'s."""
    B, N, K = Wb.shape
    Ww = Wb.gather(-1, perm[:, None, :].expand(B, N, K))  # (B, N, K) working copy, permuted
    Ww.masked_fill_(dead[:, None, :], 0.0)  # dead inputs: the weight does not matter, q = 0
    group_of = perm // g  # (Bh, K) group of each processed column, in the original order
    Hinv = Hinv.contiguous()
    if fused:  # CUDA: each block's column loop in one kernel (quantize/rounding/gptq_triton.py)
        q_perm = _codes_fused(Ww, scale, zp, Hinv, group_of, blocksize)
    else:
        q_perm = _codes_eager(Ww, scale, zp, Hinv, group_of, blocksize)
    return torch.empty_like(q_perm).scatter_(-1, perm[:, None, :].expand(B, N, K), q_perm)


def _codes_eager(Ww: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, Hinv: torch.Tensor,
                 group_of: torch.Tensor, blocksize: int) -> torch.Tensor:
    """`_codes`' loop in eager PyTorch (the reference; CPU): column by column within each block,
    each block's errors onto all later columns. Ww (B, N, K) is consumed. Returns the codes in
    processing order (B, N, K)."""
    B, N, K = Ww.shape
    q_perm = torch.empty(B, N, K, dtype=torch.int8, device=Ww.device)
    for i1 in range(0, K, blocksize):
        i2 = min(i1 + blocksize, K)
        count = i2 - i1
        idx = group_of[:, None, i1:i2].expand(B, N, count)  # (B, N, count)
        s1 = scale.gather(-1, idx)  # (B, N, count) bf16 scale of each column's group
        s1f = s1.float()
        z1 = None if zp is None else zp.gather(-1, idx)
        z1f = None if z1 is None else z1.float()
        W1 = Ww[..., i1:i2].contiguous()  # (B, N, count), a copy
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[:, i1:i2, i1:i2]  # (Bh, count, count)
        for i in range(count):
            w = W1[..., i]  # (B, N)
            d = Hinv1[:, i, i][:, None]  # (Bh, 1)
            q = _quantize_column(w, s1f[..., i], None if z1f is None else z1f[..., i])
            q_perm[..., i1 + i] = q.to(torch.int8)
            Q = _dequant(q, s1[..., i], None if z1 is None else z1[..., i])  # (B, N)
            err = (w - Q) / d  # (B, N)
            W1[..., i:] -= err[..., None] * Hinv1[:, None, i, i:]
            Err1[..., i] = err
        _propagate(Ww, Err1, Hinv, i1, i2)
    return q_perm


# The fused column loop in levels of widths: the Triton kernel rounds FUSED_WIDTHS[0] columns
# at a time (rank-1 updates inside, in registers), and each group of a level hands its errors
# on to the rest of the group of the next level in one GEMM; the largest groups' to all later
# columns. One level (128,) is the eager loop's arithmetic (every block's errors onto the rest
# of W); more levels are the same sums grouped differently (float rounding only). Why levels:
# a narrow kernel wastes fewer lanes on work replicated per row (the kernel is bound by the
# instructions it issues), and an update per block of 128 reads and writes the whole rest of
# W (~155 GB for a GLM-5.2 gate/up batch: memory-bound); benchmarks/history/scripts/check_block_kernel_gpu.py
# times the choices (benchmarks/h200_block_kernel_*.json).
FUSED_WIDTHS = (32, 128, 512)


def _codes_fused(Ww: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, Hinv: torch.Tensor,
                 group_of: torch.Tensor, blocksize: int) -> torch.Tensor:
    """`_codes`' loop on CUDA: one Triton kernel per block of columns (`gptq_triton.gptq_block`)
    reading the working weights in place, errors handed on level by level (FUSED_WIDTHS; the
    kernel's width at most `blocksize`). Ww (B, N, K) is consumed. Returns the codes in
    processing order, a (B, N, K) view."""
    B, N, K = Ww.shape
    St = scale.transpose(-1, -2).contiguous()  # (B, G, N): a group's scales for a tile of rows contiguous
    Zt = None if zp is None else zp.transpose(-1, -2).contiguous()
    gof = group_of.to(torch.int32).contiguous()
    Qt = torch.empty(B, K, N, dtype=torch.int8, device=Ww.device)
    kw = min(blocksize, FUSED_WIDTHS[0])
    widths = [kw] + [w for w in FUSED_WIDTHS[1:] if w > kw]
    # the errors of the current top-level group, column j at row j - its first column
    E = torch.empty(min(widths[-1], K), B * N, dtype=torch.float32, device=Ww.device)
    _fused_level((Ww, St, Zt, gof, Hinv, Qt, E), widths, 0, K, len(widths) - 1, 0)
    return Qt.transpose(-1, -2)


def _fused_level(arrays: tuple, widths: list[int], a: int, b: int, level: int, base: int) -> None:
    """`_codes_fused`' columns a..b in pieces of widths[level], each piece's errors onto the rest
    of a..b; `arrays`: its (Ww, St, Zt, gof, Hinv, Qt, E). A module function, not a closure:
    a closure that calls itself is a reference cycle that keeps every array it reads (Hinv, the
    working W: ~8 GiB per GLM-5.2 gate/up batch) alive after the solve, until Python's cyclic
    collector happens to run (scripts/gpu_memory_peak.py found them at the H200's peaks)."""
    Ww, St, Zt, gof, Hinv, Qt, E = arrays
    B, N, _ = Ww.shape
    top = len(widths) - 1
    for c1 in range(a, b, widths[level]):
        c2 = min(c1 + widths[level], b)
        bs = c1 if level == top else base
        if level == 0:
            gptq_triton.gptq_block(Ww, St, Zt, gof, Hinv, Qt, E[c1 - bs:c2 - bs], c1, c2 - c1,
                                   QMIN, QMAX)
        else:
            _fused_level(arrays, widths, c1, c2, level - 1, bs)
        errors = E[c1 - bs:c2 - bs].t().view(B, N, c2 - c1)  # (B, N, c2 - c1)
        _propagate(Ww, errors, Hinv, c1, c2, b)


def gptaq_target(W: torch.Tensor, H: torch.Tensor, D: torch.Tensor, percdamp: float,
                 a: float, shrink: float = 0.0) -> torch.Tensor:
    """W* = W + a · W D Hd⁻¹ for W (B, N, K), H and D (Bh, K, K) (Bh = B or 1), Hd = H damped
    as GPTQ factors it (`_damped` with `percdamp`): the target whose GPTQ rounding minimises the
    error against the unrounded model's outputs (module docstring, `gptaq`). Solved in float64
    (a Cholesky of Hd; an LU solve where that fails); returned in W's dtype."""
    frac = torch.full((H.shape[0],), percdamp, dtype=H.dtype, device=H.device)
    Hd = _damped(H, frac, shrink).double()
    Dt = D.double().mT  # (Bh, K, K)
    L, info = torch.linalg.cholesky_ex(Hd)
    Z = torch.cholesky_solve(Dt, L) if not bool(info.any()) else torch.linalg.solve(Hd, Dt)
    # Z = Hd⁻¹ Dᵀ, so W D Hd⁻¹ = (Z Wᵀ)ᵀ = W Zᵀ
    Wd = W.double()
    step = Wd @ (Z.mT if Z.shape[0] == W.shape[0] else Z[0].mT)
    return (Wd + a * step).to(W.dtype)


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, cfg: GPTQConfig = GPTQConfig(),
                  D: torch.Tensor | None = None) -> GPTQResult:
    """GPTQ-round W (..., N, K) against H (..., K, K) (or one shared (K, K)); inputs untouched.
    `D` (shaped as H): the asymmetric term 2 (X - X̃) X̃ᵀ / T, used when `cfg.gptaq` > 0: W is
    then rounded toward `gptaq_target`.

    All leading dims are solved at once (a layer's experts in one batch). With H = I the result
    equals `quantize_rtn(W)` exactly (without `mse_clip`). Memory beyond the inputs: one
    (..., K, K) float32 buffer (Hinv, factored in place) and one (..., N, K) working W; for 256
    GLM-5.2 gate projections (K 6144, N 2048) that is 39 + 13 GB, so pass experts in chunks
    where H itself does not leave room.
    """
    if W.ndim < 2 or H.shape[-2:] != (W.shape[-1], W.shape[-1]):
        raise ValueError(f"gptq_quantize: W {tuple(W.shape)} and H {tuple(H.shape)} do not fit "
                         "(need W (..., N, K) and H (..., K, K))")
    lead, (N, K) = W.shape[:-2], W.shape[-2:]
    lead_h = H.shape[:-2]
    if lead_h not in (lead, ()):
        raise ValueError(f"gptq_quantize: H's leading dims {tuple(lead_h)} must equal W's "
                         f"{tuple(lead)} (one Hessian per expert) or be absent (one shared)")
    if K % cfg.group_size:
        raise ValueError(f"gptq_quantize: in_features {K} is not a multiple of group_size "
                         f"{cfg.group_size}; pick a group size that divides it")
    g = cfg.group_size
    B = lead.numel()
    Wb = W.reshape(B, N, K).to(torch.float32)  # (B, N, K)
    Hb = H.reshape(-1, K, K).to(torch.float32)  # (Bh, K, K), Bh = B or 1 (shared)
    Bh = Hb.shape[0]
    Hdiag = torch.diagonal(Hb, dim1=-2, dim2=-1)  # (Bh, K)
    scale, zp = _group_qparams(Wb, Hdiag, cfg)  # (B, N, G) from the original W: static groups
    Wt = Wb  # what the codes approximate: W, or with `gptaq` the shifted target W*
    if D is not None and cfg.gptaq > 0:
        if D.shape != H.shape:
            raise ValueError(f"gptq_quantize: D {tuple(D.shape)} must be shaped as H {tuple(H.shape)}")
        Wt = gptaq_target(Wb, Hb, D.reshape(-1, K, K).to(torch.float32), cfg.percdamp, cfg.gptaq,
                          cfg.shrink)

    if cfg.actorder:
        perm = torch.argsort(Hdiag, dim=-1, descending=True, stable=True)  # (Bh, K) order
    else:
        perm = torch.arange(K, device=W.device).expand(Bh, K)
    fused = cfg.fused and gptq_triton.available(Wb)
    # (Bh, K, K) upper; the fused (CUDA) path also takes the cheaper factorization
    Hinv, dead, damp, retries = _inverse_cholesky(Hb, perm, cfg.percdamp, flipped=fused,
                                                    shrink=cfg.shrink)
    def codes(scale: torch.Tensor) -> torch.Tensor:  # the column loop, then any descent passes
        q = _codes(Wt, scale, zp, Hinv, perm, dead, g, cfg.blocksize, fused)
        if cfg.descend:
            q = descend_codes(Wt, Hb, q, scale, zp, g, damp, cfg.descend, cfg.shrink, cfg.blocksize)
        return q

    q = codes(scale)
    for r in range(cfg.scale_refit):  # each round: scales fitted to the codes; between rounds,
        scale = refit_scales(Wt, Hb, q, scale, zp, g, damp, rule_of=Wb,
                             shrink=cfg.shrink)  # codes under them
        if r + 1 < cfg.scale_refit:
            q = codes(scale)
    G = K // g
    weight = Int4Weight(q.reshape(*lead, N, K), scale.reshape(*lead, N, G),
                        None if zp is None else zp.reshape(*lead, N, G))
    return GPTQResult(weight, damp.reshape(lead_h), retries)
