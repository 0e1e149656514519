"""config.json's `quantization_config` for a plan (`convert` writes it; verify rebuilds it to
compare), written as compressed-tensors' own schema without importing compressed-tensors.

Its import pulls in transformers (with torch._dynamo and torch.distributed.tensor): 2.6 s on a
warm cache, and 13-25 s on an H200 node while the conversion's stream keeps the disk busy,
where an RTN conversion or `verify --no-layer-check` waited for it after their last tensor
(BENCHMARKS.md). The fields are few and fixed by the plan; `tests/test_schemes.py` proves, for
every scheme and option that changes them, that compressed-tensors' own `QuantizationConfig`
parses this dict into the very model its classes build (CI runs the lowest and the newest
compressed-tensors the package supports), and the vLLM tests load the result.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version

from quantize.plan import Plan
from quantize.source.checkpoint import SourceFormat

__all__ = ["quantization_config", "quantization_config_difference"]


def _args(num_bits: int, type_: str, symmetric: bool, strategy: str, dynamic: bool, *,
          group_size: int | None = None, block_structure: list[int] | None = None,
          observer: str | None = None) -> dict:
    """One QuantizationArgs, as compressed-tensors serializes it (unset fields left out: its
    defaults)."""
    a = {"num_bits": num_bits, "type": type_, "symmetric": symmetric, "group_size": group_size,
         "strategy": strategy, "dynamic": dynamic}
    if block_structure is not None:
        a["block_structure"] = list(block_structure)
    if observer is not None:
        a["observer"] = observer
    return a


def _scheme(targets: list[str], weights: dict, acts: dict | None, fmt: str | None) -> dict:
    s = {"targets": list(targets), "weights": weights, "input_activations": acts,
         "output_activations": None}
    if fmt is not None:
        s["format"] = fmt
    return s


def _ct_version() -> str:
    try:
        return version("compressed-tensors")
    except PackageNotFoundError:  # (a dependency: only a broken environment lacks it)
        return "unknown"


def quantization_config(plan: Plan) -> dict:
    """config.json `quantization_config`: compressed-tensors' schema (module docstring)."""
    o = plan.options
    # the observer that chose the group scales: GPTQ's MSE clip searches each group's range for
    # the least (Hessian-weighted) error, the job of llm-compressor's "mse" observers; else
    # the min-max range (engines read neither: the scales are in the file)
    observer = "mse" if o.mse_clip and "gptq" in o.method else "minmax"
    weights = _args(o.num_bits, "int", o.symmetric, "group", False, group_size=o.group_size,
                    observer=observer)
    weights["actorder"] = None  # static groups (no g_idx); engines read it: be explicit
    acts = None
    if o.scheme == "w4afp8":  # compressed-tensors' W4AFP8 preset: dynamic per-token FP8 inputs
        acts = _args(8, "float", True, "token", True)
    groups = {"group_0": _scheme(["Linear"], weights, acts,
                                 "pack-quantized" if plan.fp8_targets else None)}
    if plan.fp8_targets:  # --keep-fp8: the FP8 Linears as they are, compressed-tensors' presets
        if plan.source_format == SourceFormat.FP8_BLOCK:  # FP8_BLOCK: 128x128 weights, per-group
            w8 = _args(8, "float", True, "block", False, block_structure=list(plan.block_size))
            a8 = _args(8, "float", True, "group", True, group_size=128)
        else:  # FP8_DYNAMIC: per-channel weights, per-token activations (GLM-4.x's own scheme)
            w8 = _args(8, "float", True, "channel", False)
            a8 = _args(8, "float", True, "token", True)
        groups["group_1"] = _scheme(list(plan.fp8_targets), w8, a8, "float-quantized")
    return {
        "config_groups": groups,
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": None,
        "format": "mixed-precision" if plan.fp8_targets else "pack-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": list(plan.ignore),
        "version": _ct_version(),
        "quantization_method": o.method,  # which rounding produced the integers (informational)
    }


# what compressed-tensors' serializer adds from its own defaults (0.17 writes these for every
# QuantizationArgs, 0.20 leaves them out): not part of what a config says
_FILLED_IN = {"zp_dtype": None, "scale_dtype": None, "observer_kwargs": None,
              "observer": "memoryless_minmax"}  # (name: the value it fills in; None: any)


def _meaning(x):
    """A config as compressed-tensors reads it: a field set to None or to an empty table is
    its default, and so is a field its serializer fills in itself (`_FILLED_IN`): both are left
    out (serializers of different versions write those or not)."""
    if isinstance(x, dict):
        return {k: _meaning(v) for k, v in x.items() if v is not None and v != {}
                and not (k in _FILLED_IN and _FILLED_IN[k] in (None, v))}
    if isinstance(x, list):
        return [_meaning(v) for v in x]
    return x


def quantization_config_difference(got: dict, expected: dict) -> str | None:
    """Where two quantization_configs differ in meaning (the informational `version` and
    `quantization_method` aside), e.g. "config_groups.group_0.weights.group_size: 64, expected
    32"; None when they mean the same."""
    def strip(d: dict) -> dict:
        return {k: v for k, v in d.items() if k not in ("version", "quantization_method")}

    def first(a, b, path: str) -> str | None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                if (d := first(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))) is not None:
                    return d
            return None
        if a == b:
            return None
        def shown(v) -> str:
            return "(unset)" if v is None else json.dumps(v)[:80]
        return f"{path or '(the whole table)'}: {shown(a)}, expected {shown(b)}"

    return first(_meaning(strip(got)), _meaning(strip(expected)), "")
