"""AWQ's norm fold proven before any output is written.

AWQ divides each MLP's input channels by s and folds s into the norm that feeds the MLP
(calib/folds.py). Whether a family allows it is a property of its layer classes, not of the
weights or the widths: `find_norm_fold` gives the same answer on a layer of the model's own
classes with every width shrunk (hidden 64, 4 experts, ...) and random weights. So the run
builds one such small layer of each kind the model has (dense MLP, MoE, each attention type),
probes it, and refuses AWQ up front, naming the method that works, instead of after layer 0
with an in-progress folder. The real layers are probed again as they are calibrated (the
proof that counts); this one only moves a refusal before the output.

A config the small copy cannot be built from (a family whose widths are tied in ways this
shrink does not know) is not probed here: its layers are still probed as they run.
"""

from __future__ import annotations

import torch

from quantize.calib.decoder import build_skeleton, layer_inputs, run_layer
from quantize.calib.folds import find_norm_fold
from quantize.errors import QuantizeError

__all__ = ["prove_folds_up_front", "small_config"]

# widths and counts shrunk for the probe (keys absent from the config stay absent)
SMALL = {
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "head_dim": 16,
    "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "index_n_heads": 2, "index_head_dim": 16,
    "n_routed_experts": 4, "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
    "n_group": 1, "topk_group": 1, "vocab_size": 256, "query_pre_attn_scalar": 16,
}
PROBE_TOKENS = 8


def small_config(config: dict) -> dict:
    """`config` with every width SMALL names shrunk (the same classes, layer kinds and count)."""
    small = {k: v for k, v in config.items() if k != "quantization_config"}
    for k, v in SMALL.items():
        if k in small and isinstance(small[k], int):
            small[k] = v
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(kv, int):  # keep MHA / GQA / MQA as it is
        small["num_key_value_heads"] = 4 if kv == heads else (1 if kv == 1 else 2)
    return small


def prove_folds_up_front(config: dict, family: str) -> int | None:
    """Probe AWQ's fold on one small layer of each kind; raise the probe's QuantizeError (the
    layer and what it found, `--method gptq or rtn` as the fix) when one refuses. Returns the
    number of kinds probed (a kind the small copy cannot run is left to the run), or None when
    the small copy could not be built at all."""
    try:
        skeleton = build_skeleton(small_config(config))
    except QuantizeError:
        return None
    kinds: dict[tuple, int] = {}
    for L, layer in enumerate(skeleton.model.layers):
        key = (type(layer.mlp).__name__, getattr(layer, "attention_type", None),
               type(getattr(layer, "self_attn", None)).__name__,
               getattr(getattr(layer, "self_attn", None), "indexer", None) is not None)
        kinds.setdefault(key, L)
    inputs = layer_inputs(skeleton, PROBE_TOKENS, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    H = skeleton.config.hidden_size
    probed = 0
    for L in kinds.values():
        layer = skeleton.model.layers[L]
        try:
            layer.to_empty(device="cpu")
            with torch.no_grad():
                for n, p in layer.named_parameters():
                    p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in n
                            else 0.05 * torch.randn(p.shape, generator=gen))
            layer.float().eval()
            h = torch.randn(1, PROBE_TOKENS, H, generator=gen)
            run_layer(skeleton, layer, inputs, h, None, every_key=False)  # runs at all?
        except Exception:  # noqa: BLE001, S112 - the shrink does not fit this kind (a DSA layer that
            continue  # shares another's top-k): not probed here, only as it runs
        find_norm_fold(layer, lambda layer=layer, h=h: run_layer(skeleton, layer, inputs, h, None,
                                                                 every_key=False), L, family)
        layer.to("meta")
        probed += 1
    return probed
