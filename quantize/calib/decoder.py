"""Decoder layers for the calibration: built from transformers' own classes, filled from
the checkpoint, run over the calibration activations.

    skeleton = build_skeleton(config)                  the whole model on the meta device
    layer    = load_layer(skeleton, ckpt, units, L, device, dtype)    filled, FP8 dequantized
    out, topk = run_layer(skeleton, layer, inputs, h, topk)           one forward of (b, S, H)
    free_layer(layer)

The model's own classes give the attention (GQA, MLA, the DSA indexer and its shared top-k)
for free. The activations between layers are `HiddenStates`: chunks of CHUNK_TOKENS tokens,
kept on the compute device while twice their size fits in half its free memory, else in host
memory, else in files (GLM-5.2 at 512 x 2048 tokens: 12.9 GB of bf16 hidden states, plus the
DSA top-k indices which the layers pass on: one broadcast row per chunk where the top-k holds
every key, as GLM-5.2's at 2,048-token samples, else up to 4.3 GB as int16).
"""

from __future__ import annotations

import inspect
import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from quantize.errors import Problem, QuantizeError
from quantize.plan import Unit
from quantize.source.checkpoint import Checkpoint

__all__ = [
    "CHUNK_TOKENS",
    "MLP_GROUP_TOKENS",
    "MOE_CLASSES",
    "PASS2_GROUP_TOKENS",
    "HiddenStates",
    "LayerInputs",
    "ReadAhead",
    "SplitLayer",
    "build_skeleton",
    "chunk_tokens",
    "device_free",
    "embed",
    "embed_scale",
    "every_key_indexer",
    "every_key_on",
    "free_bytes",
    "free_layer",
    "layer_inputs",
    "layer_type",
    "layer_weight",
    "limit_gpu_memory",
    "load_layer",
    "mlp_group_tokens",
    "mlp_input_whole",
    "mlp_kind",
    "mlp_target",
    "round_in_place",
    "run_layer",
    "topk_dtype",
]

# Tokens per attention forward (a chunk of the hidden states): GLM-5.2's DSA indexer holds
# (b, S, 32 heads, S) float32 scores, ~6.4 GB of scratch at 8192 tokens. The MLP, once split
# off (`SplitLayer`), takes several chunks per call (MLP_GROUP_TOKENS).
CHUNK_TOKENS = {"cuda": 8192, "cpu": 8192}


def chunk_tokens(device: torch.device) -> int:
    return CHUNK_TOKENS.get(torch.device(device).type, CHUNK_TOKENS["cpu"])


# Tokens per MLP forward once the attention is split off (`SplitLayer`): the MLP alone needs no
# (b, heads, S, S) scratch, so several chunks go through it at once (GLM-5.2: ~2,000 routed
# tokens per expert per call instead of ~500, a quarter of the per-expert launches).
# Pass 2's MoE blocks run capture.moe_output: its scratch is ~5 GB per 32k GLM-5.2 tokens (bf16
# routed rows), and on an H200 1 M tokens took 1.47 s at 32k tokens a call, 1.46 s at 65k (10 GB
# of scratch); transformers' own grouped_mm forward 2.30 s at 16k with 9 GB of float32 scratch
# (benchmarks/h200_moe_forward.json).
MLP_GROUP_TOKENS = {"cuda": 65536, "cpu": 16384}
PASS2_GROUP_TOKENS = {"cuda": 32768, "cpu": 16384}


def mlp_group_tokens(device: torch.device, pass2: bool = False) -> int:
    table = PASS2_GROUP_TOKENS if pass2 else MLP_GROUP_TOKENS
    return table.get(torch.device(device).type, table["cpu"])

# ---------------------------------------------------------------------------------------------
# Hidden states


class HiddenStates:
    """The calibration activations between layers: a list of (b, S, H) chunks, kept `where`
    `placement` says: on the compute device when they fit, else in host memory (a GPU run
    copies each chunk in for its forward), else one file per chunk in a temporary folder.
    A chunk is replaced by `put`, never modified in place (a checkpoint may hold the old one)."""

    def __init__(self, chunks: list[torch.Tensor], device: torch.device, where: str) -> None:
        self.device, self.where = device, where
        self._dir = tempfile.TemporaryDirectory(prefix="calib-hidden-") if where == "disk" else None
        self._chunks: list[torch.Tensor | None] = []
        for c in chunks:
            self.append(c)

    @property
    def on_disk(self) -> bool:
        return self._dir is not None

    def append(self, t: torch.Tensor) -> None:
        self._chunks.append(None)
        self.put(len(self._chunks) - 1, t)

    def __len__(self) -> int:
        return len(self._chunks)

    def _path(self, i: int) -> Path:
        return Path(self._dir.name) / f"{i:06d}.pt"

    def get(self, i: int) -> torch.Tensor:
        """Chunk i where it is kept (`to(device)` brings a host chunk in)."""
        if self._dir is None:
            return self._chunks[i]
        return torch.load(self._path(i), map_location=self.device)

    def on_device(self, i: int) -> torch.Tensor:
        return self.get(i).to(self.device)

    def put(self, i: int, t: torch.Tensor) -> None:
        if self.where == "device":
            self._chunks[i] = t.to(self.device)
        elif self.where == "host":
            self._chunks[i] = t.to("cpu")
        else:
            torch.save(t.cpu(), self._path(i))

    @staticmethod
    def should_spill(nbytes: int, device: torch.device) -> bool:
        """Whether `nbytes` more would take over half of the device's free memory."""
        return nbytes > free_bytes(device) // 2

    @staticmethod
    def placement(nbytes: int, device: torch.device) -> str:
        """Where hidden states of `nbytes` are kept: "device" while twice that fits in half of
        its free memory (a layer's pass 2 holds old and new chunks), else "host" while twice
        that fits in half of the free host memory, else "disk"."""
        if not HiddenStates.should_spill(2 * nbytes, device):
            return "device"
        if device.type == "cuda" and 2 * nbytes <= _host_free() // 2:
            return "host"
        return "disk"


def _host_free() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_bytes(device: torch.device) -> int:
    """Bytes still free where tensors on `device` live: the GPU's (`device_free`) or the
    host's memory."""
    return device_free(device) if device.type == "cuda" else _host_free()


_GPU_LIMIT: dict[int, int] = {}  # device index -> bytes this process may hold (limit_gpu_memory)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def limit_gpu_memory(device: torch.device, nbytes: int) -> None:
    """Keep this process's memory on a GPU under `nbytes` (`convert --max-gpu-memory`): torch's
    caching allocator refuses to reserve more (an out-of-memory error, never a silent excess),
    and every size decision of the calibration (`device_free`: where the hidden states live,
    experts per GPTQ solve) counts only what is left under it. An H200 run with 80 GiB behaves
    as on an 80 GB GPU."""
    i = _index(device)
    total = torch.cuda.get_device_properties(i).total_memory
    if not 0 < nbytes <= total:
        raise QuantizeError("--max-gpu-memory does not fit the GPU", [Problem(
            "--max-gpu-memory", None, f"{nbytes / 2**30:.1f} GiB",
            f"more than 0 and at most the GPU's {total / 2**30:.1f} GiB",
            f"pass --max-gpu-memory {int(total // 2**30)} or less, or leave it out (all of it)")])
    torch.cuda.set_per_process_memory_fraction(nbytes / total, i)
    _GPU_LIMIT[i] = nbytes


def device_free(device: torch.device) -> int:
    """Bytes this process can still get on `device` (a GPU): the driver's free memory plus
    what torch's caching allocator holds unused (it hands those blocks out again, and frees
    them to the driver before it would fail), and at most what `limit_gpu_memory` leaves above
    what is allocated. (The driver's figure alone misses the cache: after a GLM-5.2 MoE layer
    peaked at 71 GB, the next layer saw ~66 GB free of an H200's 139.)"""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    free += max(0, cached)
    limit = _GPU_LIMIT.get(_index(device))
    if limit is not None:
        free = min(free, max(0, limit - torch.cuda.memory_allocated(device)))
    return free

# ---------------------------------------------------------------------------------------------
# The layer, from transformers' classes and the checkpoint


_BUILD = threading.Lock()  # one model build at a time in this process


def build_skeleton(config: dict):
    """The whole model on the meta device (no memory): its layer classes, rotary and config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    model_type = cfg.pop("model_type", None)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise QuantizeError("calibration needs a model transformers knows", [Problem(
            "config.json", None, f"model_type {model_type!r}",
            "a decoder-only architecture of the installed transformers",
            "use --method rtn, which needs no forward pass")])
    try:
        hf_config = AutoConfig.for_model(model_type, **cfg)
    except Exception as e:  # noqa: BLE001 - the config class's own validation, said before any output
        raise QuantizeError("calibration cannot build this model's layers", [Problem(
            "config.json", None, f"transformers {model_type} config: {type(e).__name__}: {e}",
            "a config the installed transformers' config class accepts",
            "check config.json against the release, or use --method rtn")]) from None
    try:
        with _BUILD, torch.device("meta"):
            # trust_remote_code=False: a config.json auto_map naming the checkpoint's own Python
            # is never imported (only the installed transformers' classes are built). dtype: the
            # default as it is, so transformers' set-and-restore of torch's process-wide default
            # dtype (to the config's BF16) changes nothing another thread could see (verify
            # builds this on a thread while it checks tensors); load_layer casts each layer
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa",
                                                     trust_remote_code=False,
                                                     dtype=torch.get_default_dtype())
    except Exception as e:  # noqa: BLE001 - whatever the model class raises, said before any output
        raise QuantizeError("calibration cannot build this model's layers", [Problem(
            "config.json", None, f"transformers {model_type} raised {type(e).__name__}: {e}",
            "a config the installed transformers' model class accepts",
            "check config.json against the release, or use --method rtn")]) from None
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(model.model, "rotary_emb"):
        raise QuantizeError("calibration supports decoder-only models with model.model.layers", [
            Problem("config.json", None, f"{type(model).__name__} has no model.model.layers / rotary_emb",
                    "a Llama-like decoder (GLM-4.x, GLM-5.x, Llama, Qwen, ...)",
                    "use --method rtn")])
    return model


# MoE blocks whose forward `moe_forward` mirrors (router -> fused experts -> + shared experts).
MOE_CLASSES = ("GlmMoeDsaMoE", "Glm4MoeMoE", "DeepseekV3MoE")


def mlp_target(name: str) -> bool:
    """A Linear weight of a layer's MLP (what the calibration rounds)."""
    return ".mlp." in name and name.endswith("_proj.weight")


def mlp_kind(mlp: torch.nn.Module) -> str:
    if type(mlp).__name__ in MOE_CLASSES:
        return "moe"
    if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return "dense"
    return "unsupported"


def load_layer(skeleton, ckpt: Checkpoint, units: dict[str, Unit] | None, L: int,
               device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Layer L of `skeleton` filled from the checkpoint, in `dtype` on `device` (router and
    fp32-kept modules stay float32). `units`: the plan's, so FP8 weights are dequantized with
    their scales; None reads every tensor as `ckpt.read` gives it (eval's INT4 view)."""
    from quantize.source.weights import _nonfinite, finite_hint, source_weight

    layer = skeleton.model.layers[L]
    prefix = f"model.layers.{L}."
    E = getattr(getattr(layer.mlp, "experts", None), "num_experts", 0)

    def names(key: str) -> list[str]:  # checkpoint tensors behind one module parameter
        if key.endswith("experts.gate_up_proj"):
            m = prefix + key[: -len("gate_up_proj")]
            return [f"{m}{e}.{k}_proj.weight" for e in range(E) for k in ("gate", "up")]
        if key.endswith("experts.down_proj"):
            m = prefix + key[: -len("down_proj")]
            return [f"{m}{e}.down_proj.weight" for e in range(E)]
        return [prefix + key]

    have = units if units is not None else ckpt.tensors
    missing = [n for key in layer.state_dict() for n in names(key) if n not in have]
    if missing:
        raise QuantizeError("the checkpoint lacks tensors the layer class needs", [Problem(
            "model.safetensors.index.json", n, "missing", "every parameter of the transformers layer",
            "the config and weights disagree; re-download the checkpoint") for n in missing])
    layer.to(dtype)  # on the meta device: free
    keep32 = list(getattr(skeleton, "_keep_in_fp32_modules", None) or []) + \
        list(getattr(skeleton, "_keep_in_fp32_modules_strict", None) or [])
    for name, mod in layer.named_modules():
        if any(k in name.split(".") or name.endswith(k) for k in keep32):
            mod.float()
    if mlp_kind(layer.mlp) == "moe":
        layer.mlp.gate.float()  # routing in float32, as transformers keeps it
    layer.to_empty(device=device)

    def get(n: str) -> torch.Tensor:
        return source_weight(ckpt, units[n], device) if units is not None else ckpt.read(n, device).float()

    params = layer.state_dict()  # views of the parameters: filled in place
    order = [(key, i, n) for key, t in params.items() for i, n in enumerate(names(key))]
    finite = []  # one hint per tensor (finite_hint), read once at the end: no device sync per tensor
    with torch.no_grad(), ReadAhead(get, [n for _, _, n in order], depth=16) as R:
        for key, i, n in order:
            w, t = R[n], params[key]
            finite.append(finite_hint(w))
            if key.endswith("experts.gate_up_proj"):  # (E, 2I, H): gate rows, then up rows
                half = t.shape[1] // 2
                t[i // 2, (i % 2) * half:(i % 2 + 1) * half].copy_(w)
            elif key.endswith("experts.down_proj"):  # (E, H, I)
                t[i].copy_(w)
            else:
                t.copy_(w)
        del w
    if finite and not bool(torch.stack(finite).all()):  # re-checked exactly: a hint can be wrong
        for (_, _, n), ok in zip(order, finite):
            if not ok and not bool(torch.isfinite(w := get(n)).all()):
                raise _nonfinite(ckpt, n, w)
    layer.eval()
    return layer


def layer_weight(layer: torch.nn.Module, L: int, name: str) -> torch.Tensor:
    """The module's view of checkpoint tensor `name` of layer L (a slice of the fused expert
    parameters for `...experts.E.gate_proj/up_proj/down_proj.weight`): copy into it to set it."""
    key = name[len(f"model.layers.{L}."):]
    if ".experts." in key:
        head, e, proj, _ = key.rsplit(".", 3)  # mlp.experts, E, gate_proj, weight
        if proj == "down_proj":
            return layer.get_parameter(f"{head}.down_proj")[int(e)]
        fused = layer.get_parameter(f"{head}.gate_up_proj")  # (E, 2I, H): gate rows, then up
        half = fused.shape[1] // 2
        return fused[int(e), :half] if proj == "gate_proj" else fused[int(e), half:]
    return layer.get_parameter(key)


EXPERT_RTN_BATCH = 32  # experts rounded per call by `round_in_place` (GLM-5.2: ~3 GB float32)


def round_in_place(layer: torch.nn.Module, L: int, names: list[str], group_size: int,
                   symmetric: bool) -> None:
    """Layer L's weights `names` replaced by their round-to-nearest INT4 values (dequantized):
    a fused expert parameter whose experts are all among `names` in batches of EXPERT_RTN_BATCH
    experts (rows are rounded independently: the same values as one call per expert, in a few
    calls instead of 3 E), the rest one by one. Call under torch.no_grad()."""
    from quantize.rounding.int4 import dequantize, quantize_rtn

    def rtn(w: torch.Tensor) -> torch.Tensor:
        return dequantize(quantize_rtn(w.float(), group_size, symmetric), torch.float32)

    left = set(names)
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    E = getattr(experts, "num_experts", 0)
    stem = f"model.layers.{L}.mlp.experts."
    for key, projs in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        fused_names = {f"{stem}{e}.{p}.weight" for e in range(E) for p in projs}
        if not E or not fused_names <= left or not hasattr(experts, key):
            continue
        fused = getattr(experts, key)  # (E, N, K)
        for c in range(0, E, EXPERT_RTN_BATCH):
            v = fused.data[c: c + EXPERT_RTN_BATCH]
            v.copy_(rtn(v.reshape(-1, v.shape[-1])).reshape(v.shape))
        left -= fused_names
    for n in sorted(left):
        v = layer_weight(layer, L, n)
        v.copy_(rtn(v))


def free_layer(layer: torch.nn.Module) -> None:
    layer.to_empty(device="meta")

# ---------------------------------------------------------------------------------------------
# Running a layer over the calibration activations


@dataclass
class LayerInputs:
    """What every decoder layer takes besides the hidden states (shared by all layers)."""

    position_ids: torch.Tensor  # (1, S)
    # (cos, sin), or one per layer type where the model's rotary takes one (Gemma3: local and
    # global rotary embeddings for its sliding / full attention layers)
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | dict[str, tuple[torch.Tensor, torch.Tensor]]
    masks: dict[tuple[int, str], torch.Tensor | None]  # (batch size, layer type) -> mask


def layer_inputs(skeleton, seq_len: int, device: torch.device, dtype: torch.dtype) -> LayerInputs:
    rotary = type(skeleton.model.rotary_emb)(config=skeleton.config).to(device)
    pos = torch.arange(seq_len, device=device).unsqueeze(0)
    probe = torch.zeros(1, seq_len, 1, device=device, dtype=dtype)
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        types = sorted(set(getattr(skeleton.config, "layer_types", None) or ["full_attention"]))
        return LayerInputs(pos, {t: rotary(probe, pos, t) for t in types}, {})
    return LayerInputs(pos, rotary(probe, pos), {})


def layer_type(skeleton, layer: torch.nn.Module) -> str:
    """The layer's attention type as the model's forward picks its mask and rotary:
    config.layer_types[i] ("full_attention", "sliding_attention"), else full."""
    t = getattr(layer, "attention_type", None)
    if t is None:
        types = getattr(skeleton.config, "layer_types", None)
        i = getattr(getattr(layer, "self_attn", None), "layer_idx", None)
        t = types[i] if types and i is not None and i < len(types) else "full_attention"
    return t


def embed_scale(skeleton) -> float | None:
    """The factor the model's embedding module multiplies looked-up rows by (Gemma's
    sqrt(hidden): `scalar_embed_scale`), None for a plain nn.Embedding."""
    return getattr(skeleton.model.embed_tokens, "scalar_embed_scale", None)


def embed(skeleton, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The model's embedding of token ids with the table `weight`, op for op (a scaled
    embedding multiplies in the table's dtype, as Gemma3TextScaledWordEmbedding)."""
    rows = weight[ids]
    s = embed_scale(skeleton)
    return rows if s is None else rows * torch.tensor(s, dtype=weight.dtype, device=weight.device)


def _mask(skeleton, inputs: LayerInputs, h: torch.Tensor, kind: str = "full_attention"
          ) -> torch.Tensor | None:
    from transformers import masking_utils

    b = h.shape[0]
    make = masking_utils.create_sliding_window_causal_mask if kind == "sliding_attention" \
        else masking_utils.create_causal_mask
    if (b, kind) not in inputs.masks:
        inputs.masks[(b, kind)] = make(config=skeleton.config, inputs_embeds=h,
                                       attention_mask=None, past_key_values=None,
                                       position_ids=inputs.position_ids.expand(b, -1),
                                       allow_is_causal_skip=False)
    return inputs.masks[(b, kind)]


def topk_dtype(seq_len: int) -> torch.dtype:
    """How the DSA top-k key positions (< seq_len) are kept between layers: int16 while they
    fit (GLM-5.2 at 512 x 2048: 4.3 GB instead of the model's int32 8.6 GB), else int32."""
    from quantize.disk import topk_itemsize

    return torch.int16 if topk_itemsize(seq_len) == 2 else torch.int32


# Whether a DSA indexer whose top-k holds every key may answer "every key" without scoring them
# (`run_layer`); cleared for the process if a layer's forward ever differs with it.
EVERY_KEY = [True]


def every_key_on() -> bool:
    """Whether `run_layer` still skips indexers that select every key (see EVERY_KEY)."""
    return EVERY_KEY[0]


def every_key_indexer(layer: torch.nn.Module, seq_len: int) -> torch.nn.Module | None:
    """The layer's DSA indexer where its top-k selects every key of a `seq_len`-token sequence
    (index_topk >= seq_len: GLM-5.2's 2048 at the recommended 2,048-token samples), under the
    eager / SDPA attention that only scatters the indices into the attention mask; else None.
    There the indexer's scores decide nothing: each query's top-k is all keys, in some order."""
    attn = getattr(layer, "self_attn", None)
    idx = getattr(attn, "indexer", None)
    topk = getattr(idx, "index_topk", None)
    impl = getattr(getattr(attn, "config", None), "_attn_implementation", None)
    if idx is None or not isinstance(topk, int) or topk < seq_len or impl not in ("eager", "sdpa"):
        return None
    return idx


def _every_key(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """What an indexer whose top-k holds every key returns, without its projections, scores
    and sort: each query's key positions 0..S-1 (int32 (b, S, S), a broadcast view)."""
    b, S = hidden_states.shape[:2]
    return torch.arange(S, dtype=torch.int32, device=hidden_states.device).expand(b, S, S)


def run_layer(skeleton, layer: torch.nn.Module, inputs: LayerInputs, h: torch.Tensor,
              topk: torch.Tensor | None, every_key: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decoder layer on (b, S, H); returns the output and the DSA top-k indices it carries
    (as `topk_dtype`: the layer gets them back as the int32 it returns, the same values).
    The mask and rotary embedding are the ones the model's forward gives this layer's type.
    Where the layer's DSA indexer would select every key (`every_key_indexer`) it answers so
    without computing (the same mask, the same output bit for bit; `every_key=False`: it
    computes). The first forward of each layer (module) runs both ways as the proof: if the
    outputs or the key sets differ, that forward's computed result is returned and no
    indexer is skipped again in this process (EVERY_KEY)."""
    idx = every_key_indexer(layer, h.shape[1]) if every_key and EVERY_KEY[0] else None
    if idx is None:
        return _run_layer(skeleton, layer, inputs, h, topk)
    proved = idx.__dict__.get("_quantize_every_key")
    if proved is None:  # this layer's first forward: both ways
        ref = _run_layer(skeleton, layer, inputs, h, topk)
        got = _run_skipping(idx, skeleton, layer, inputs, h, topk)
        proved = torch.equal(ref[0], got[0]) and (ref[1] is None) == (got[1] is None) and \
            (ref[1] is None or torch.equal(ref[1].sort(-1).values, got[1].sort(-1).values))
        idx.__dict__["_quantize_every_key"] = proved
        if not proved:
            EVERY_KEY[0] = False
        return got if proved else ref
    return _run_skipping(idx, skeleton, layer, inputs, h, topk) if proved else \
        _run_layer(skeleton, layer, inputs, h, topk)


def _run_skipping(idx: torch.nn.Module, skeleton, layer: torch.nn.Module, inputs: LayerInputs,
                  h: torch.Tensor, topk: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer with its indexer answering every key. The top-k it passes on (every key of
    each query; the proof compares its key sets with the computed ones) is kept as a
    broadcast view of one row, not (b, S, S) of them (GLM-5.2 at 512 x 2048: 4.3 GB less on
    the device; a checkpoint writes the row, state.py)."""
    idx.forward = _every_key
    try:
        out, t = _run_layer(skeleton, layer, inputs, h, topk)
    finally:
        del idx.forward
    if t is not None:
        b, S = h.shape[:2]
        t = torch.arange(S, dtype=t.dtype, device=t.device).expand(b, S, S)
    return out, t


def _run_layer(skeleton, layer: torch.nn.Module, inputs: LayerInputs, h: torch.Tensor,
               topk: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    kwargs = {}
    if "prev_topk_indices" in inspect.signature(layer.forward).parameters:
        kwargs["prev_topk_indices"] = None if topk is None else topk.to(torch.int32)
    b = h.shape[0]
    kind = layer_type(skeleton, layer)
    pe = inputs.position_embeddings
    if isinstance(pe, dict):
        pe = pe[kind]
    out = layer(h, attention_mask=_mask(skeleton, inputs, h, kind),
                position_ids=inputs.position_ids.expand(b, -1), position_embeddings=pe, **kwargs)
    if isinstance(out, tuple):
        if len(out) > 1 and torch.is_tensor(out[1]):
            t = out[1]
            if topk is not None and t is kwargs.get("prev_topk_indices"):
                return out[0], topk  # passed on as given (a shared DSA layer): the carried one
            return out[0], t.to(topk_dtype(h.shape[1])) if not t.is_floating_point() else t
        return out[0], topk
    return out, topk


def _answer_zero(sink: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], torch.Tensor]:
    """An MLP forward that hands its input to `sink` and answers 0 (`SplitLayer`)."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        sink(x)
        return torch.zeros_like(x)
    return forward


def mlp_input_whole(skeleton, layer: torch.nn.Module, inputs: LayerInputs, h: torch.Tensor,
                    topk: torch.Tensor | None) -> torch.Tensor:
    """The MLP's input on the layer input h, by the layer's own forward with its MLP answering
    0 (for a layer `SplitLayer` cannot split; the attention runs again)."""
    xs: list[torch.Tensor] = []
    mlp = layer.mlp
    mlp.forward = _answer_zero(xs.append)
    try:
        run_layer(skeleton, layer, inputs, h, topk)
    finally:
        del mlp.forward
    if len(xs) != 1:
        raise RuntimeError(f"the layer's forward called its MLP {len(xs)} times, not once")
    return xs[0]


class SplitLayer:
    """A decoder layer's forward in its two halves, through the layer's own forward:

        h1, topk = split.attention(h, topk, mlp_input)   the MLP answers 0: out = h1 + g(0) = h1
        out      = split.mlp(h1)                         the attention answers 0: h1 + g(0) = h1

    A calibration changes only the MLP, so the attention half runs once per layer (pass 1) and
    the second forward through the rounded MLP (pass 2) starts from h1 instead of running the
    attention again (GLM-5.2 at 512 x 2048 tokens: ~4 s of ~7 per pass 2), and the MLP half can
    take several chunks at once. It holds when the layer adds each half's (normed) output to
    its residual, g(0) = 0 (RMSNorm, identity) and x + 0 == x: every pre-norm decoder
    (Llama, Qwen, GLM, DeepSeek; Gemma's post-norms too). `check` proves it bit for bit on
    real inputs before it is used; where it does not hold the caller runs whole layers."""

    def __init__(self, skeleton, layer: torch.nn.Module, inputs: LayerInputs) -> None:
        self.skeleton, self.layer, self.inputs = skeleton, layer, inputs
        self._arity: int | None = None  # what the attention returns: a tuple of n, or a tensor (0)
        self._norm: torch.nn.Module | None = None  # the MLP's norm, once `check` proved it alone

    def attention(self, h: torch.Tensor, topk: torch.Tensor | None,
                  mlp_input: Callable[[torch.Tensor], None]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h1 (the residual stream after the attention) and the top-k the layer passes on;
        `mlp_input(x)` receives the MLP's input."""
        mlp, attn = self.layer.mlp, self.layer.self_attn
        real = attn.forward

        def record(*a, **k):
            r = real(*a, **k)
            self._arity = len(r) if isinstance(r, tuple) else 0
            return r

        mlp.forward, attn.forward = _answer_zero(mlp_input), record
        try:
            return run_layer(self.skeleton, self.layer, self.inputs, h, topk)
        finally:
            del mlp.forward, attn.forward

    def _zero_attention(self, *a, **k):
        x = k["hidden_states"] if "hidden_states" in k else a[0]
        z = torch.zeros_like(x)
        return (z, *[None] * (self._arity - 1)) if self._arity else z

    def mlp(self, h1: torch.Tensor) -> torch.Tensor:
        """The layer's output from h1, its attention answering 0 (its top-k is not needed)."""
        if self._arity is None:
            raise RuntimeError("SplitLayer.mlp before SplitLayer.attention")
        attn = self.layer.self_attn
        attn.forward = self._zero_attention
        try:
            return run_layer(self.skeleton, self.layer, self.inputs, h1, None)[0]
        finally:
            del attn.forward

    # the layer's norm in front of its MLP, by the names transformers' decoders give it
    MLP_NORMS = ("post_attention_layernorm", "pre_feedforward_layernorm")

    def mlp_input(self, h1: torch.Tensor) -> torch.Tensor:
        """The MLP's input on h1 (the layer's own norm of it), nothing else computed: the norm
        module alone where `check` found it gives the very bits of the layer's forward, else
        the layer's forward with its attention and MLP answering 0."""
        if self._arity is None:
            raise RuntimeError("SplitLayer.mlp_input before SplitLayer.attention")
        if self._norm is not None:
            return self._norm(h1)
        return self._mlp_input_by_forward(h1)

    def _mlp_input_by_forward(self, h1: torch.Tensor) -> torch.Tensor:
        xs: list[torch.Tensor] = []
        mlp, attn = self.layer.mlp, self.layer.self_attn
        mlp.forward, attn.forward = _answer_zero(xs.append), self._zero_attention
        try:
            run_layer(self.skeleton, self.layer, self.inputs, h1, None)
        finally:
            del mlp.forward, attn.forward
        return xs[0]

    def check(self, h: torch.Tensor, topk: torch.Tensor | None
              ) -> tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Whether the halves give the whole forward bit for bit on h; returns (ok, the whole
        forward's output, h1, top-k, the MLP's input)."""
        whole, topk_w = run_layer(self.skeleton, self.layer, self.inputs, h, topk)
        xs: list[torch.Tensor] = []
        h1, topk_s = self.attention(h, topk, xs.append)
        ok = len(xs) == 1 and torch.equal(self.mlp(h1), whole) and \
            torch.equal(self._mlp_input_by_forward(h1), xs[0]) and \
            (topk_w is None) == (topk_s is None) and (topk_w is None or torch.equal(topk_w, topk_s))
        if ok:  # the MLP's input by its norm alone (a pass over h1, not a layer forward)
            norms = [getattr(self.layer, n, None) for n in self.MLP_NORMS]
            self._norm = next((m for m in norms if isinstance(m, torch.nn.Module)
                               and torch.equal(m(h1), xs[0])), None)
        return ok, whole, h1, topk_s, xs[0] if xs else None


class ReadAhead:
    """get(name) for names used in a known order, computed `depth` ahead on worker threads:
    the disk reads, host-to-device copies and FP8 dequantization of the next tensors overlap
    the work on the current ones (each read releases the GIL). A name out of order, or one
    not listed, is read on the spot."""

    def __init__(self, get: Callable[[str], torch.Tensor], names: list[str], depth: int,
                 workers: int = 4) -> None:
        self.get, self.names, self.depth = get, list(names), max(1, depth)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="quantize-read")
        self.ahead: dict[str, Future] = {}
        self.i = 0
        self._fill()

    def _fill(self) -> None:
        while self.i < len(self.names) and len(self.ahead) < self.depth:
            n = self.names[self.i]
            self.ahead[n] = self.pool.submit(self.get, n)
            self.i += 1

    def __getitem__(self, name: str) -> torch.Tensor:
        f = self.ahead.pop(name, None)
        t = f.result() if f is not None else self.get(name)
        self._fill()
        return t

    def close(self) -> None:
        for f in self.ahead.values():
            f.cancel()
        self.ahead.clear()
        self.pool.shutdown(wait=True)

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
