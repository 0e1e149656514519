"""Pass 2's top-k weighted sum as a Triton kernel (`moe_triton.combine_topk`) against the torch
expression `capture.moe_output` runs on the CPU, and against float64.

Run by tests/triton_script.py (compiled on a GPU, else under Triton's interpreter); skipped
where triton is not installed, whose machines run the torch expression.
"""

from __future__ import annotations

import textwrap

from triton_script import needs_triton, run_script

pytestmark = needs_triton("the torch expression is used")

SCRIPT = textwrap.dedent("""
    import os
    import torch
    from quantize.calib import moe_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    T, k, H, E = 37, 4, 1100, 6  # H: one full block of BLOCK_H and a ragged one
    moe_triton.BLOCK_H = 1024
    y = (torch.randn(T * k, H, generator=g) * 3).to(torch.bfloat16).to(dev)  # expert order
    inv = torch.randperm(T * k, generator=g).to(dev)  # each (token, slot) pair's row of y
    w = torch.rand(T, k, generator=g).to(dev) * 2.5
    rows = y.index_select(0, inv).view(T, k, H)
    torch_f32 = (rows * w[:, :, None]).sum(dim=1)  # what moe_output computes without the kernel
    got_f32 = moe_triton.combine_topk(y, inv, w, torch.float32)
    got_bf16 = moe_triton.combine_topk(y, inv, w, torch.bfloat16)
    terms = rows.double() * w.double()[:, :, None]
    exact = terms.sum(dim=1)
    # float32 rounding of k products and k additions: at most 2k units of 2^-24 of sum |terms|
    bound = 2 * k * 2.0 ** -24 * terms.abs().sum(dim=1)
    assert bool(((got_f32.double() - exact).abs() <= bound).all())
    # the same products added in the same order: equal to the torch expression's float32 sum
    # except where that reduction groups the k terms otherwise (counted, not assumed)
    same_f32 = float((got_f32 == torch_f32).float().mean())
    same_bf16 = float((got_bf16 == torch_f32.to(torch.bfloat16)).float().mean())
    assert torch.equal(got_bf16, got_f32.to(torch.bfloat16))
    print(dev, same_f32, same_bf16)
""")


def test_combine_topk_matches_the_torch_sum():
    out = run_script(SCRIPT, timeout=600)
    dev, same_f32, same_bf16 = out.split()
    if dev == "cpu":  # the interpreter against torch's CPU sum: the same order, bit for bit
        assert float(same_f32) == float(same_bf16) == 1.0, out
    else:  # a GPU reduction may group the k terms otherwise: float32 ulps, rare bf16 flips
        assert float(same_bf16) >= 0.999 and float(same_f32) >= 0.9, out
