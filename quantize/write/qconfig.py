"""config.json's `quantization_config` for a plan, built with compressed-tensors' own classes
(verify rebuilds it to compare; `convert` writes it)."""

from __future__ import annotations

from quantize.plan import Plan
from quantize.source.checkpoint import SourceFormat

__all__ = ["quantization_config"]


def quantization_config(plan: Plan) -> dict:
    """config.json `quantization_config`, built with compressed-tensors' own classes."""
    import compressed_tensors
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    o = plan.options
    # the observer that chose the group scales: GPTQ's MSE clip searches each group's range for
    # the least (Hessian-weighted) error, the job of llm-compressor's "mse" observers; else
    # the min-max range (engines read neither: the scales are in the file)
    observer = "mse" if o.mse_clip and "gptq" in o.method else "minmax"
    args = QuantizationArgs(num_bits=o.num_bits, type="int", symmetric=o.symmetric, strategy="group",
                            group_size=o.group_size, dynamic=False, actorder=None, observer=observer)
    acts = None
    if o.scheme == "w4afp8":  # compressed-tensors' W4AFP8 preset: dynamic per-token FP8 inputs
        acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token",
                                dynamic=True, observer=None)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)}
    if plan.fp8_targets:  # --keep-fp8: the FP8 Linears as they are, compressed-tensors' presets
        if plan.source_format == SourceFormat.FP8_BLOCK:  # FP8_BLOCK: 128x128 weights, per-group
            w8 = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block",
                                  block_structure=list(plan.block_size), dynamic=False, observer=None)
            a8 = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group",
                                  group_size=128, dynamic=True, observer=None)
        else:  # FP8_DYNAMIC: per-channel weights, per-token activations (GLM-4.x's own scheme)
            w8 = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel",
                                  dynamic=False, observer=None)
            a8 = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token",
                                  dynamic=True, observer=None)
        groups["group_0"].format = "pack-quantized"
        groups["group_1"] = QuantizationScheme(targets=list(plan.fp8_targets), weights=w8,
                                               input_activations=a8, format="float-quantized")
    qc = QuantizationConfig(
        config_groups=groups,
        format="mixed-precision" if plan.fp8_targets else "pack-quantized",
        quantization_status="compressed",
        ignore=list(plan.ignore),
        kv_cache_scheme=None,
    ).model_dump()
    qc["config_groups"]["group_0"]["weights"]["actorder"] = None  # engines read it; be explicit
    qc["version"] = compressed_tensors.__version__
    qc["quantization_method"] = o.method  # which rounding produced the integers (informational)
    return qc
