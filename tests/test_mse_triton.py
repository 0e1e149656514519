"""The MSE clip search as one Triton kernel against the eager loop: bit-identical scales and zps.

`gptq_triton.mse_clip_qparams` repeats `gptq._group_qparams`' arithmetic op for op (IEEE
division, round half to even, the bf16 roundings of `rtn_qparams` / `_dequant`) and adds each
group's errors in the eager loop's fixed order (`gptq._tree_sum`), launched without FMA
contraction, so no tolerance is needed: near-tie groups (different scales whose errors differ
in the last bits) are decided the same way. Measured: every scale and zero point equal, under
the interpreter here and compiled on an H200 (benchmarks/history/scripts/check_mse_gpu.py, 32 GLM-5.2 experts).

Run by tests/triton_script.py (compiled on a GPU, with `_group_qparams`' dispatch to it, else
under Triton's interpreter on small shapes); skipped where triton is not installed, whose
machines run the eager loop.
"""

from __future__ import annotations

import textwrap

from triton_script import needs_triton, run_script

pytestmark = needs_triton("the eager loop is used")

SCRIPT = textwrap.dedent("""
    import itertools
    import os
    import torch
    from dataclasses import replace
    import quantize.rounding.gptq as G
    from quantize.rounding.int4 import QMAX, QMIN, rtn_qparams

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    # (B, N, K, g, shared Hdiag): odd row counts, G from 1 to 6, a g that is no power of two
    shapes = [(2, 7, 192, 32, False), (1, 9, 256, 64, True), (3, 5, 256, 128, False),
              (2, 6, 96, 48, True)]
    groups = moved = 0
    for B, N, K, g, shared in shapes:
        for symmetric, bf16, norm in itertools.product((True, False), (True, False), (2, 3)):
            W = torch.randn(B, N, K, generator=gen) * torch.rand(B, N, 1, generator=gen)
            W[0, 0, :g] = 0.0  # an all-zero group: eps scale
            W[-1, -1, -g:] = W[-1, -1, -g:].abs()  # min > 0: clamped through 0
            if bf16:
                W = W.bfloat16().float()  # (B, N, K) bf16 values, as checkpoints give
            Hd = torch.rand(1 if shared else B, K, generator=gen)  # (Bh, K) > 0
            Hd[torch.rand(Hd.shape, generator=gen) < 0.1] = 0.0  # dead inputs
            Hd[0, :g] = 0.0  # a group of dead inputs: every p ties, RTN is kept
            W, Hd = W.to(dev), Hd.to(dev)
            cfg = G.GPTQConfig(group_size=g, symmetric=symmetric, mse_clip=True, mse_norm=norm)
            ref_s, ref_z = G._group_qparams(W, Hd, replace(cfg, fused=False))
            got_s, got_z = G.gptq_triton.mse_clip_qparams(W, Hd, G.MSE_SHRINK, g, symmetric,
                                                          QMIN, QMAX, cube=norm == 3)
            case = (seed, B, N, K, g, shared, symmetric, bf16, norm)
            assert got_s.dtype == ref_s.dtype and got_s.shape == ref_s.shape, case
            same = (got_s == ref_s).double().mean().item()
            assert torch.equal(got_s, ref_s), (case, same)
            if symmetric:
                assert got_z is None and ref_z is None, case
            else:
                assert got_z.dtype == torch.int8 and torch.equal(got_z, ref_z), case
            if dev == "cuda":  # the dispatch in _group_qparams takes the kernel there
                via = G._group_qparams(W, Hd, cfg)
                assert torch.equal(via[0], ref_s), case
            rtn, _ = rtn_qparams(W.reshape(B * N, K), g, symmetric)
            groups += ref_s.numel()
            moved += (ref_s.reshape(B * N, -1) != rtn).sum().item()
    assert moved > groups // 4, (moved, groups)  # the search is not trivially p = 1
    print(dev, groups, moved)
""")


def test_mse_clip_kernel_matches_the_eager_loop():
    run_script(SCRIPT, timeout=600)
