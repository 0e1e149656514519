"""Pass 2's weighted sum of a MoE block's top-k expert outputs as one Triton kernel (CUDA).

`capture.moe_output` has each routed (token, slot) pair's expert output y in expert order
(S = T x k rows of H bf16). transformers' forward then multiplies every row by its float32
routing weight (a float32 copy of all S rows), puts them back in token order and sums the k
rows of each token in float32. `combine_topk` reads each token's k rows straight from y
(through the inverse permutation) and does the same arithmetic in registers:

    out[t] = bf16( ((0 + f32(y[inv[t,0]]) * w[t,0]) + f32(y[inv[t,1]]) * w[t,1]) + ... )

each product rounded to float32 before it is added (no fused multiply-add), the k terms added
in slot order, the sum rounded to bf16 to nearest even: no float32 copy of the rows, one read
of y. CPU runs use the torch expression (`moe_output`); tests/test_moe_triton.py runs the
kernel under Triton's interpreter against it (equal bit for bit there), and
`benchmarks/history/scripts/bench_moe_forward.py` compares pass 2's output with transformers' forward on the GPU.
"""

from __future__ import annotations

import torch

from quantize.rounding.gptq_triton import available

try:  # triton ships with CUDA builds of torch; CPU builds have none and never call this
    import triton
    import triton.language as tl

    from quantize.rounding.gptq_triton import bf16_rne
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

__all__ = ["available", "combine_topk"]

BLOCK_H = 1024  # hidden features per program

if triton is not None:

    @triton.jit
    def _combine_kernel(Y_ptr, INV_ptr, W_ptr, OUT_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr,
                        ROUND_BF16: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < H
        acc = tl.zeros((BLOCK,), tl.float32)
        for j in tl.static_range(K):
            r = tl.load(INV_ptr + t * K + j).to(tl.int64)  # the pair's row of y
            w = tl.load(W_ptr + t * K + j)
            y = tl.load(Y_ptr + r * H + offs, mask=m, other=0.0).to(tl.float32)
            acc = acc + y * w
        if ROUND_BF16:  # to nearest bfloat16 by bits, as torch rounds, on every backend (the
            # interpreter's own cast does not round so): the store's cast is then exact
            acc = bf16_rne(acc)
        tl.store(OUT_ptr + t * H + offs, acc.to(OUT_ptr.dtype.element_ty), mask=m)


def combine_topk(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """y (S, H) expert outputs in expert order, inv (T * k,) the row of y of each (token, slot)
    pair in token-major order, weights (T, k) float32 -> (T, H) `out_dtype`: sum over the slots
    of y[inv[t, j]] * weights[t, j] in float32, as described above."""
    T, k = weights.shape
    H = y.shape[-1]
    assert y.is_contiguous() and inv.numel() == T * k and weights.dtype == torch.float32
    out = torch.empty(T, H, dtype=out_dtype, device=y.device)
    grid = (T, triton.cdiv(H, BLOCK_H))
    _combine_kernel[grid](y, inv.contiguous(), weights.contiguous(), out, H, K=k, BLOCK=BLOCK_H,
                          ROUND_BF16=out_dtype == torch.bfloat16, num_warps=4, enable_fp_fusion=False)
    return out
