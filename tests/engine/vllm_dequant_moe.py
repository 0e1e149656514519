"""Test-only vLLM patch: the routed-expert compute as a dequantized matmul, nothing else.

vLLM's CPU build has no INT4 MoE kernel for these checkpoints (its CPUExpertsInt4 needs AMX,
group scales other than 32 and plain softmax top-k routing; GLM routes DeepSeek-style:
sigmoid scores, `e_score_correction_bias`, grouped top-k), so `get_moe_method` would raise
"No WNA16 MoE backend supports the deployment configuration". `install()` swaps the two
compressed-tensors MoE method classes that `CompressedTensorsMoEMethod.get_moe_method`
imports for subclasses that keep vLLM's own parameter creation (`create_weights`) and
FusedMoE weight loader, keep the loaded parameters in the checkpoint's layout (no kernel
repack), and compute each routed expert as `silu(x W1^T) * (x W3^T) W2^T` with W dequantized
in float32 from those very parameters. vLLM's scheme dispatch, router (grouped top-k with the
correction bias), routed scaling, shared experts, attention, the dense INT4 Linears (its
CPUWNA16 kernel) and the sampler's log-probs stay vLLM's.

`install()` also records every parameter just before `process_weights_after_loading` (which
repacks the dense INT4 Linears for the CPU kernel): that is what the weight loader wrote from
the checkpoint, the state the tests compare bit for bit with our files.

W4A8-FP8 (`--scheme w4afp8`): vLLM's W4A8-FP8 MoE method picks a CUTLASS backend that the
CPU build does not have. Its subclass here keeps its `create_weights` (so its loader is
checked) and computes the experts with the same W4A16 matmul, without the FP8 quantization of
the activations the real kernel applies: enough for the engine's warm-up run, not a check of
its numerics, so the tests compare its parameters only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["install", "loaded_parameters", "quant_methods", "unpack_int4_rows"]

_LOADED: dict[str, torch.Tensor] = {}
_METHODS: dict[str, str] = {}


def loaded_parameters() -> dict[str, torch.Tensor]:
    """{vLLM parameter name: copy} as the weight loader left them (before kernel repacking)."""
    return _LOADED


def quant_methods() -> dict[str, str]:
    """{module name: "QuantMethodClass[/SchemeClass]"} of every module vLLM gave a method."""
    return _METHODS


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., K/8] -> int32 [..., K] of stored nibbles 0..15, element j of each word in
    bits 4j..4j+3 (compressed-tensors' pack-quantized order, low nibble first)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)  # (8,)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # (..., K/8, 8)
    return nibbles.flatten(-2)


def _dequant(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """One expert's [N, K/8] int32 + [N, G] scale (+ [N/8, G] zero point) -> float32 [N, K]."""
    q = unpack_int4_rows(packed)  # (N, K) stored 0..15
    N, K = q.shape
    G = scale.shape[1]
    if zero is None:
        z = torch.full((N, G), 8, dtype=torch.int32)  # symmetric: stored value - 8
    else:
        # zero points are packed along N: [N/8, G] words -> (N, G)
        z = unpack_int4_rows(zero.t().contiguous()).t()[:N]
    w = (q - z.repeat_interleave(K // G, dim=1)).float()  # (N, K) integer levels, exact
    return w * scale.float().repeat_interleave(K // G, dim=1)  # exact in float32


def _experts(layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
             ) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), in float32."""
    out = torch.zeros(x.shape[0], layer.w2_weight_packed.shape[1], dtype=torch.float32)
    zp13 = getattr(layer, "w13_weight_zero_point", None)
    zp2 = getattr(layer, "w2_weight_zero_point", None)
    xf = x.float()
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        W13 = _dequant(layer.w13_weight_packed[e], layer.w13_weight_scale[e],
                       None if zp13 is None else zp13[e])  # (2I, H)
        W2 = _dequant(layer.w2_weight_packed[e], layer.w2_weight_scale[e],
                      None if zp2 is None else zp2[e])  # (H, I)
        gate, up = (xf[tok] @ W13.t()).chunk(2, dim=-1)  # (T_e, I) each
        y = (F.silu(gate) * up) @ W2.t()  # (T_e, H)
        out.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(-1))
    return out.to(x.dtype)


def _mixin(base: type) -> type:
    class Dequantized(base):
        def __init__(self, weight_quant, input_quant, moe, layer_name=None):
            # the base's __init__ minus its kernel-backend selection (which raises on CPU)
            super(base, self).__init__(moe)
            self.weight_quant, self.input_quant = weight_quant, input_quant
            self.num_bits = weight_quant.num_bits
            self.strategy = weight_quant.strategy
            self.symmetric = weight_quant.symmetric
            self.group_size = -1 if weight_quant.group_size is None else weight_quant.group_size
            from fractions import Fraction
            self.packed_factor = (Fraction(32, self.num_bits) if base.__name__.endswith("WNA16MoEMethod")
                                  else 32 // self.num_bits)

        @property
        def is_monolithic(self) -> bool:
            return False

        def process_weights_after_loading(self, layer) -> None:
            """Keep the checkpoint layout: `apply` reads it as loaded."""

        def get_fused_moe_quant_config(self, layer):
            return None

        def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
            return _experts(layer, x, topk_weights, topk_ids)

    Dequantized.__name__ = Dequantized.__qualname__ = "Dequantized" + base.__name__
    return Dequantized


def install() -> None:
    """Patch vLLM in this process (call before building the engine; in-process engine only)."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a8_fp8 as w4a8_fp8,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as wna16,
    )
    from vllm.model_executor.model_loader import base_loader

    wna16.CompressedTensorsWNA16MoEMethod = _mixin(wna16.CompressedTensorsWNA16MoEMethod)
    w4a8_fp8.CompressedTensorsW4A8Fp8MoEMethod = _mixin(w4a8_fp8.CompressedTensorsW4A8Fp8MoEMethod)

    original = base_loader.process_weights_after_loading

    def record_then_process(model, model_config, target_device):
        _LOADED.clear()
        _LOADED.update({n: p.detach().clone() for n, p in model.named_parameters()})
        _METHODS.clear()
        for name, m in model.named_modules():
            method = getattr(m, "quant_method", None)
            if method is not None:
                scheme = getattr(m, "scheme", None)
                _METHODS[name] = type(method).__name__ + (f"/{type(scheme).__name__}" if scheme else "")
        return original(model, model_config, target_device)

    base_loader.process_weights_after_loading = record_then_process
