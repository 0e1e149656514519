"""The MTP (multi-token prediction) layer in the calibration: index num_hidden_layers, dropped by
transformers on load, run on its real inputs through the same decoder-layer class built for
that index. At position i its input is eh_proj([enorm(embed(token i+1)), hnorm(h_i)]), h_i the
last decoder layer's output, over the first S-1 positions (the last has no next token).
Further MTP layers, or one whose eh_proj / norms are missing, are rounded to nearest and the
report says so (`rtn_entries`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from quantize.calib.layer import Carry
from quantize.plan import Plan
from quantize.source.checkpoint import Checkpoint
from quantize.source.layout import layer_of

__all__ = ["mtp_config", "mtp_inputs", "mtp_runnable", "rtn_entries"]


def mtp_runnable(ckpt: Checkpoint, L: int, seq_len: int) -> bool:
    """Whether MTP layer L has what its inputs need (eh_proj, enorm, hnorm; two positions)."""
    need = [f"model.layers.{L}.{n}.weight" for n in ("eh_proj", "enorm", "hnorm")]
    return all(n in ckpt.tensors for n in need) and seq_len >= 2


def mtp_config(ckpt: Checkpoint, L: int) -> dict:
    """config.json for a model of L+1 decoder layers, the MTP layer L the last: every
    per-layer list (`layer_types`, `mlp_layer_types`, ... as transformers writes them)
    extended by its last entry, DSA `indexer_types` from the tensors (which layers have
    their own indexer)."""
    n = ckpt.num_hidden_layers
    cfg = dict(ckpt.config, num_hidden_layers=L + 1)
    for k, v in ckpt.config.items():
        if isinstance(v, list) and v and len(v) == n and k.endswith("_types"):
            cfg[k] = list(v) + [v[-1]] * (L + 1 - n)
    if ckpt.model_type == "glm_moe_dsa":
        cfg["indexer_types"] = ["full" if f"model.layers.{i}.self_attn.indexer.wq_b.weight"
                                in ckpt.tensors else "shared" for i in range(L + 1)]
    return cfg


@torch.no_grad()
def mtp_inputs(ckpt: Checkpoint, L: int, skeleton, carry: Carry, tokens: torch.Tensor,
               device: torch.device, dtype: torch.dtype,
               before_overwrite: Callable[[], None]) -> None:
    """The carried hidden states (the last decoder layer's outputs) replaced, chunk by chunk,
    by MTP layer L's inputs (S-1 positions each); its top-k reset (it computes its own). With
    --gptaq the unrounded model's stream alike.
    `tokens`: the calibration tokens of these chunks, in order."""
    p = f"model.layers.{L}."
    cfg = mtp_config(ckpt, L)
    norm_cls = type(skeleton.model.norm)
    eps = cfg.get("rms_norm_eps", 1e-6)
    H = cfg["hidden_size"]
    enorm, hnorm = norm_cls(H, eps=eps).to(device, dtype), norm_cls(H, eps=eps).to(device, dtype)
    enorm.weight.copy_(ckpt.read(p + "enorm.weight", device))
    hnorm.weight.copy_(ckpt.read(p + "hnorm.weight", device))
    eh = ckpt.read(p + "eh_proj.weight", device).to(dtype)  # (H, 2H)
    emb = ckpt.read("model.embed_tokens.weight", device)  # (V, H)
    before_overwrite()
    streams = [carry.hidden] + ([carry.fp] if carry.fp is not None else [])  # (--gptaq: both)
    carry.topk = [None] * len(carry.hidden)
    carry.fp_topk = [None] * len(carry.hidden) if carry.fp is not None else []
    for hs in streams:
        first = 0  # the chunk's first sample (chunks as the embedding, or a checkpoint, made them)
        for i in range(len(hs)):  # each chunk replaced in turn: no second copy
            h = hs.on_device(i)
            t = tokens[first:first + h.shape[0], 1:].to(device)  # (b, S-1) next tokens
            first += h.shape[0]
            x = torch.cat([enorm(emb[t].to(dtype)), hnorm(h[:, :-1])], -1)
            del h
            hs.put(i, F.linear(x, eh))  # (b, S-1, H)
            del x


def rtn_entries(plan: Plan, num_layers: int, carry: Carry) -> list[dict]:
    """Report entries of MTP layers rounded to nearest: their quantized units that got no
    calibrated result (from the plan, so a resumed run reports the same)."""
    ran = {e["layer"] for e in carry.layers}
    out: dict[int, dict] = {}
    for u in plan.units:
        L = layer_of(u.source)
        if L is None or L < num_layers or u.action != "quantize":
            continue
        p = f"model.layers.{L}.mlp."
        if L in ran and u.source.startswith(p) and u.source.endswith("_proj.weight"):
            continue  # calibrated (the MTP layer's MLP targets)
        entry = out.setdefault(L, {"layer": L, "mtp": True, "method": "rtn", "modules": 0,
                                   "reason": carry.mtp_skip.get(L, "only the first MTP layer is run")})
        entry["modules"] += 1
    return list(out.values())
