"""The MoE forwards of a calibrated layer, alone: pass 2's (the rounded MLP's output over every
calibration token) and pass 1's statistics forward, on one GLM-5.2-shaped MoE block with
random weights (hidden 6144, 256 experts of width 2048, top-8, GLM-5.2's router), over
`--tokens` tokens in groups, each variant timed (CUDA events, after a warm-up) and its output
compared with transformers' own forward in float64 terms (max and mean relative error).

    PYTHONPATH=. python3 benchmarks/history/scripts/bench_moe_forward.py --out benchmarks/h200_moe_forward.json
    PYTHONPATH=. python3 benchmarks/history/scripts/bench_moe_forward.py --smoke     # tiny, on the CPU: checks the script

Variants of pass 2 (`--pass2`): `hf:G` the module's forward (transformers' grouped_mm experts)
on groups of G tokens; `ours:G` quantize.calib.capture.moe_output. Pass 1 (`--pass1`: G, ...):
capture.moe_forward(outputs=False) feeding MLPStats as the default GPTQ run does, on groups of
G tokens, its down_proj Hessians checked against float64 on four experts. Run it with an older
tree first on PYTHONPATH for an A/B of the same machine.
`--profile DIR` writes a torch.profiler table of one group of each variant.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch


def build_moe(smoke: bool, device: torch.device, seed: int = 0):
    from transformers import AutoConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaMoE

    from quantize.source.synth import GLM52_CONFIG, tiny_config

    cfg = tiny_config("glm_moe_dsa") if smoke else {**tiny_config("glm_moe_dsa"), **GLM52_CONFIG}
    if smoke:
        cfg.update(hidden_size=256, moe_intermediate_size=128, n_routed_experts=16,
                   num_experts_per_tok=4)
    cfg = {k: v for k, v in cfg.items() if k != "model_type"}
    hf = AutoConfig.for_model("glm_moe_dsa", **cfg)
    hf._experts_implementation = "grouped_mm"
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        moe = GlmMoeDsaMoE(hf).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            fan_in = p.shape[-1]
            p.copy_((torch.randn(p.shape, generator=g, device=device) / fan_in ** 0.5).to(p.dtype))
        moe.gate.weight.data = moe.gate.weight.data.float()
        moe.gate.e_score_correction_bias.copy_(torch.rand(moe.gate.num_experts, generator=g, device=device) * 0.1)
    return moe, hf


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_groups(fn, xs: list[torch.Tensor], device: torch.device, repeat: int) -> float:
    """Seconds per pass over every group (the best of `repeat` passes, one warm-up first)."""
    fn(xs[0])
    _sync(device)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for x in xs:
            fn(x)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (a.double() - ref.double()).abs()
    scale = ref.double().abs().mean()
    return {"max_rel": float(d.max() / scale), "mean_rel": float(d.mean() / scale)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512 * 2048)
    ap.add_argument("--pass2", default="hf:16384,ours:16384,ours:65536")
    ap.add_argument("--pass1", default="65536", help="token groups of pass 1's statistics forward")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench_out/moe_forward.json"))
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()

    from quantize.calib.capture import MLPStats, moe_forward

    try:
        from quantize.calib.capture import moe_output
    except ImportError:  # an older tree (an A/B): its pass 2 is the module's forward
        moe_output = None

    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        args.tokens = 4096
    moe, _ = build_moe(args.smoke, device)
    H = moe.experts.hidden_dim
    E = moe.experts.num_experts
    k = moe.gate.top_k
    x_all = torch.randn(args.tokens, H, generator=torch.Generator(device=device).manual_seed(1),
                        device=device).to(torch.bfloat16)
    flops = 2 * args.tokens * k * 3 * H * moe.experts.intermediate_dim
    res = {"command": "python3 benchmarks/history/scripts/bench_moe_forward.py " + " ".join(sys.argv[1:]), "tokens": args.tokens, "hidden": H, "experts": E,
        "top_k": k, "routed_gflop": round(flops / 1e9, 1), "pass2": [], "pass1": []}
    try:
        res["code"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True, check=False).stdout.strip()
    except OSError:
        pass
    if device.type == "cuda":
        res["device"] = torch.cuda.get_device_name(device)

    def groups(G: int) -> list[torch.Tensor]:
        return list(x_all.split(G))

    x_ref = x_all[: min(16384, args.tokens)]
    with torch.no_grad():
        ref = moe(x_ref)

    def profile(name: str, fn, x: torch.Tensor) -> None:
        if args.profile is None:
            return
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with prof(activities=acts) as p:
            fn(x)
            _sync(device)
        args.profile.mkdir(parents=True, exist_ok=True)
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        (args.profile / f"{name.replace(':', '_')}.txt").write_text(
            p.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60))

    with torch.no_grad():
        for spec in [s for s in args.pass2.split(",") if s]:
            kind, G = spec.split(":")
            if kind == "ours" and moe_output is None:
                continue
            fn = moe if kind == "hf" else (lambda x: moe_output(moe, x))
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            s = time_groups(fn, groups(int(G)), device, args.repeat)
            row = {"variant": spec, "s": round(s, 4), "tflops": round(flops / s / 1e12, 1),
                   "vs_hf_on_16k": rel_err(fn(x_ref), ref)}
            if device.type == "cuda":
                row["scratch_gib"] = round((torch.cuda.max_memory_allocated(device) - base) / 2**30, 2)
            res["pass2"].append(row)
            print(json.dumps(row), flush=True)
            profile("pass2-" + spec, fn, groups(int(G))[0])

        for G in [int(s) for s in args.pass1.split(",") if s]:
            xs = groups(G)

            def fresh() -> MLPStats:
                return MLPStats("moe", hessians=True, samples=False, all_experts=False, num_experts=E)

            moe_forward(moe, xs[0], fresh(), outputs=False)  # warm-up
            _sync(device)
            best = float("inf")
            for _ in range(args.repeat):
                st = fresh()
                t0 = time.perf_counter()
                for x in xs:
                    moe_forward(moe, x, st, outputs=False)
                _sync(device)
                best = min(best, time.perf_counter() - t0)
            row = {"variant": f"moe_forward:{G}", "s": round(best, 4),
                   "gate_up_tflops": round(2 * args.tokens * k * H * 2 * moe.experts.intermediate_dim / best / 1e12, 1),
                   "routed_pairs": sum(st.expert_tokens)}
            # expert down_proj Hessians of the first group against float64 (4 experts)
            st = fresh()
            moe_forward(moe, xs[0], st, outputs=False)
            errs = []
            x64 = xs[0].double()
            for e in sorted(st.S_down_e)[:4]:
                rows = torch.cat([r for _, r, _ in st.rows_e[e]])
                gu = x64[rows] @ moe.experts.gate_up_proj[e].double().t()
                g_, u_ = gu.chunk(2, dim=-1)
                inter = torch.nn.functional.silu(g_) * u_
                ref64 = inter.t() @ inter
                errs.append(float((st.S_down_e[e].double() - ref64).norm() / ref64.norm()))
            row["down_hessian_fro_rel_vs_float64"] = max(errs)
            res["pass1"].append(row)
            print(json.dumps(row), flush=True)
            profile(f"pass1-{G}", lambda x: moe_forward(moe, x, fresh(), outputs=False), xs[0])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
