"""GPTQ Hessians of GLM-5.2-like layer inputs for the GPU checks (benchmarks/history/scripts/check_factor_gpu.py,
benchmarks/history/scripts/check_block_kernel_gpu.py): H = 2 XᵀX / T of bf16 inputs X (T = 4K tokens per expert)
with log-normal channel scales, 8 outlier channels (x20) and correlated columns (a random
mixing), + percdamp x mean(diag H) as GPTQ damps them. Drawn from torch's global generator."""

from __future__ import annotations

import torch


def hessians(E: int, K: int, device: torch.device, percdamp: float = 0.0) -> torch.Tensor:
    """(E, K, K) float32 on `device`. T = 4K tokens per expert: a 512 x 2048 run routes ~32k to
    each; 4K keeps H as well conditioned as that and the build quick."""
    T = 4 * K
    Hs = torch.empty(E, K, K, device=device)
    mix = torch.eye(K, device=device) + 0.3 * torch.randn(K, K, device=device) / K ** 0.5
    for e in range(E):
        scale = torch.exp(torch.randn(K, device=device) * 0.7)
        scale[torch.randperm(K, device=device)[:8]] *= 20
        X = ((torch.randn(T, K, device=device) * scale) @ mix).to(torch.bfloat16).float()
        H = 2 * X.mT @ X / T
        Hs[e] = H + percdamp * H.diagonal().mean() * torch.eye(K, device=device)
    return Hs
