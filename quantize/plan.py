"""The exact output of a conversion, computed from the source's headers alone.

`make_plan` decides, for every source tensor, one action:

    quantize   a target Linear   -> weight_packed I32 (N, K/8), weight_scale BF16 (N, K/g),
                                    weight_shape I64 (2,) [, weight_zero_point I32 (ceil(N/8), K/g)]
    dequant    an FP8 weight     -> weight BF16 (N, K); its weight_scale_inv / weight_scale dropped
    copy       everything else   -> the same bytes

and assigns the outputs to shards of at most `max_shard_size` bytes, in layer order, keeping
each source module's outputs in one shard. Because the shard headers are part of the plan
too, `predicted file bytes == written file bytes` exactly; `convert` writes this plan and
nothing else.

GLM-5.2 FP8 as a worked number: 703.7 GiB in, routed experts at 0.5625 bytes/parameter
(0.5 for the nibbles + 2/32 for a BF16 scale per 32) and the rest BF16 -> 419.9 GiB out.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from quantize.errors import Problem, QuantizeError
from quantize.lint import Check, lint
from quantize.options import ConvertOptions
from quantize.source.checkpoint import DTYPE_BYTES, Checkpoint, SourceFormat, gc_paused
from quantize.source.layout import (
    fp8_targets,
    fused_names,
    ignore_patterns,
    is_ignored,
    layer_of,
    linear_role,
    module_of,
    natural_key,
)

__all__ = ["Check", "OutTensor", "Plan", "Shard", "Unit", "gptq_extras", "make_plan", "shard_header"]


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Unit:
    """One source tensor (with its scale) and what it becomes."""

    source: str  # source tensor name
    action: str  # "quantize" | "dequant" | "copy" | "keep" (FP8 weight + scale as they are)
    role: str  # layout role of the module, or "tensor" for non-Linear tensors
    scale: str | None  # the FP8 scale tensor consumed with it
    outputs: tuple[OutTensor, ...]
    source_bytes: int  # bytes read from the source (tensor + scale)

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)


@dataclass(frozen=True)
class Shard:
    file: str
    units: tuple[Unit, ...]

    @property
    def tensors(self) -> list[OutTensor]:
        return [o for u in self.units for o in u.outputs]

    @property
    def data_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    @cached_property
    def file_bytes(self) -> int:  # (computed once: GLM-5.2's shards hold ~180,000 tensors)
        return header_bytes(self.tensors) + self.data_bytes


@dataclass(frozen=True)
class Plan:
    options: ConvertOptions
    source_format: str
    source_bytes: int  # tensor data bytes in the source
    units: tuple[Unit, ...]
    shards: tuple[Shard, ...]
    ignore: tuple[str, ...]
    checks: tuple[Check, ...]  # the serving kernels' rules at tensor-parallel size `tp`
    expert_width: int | None
    tp: int  # the tensor-parallel size it was planned for (the card's serving commands)
    hidden_size: int = 0  # config.json's (the size of a calibration checkpoint)
    index_topk: int = 0  # config.json's, DSA models (their checkpoints carry the top-k too)
    fp8_targets: tuple[str, ...] = ()  # --keep-fp8: the FP8 config group's targets
    block_size: tuple[int, int] | None = None  # the source's FP8 block (block FP8 sources)

    def quantizes(self, *roles: str) -> bool:
        """Whether any INT4 target has one of these layout roles (routed, shared, dense)."""
        return any(u.action == "quantize" and u.role in roles for u in self.units)

    @property
    def gptaq_active(self) -> bool:
        """Whether --gptaq changes anything: it applies to dense and shared-expert MLP Linears
        (routed experts keep plain GPTQ), so with none of those among the INT4 targets the
        calibration carries no second stream of hidden states."""
        return bool(self.options.gptaq) and self.quantizes("dense", "shared")

    @property
    def scale_refits(self) -> dict[str, int]:
        """The rounds of --scale-refit each kind of target present gets: {"dense/shared": n,
        "routed": m}, rounds > 0 only."""
        o, out = self.options, {}
        if o.scale_refit and self.quantizes("dense", "shared"):
            out["dense/shared"] = o.scale_refit
        if o.scale_refit_routed and self.quantizes("routed"):
            out["routed"] = o.scale_refit_routed
        return out

    @property
    def clip_settings(self) -> dict[str, tuple[int, float]]:
        """The MSE clip's (error power, channel weight power) for each kind of target present:
        {"dense/shared": (mse_norm, mse_weight_power), "routed": (the *_routed pair)}."""
        o, out = self.options, {}
        if self.quantizes("dense", "shared"):
            out["dense/shared"] = (o.mse_norm, o.mse_weight_power)
        if self.quantizes("routed"):
            out["routed"] = (o.mse_norm_routed, o.mse_weight_power_routed)
        return out

    def clip_words(self) -> str:
        """How GPTQ chooses the group scales in this plan, in words (`clip_words`)."""
        return clip_words(bool(self.options.mse_clip), self.clip_settings)

    @property
    def sequential_active(self) -> bool:
        """Whether --sequential-mlp changes anything: it orders the solves of dense and
        shared-expert MLPs (routed experts keep pass 1's statistics)."""
        return bool(self.options.sequential_mlp) and self.quantizes("dense", "shared")

    def gptq_extras(self) -> list[str]:
        """What GPTQ does beyond the column loop in this plan, in words (`gptq_extras`)."""
        o = self.options
        return gptq_extras(o.gptaq if self.gptaq_active else 0, self.scale_refits,
                           self.sequential_active)

    @property
    def output_bytes(self) -> int:
        return sum(s.data_bytes for s in self.shards)

    @property
    def output_file_bytes(self) -> int:
        return sum(s.file_bytes for s in self.shards)

    def read_order(self, skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """The source tensors (and their scales) in the order the stream reads them: shard by
        shard in plan order, the shards named in `skip` (kept by a resume) left out."""
        return [n for s in self.shards if s.file not in skip for u in s.units
                for n in (u.source, u.scale) if n]

    def bytes_by(self, key: str) -> dict[str, tuple[int, int]]:
        """{role or action: (source bytes, output bytes)} for the summary tables."""
        out: dict[str, tuple[int, int]] = {}
        for u in self.units:
            k = getattr(u, key)
            s, o = out.get(k, (0, 0))
            out[k] = (s + u.source_bytes, o + u.nbytes)
        return out


def shard_header(tensors: list[OutTensor]) -> bytes:
    """The safetensors header (length prefix included) for tensors written in this order.

    JSON padded with spaces to a multiple of 8 bytes, as the safetensors library writes it.
    """
    entries: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    off = 0
    for t in tensors:
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw


_PLAIN_NAME = re.compile(r'[ -!#-\[\]-~]*')  # printable ASCII but '"' and '\\': JSON writes it as is


def header_bytes(tensors: list[OutTensor]) -> int:
    """len(shard_header(tensors)), counted without building the JSON (~4x faster: the
    free-space check sums it over every shard of GLM-5.2 before the stream starts). Names
    JSON would escape are measured by json itself; tests/test_plan.py holds it to
    shard_header's length."""
    n, off = len('{"__metadata__":{"format":"pt"}}'), 0
    for t in tensors:
        name = len(t.name) + 2 if _PLAIN_NAME.fullmatch(t.name) else len(json.dumps(t.name))
        end = off + t.nbytes
        # ,NAME:{"dtype":"X","shape":[..],"data_offsets":[off,end]}
        n += (name + len(t.dtype) + len(str(off)) + len(str(end)) + 44
              + sum(len(str(d)) for d in t.shape) + max(len(t.shape) - 1, 0))
        off = end
    return 8 + n + (-n) % 8


def _quantized_outputs(module: str, N: int, K: int, opts: ConvertOptions) -> tuple[OutTensor, ...]:
    G = K // opts.group_size
    outs = [
        OutTensor(f"{module}.weight_packed", "I32", (N, math.ceil(K / 8))),
        OutTensor(f"{module}.weight_scale", "BF16", (N, G)),
        OutTensor(f"{module}.weight_shape", "I64", (2,)),
    ]
    if not opts.symmetric:
        outs.append(OutTensor(f"{module}.weight_zero_point", "I32", (math.ceil(N / 8), G)))
    return tuple(outs)


def _scale_name(ckpt: Checkpoint, weight: str) -> str | None:
    if ckpt.tensors[weight].dtype != "F8_E4M3":
        return None
    stem = weight[: -len("weight")]
    return stem + ("weight_scale_inv" if ckpt.source_format == SourceFormat.FP8_BLOCK else "weight_scale")


def _units(ckpt: Checkpoint, opts: ConvertOptions) -> list[Unit]:
    scales = {s for w in ckpt.tensors if (s := _scale_name(ckpt, w))}
    problems: list[Problem] = []
    units = []
    for name in sorted(ckpt.tensors, key=natural_key):
        if name in scales:
            continue
        t = ckpt.tensors[name]
        is_linear = name.endswith(".weight") and len(t.shape) == 2 and "embed_tokens" not in name
        role = linear_role(module_of(name)) if is_linear else "tensor"
        scale = _scale_name(ckpt, name)
        src_bytes = t.nbytes + (ckpt.tensors[scale].nbytes if scale else 0)
        kept_mtp = opts.mtp == "keep" and (L := layer_of(name)) is not None and L >= ckpt.num_hidden_layers
        if role in opts.targets and not kept_mtp:
            N, K = t.shape
            if K % opts.group_size:
                problems.append(Problem(t.file, name, f"in_features {K}",
                                        f"a multiple of --group-size {opts.group_size}",
                                        "pick a --group-size that divides it, or leave this role "
                                        "out of --targets (padding would break the engines' shapes)"))
                continue
            units.append(Unit(name, "quantize", role, scale, _quantized_outputs(module_of(name), N, K, opts),
                              src_bytes))
        elif scale is not None and opts.keep_fp8 and is_linear:  # FP8 + its scale, as they are
            st = ckpt.tensors[scale]
            units.append(Unit(name, "keep", role, scale, (
                OutTensor(name, t.dtype, t.shape),
                OutTensor(name[: -len("weight")] + "weight_scale", st.dtype, st.shape)), src_bytes))
        elif scale is not None:
            units.append(Unit(name, "dequant", role, scale, (OutTensor(name, "BF16", t.shape),), src_bytes))
        else:
            units.append(Unit(name, "copy", role, None, (OutTensor(name, t.dtype, t.shape),), src_bytes))
    if problems:
        raise QuantizeError("the group size does not tile these weights", problems)
    if opts.keep_fp8 and not any(u.action == "keep" for u in units):
        raise QuantizeError("--keep-fp8: nothing to keep", [Problem(
            "config.json", None, f"a {ckpt.source_format} source with no FP8 Linear outside "
            "--targets", "an FP8 release (GLM-5.x block FP8, GLM-4.x channel FP8)",
            "drop --keep-fp8 (a BF16 source is written as BF16 anyway)")])
    if not any(u.action == "quantize" for u in units):
        raise QuantizeError("nothing to quantize", [Problem(
            "model.safetensors.index.json", None,
            f"no Linear of role {','.join(sorted(opts.targets))}",
            "routed experts (model.layers.L.mlp.experts.E.*_proj) or the requested --targets",
            "check --targets; dense models need --targets dense (other MoE layouts, e.g. "
            "Mixtral's block_sparse_moe.experts.E.w1/w2/w3, are not supported)")])
    return units


def _shards(units: list[Unit], max_bytes: int) -> list[Shard]:
    groups: list[list[Unit]] = [[]]
    size = 0
    for u in units:
        if groups[-1] and size + u.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(u)
        size += u.nbytes
    n = len(groups)
    return [Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(g)) for i, g in enumerate(groups)]


def _expert_width(ckpt: Checkpoint) -> int | None:
    w = ckpt.config.get("moe_intermediate_size")
    if w:
        return int(w)
    for name, t in ckpt.tensors.items():
        if linear_role(module_of(name)) == "routed" and name.endswith("gate_proj.weight"):
            return t.shape[0]
    return None


def tp_checks(ckpt: Checkpoint, opts: ConvertOptions, tp: int, expert_width: int | None,
              row_widths: dict[str, set[int]] | None = None) -> list[Check]:
    """What vLLM's Marlin MoE / SGLang WNA16 kernels require of the quantized layout at `tp`.
    `row_widths`: {role: in-dimensions of its INT4 down_proj} for shared/dense targets."""
    checks: list[Check] = []
    g = opts.group_size
    hidden = ckpt.config.get("hidden_size")
    if hidden:
        lvl = "ok" if hidden % 128 == 0 else "fail"
        checks.append(Check(lvl, "hidden size % 128", f"{hidden} % 128 = {hidden % 128}"))
    if expert_width and "routed" in opts.targets:
        if expert_width % tp:
            checks.append(Check("fail", f"expert width / TP{tp}",
                                f"{expert_width} is not divisible by {tp}; use a TP size that divides it"))
        else:
            part = expert_width // tp
            need = max(64, g)
            ok = part % need == 0
            fix = ""
            if not ok:
                good_g = [x for x in (32, 64, 128) if part % max(64, x) == 0]
                good_tp = [t for t in (1, 2, 4, 8, 16) if expert_width % t == 0
                           and (expert_width // t) % need == 0]
                fixes = ([f"--group-size {good_g[-1]}"] if good_g else []) + (
                    [f"serve at TP {', '.join(map(str, good_tp))}"] if good_tp else [])
                fix = ("; fix: " + " or ".join(fixes) if fixes
                       else "; no group size or TP size in 1..16 satisfies the MoE kernels")
            checks.append(Check("ok" if ok else "fail", f"expert width / TP{tp} % max(64, group)",
                                f"{expert_width}/{tp} = {part}, {part} % {need} = {part % need}{fix}"))
    # Row-parallel INT4 Linears outside the routed experts (shared experts, dense MLPs): each
    # rank holds K / TP input columns, and its groups must tile them.
    for role, ks in sorted((row_widths or {}).items()):
        for k in sorted(ks):
            ok = k % tp == 0 and (k // tp) % g == 0
            good_tp = [t for t in (1, 2, 4, 8, 16) if k % t == 0 and (k // t) % g == 0]
            detail = f"{k}/{tp} = {k / tp:g}, % {g} = {(k // tp) % g if k % tp == 0 else 'n/a'}"
            if not ok:
                detail += (f"; fix: serve at TP {', '.join(map(str, good_tp))}, a smaller "
                           f"--group-size, or leave {role} out of --targets")
            checks.append(Check("ok" if ok else "fail", f"{role} down_proj K / TP{tp} % group",
                                detail))
    if opts.scheme == "w4afp8":
        checks += _w4afp8_checks(hidden, expert_width, tp, opts)
    if not opts.symmetric:
        checks.append(Check("warn", "asymmetric zero points",
                            "SGLang's MoE WNA16 kernels assert symmetric weights and transformers "
                            "ignores MoE zero points when decompressing; vLLM Marlin reads them"))
    return checks


W4A8_MULTIPLE = 256  # the CUTLASS W4A8 MoE GEMM's tile along K and N


def _w4afp8_checks(hidden: int | None, expert_width: int | None, tp: int,
                   opts: ConvertOptions) -> list[Check]:
    """The CUTLASS W4A8 MoE kernels (vLLM CompressedTensorsW4A8Fp8MoEMethod, SGLang
    CompressedTensorsW4AFP8MoE): group 128, symmetric, hidden size and the per-rank expert
    width multiples of 256. GLM-5.x (6144, 2048): TP 1-8; GLM-4.5-4.7 (5120, 1536): TP 1-2 (or
    expert parallel); GLM-4.5-Air (4096, 1408): never."""
    m = W4A8_MULTIPLE
    out = []
    if hidden:
        out.append(Check("ok" if hidden % m == 0 else "fail", f"w4afp8: hidden size % {m}",
                         f"{hidden} % {m} = {hidden % m}"))
    if expert_width and "routed" in opts.targets:
        good = [t for t in (1, 2, 4, 8, 16) if expert_width % t == 0 and (expert_width // t) % m == 0]
        part = expert_width / tp
        ok = tp in good
        detail = f"{expert_width}/{tp} = {part:g}" + (f", % {m} = {int(part) % m}" if part == int(part) else "")
        if not ok:
            detail += (f"; w4afp8 serves at TP {', '.join(map(str, good))} (or with expert parallel)"
                       if good else "; no TP size in 1..16 works: use --scheme w4a16")
        out.append(Check("ok" if ok else "fail", f"w4afp8: expert width / TP{tp} % {m}", detail))
    return out


def _row_widths(ckpt: Checkpoint, units: list[Unit]) -> dict[str, set[int]]:
    """{role: in-dimensions} of the INT4 down_proj units outside the routed experts."""
    widths: dict[str, set[int]] = {}
    for u in units:
        if u.action == "quantize" and u.role in ("shared", "dense") \
                and u.source.endswith("down_proj.weight"):
            widths.setdefault(u.role, set()).add(ckpt.tensors[u.source].shape[1])
    return widths


def _lint(opts: ConvertOptions, units: list[Unit]) -> list[Check]:
    """quantize/lint.py's rules on the layout this plan writes."""
    acts = {"num_bits": 8, "type": "float"} if opts.scheme == "w4afp8" else None
    qc = {"config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "weights": {
        "type": "int", "group_size": opts.group_size, "symmetric": opts.symmetric}}}}
    return lint(qc, [o.name for u in units for o in u.outputs])


@gc_paused()
def make_plan(ckpt: Checkpoint, opts: ConvertOptions, tp: int = 8) -> Plan:
    """Every output tensor, its shard and bytes, plus the serving checks at `tp`. Reads no data."""
    units = _units(ckpt, opts)
    others = [module_of(u.source) for u in units if u.action not in ("quantize", "keep")
              and u.role != "tensor"]
    mtp_layers = sorted({L for u in units if (L := layer_of(u.source)) is not None
                         and L >= ckpt.num_hidden_layers}) if opts.mtp == "keep" else []
    kept = [module_of(u.source) for u in units if u.action == "keep"]
    ignore = ignore_patterns(opts.targets, others, mtp_layers, kept)
    fp8 = fp8_targets(kept, ckpt.num_hidden_layers) if kept else []
    problems = []
    for u in units:
        mod = module_of(u.source)
        if u.action in ("quantize", "keep") and any(is_ignored(n, ignore) for n in fused_names(mod)):
            problems.append(Problem("config.json", u.source, "a target matched by the ignore list",
                                    "targets outside `ignore`", "report this as a bug"))
        hit = any(is_ignored(n, fp8) for n in fused_names(mod))  # (is_ignored: the same matching)
        if (u.action == "keep") != hit and u.role != "tensor":
            problems.append(Problem("config.json", u.source, f"{u.action}, FP8 group match {hit}",
                                    "kept FP8 Linears, and only those, in the FP8 group",
                                    "report this as a bug"))
    if problems:
        raise QuantizeError("internal: the ignore list would hide targets", problems)
    width = _expert_width(ckpt)
    return Plan(
        options=opts,
        source_format=ckpt.source_format,
        source_bytes=ckpt.total_bytes,
        units=tuple(units),
        shards=tuple(_shards(units, opts.max_shard_size)),
        ignore=tuple(ignore),
        checks=tuple(tp_checks(ckpt, opts, tp, width, _row_widths(ckpt, units))
                     + _lint(opts, units)),
        expert_width=width,
        tp=tp,
        hidden_size=int(ckpt.config.get("hidden_size") or 0),
        index_topk=int(ckpt.config.get("index_topk") or 0) if ckpt.model_type == "glm_moe_dsa" else 0,
        fp8_targets=tuple(fp8),
        block_size=tuple(ckpt.block_size) if ckpt.block_size else None,
    )


def clip_words(mse_clip: bool, settings: dict[str, Sequence[float]]) -> str:
    """How GPTQ chooses its group scales, in words, as convert's start line, plan's table and the
    model card say it: the MSE clip's error power and its weight on each input channel (H_kk^a:
    a = 0 channels alike, 1 weighted by their activations) per kind of target present
    ({"dense/shared": (power, a), "routed": (power, a)}, pairs as tuples or, read from JSON,
    lists; one phrase where they agree), or the min-max range."""
    if not mse_clip:
        return "min-max range (no MSE clip)"
    settings = {k: tuple(v) for k, v in settings.items()}

    def one(norm: int, a: float) -> str:
        weight = "channels alike" if a == 0 else "channels weighted by their activations" + (
            "" if a == 1 else f"^{a:g}")
        return f"error power {norm}, {weight}"

    if len(set(settings.values())) <= 1:
        return "MSE clip" + "".join(f" of {one(*v)}" for v in list(settings.values())[:1])
    names = {"dense/shared": "dense and shared-expert Linears", "routed": "routed experts"}
    return "MSE clip " + ", ".join(f"of {one(*v)} ({names.get(k, k)})" for k, v in settings.items())


def gptq_extras(gptaq: float, scale_refits: dict[str, int], sequential: bool) -> list[str]:
    """GPTQ's steps beyond the column loop in words, as convert's start line, plan's table and
    the model card say them: GPTAQ's fraction, the scale re-fit's rounds per kind of target
    ({"dense/shared": n, "routed": m}, rounds > 0), --sequential-mlp."""
    words = [f"GPTAQ {gptaq:g} on dense and shared-expert Linears"] if gptaq else []
    names = {"dense/shared": "dense and shared-expert", "routed": "routed experts'"}
    if len(scale_refits) == 2 and len(set(scale_refits.values())) == 1:
        words.append(f"scales re-fitted x{next(iter(scale_refits.values()))}")
    else:
        words += [f"{names.get(k, k)} scales re-fitted x{v}" for k, v in scale_refits.items()]
    if sequential:
        words.append("down_proj fitted after the rounded gate/up (dense and shared-expert MLPs)")
    return words
