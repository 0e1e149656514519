"""What INT4 weights buy at serving time: the KV cache's room per GPU, in tokens.

Every GPU of a TP group holds its share of the weights; the engine keeps a fixed fraction of
the GPU's memory for weights + KV cache (SGLang's `mem_fraction_static`) and fills what the
weights leave with KV-cache slots. Fewer weight bytes per GPU: more tokens in flight.

Bytes per token, per layer, per GPU, as the engines store them:
- GLM-5.x (DSA, sparse MLA; `kv_lora_rank` + `index_topk` in the config): one latent row, the
  512-wide normed `kv_c` and the 64-wide RoPE key. BF16: (512 + 64) x 2 = 1,152 B. FP8 as both
  SGLang and vLLM store sparse MLA: 512 e4m3 + 4 fp32 tile scales (one per 128) + 64 BF16 =
  656 B. The DSA indexer keeps its own key cache either way: `index_head_dim` e4m3 + one fp32
  scale = 132 B. So FP8 holds 1,284 / 788 = 1.63x the tokens of BF16 with the indexer (1.76x
  without), not 2x. MLA's latent is not split by TP: every rank caches the whole row.
- MLA without an indexer (DeepSeek-V3 style): (kv_lora_rank + rope) x 2 B, FP8 576 B flat.
- GQA (GLM-4.x, Llama, Qwen): K and V of the KV heads this rank holds, ceil(heads / TP) (a
  head is replicated when there are fewer heads than ranks) x head_dim x 2 (K, V) x the dtype.

SGLang 0.5.23's `mem_fraction_static` when none is given (`arg_groups/memory_hook.py`,
`_handle_gpu_memory_settings`): (GPU MiB - reserved) / GPU MiB, reserved = 512 + 1.5 x
chunked_prefill_size + TP/8 x 1024 + 2 x the decode CUDA-graph max batch (+ 1,536 for an MLA
model's prefill graph, taken as on), at least 10 GiB on a GPU over 60 GiB. On H100 / H200 at
TP >= 4: chunked prefill 8,192 and max batch 512; at TP 8 an MLA model (GLM-5) reserves 16,384
MiB: 0.886 of an H200 (143,771 MiB), 0.799 of an H100 (81,559 MiB). The engine's own log line
("mem_fraction_static=...") is the figure to trust; pass it as --mem-fraction.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from quantize.sizes import GiB

__all__ = ["GPU_MEMORY_MIB", "KvRoom", "describe", "gpu_bytes", "kv_bytes_per_token", "kv_room",
           "sglang_mem_fraction"]

# the total memory torch / nvidia-smi report, MiB
GPU_MEMORY_MIB = {"h100": 81_559, "h200": 143_771, "b200": 183_359}


def gpu_bytes(text: str) -> int:
    """`--gpu-memory`: h100, h200, b200 (the memory torch reports for them) or a size (141GB,
    140GiB, 143771MiB) -> bytes."""
    from quantize.options import parse_size

    t = text.strip().lower()
    if t in GPU_MEMORY_MIB:
        return GPU_MEMORY_MIB[t] * 2**20
    try:
        n = parse_size(text)
    except ValueError:
        n = 0
    if n < 2**30:
        raise ValueError(f"--gpu-memory {text!r}: expected h100, h200, b200 or a size such as "
                         "141GB or 143771MiB (nvidia-smi's total)")
    return n


def _layers(config: dict) -> int:
    return int(config.get("num_hidden_layers") or 0)


def kv_bytes_per_token(config: dict, tp: int, dtype: str) -> tuple[int, str]:
    """KV-cache bytes one token takes on one GPU of a TP group, over every decoder layer, and
    how they were counted. `dtype`: "bf16" or "fp8" (the engine's --kv-cache-dtype)."""
    if dtype not in ("bf16", "fp8"):
        raise ValueError(f"dtype {dtype!r}: bf16 or fp8")
    L = _layers(config)
    lora, rope = config.get("kv_lora_rank"), config.get("qk_rope_head_dim")
    if isinstance(lora, int) and isinstance(rope, int):  # MLA: the latent row, whole on each rank
        dsa = isinstance(config.get("index_topk"), int) and config.get("index_head_dim")
        if dtype == "bf16":
            row, how = (lora + rope) * 2, f"({lora} + {rope}) x 2 B"
        elif dsa:
            row = lora + 4 * math.ceil(lora / 128) + rope * 2
            how = f"{lora} e4m3 + {math.ceil(lora / 128)} fp32 scales + {rope} x 2 B"
        else:
            row, how = lora + rope, f"({lora} + {rope}) e4m3"
        if dsa:
            idx = int(config["index_head_dim"]) + 4
            row += idx
            how += f" + the DSA indexer's {idx} B ({config['index_head_dim']} e4m3 + an fp32 scale)"
        return row * L, f"MLA latent per layer: {how} = {row} B, x {L} layers (not split by TP)"
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // max(heads or 1, 1))
    per_rank = math.ceil(kv / tp)
    size = 2 if dtype == "bf16" else 1
    row = 2 * per_rank * head_dim * size
    return row * L, (f"GQA per layer: K and V of {per_rank} of {kv} KV heads per GPU x {head_dim} "
                     f"x {size} B = {row} B, x {L} layers")


def sglang_mem_fraction(gpu_mib: float, tp: int, mla: bool) -> float:
    """SGLang 0.5.23's default `mem_fraction_static` (module docstring), for H100/H200-class
    GPUs (60-160 GiB); other sizes take the same rule with that band's defaults."""
    if gpu_mib < 60 * 1024:
        chunk, max_bs = 4096, (32 if tp < 4 else 160)
    elif gpu_mib < 160 * 1024:
        chunk, max_bs = 8192, (256 if tp < 4 else 512)
    else:
        chunk, max_bs = 16384, 512
    reserved = 512 + 1.5 * max(chunk, 2048) + tp / 8 * 1024 + 2 * max_bs + (1536 if mla else 0)
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mib - reserved) / gpu_mib, 3)


@dataclass(frozen=True)
class KvRoom:
    """The KV room on one GPU for the source's and the output's weights."""
    gpu_bytes: int
    mem_fraction: float
    mem_fraction_source: str
    tp: int
    weights_source: float  # bytes per GPU (even split)
    weights_output: float
    per_token: dict  # dtype -> bytes per token per GPU
    per_token_how: dict
    tokens: dict  # "source"/"output" -> dtype -> tokens (0 where the weights do not fit)

    def to_json(self) -> dict:
        return asdict(self)


def kv_room(config: dict, tp: int, gpu_bytes: int, weights_source: float, weights_output: float,
            mem_fraction: float | None = None) -> KvRoom:
    """Tokens of KV cache each GPU holds beside the source's and the output's weights, with a BF16
    and an FP8 cache; `mem_fraction` None: SGLang's default for this GPU and TP."""
    mla = isinstance(config.get("kv_lora_rank"), int)
    how = "given"
    if mem_fraction is None:
        mem_fraction = sglang_mem_fraction(gpu_bytes / 2**20, tp, mla)
        how = "SGLang 0.5.23's default for this GPU memory and TP (memory_hook.py)"
    per, per_how = {}, {}
    for dt in ("bf16", "fp8"):
        per[dt], per_how[dt] = kv_bytes_per_token(config, tp, dt)
    budget = mem_fraction * gpu_bytes
    tokens = {side: {dt: max(0, int((budget - w) // per[dt])) if per[dt] else 0 for dt in per}
              for side, w in (("source", weights_source), ("output", weights_output))}
    return KvRoom(gpu_bytes, mem_fraction, how, tp, weights_source, weights_output, per, per_how,
                  tokens)


def describe(room: KvRoom) -> list[str]:
    """The assumptions, one line each, as plan prints them."""
    return [(f"GPU memory {room.gpu_bytes / GiB:,.1f} GiB; engine fraction for weights + KV "
             f"{room.mem_fraction:.3f} ({room.mem_fraction_source})"),
            (f"weights per GPU at TP {room.tp} (even split): source "
             f"{room.weights_source / GiB:,.1f} GiB, output {room.weights_output / GiB:,.1f} GiB"),
            *(f"{dt.upper()} cache: {room.per_token[dt]:,} B per token per GPU "
              f"({room.per_token_how[dt]})" for dt in ("bf16", "fp8")),
            "no MTP draft layer counted (speculative decoding adds its layer's cache), no DP attention"]
