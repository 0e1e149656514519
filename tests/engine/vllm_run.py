"""Load one checkpoint with vLLM on the CPU and save what the engine tests compare.

    python tests/engine/vllm_run.py MODEL_DIR OUT.pt PROMPT_IDS_JSON [--loader-only]

Run in its own process (one vLLM engine per process). Saves {"params": every parameter as
the weight loader wrote it (vllm_dequant_moe.loaded_parameters), "logprobs": float32
[T - 1, vocab] prompt log-probs (row t: the distribution of token t + 1 given tokens 0..t;
None with --loader-only: the engine is built and its weights loaded and post-processed, no
forward), "methods": each module's quantization method and scheme class}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the patch reaches it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
sys.path.insert(0, str(Path(__file__).parent))

import torch
import vllm_dequant_moe


def main(model_dir: str, out: str, prompt: str, *flags: str) -> None:
    vllm_dequant_moe.install()
    from vllm import LLM, SamplingParams

    ids = json.loads(prompt)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=128, max_num_seqs=1, max_num_batched_tokens=128, max_logprobs=vocab,
              seed=0)
    result = {"params": vllm_dequant_moe.loaded_parameters(), "logprobs": None,
              "methods": vllm_dequant_moe.quant_methods()}
    if "--loader-only" in flags:
        torch.save(result, out)
        return
    (res,) = llm.generate({"prompt_token_ids": ids},
                          SamplingParams(max_tokens=1, prompt_logprobs=vocab, temperature=0.0))
    lp = torch.full((len(ids) - 1, vocab), float("nan"), dtype=torch.float32)
    for t, row in enumerate(res.prompt_logprobs[1:]):  # [0] is None: nothing predicts token 0
        for tok, logprob in row.items():
            lp[t, tok] = logprob.logprob
    torch.save({**result, "logprobs": lp}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
