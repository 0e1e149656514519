"""Calibration cost of one GLM-5.2-shaped MoE layer on one GPU: time and peak memory per layer.

    OMP_NUM_THREADS=8 PYTHONPATH=. python benchmarks/history/scripts/bench_calib_gpu.py --out bench_out/calib_gpu.json
    # with llm-compressor side by side (optional wheels, see --llmcompressor):
    OMP_NUM_THREADS=8 PYTHONPATH=. python benchmarks/history/scripts/bench_calib_gpu.py --llmcompressor

Model: a 2-layer `glm_moe_dsa` with GLM-5.2's shapes (hidden 6144, MLA q_lora 2048 / kv_lora
512, 64 heads, DSA indexer 32 x 128, layer 0 dense 12288, layer 1: 256 routed experts of width
2048, top-8, + 1 shared), no MTP layer, vocab cut to 32768 (only the embedding depends on it),
block-FP8 like the release, written by `quantize.source.synth` (~10 GB on disk, a few minutes).
Calibration: 64 x 2048 random token ids (seed 0), group 32, targets routed.

Runs, each through `quantize.calib.loop.Calibrator` on the FP8 checkpoint (what `convert` does
for one layer; the report's per-layer `seconds` and `peak_gpu_gib` are the figures):
    rtn-plain   the RTN path: read + dequantize + round every routed expert of layer 1 (no forward)
    rtn         calibration pipeline with RTN rounding (forward, capture, round, forward again)
    gptq        GPTQ, routed-token Hessians per expert (--expert-calibration routed)
    gptq-all    GPTQ, every expert on every token, one shared gate/up Hessian
    awq         AWQ scale search + RTN
llm-compressor (--llmcompressor): `oneshot` GPTQ W4A16 group 32 on the BF16 copy of the same
model, sequential pipeline, all-expert MoE calibration where its version supports it; its
failure, if any, is recorded rather than fatal.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from quantize.calib.data import CalibrationSet
from quantize.calib.loop import Calibrator
from quantize.options import ConvertOptions
from quantize.pipeline import compute_unit
from quantize.plan import make_plan
from quantize.source.checkpoint import open_checkpoint
from quantize.source.synth import GLM52_CONFIG, tiny_config, write_checkpoint, write_tokenizer

RUNS = {
    "rtn": {"method": "rtn"},
    "gptq": {"method": "gptq", "expert_calibration": "routed"},
    "gptq-all": {"method": "gptq", "expert_calibration": "all"},
    # the GPTQ defaults before issue 16 (no MSE clip, dampening 0.01): llm-compressor's choices
    "gptq-noclip": {"method": "gptq", "expert_calibration": "routed", "mse_clip": False,
                    "percdamp": 0.01},
    "awq": {"method": "awq"},
}


def glm52_two_layers(vocab: int) -> dict:
    base = tiny_config("glm_moe_dsa")  # the defaults the release config leaves implicit
    cfg = {**base, **GLM52_CONFIG}
    cfg.update(num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=0,
               vocab_size=vocab, max_position_embeddings=4096)
    return cfg


def gib(n: int) -> float:
    return round(n / 2**30, 2)


def reset(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def peak(dev: torch.device) -> float | None:
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    return gib(torch.cuda.max_memory_allocated(dev))


def run_ours(src: Path, name: str, kw: dict, tokens: torch.Tensor, dev: torch.device) -> dict:
    ck = open_checkpoint(src)
    opts = ConvertOptions(group_size=32, num_samples=tokens.shape[0], seq_len=tokens.shape[1], **kw)
    plan = make_plan(ck, opts)
    calib = CalibrationSet(tokens, "random token ids (seed 0)", tokens.shape[0], tokens.numel(),
                           False, "unused")
    reset(dev)
    t0 = time.perf_counter()
    c = Calibrator(ck, plan, opts, dev, log=lambda m: print(f"  [{name}] {m}", flush=True), calib=calib)
    for u in plan.units:
        c.result(u)
    peak_gib = peak(dev)
    rep = c.report()
    layers = [{k: v for k, v in lay.items() if k not in ("expert_tokens", "modified_bf16")}
              for lay in rep["layers"]]
    moe = next(lay for lay in rep["layers"] if lay.get("mlp") == "moe")
    out = {"run": name, **kw, "mse_clip": opts.mse_clip, "percdamp": opts.percdamp,
           "total_seconds": round(time.perf_counter() - t0, 2),
           "peak_gpu_gib": peak_gib, "layers": layers,
           "moe_expert_tokens_min_max": [min(moe["expert_tokens"]), max(moe["expert_tokens"])]}
    del c
    reset(dev)
    return out


def run_rtn_plain(src: Path, dev: torch.device) -> dict:
    ck = open_checkpoint(src)
    opts = ConvertOptions(group_size=32)
    units = [u for u in make_plan(ck, opts).units if u.action == "quantize" and ".layers.1." in u.source]
    reset(dev)
    t0 = time.perf_counter()
    for u in units:
        for t in compute_unit(ck, u, opts, dev):
            t.cpu()
    p = peak(dev)
    return {"run": "rtn-plain", "modules": len(units), "seconds": round(time.perf_counter() - t0, 2),
            "peak_gpu_gib": p}


def run_llmcompressor(src_bf16: Path, tokens: torch.Tensor, dev: torch.device) -> dict:
    try:
        import llmcompressor
        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import GPTQModifier
        from transformers import AutoModelForCausalLM, AutoTokenizer

        reset(dev)
        model = AutoModelForCausalLM.from_pretrained(src_bf16, dtype=torch.bfloat16, device_map=str(dev),
                                                     trust_remote_code=False)
        loaded = peak(dev)
        recipe = GPTQModifier(
            config_groups={"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
            ignore=["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:.*shared_experts.*",
                    "re:model\\.layers\\.0\\.mlp\\..*"])
        ds = Dataset.from_dict({"input_ids": tokens.tolist(),
                                "attention_mask": torch.ones_like(tokens).tolist()})
        t0 = time.perf_counter()
        kwargs = {"moe_calibrate_all_experts": True}
        tok = AutoTokenizer.from_pretrained(src_bf16, trust_remote_code=False)
        try:
            oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=tokens.shape[0],
                    max_seq_length=tokens.shape[1], processor=tok, **kwargs)
        except TypeError:  # a version without that argument
            kwargs = {}
            oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=tokens.shape[0],
                    max_seq_length=tokens.shape[1], processor=tok)
        seconds = round(time.perf_counter() - t0, 2)
        return {"run": "llm-compressor oneshot GPTQ W4A16 g32", "version": llmcompressor.__version__,
                "args": kwargs, "seconds": seconds, "peak_gpu_gib": peak(dev),
                "model_loaded_gib": loaded}
    except Exception as e:  # noqa: BLE001 - an optional baseline: record why it did not run
        return {"run": "llm-compressor", "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench-calib-gpu"))
    ap.add_argument("--out", type=Path, default=Path("bench_out/calib_gpu.json"))
    ap.add_argument("--runs", default="rtn-plain,rtn,gptq,gptq-all,awq",
                    help="comma list of our runs, or 'none' (e.g. only --llmcompressor)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the "
                    "script end to end without a GPU (figures meaningless)")
    ap.add_argument("--llmcompressor", action="store_true", help="also run llm-compressor oneshot "
                    "(needs llmcompressor + datasets installed, e.g. from carried wheels)")
    args = ap.parse_args()
    if args.smoke:
        dev, cfg = torch.device("cpu"), tiny_config("glm_moe_dsa", num_hidden_layers=2,
                                                    num_nextn_predict_layers=0)
        args.vocab, args.samples, args.seq_len = cfg["vocab_size"], 4, 64
        src = args.workdir / "smoke-fp8"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device (or --smoke)")
        dev, cfg = torch.device("cuda"), glm52_two_layers(args.vocab)
        src = args.workdir / "glm52-2layer-fp8"
    ours = [n for n in args.runs.split(",") if n and n != "none"]
    if ours and not (src / "config.json").exists():
        t0 = time.perf_counter()
        write_checkpoint(src, cfg, "fp8-block", shard_bytes=4 * 10**9, device=dev.type)
        print(f"wrote {src} in {time.perf_counter() - t0:.0f} s", flush=True)
    tokens = torch.randint(0, args.vocab, (args.samples, args.seq_len),
                           generator=torch.Generator().manual_seed(0))
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "model": "glm_moe_dsa, GLM-5.2 shapes, 2 layers (0 dense, 1 MoE 256x2048 top-8), FP8 block",
           "tokens": list(tokens.shape), "group_size": 32, "command": " ".join(sys.argv), "runs": []}
    for name in ours:
        r = run_rtn_plain(src, dev) if name == "rtn-plain" else run_ours(src, name, RUNS[name], tokens, dev)
        print(json.dumps(r), flush=True)
        res["runs"].append(r)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2))
    if args.llmcompressor:
        src_bf16 = args.workdir / ("smoke-bf16" if args.smoke else "glm52-2layer-bf16")
        if not (src_bf16 / "config.json").exists():
            write_checkpoint(src_bf16, cfg, "bf16", shard_bytes=4 * 10**9)
            write_tokenizer(src_bf16, cfg["vocab_size"])  # oneshot wants the model's processor
        r = run_llmcompressor(src_bf16, tokens, dev)
        print(json.dumps({k: v for k, v in r.items() if k != "traceback"}), flush=True)
        res["runs"].append(r)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
