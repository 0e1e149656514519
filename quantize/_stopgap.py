"""STOPGAP until quantize/gptq.py and quantize/awq.py land on main: the smallest GPTQ / AWQ
with the agreed call signatures, so calibrate.py runs end to end. Delete this file once
`from quantize.gptq import ...` and `from quantize.awq import ...` succeed (calibrate.py
imports those first).

GPTQ here: Frantar et al. 2022 Algorithm 1 with lazy block updates, no activation order, group
scales taken from the error-updated weights at each group's first column. AWQ here: grid over
alpha of s = mean|x|^alpha, normalised, minimising sum_i ||(Q(W_i s) / s - W_i) X^T||^2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from quantize.int4 import Int4Weight, dequantize, quantize_rtn, quantize_with_qparams, rtn_qparams

__all__ = [
    "AWQConfig", "AWQResult", "GPTQConfig", "GPTQResult", "accumulate_hessian", "awq_search",
    "fold_into_linear_rows", "fold_into_norm", "gptq_quantize", "scale_linear_inputs",
]


def accumulate_hessian(H: torch.Tensor, X: torch.Tensor, n_seen: int) -> tuple[torch.Tensor, int]:
    """Running H = 2/n sum x x^T over the rows of X (T, K); returns a new tensor."""
    X = X.reshape(-1, X.shape[-1]).float()
    t = X.shape[0]
    if t == 0:
        return H, n_seen
    n = n_seen + t
    return H * (n_seen / n) + (X.t() @ X) * (2.0 / n), n


@dataclass(frozen=True)
class GPTQConfig:
    group_size: int = 32
    symmetric: bool = True
    percdamp: float = 0.01
    blocksize: int = 128
    max_retries: int = 6


class GPTQResult(NamedTuple):
    weight: Int4Weight
    damp: float
    retries: int


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, cfg: GPTQConfig) -> GPTQResult:
    """W (..., N, K) float, H (..., K, K) -> integers and scales per (..., N, K); batched."""
    lead = W.shape[:-2]
    N, K = W.shape[-2:]
    g = cfg.group_size
    W = W.float().clone()
    H = H.float().clone().expand(*lead, K, K).clone() if H.dim() < W.dim() else H.float().clone()
    diag = H.diagonal(dim1=-2, dim2=-1)  # (..., K) view
    dead = diag == 0
    diag.masked_fill_(dead, 1.0)
    W.masked_fill_(dead.unsqueeze(-2), 0.0)
    damp, retries = cfg.percdamp, 0
    eye = torch.eye(K, device=W.device)
    while True:
        Hd = H + eye * (damp * diag.mean(-1))[..., None, None]
        L, info = torch.linalg.cholesky_ex(Hd)
        if not bool((info > 0).any()):
            break
        retries += 1
        damp *= 10
        if retries > cfg.max_retries:
            raise RuntimeError("GPTQ: the Hessian stays not positive definite after dampening")
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)  # (..., K, K) upper
    Q = torch.zeros(*lead, N, K, dtype=torch.int8, device=W.device)
    scales, zps = [], []
    for i1 in range(0, K, cfg.blocksize):
        i2 = min(i1 + cfg.blocksize, K)
        W1 = W[..., i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[..., i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:
                Wg = W1[..., i:i + g].reshape(-1, g)  # (M, g): this group's updated columns
                s, z = rtn_qparams(Wg, g, cfg.symmetric)  # (M, 1)
                scales.append(s.reshape(*lead, N, 1))
                zps.append(None if z is None else z.reshape(*lead, N, 1))
            s, z = scales[-1], zps[-1]
            w = W1[..., i]  # (..., N)
            q = quantize_with_qparams(w.reshape(-1, 1), s.reshape(-1, 1),
                                      None if z is None else z.reshape(-1, 1), 1).reshape(w.shape)
            Q[..., col] = q
            deq = (q.float() - (0 if z is None else z[..., 0].float())) * s[..., 0].float()
            d = Hinv1[..., i, i].unsqueeze(-1)  # (..., 1)
            err = (w - deq) / d
            W1[..., i:] -= err.unsqueeze(-1) * Hinv1[..., i, i:].unsqueeze(-2)
            Err1[..., i] = err
        W[..., i2:] -= Err1 @ Hinv[..., i1:i2, i2:]
    scale = torch.cat(scales, -1)
    zp = None if zps[0] is None else torch.cat(zps, -1)
    return GPTQResult(Int4Weight(Q, scale, zp), damp, retries)


@dataclass(frozen=True)
class AWQConfig:
    group_size: int = 32
    symmetric: bool = True
    n_grid: int = 20


class AWQResult(NamedTuple):
    scales: torch.Tensor  # (K,) float32; the weights are multiplied by it, the inputs divided
    alpha: float
    error: float
    rtn_error: float


def _qdq(W: torch.Tensor, cfg: AWQConfig) -> torch.Tensor:
    K = W.shape[-1]
    w = quantize_rtn(W.reshape(-1, K), cfg.group_size, cfg.symmetric)
    return dequantize(w, torch.float32).reshape(W.shape)


def awq_search(Ws: list[torch.Tensor], X: torch.Tensor, cfg: AWQConfig) -> AWQResult:
    """Per-input-channel scales for weights (..., N, K) sharing the input X (T, K)."""
    X = X.reshape(-1, X.shape[-1]).float()
    xmean = X.abs().mean(0).clamp(min=1e-6)  # (K,)
    ref = [W.float() @ X.t() for W in Ws]

    def loss(s: torch.Tensor) -> float:
        return sum(float(((_qdq(W.float() * s, cfg) / s) @ X.t() - r).pow(2).sum())
                   for W, r in zip(Ws, ref))

    best = (loss(torch.ones_like(xmean)), 0.0, torch.ones_like(xmean))
    rtn = best[0]
    for i in range(1, cfg.n_grid):
        alpha = i / cfg.n_grid
        s = xmean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        e = loss(s)
        if e < best[0]:
            best = (e, alpha, s)
    return AWQResult(best[2], best[1], best[0], rtn)


def fold_into_norm(weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """A norm's weight (K,) that outputs x / s."""
    return weight.float() / s


def fold_into_linear_rows(W: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """A producing Linear (..., K, J) whose outputs are divided by s (K,)."""
    return W.float() / s.unsqueeze(-1)


def scale_linear_inputs(W: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """A consuming Linear (..., N, K) whose input columns are multiplied by s (K,)."""
    return W.float() * s
