"""Synthetic GLM checkpoints in the exact release layouts, for the demo, tests and benchmarks.

`release_tensors(config, fmt)` lists every tensor a GLM release of that config holds, with
its on-disk dtype and shape (GLM-5.x `glm_moe_dsa` block FP8, GLM-4.x `glm4_moe` channel
FP8, or BF16), the MTP layer `num_hidden_layers` included. With the real GLM-5.2 config it
gives the release's 118,629 tensors and 755,617,140,416 bytes (703.7 GiB), checked with tensors
and bytes per dtype and parameters per group against what the release publishes
(tests/test_plan.py).

`write_checkpoint` fills them with seeded random weights (or, `sparse=True`, writes only the
headers into sparse files: a full-size replica for `plan` that costs no disk), in several
shards, with one FP8 scale deliberately stored in another shard than its weight.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantize.plan import OutTensor, shard_header
from quantize.source.checkpoint import DTYPE_BYTES, INDEX_NAME, SourceFormat, torch_dtype
from quantize.source.layout import natural_key

__all__ = ["GLM52_CONFIG", "release_tensors", "tiny_config", "write_checkpoint", "write_tokenizer"]

FP8_MAX = 448.0  # largest finite float8_e4m3fn

# The GLM-5.2 FP8 release's config.json, the fields that decide tensor shapes.
GLM52_CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
    "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_nextn_predict_layers": 1,
    "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
    "v_head_dim": 256, "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
    "index_topk_freq": 4, "index_skip_topk_offset": 3, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

FP8_BLOCK_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}


def tiny_config(model_type: str = "glm_moe_dsa", **overrides) -> dict:
    """A small config of either architecture with ragged (non-multiple-of-128) dimensions."""
    if model_type == "glm_moe_dsa":
        cfg = {
            "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
            "vocab_size": 512, "hidden_size": 256, "intermediate_size": 384,
            "moe_intermediate_size": 96, "num_hidden_layers": 3, "num_nextn_predict_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
            "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
            "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
            "v_head_dim": 32, "index_n_heads": 2, "index_head_dim": 32, "index_topk": 16,
            "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 256, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "bos_token_id": 0, "eos_token_id": 1,
        }
    elif model_type == "glm4_moe":
        cfg = {
            "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
            "vocab_size": 512, "hidden_size": 256, "intermediate_size": 384,
            "moe_intermediate_size": 96, "num_hidden_layers": 3, "num_nextn_predict_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "first_k_dense_replace": 1, "use_qk_norm": True, "attention_bias": True,
            "partial_rotary_factor": 0.5, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
        }
    else:
        raise ValueError(f"unknown model_type {model_type!r}")
    cfg.update(overrides)
    return cfg


def _indexer_layers(cfg: dict) -> set[int]:
    L = cfg["num_hidden_layers"]
    freq = max(cfg.get("index_topk_freq", 1), 1)
    offset = cfg.get("index_skip_topk_offset", 2)
    return {i for i in range(L) if max(i - offset + 1, 0) % freq == 0} | {L}


def _attention(cfg: dict, a: str, indexer: bool, dsa: bool, linear, bf16) -> None:
    """One layer's attention tensors under prefix `a` (MLA + the DSA indexer on its layers, or
    GQA), through release_tensors' `linear` / `bf16` recorders."""
    H = cfg["hidden_size"]
    if dsa:
        nh, nope, rope, vh = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"],
                              cfg["qk_rope_head_dim"], cfg["v_head_dim"])
        ql, kvl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
        linear(a + "q_a_proj", ql, H)
        bf16(a + "q_a_layernorm.weight", ql)
        linear(a + "q_b_proj", nh * (nope + rope), ql)
        linear(a + "kv_a_proj_with_mqa", kvl + rope, H)
        bf16(a + "kv_a_layernorm.weight", kvl)
        linear(a + "kv_b_proj", nh * (nope + vh), kvl)
        linear(a + "o_proj", H, nh * vh)
        if indexer:
            ih, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
            linear(a + "indexer.wq_b", ih * ihd, ql)
            linear(a + "indexer.wk", ihd, H)
            bf16(a + "indexer.k_norm.weight", ihd)
            bf16(a + "indexer.k_norm.bias", ihd)
            bf16(a + "indexer.weights_proj.weight", ih, H)
    else:
        nh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or H // nh
        for proj, n in (("q_proj", nh * hd), ("k_proj", kvh * hd), ("v_proj", kvh * hd)):
            linear(a + proj, n, H)
            if cfg.get("attention_bias"):
                bf16(a + proj + ".bias", n)
        linear(a + "o_proj", H, nh * hd)
        if cfg.get("use_qk_norm"):
            bf16(a + "q_norm.weight", hd)
            bf16(a + "k_norm.weight", hd)


def release_tensors(cfg: dict, fmt: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (safetensors dtype, shape)} of a release of `cfg` in source format `fmt`."""
    H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    E, I, DI = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
    T: dict[str, tuple[str, tuple[int, ...]]] = {}

    def linear(name: str, n: int, k: int) -> None:
        if fmt == SourceFormat.BF16:
            T[name + ".weight"] = ("BF16", (n, k))
        elif fmt == SourceFormat.FP8_BLOCK:
            T[name + ".weight"] = ("F8_E4M3", (n, k))
            T[name + ".weight_scale_inv"] = ("F32", (math.ceil(n / 128), math.ceil(k / 128)))
        else:
            T[name + ".weight"] = ("F8_E4M3", (n, k))
            T[name + ".weight_scale"] = ("BF16", (n, 1))

    def bf16(name: str, *shape: int, dtype: str = "BF16") -> None:
        T[name] = (dtype, shape)

    bf16("model.embed_tokens.weight", V, H)
    bf16("lm_head.weight", V, H)
    bf16("model.norm.weight", H)
    dsa = cfg["model_type"] == "glm_moe_dsa"
    idx_layers = _indexer_layers(cfg) if dsa else set()
    n_mtp = cfg.get("num_nextn_predict_layers", 0)
    for layer in range(L + n_mtp):
        p = f"model.layers.{layer}."
        bf16(p + "input_layernorm.weight", H)
        bf16(p + "post_attention_layernorm.weight", H)
        _attention(cfg, p + "self_attn.", layer in idx_layers, dsa, linear, bf16)
        m = p + "mlp."
        if layer < cfg["first_k_dense_replace"]:
            linear(m + "gate_proj", DI, H)
            linear(m + "up_proj", DI, H)
            linear(m + "down_proj", H, DI)
        else:
            bf16(m + "gate.weight", E, H)
            bf16(m + "gate.e_score_correction_bias", E, dtype="F32")
            for e in range(E):
                linear(m + f"experts.{e}.gate_proj", I, H)
                linear(m + f"experts.{e}.up_proj", I, H)
                linear(m + f"experts.{e}.down_proj", H, I)
            SI = I * cfg.get("n_shared_experts", 1)
            linear(m + "shared_experts.gate_proj", SI, H)
            linear(m + "shared_experts.up_proj", SI, H)
            linear(m + "shared_experts.down_proj", H, SI)
        if layer >= L:  # the MTP (next-token prediction) layer
            bf16(p + "eh_proj.weight", H, 2 * H)
            bf16(p + "enorm.weight", H)
            bf16(p + "hnorm.weight", H)
            bf16(p + "shared_head.norm.weight", H)
    return T


def source_config(cfg: dict, fmt: str) -> dict:
    """The config.json a release in `fmt` ships (its quantization_config included)."""
    out = dict(cfg)
    if fmt == SourceFormat.FP8_BLOCK:
        out["quantization_config"] = {**FP8_BLOCK_QC, "modules_to_not_convert": [
            "lm_head", "model.embed_tokens", "model.layers.*.mlp.gate", "indexers_proj"]}
    elif fmt == SourceFormat.FP8_CHANNEL:
        out["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                            "dynamic": False, "observer": "minmax"},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                      "strategy": "token", "dynamic": True, "observer": None}}},
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*eh_proj.*", "re:.*shared_head.*"],
        }
    return out


def _fill(name: str, dtype: str, shape: tuple[int, ...], gen: torch.Generator,
          fmt: str, scale_of: dict[str, str]) -> dict[str, torch.Tensor]:
    """Seeded values for one tensor (and its FP8 scale): a float master, then FP8-quantized."""
    if name in scale_of:  # a scale: produced with its weight
        return {}
    if len(shape) == 1:
        base = 1.0 if name.endswith("norm.weight") else 0.0
        t = base + 0.02 * torch.randn(shape, generator=gen, device=gen.device)
        return {name: t.to(torch_dtype(dtype)).cpu()}
    n, k = shape
    std = 1.0 if "embed_tokens" in name else k ** -0.5
    w = torch.randn(shape, generator=gen, device=gen.device) * std
    if ".experts.0.down_proj" in name and n >= 2 and k >= 32:
        w[1, :32] = 0.0  # one all-zero group: scale must fall back to eps, codes to 0
    if dtype != "F8_E4M3":
        return {name: w.to(torch_dtype(dtype)).cpu()}
    stem = name[: -len("weight")]
    if fmt == SourceFormat.FP8_BLOCK:
        nb, kb = math.ceil(n / 128), math.ceil(k / 128)
        wp = torch.nn.functional.pad(w, (0, kb * 128 - k, 0, nb * 128 - n))
        amax = wp.reshape(nb, 128, kb, 128).abs().amax(dim=(1, 3)).clamp(min=1e-12)  # (nb, kb)
        s = amax / FP8_MAX
        full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        return {name: (w / full).to(torch.float8_e4m3fn).cpu(), stem + "weight_scale_inv": s.float().cpu()}
    s = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # (n, 1)
    return {name: (w / s).to(torch.float8_e4m3fn).cpu(), stem + "weight_scale": s.to(torch.bfloat16).cpu()}


def write_checkpoint(out: str | Path, cfg: dict, fmt: str = SourceFormat.FP8_BLOCK, seed: int = 0,
                     shard_bytes: int = 2 * 2**20, sparse: bool = False, device: str = "cpu") -> Path:
    """Write a checkpoint of `cfg` in `fmt` into `out` (several shards + index + config).
    `device`: where the random values are drawn (a GPU builds a GLM-5.2-sized slice ~10x
    faster; other values than the CPU's for the same seed).

    The scale of the first routed expert's gate_proj is moved to the last shard, as real
    releases sometimes split a weight from its scale.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    specs = release_tensors(cfg, fmt)
    names = sorted(specs, key=natural_key)
    scale_of = {n: n.rsplit(".", 1)[0] + ".weight" for n in names if n.endswith(("weight_scale_inv", "weight_scale"))}
    moved = next((s for s, w in scale_of.items() if ".experts.0.gate_proj" in w), None)
    if moved:
        names.remove(moved)
        names.append(moved)
    groups: list[list[str]] = [[]]
    size = 0
    for n in names:
        nb = math.prod(specs[n][1]) * DTYPE_BYTES[specs[n][0]]
        if groups[-1] and size + nb > shard_bytes and n != moved:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nb
    total = len(groups)
    weight_map: dict[str, str] = {}
    gen = torch.Generator(device=device).manual_seed(seed)
    pending: dict[str, torch.Tensor] = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        for n in group:
            weight_map[n] = fname
        if sparse:
            planned = [OutTensor(n, *specs[n]) for n in group]
            header = shard_header(planned)
            with open(out / fname, "wb") as f:
                f.write(header)
            os.truncate(out / fname, len(header) + sum(t.nbytes for t in planned))
            continue
        tensors = {}
        for n in group:
            if n not in pending:
                pending.update(_fill(n, *specs[n], gen, fmt, scale_of))
            tensors[n] = pending.pop(n)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
    total_size = sum(math.prod(s) * DTYPE_BYTES[d] for d, s in specs.values())
    (out / INDEX_NAME).write_text(json.dumps(
        {"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(source_config(cfg, fmt), indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.get("bos_token_id", 0), "eos_token_id": cfg.get("eos_token_id", 1)}))
    return out


# Special tokens first, so their ids match tiny_config's bos_token_id 0 / eos_token_id 1.
_SPECIALS = ["<|begin|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@functools.lru_cache(maxsize=4)
def _train_tokenizer(vocab_size: int) -> str:
    """tokenizer.json text of a byte-level BPE trained on the small shipped calibration set's first
    200 kB (a second on one core; every byte is encodable, so any text tokenizes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from quantize.calib.data import SHIPPED_SETS, read_documents

    texts = [d if isinstance(d, str) else "\n".join(m["content"] for m in d)
             for d in read_documents(SHIPPED_SETS["small"])]
    corpus, n = [], 0
    for t in texts:
        corpus.append(t)
        n += len(t)
        if n > 200_000:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok.to_str()


def write_tokenizer(out: str | Path, vocab_size: int, prefix: tuple[str, ...] = (),
                    suffix: tuple[str, ...] = (), chat_start: str = "") -> Path:
    """Write tokenizer.json + tokenizer_config.json (with a chat template) of at most
    `vocab_size` tokens into `out`, so tiny checkpoints calibrate offline. `prefix` / `suffix`:
    special tokens (of _SPECIALS) the tokenizer puts before / after every text, as Gemma's and
    Llama's tokenizer.json put their BOS (a TemplateProcessing post-processor); none by default.
    `chat_start`: text the chat template writes before the messages (GLM's writes
    `[gMASK]<sop>`, which its tokenizer does not add)."""
    from tokenizers import Tokenizer, processors

    out = Path(out)
    text = _train_tokenizer(vocab_size)
    if prefix or suffix:
        tok = Tokenizer.from_str(text)
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join([*prefix, "$A", *suffix]),
            special_tokens=[(t, _SPECIALS.index(t)) for t in dict.fromkeys([*prefix, *suffix])])
        text = tok.to_str()
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": _SPECIALS[0],
        "eos_token": _SPECIALS[1], "pad_token": _SPECIALS[1], "model_max_length": 1 << 20,
        "chat_template": chat_start + _CHAT_TEMPLATE}, indent=2))
    return out
