"""AWQ-style per-input-channel scales: protect the weights that meet loud activations.

Names: N = out_features, K = in_features (the channels of the shared input), T = tokens,
g = group_size. Lin et al. 2023, "AWQ", section 3.2 (search over the exponent alpha of the
activation magnitude); the grid and the normalisation follow AutoAWQ.

A set of Linears that read the same input X (T, K) computes Y = X Wᵀ. For any positive s (K,),

    Y = (X diag(1/s)) (W diag(s))ᵀ

so the input can be divided by s (folded exactly into whatever produced X: a norm's weight, or
the rows of the previous Linear) while W's columns are multiplied by s before rounding. A column
scaled up by s_k > 1 keeps more of its precision inside its group, and its rounding error reaches
the output divided by s_k: good for the channels whose |x| is large. The search:

    mean_abs = mean_t |X[t, k]|                                   (K,)
    s(alpha) = clamp(mean_abs ** alpha, 1e-4); s /= sqrt(max(s) * min(s))
    err(alpha) = sqrt( sum_W ||(dq(rtn(W diag(s))) diag(1/s) - W) Xᵀ||_F² )
    alpha in linspace(0, 1, 20); keep the smallest err, ties to the smaller alpha.

alpha = 0 gives s = 1 and exactly the RTN weight, so `err_after <= err_before` (= RTN's error)
always holds. Worked number: mean_abs = [4, 1], alpha = 0.5: s = [2, 1] / sqrt(2) =
[1.414, 0.707]; the loud channel's weights are multiplied by 1.414 and its input by 0.707.

Where the scales go (GLM MoE layer, the folds `fold_into_norm`, `fold_into_linear_rows`,
`scale_linear_inputs` below; all exact in real arithmetic, one bf16 rounding when stored):
- gate_proj and up_proj of one expert share the expert's input; across the layer, every expert,
  the shared expert and the router read the post-attention-norm output. One s for that input is
  searched over all the quantized ones (pass the experts' weights as (E * N, K)) and folded into
  the norm; every reader, quantized or not (the router), gets `scale_linear_inputs`. Which norm
  and how (`fold_into_norm` is the `x * w` form only) is quantize/calib/folds.py's: found on the layer.
- down_proj's input act(gate x) * (up x) is per expert: s (E, I) folds into up_proj's rows.
Zero rows that pad experts to a common T change neither s (the normalisation cancels the
dilution of the mean) nor the error, so padded per-expert inputs can be searched in one batch.
The scales change GPTQ's Hessian too: after the fold the layer sees X diag(1/s), so run GPTQ on
`scale_linear_inputs(W, s)` with H' = diag(1/s) H diag(1/s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from quantize.rounding.int4 import dequantize, quantize_rtn

__all__ = [
    "AWQConfig",
    "AWQResult",
    "awq_search",
    "fold_into_linear_rows",
    "fold_into_norm",
    "scale_linear_inputs",
]


@dataclass(frozen=True)
class AWQConfig:
    # 32: the layout of the published GLM INT4 checkpoints; must match the rounding that follows.
    group_size: int = 32
    # Symmetric is what SGLang's MoE WNA16 path asserts.
    symmetric: bool = True
    # 20 exponents, AutoAWQ's grid size; ours is linspace(0, 1) so alpha = 1 is tried too.
    n_grid: int = 20

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size must be positive, got {self.group_size}")
        if self.n_grid < 2:
            raise ValueError(f"n_grid must be >= 2 (it includes alpha = 0 and 1), got {self.n_grid}")


class AWQResult(NamedTuple):
    scales: torch.Tensor  # float32 (..., K) multiply W's columns, divide the input
    alpha: torch.Tensor  # float32 (...,) the exponent chosen
    err_before: torch.Tensor  # float32 (...,) output error of RTN (alpha = 0)
    err_after: torch.Tensor  # float32 (...,) output error with the chosen scales


def _compute_dtype(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def fold_into_norm(norm_weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Norm weight (..., K) / s: the norm's output comes out divided by s; dtype kept.

    (A LayerNorm bias would be divided too; GLM's RMSNorms have none.)
    """
    dt = _compute_dtype(norm_weight, s)
    return (norm_weight.to(dt) / s.to(dt)).to(norm_weight.dtype)


def fold_into_linear_rows(W_prev: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Rows of the producing Linear (..., N_prev, K_prev) / s (..., N_prev); dtype kept.

    e.g. up_proj's rows for down_proj's input act(gate x) * (up x). (A bias would be divided
    too; GLM's experts have none.)
    """
    dt = _compute_dtype(W_prev, s)
    return (W_prev.to(dt) / s.to(dt).unsqueeze(-1)).to(W_prev.dtype)  # (..., N_prev, K_prev)


def scale_linear_inputs(W: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Columns of a consuming Linear (..., N, K) * s (..., K); dtype kept."""
    dt = _compute_dtype(W, s)
    return (W.to(dt) * s.to(dt).unsqueeze(-2)).to(W.dtype)  # (..., N, K)


def _fake_quant(W: torch.Tensor, cfg: AWQConfig) -> torch.Tensor:
    """float32 dq(rtn(W)) for W (..., N, K), as the engines reconstruct it."""
    K = W.shape[-1]
    w = quantize_rtn(W.reshape(-1, K), cfg.group_size, cfg.symmetric)  # rows are independent
    return dequantize(w).float().reshape(W.shape)


def _sq_output_error(D: torch.Tensor, X: torch.Tensor, G: torch.Tensor | None) -> torch.Tensor:
    """||D Xᵀ||_F² per leading index, for D (..., N, K), X (..., T, K), G = XᵀX (..., K, K)."""
    if G is None:
        return (D @ X.mT).square().sum((-2, -1))  # (..., N, T)
    return ((D @ G) * D).sum((-2, -1))  # tr(D G Dᵀ): cheaper when T > K


def awq_search(Ws: list[torch.Tensor], X: torch.Tensor, cfg: AWQConfig = AWQConfig()
               ) -> AWQResult:
    """Grid-search alpha for the Linears `Ws` (each (..., N_i, K)) that share the input X (..., T, K).

    Leading dims of every W equal X's (one search per expert, all at once). Inputs are untouched.
    """
    if not Ws:
        raise ValueError("awq_search: no weights given")
    lead, K = X.shape[:-2], X.shape[-1]
    bad = [f"Ws[{i}] {tuple(W.shape)}" for i, W in enumerate(Ws)
           if W.shape[:-2] != lead or W.shape[-1] != K]
    if bad:
        raise ValueError(f"awq_search: {', '.join(bad)} do not fit X {tuple(X.shape)} "
                         f"(need (*{tuple(lead)}, N, {K}); stack experts that share one input "
                         "as (E * N, K))")
    if K % cfg.group_size:
        raise ValueError(f"awq_search: in_features {K} is not a multiple of group_size "
                         f"{cfg.group_size}")
    Xf = X.to(torch.float32)
    Wf = [W.to(torch.float32) for W in Ws]
    T = X.shape[-2]
    G = Xf.mT @ Xf if T > K else None  # (..., K, K)
    mean_abs = Xf.abs().mean(-2)  # (..., K)

    best_err = best_alpha = best_s = err_before = None
    for alpha in torch.linspace(0, 1, cfg.n_grid).tolist():
        s = mean_abs.pow(alpha).clamp(min=1e-4)  # (..., K)
        s = s / (s.amax(-1, keepdim=True) * s.amin(-1, keepdim=True)).sqrt()
        err = sum(_sq_output_error(_fake_quant(W * s.unsqueeze(-2), cfg) / s.unsqueeze(-2) - W,
                                   Xf, G) for W in Wf).clamp(min=0).sqrt()  # (...,)
        if best_err is None:
            best_err, err_before, best_s = err, err, s
            best_alpha = torch.zeros_like(err)
            continue
        better = err < best_err  # strict: ties keep the smaller alpha
        best_err = torch.where(better, err, best_err)
        best_alpha = torch.where(better, torch.full_like(err, alpha), best_alpha)
        best_s = torch.where(better.unsqueeze(-1), s, best_s)
    return AWQResult(best_s, best_alpha, err_before, best_err)
