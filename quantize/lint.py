"""Known-bad layouts, found before an engine finds them (issue 13, item 4).

    lint(quantization_config, tensor names) -> [Check]       `plan` (on what convert would
                                                              write) and `verify` (on what it did)

Each rule is one a serving engine enforces or trips on:

    fail  no config group whose targets include `Linear`: SGLang builds (<= 0.5) read the scheme
          of the group targeting literally "Linear"
    fail  an INT4 `self_attn.indexer.weights_proj`: vLLM's DSA indexer loads it as a plain
          BF16 weight (a KeyError on `weight_packed`); GLM-5 keeps it BF16 in the FP8 release
    fail  an INT4 router (`mlp.gate`) or norm: engines build them unquantized
    fail  FP8 input activations (W4AFP8) on a group that is not group 128, symmetric: the CUTLASS
          W4A8 MoE kernels take nothing else
    warn  routed experts INT4 while the shared experts are not (BF16, or FP8 with --keep-fp8):
          SGLang fuses the shared expert
          into the routed MoE kernel (shared-experts fusion) only when both share a scheme, so
          serve with `--disable-shared-experts-fusion` (the card's command says so)
    warn  FP8 Linears kept beside the INT4 ones (--keep-fp8: the `mixed-precision` format):
          SGLang (0.5.23) builds its fused-MoE schemes only for a `pack-quantized` checkpoint
          ("For Fused MoE layers, only pack-quantized ..."); vLLM reads it. The card prints no
          SGLang command for it.
    warn  zero points on the routed experts (--asymmetric): SGLang's (0.5.23) MoE weight loader
          fails on them (it lays the experts' tensors out transposed, and not the zero points:
          "The size of tensor a ... must match"); vLLM's Marlin reads them. The card prints no
          SGLang command for it.

The two SGLang rules above were found by running SGLang's own loader on our outputs
(tests/engine_sglang, `make engine-check`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Check", "kept_fp8", "lint", "needs_shared_fusion_off", "routed_zero_points",
           "sglang_refusals"]


@dataclass(frozen=True)
class Check:
    """One rule's verdict (plan's serving checks and these layout rules alike)."""

    level: str  # "ok" | "warn" | "fail" (the serving kernels would refuse it)
    what: str
    detail: str

_INDEXER_W = re.compile(r".*\.self_attn\.indexer\.weights_proj$")
_ROUTER = re.compile(r".*\.mlp\.gate$")
_NORM = re.compile(r".*norm[^.]*$")
_ROUTED = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj$")
_SHARED = re.compile(r".*\.mlp\.shared_experts\.(gate|up|down)_proj$")


def _packed(names) -> set[str]:
    return {n[: -len(".weight_packed")] for n in names if n.endswith(".weight_packed")}


def needs_shared_fusion_off(names) -> bool:
    """Routed experts INT4, shared experts present and not INT4."""
    names = set(names)
    packed = _packed(names)
    routed = any(_ROUTED.match(m) for m in packed)
    shared_int4 = any(_SHARED.match(m) for m in packed)
    shared_any = any(".mlp.shared_experts." in n for n in names)
    return routed and shared_any and not shared_int4


def kept_fp8(names) -> list[str]:
    """The Linears written FP8 with their scales (--keep-fp8), sorted."""
    names = set(names)
    packed = _packed(names)
    return sorted(n[: -len(".weight_scale")] for n in names if n.endswith(".weight_scale")
                  and n[: -len(".weight_scale")] not in packed)


def routed_zero_points(names) -> list[str]:
    """The routed experts' Linears written with zero points (--asymmetric), sorted."""
    return sorted(m for n in names if n.endswith(".weight_zero_point")
                  and _ROUTED.match(m := n[: -len(".weight_zero_point")]))


def _mixed(qc: dict | None, fp8: list[str]) -> bool:
    """The checkpoint is `mixed-precision` (FP8 Linears kept beside the INT4 ones)."""
    return bool(fp8) or (qc or {}).get("format") == "mixed-precision"


def sglang_refusals(qc: dict | None, names) -> list[str]:
    """Why SGLang (0.5.23) loads this layout under no flag, each with the fix ([]: it loads);
    the model card prints these instead of an SGLang command (the rules below, in its words)."""
    why = []
    if _mixed(qc, kept_fp8(names)):
        why.append("`--keep-fp8` writes the `mixed-precision` format and SGLang's fused-MoE "
                   "schemes take `pack-quantized` only: convert without --keep-fp8")
    if routed_zero_points(names):
        why.append("the routed experts store zero points (`--asymmetric`) and SGLang's MoE "
                   "weight loader fails on them: convert without --asymmetric")
    return why


def lint(qc: dict, names) -> list[Check]:
    """The rules above on a `quantization_config` and the output's tensor names."""
    names = set(names)
    packed = _packed(names)
    out: list[Check] = []
    groups = (qc or {}).get("config_groups") or {}
    if not any("Linear" in (g.get("targets") or []) for g in groups.values()):
        out.append(Check("fail", "layout: a config group targeting Linear",
                         f"config groups target {[g.get('targets') for g in groups.values()]}; "
                         "SGLang reads the scheme of the group whose target is `Linear`"))
    bad = sorted(m for m in packed if _INDEXER_W.match(m))
    if bad:
        out.append(Check("fail", "layout: INT4 indexer.weights_proj",
                         f"{bad[0]} (+{len(bad) - 1}) is INT4: vLLM loads the DSA indexer's "
                         "weights_proj as a BF16 weight (KeyError); keep attention out of --targets"))
    bad = sorted(m for m in packed if _ROUTER.match(m) or _NORM.match(m))
    if bad:
        out.append(Check("fail", "layout: INT4 router or norm",
                         f"{bad[0]} (+{len(bad) - 1}) is INT4: engines build routers and norms "
                         "unquantized"))
    for name, g in groups.items():
        a, w = g.get("input_activations") or {}, g.get("weights") or {}
        if w.get("type", "int") == "int" and a.get("type") == "float" and a.get("num_bits") == 8 and \
                (w.get("group_size") != 128 or not w.get("symmetric", True)):
            out.append(Check("fail", "layout: W4AFP8 group",
                             f"{name}: FP8 activations with weights group {w.get('group_size')}, "
                             f"symmetric={w.get('symmetric')}: the CUTLASS W4A8 MoE kernels need "
                             "group 128, symmetric (convert with --scheme w4afp8 --group-size 128)"))
    fp8 = kept_fp8(names)
    mixed = _mixed(qc, fp8)
    zp = routed_zero_points(names)
    if needs_shared_fusion_off(names) and not (mixed or zp):  # (no SGLang flag serves those)
        out.append(Check("warn", "layout: shared experts not INT4",
                         "routed experts are INT4, the shared experts not: serve SGLang with "
                         "--disable-shared-experts-fusion (its fused shared-expert path needs one "
                         "scheme for both), or convert with --targets routed,shared"))
    if mixed:
        first = f"{fp8[0]} (+{len(fp8) - 1}) stays" if fp8 else "Linears stay"
        out.append(Check("warn", "layout: FP8 Linears kept (mixed-precision)",
                         f"{first} FP8: the checkpoint's format is mixed-precision, which SGLang "
                         "(0.5.23) refuses for the MoE (its fused-MoE schemes need "
                         "pack-quantized); vLLM reads it. For SGLang, convert without --keep-fp8"))
    if zp:
        out.append(Check("warn", "layout: zero points on the routed experts",
                         f"{zp[0]} (+{len(zp) - 1}) stores zero points: SGLang's (0.5.23) MoE "
                         "weight loader fails on them (it lays the experts out transposed, not "
                         "their zero points); vLLM's Marlin reads them. For SGLang, convert "
                         "without --asymmetric"))
    return out
