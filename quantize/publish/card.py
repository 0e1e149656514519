"""The model card (README.md of an output folder): facts in, markdown out. No I/O here.

`readme.py` gathers the facts from the output folder (manifest, config, verify.json, eval.json,
the plan recomputed from the source headers) and writes the file; this module only renders.

The card opens with the Hub's YAML front matter:

    ---
    base_model: zai-org/GLM-5.2-FP8        # only when the source is known as a Hub repo id
    base_model_relation: quantized
    library_name: transformers             # compressed-tensors checkpoints load through it
    tags: [compressed-tensors, int4, w4a16, ...]
    ---

then: what was quantized and how (with the calibration figures of calibration-report.json for
a calibrated method), the size figures, the verify (and eval) results, serving
commands for vLLM and SGLang with the tensor-parallel sizes the group size allows (SGLang's
only for a layout SGLang loads: `make engine-check` runs SGLang's own loader under the flags
the card prints), and the exact command and tool version that produced the folder.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["CalibrationFacts", "CardFacts", "Sizes", "render_card"]

GiB = 2**30


@dataclass(frozen=True)
class Sizes:
    """The plan's byte figures (exactly what convert wrote)."""

    source_bytes: int | None  # tensor data in the source (None: source folder not available)
    output_bytes: int  # tensor data written (= index total_size)
    output_file_bytes: int  # shard files on disk, headers included
    shards: int
    by_role: tuple[tuple[str, int, int], ...] = ()  # (role, source bytes, output bytes)


@dataclass(frozen=True)
class CalibrationFacts:
    """What calibration-report.json says about the calibration data and the experts' statistics."""

    data: str  # the calibration file's name (never a local path)
    shipped: bool  # one of the sets shipped with the tool (calib_data/; the default or shipped:NAME)
    sha256: str | None  # of the data's bytes (None: a report from before it was recorded)
    documents: int
    num_samples: int
    seq_len: int
    overlapping: bool  # the text held fewer than num_samples x seq_len tokens
    expert_calibration: str  # "routed" | "routed-weighted" | "all"
    min_expert_tokens: int
    moe_layers: int  # calibrated MoE layers (the MTP layer included)
    expert_tokens: tuple[int, ...]  # routed tokens of every expert in every MoE layer
    fallbacks: tuple[tuple[int, int, int], ...]  # (layer, expert, routed tokens): all-token statistics
    rounded: tuple[tuple[int, str], ...] = ()  # (layer, why): rounded to nearest instead
    coverage: int = 0  # --expert-coverage (0: off, or a report from before it)
    topped_up: tuple[tuple[int, int, int, int], ...] = ()  # (layer, expert, routed, added)
    gptq: str = ""  # GPTQ's settings in words (calibration-report.json), "" for awq / old reports
    prefix: tuple[str, ...] = ()  # the tokens each window begins with (the tokenizer's BOS)

    @property
    def tokens(self) -> int:
        return self.num_samples * self.seq_len


@dataclass(frozen=True)
class CardFacts:
    source_name: str  # the source as given (path or repo id)
    base_model: str | None  # Hub repo id of the source, when known
    base_revision: str | None  # the source's commit sha, when known
    repo_id: str | None  # the repo this card is published to, when known
    model_type: str
    method: str
    num_bits: int
    group_size: int
    symmetric: bool
    targets: tuple[str, ...]
    ignore: tuple[str, ...]
    int4_linears: int
    kept_tensors: int  # output tensors that are not INT4 (BF16 weights, norms, ...)
    sizes: Sizes
    tp: int  # tensor-parallel size used in the serving commands
    valid_tp: tuple[int, ...]  # TP sizes the MoE kernels accept at this group size
    expert_width: int | None
    calibration: CalibrationFacts | None  # None: rtn, or no calibration-report.json
    verify: dict | None  # verify.json (summary + worst)
    eval: dict | None  # eval.json, when an eval ran
    tool_version: str
    compressed_tensors_version: str | None
    command: str | None
    license: str | None = None  # the source's (its card's front matter), when known
    pictures: tuple[tuple[str, str], ...] = ()  # (file in the folder, caption) that exist
    scheme: str = "w4a16"  # w4a16 | w4afp8 (FP8 input activations declared)
    mtp: str = "int4"  # int4 | keep
    sglang_no_shared_fusion: bool = False  # routed INT4, shared BF16 (quantize/lint.py)
    sglang_refusals: tuple[str, ...] = ()  # why SGLang loads it under no flag (lint.sglang_refusals)
    keep_fp8: bool = False  # --keep-fp8: a second, FP8 group
    eval_verdict: dict | None = None  # eval.json's verdict: ok, the thresholds it used, what failed


def _bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    if n >= GiB / 10:
        return f"{n:,} bytes ({n / GiB:,.1f} GiB)"
    return f"{n:,} bytes ({n / 2**20:,.2f} MiB)"


def _num(x) -> str:
    if x is None:  # (JSON null: a non-finite figure, e.g. the SQNR of exact tensors)
        return "n/a (exact)"
    if isinstance(x, float):
        if math.isnan(x):
            return "not a number"
        return "inf" if math.isinf(x) else f"{x:.2f}"
    return str(x)


def _count(x) -> str:
    return f"{x:,}" if isinstance(x, int) else _num(x)


def _fixed(x, digits: int = 4) -> str:
    """A figure with `digits` decimals; a null or non-finite one (an error that overflowed,
    written as JSON null) said in words, never a formatting error."""
    if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
        return f"{x:.{digits}f}"
    return "not finite" if x is None or isinstance(x, float) else str(x)


def _tag(t: str) -> str:
    """A Hub tag: lowercase letters, digits and - (`awq+gptq` -> `awq-gptq`)."""
    return re.sub(r"[^a-z0-9-]+", "-", t.lower()).strip("-")


def _front_matter(f: CardFacts) -> list[str]:
    """The card's YAML metadata, built with huggingface_hub's ModelCardData (the Hub's own
    schema: license, base_model + base_model_relation, pipeline_tag, library_name, tags)."""
    from huggingface_hub import ModelCardData

    tags = ["compressed-tensors", "int4", f.scheme, "quantized", "moe", f.method]
    if f.model_type and f.model_type != "unknown":
        tags.append(f.model_type)
    data = ModelCardData(
        license=f.license, base_model=f.base_model,
        base_model_relation="quantized" if f.base_model else None,
        library_name="transformers", pipeline_tag="text-generation",
        tags=list(dict.fromkeys(_tag(t) for t in tags)))
    return ["---", *data.to_yaml().splitlines(), "---"]


def _what(f: CardFacts) -> list[str]:
    acts = ("dynamic per-token FP8 activations (W4AFP8)" if f.scheme == "w4afp8"
            else "activations stay BF16")
    scheme = (f"W{f.num_bits}{'AFP8' if f.scheme == 'w4afp8' else 'A16'}, INT{f.num_bits} weights, "
              f"{'symmetric' if f.symmetric else 'asymmetric'}"
              f", one BF16 scale per {f.group_size} input channels"
              f"{'' if f.symmetric else ' plus a zero point'}; {acts}")
    base = f.base_model or f.source_name
    rev = f" at revision `{f.base_revision}`" if f.base_revision else ""
    return [
        (f"INT{f.num_bits} weight-only quantization of `{base}`{rev}, in the compressed-tensors "
         "`pack-quantized` format (vLLM and SGLang load it directly)."),
        "",
        "| | |",
        "|---|---|",
        f"| base model | `{base}`{rev} |",
        f"| method | `{f.method}` |",
        f"| scheme | {scheme} |",
        f"| group size | {f.group_size} |",
        ("| MTP layer (speculative decoding) | kept as in the source (BF16), `--mtp keep` |"
         if f.mtp == "keep" else "| MTP layer (speculative decoding) | INT4 like the decoder layers |"),
        f"| INT{f.num_bits} modules | {f.int4_linears:,} Linear layers of role(s): {', '.join(f.targets)} |",
        (f"| kept in original precision | {f.kept_tensors:,} tensors: the FP8 Linears FP8 with "
         "their scales (`--keep-fp8`, a float-quantized group: vLLM reads this mixed-precision "
         "format, SGLang does not), everything matched by the `ignore` list below BF16 |"
         if f.keep_fp8 else
         f"| kept in original precision | {f.kept_tensors:,} tensors: everything matched by the "
         "`ignore` list below (BF16; FP8 sources are dequantized exactly) |"),
        *_calibration(f),
        "",
        "Kept out of INT4 (`quantization_config.ignore`, as the engines match it):",
        "",
        *[f"- `{p}`" for p in f.ignore],
    ]


def _calibration(f: CardFacts) -> list[str]:
    c = f.calibration
    if c is None:
        why = ("none (round-to-nearest needs no calibration data)" if f.method == "rtn"
               else "not recorded (no calibration-report.json)")
        return [f"| calibration data | {why} |"]
    data = f"`{c.data}`" + (f" (shipped with the tool as calib_data/{c.data})" if c.shipped else "")
    if c.sha256:
        data += f", sha256 `{c.sha256}`"
    # the prefix as one code span (`[gMASK]``<sop>` would be read as one span holding the
    # backticks), a pipe escaped (Llama 3's `<|begin_of_text|>` would end the table's cell)
    start = "".join(c.prefix).replace("|", "\\|")
    lines = [
        f"| calibration data | {data}; {c.documents:,} document{'' if c.documents == 1 else 's'} |",
        (f"| calibration tokens | {c.num_samples:,} samples x {c.seq_len:,} tokens = {c.tokens:,} tokens"
         + (f", each beginning with `{start}` as every served "
            "request does" if c.prefix else "")
         + f"{' (overlapping windows: the text holds fewer)' if c.overlapping else ''} |"),
    ]
    if c.moe_layers:
        how = {"routed": "routed: each expert's statistics from the tokens the router sends it",
               "routed-weighted": "routed-weighted: each expert's statistics from the tokens the "
                                  "router sends it, each weighted by its squared routing weight",
               }.get(c.expert_calibration, "all: every expert's statistics from every token")
        et = sorted(c.expert_tokens)
        lines += [
            f"| expert calibration | {how} |",
            (f"| routed tokens per expert | min {et[0]:,} / median {et[len(et) // 2]:,} / max {et[-1]:,} "
             f"({len(et):,} experts in {c.moe_layers} MoE layers) |"),
            f"| expert fallbacks | {_fallbacks(c)} |",
        ]
        if c.coverage and c.expert_calibration != "all":
            lines.append(f"| expert coverage | {_coverage(c)} |")
    if c.gptq:
        lines.append(f"| GPTQ settings | {c.gptq} |")
    if c.rounded:
        lines.append("| rounded to nearest instead | "
                     + "; ".join(f"layer {L}: {why}" for L, why in c.rounded) + " |")
    return lines


def _fallbacks(c: CalibrationFacts) -> str:
    if c.expert_calibration == "all":
        return "none (every expert sees every token)"
    if not c.fallbacks:
        return f"none: every expert had at least {c.min_expert_tokens} routed tokens"
    shown = ", ".join(f"layer {L} expert {e} ({n})" for L, e, n in c.fallbacks[:8])
    more = f" and {len(c.fallbacks) - 8} more" if len(c.fallbacks) > 8 else ""
    return (f"{len(c.fallbacks)} of {len(c.expert_tokens)} experts had fewer than "
            f"{c.min_expert_tokens} routed tokens and used all-token statistics instead "
            f"(calibration-report.json lists each): {shown}{more}")


def _coverage(c: CalibrationFacts) -> str:
    head = f"each expert's statistics over at least {c.coverage:,} tokens"
    if not c.topped_up:
        return f"{head}: every expert was routed that many"
    shown = ", ".join(f"layer {L} expert {e} ({n} + {a})" for L, e, n, a in c.topped_up[:8])
    more = f" and {len(c.topped_up) - 8} more" if len(c.topped_up) > 8 else ""
    return (f"{head}: {len(c.topped_up)} of {len(c.expert_tokens)} experts were routed fewer and "
            f"got the tokens their router ranks highest among the rest (routed + added): "
            f"{shown}{more}")


def _sizes(f: CardFacts) -> list[str]:
    s = f.sizes
    ratio = f"{s.output_bytes / s.source_bytes:.3f}" if s.source_bytes else "n/a"
    lines = [
        "## Size",
        "",
        "| | bytes |",
        "|---|---|",
        f"| source tensors | {_bytes(s.source_bytes)} |",
        f"| output tensors | {_bytes(s.output_bytes)} |",
        f"| output files ({s.shards} shards, headers included) | {_bytes(s.output_file_bytes)} |",
        f"| output / source | {ratio} |",
        f"| weights per GPU at TP{f.tp} (even split) | {_bytes(s.output_bytes // f.tp)} |",
    ]
    if s.by_role:
        lines += ["", "| role | source | output |", "|---|---|---|"]
        lines += [f"| {r} | {_bytes(a)} | {_bytes(b)} |" for r, a, b in s.by_role]
    return lines


def _results(f: CardFacts) -> list[str]:
    lines = ["## Verification", ""]
    v = f.verify
    if v is None:
        lines.append("Not verified yet: run `quantize verify SRC DST`.")
    else:
        s = v["summary"]
        lines += [
            ("`quantize verify` reloaded every output tensor and compared it with the source: "
             f"**{'PASS' if s['ok'] else 'FAIL'}**."),
            "",
            "| check | result |",
            "|---|---|",
            f"| INT4 tensors checked | {_count(s['quantized'])} |",
            f"| SQNR min / mean (dB) | {_num(s['min_sqnr_db'])} / {_num(s['mean_sqnr_db'])} |",
            f"| SQNR floor (dB) | {_num(v.get('min_sqnr_db_threshold'))} |",
            f"| max relative error | {_fixed(s['max_rel_err'])} |",
            f"| bit-exact tensors (copied / dequantized) | {_count(s['exact_ok'])} / {_count(s['exact_total'])} |",
            f"| problems | {len(s['problems'])} |",
        ]
        worst = v.get("worst") or []
        if worst:
            lines += ["", "Lowest-SQNR tensors:", "", "| tensor | rel. error | SQNR dB |", "|---|---|---|"]
            lines += [f"| `{w['name']}` | {_fixed(w['rel_err'])} | "
                      f"{_num(w['sqnr_db']) if w['rel_err'] is not None else 'not finite'} |"
                      for w in worst[:5]]
    if f.eval:
        lines += ["", "## Evaluation", "",
                  ("`quantize eval` ran the source and this checkpoint side by side, layer by layer, "
                  "on held-out text and compared their next-token predictions:"), "",
                  "| measure | value |", "|---|---|"]
        known = set()
        for key, label, fmt in EVAL_ROWS:
            if key in f.eval:
                known.add(key)
                lines.append(f"| {label} | {fmt(f.eval[key])} |")
        lines += [f"| {k} | {_metric(x)} |" for k, x in _flat(f.eval) if k not in known]
        v = f.eval_verdict
        if isinstance(v, dict) and isinstance(v.get("ok"), bool):
            def g(x) -> str:
                return f"{x:g}" if _finite(x) else _num(x)

            rule = (f"a perplexity ratio of at most {g(v.get('max_ppl_ratio'))} and a mean KL "
                    f"of at most {g(v.get('max_kl'))} nats per token, held-out and "
                    "out-of-domain text (`quantize eval --max-ppl-ratio / --max-kl`)")
            lines += ["", (f"Verdict: **pass**, by its thresholds: {rule}." if v["ok"] else
                           f"Verdict: **fail** ({'; '.join(map(str, v.get('failed') or []))}), by "
                           f"its thresholds: {rule}.")]
    return lines


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _pct(x) -> str:
    return f"{100 * x:.2f} %" if _finite(x) else _num(x)


def _ratio(x) -> str:
    if not _finite(x):
        return _num(x)
    return f"{_metric(float(x))} ({100 * (x - 1):+.2f} % perplexity)"


# eval.json's summary as a reader wants it: (key, what it means, how to print it); other keys
# follow under their own names
EVAL_ROWS = (
    ("ppl_source", "perplexity of the source", lambda x: _metric(x)),
    ("ppl_quantized", "perplexity of this checkpoint", lambda x: _metric(x)),
    ("ppl_ratio", "perplexity ratio (this / source)", _ratio),
    ("kl_mean", "mean KL divergence, source -> this (nats per token)", lambda x: _metric(x)),
    ("top1_agreement", "same top-1 next token as the source", _pct),
    ("tokens", "tokens scored", lambda x: f"{x:,}" if isinstance(x, int) else _num(x)),
    ("data", "evaluation text", lambda x: str(x)),
    ("ood_ppl_ratio", "out of domain: perplexity ratio", _ratio),
    ("ood_kl_mean", "out of domain: mean KL divergence (nats per token)", lambda x: _metric(x)),
    ("ood_top1_agreement", "out of domain: same top-1 next token", _pct),
    ("ood_data", ("out-of-domain text (general English; a calibrated method that fits its "
                  "calibration text too closely shows here first)"), lambda x: str(x)),
)


def _metric(x) -> str:
    """An eval figure with the digits that matter: a ppl ratio of 1.0123 stays 1.0123 (not
    1.01), a KL of 0.0123 stays 0.0123; at least two decimals (5.4 -> 5.40)."""
    if not isinstance(x, float) or not math.isfinite(x):
        return _num(x)
    if x != 0 and abs(x) < 1e-3:
        return f"{x:.3e}"
    whole, frac = f"{x:.4f}".rstrip("0").split(".")
    return f"{whole}.{frac.ljust(2, '0')}"


def _flat(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _flat(v, f"{prefix}{k}.")
        elif isinstance(v, (int, float, str, bool)):
            out.append((f"{prefix}{k}", v))
    return out


def _serving(f: CardFacts) -> list[str]:
    model = f.repo_id or "PATH_OR_REPO_ID"
    tps = ", ".join(map(str, f.valid_tp)) or "none in 1..16"
    width = (f"The routed experts are {f.expert_width} wide; the MoE INT4 kernels need "
             f"`{f.expert_width} / TP` to be a multiple of max(64, group size) = "
             f"{max(64, f.group_size)}, so the tensor-parallel sizes that work at group size "
             f"{f.group_size} are: **{tps}**.") if f.expert_width else ""
    w4a8 = f.scheme == "w4afp8"
    vllm_kernels = "CUTLASS W4A8 MoE with FP8 activations, Hopper" if w4a8 else \
        "Marlin / Machete W4A16 kernels"
    sglang_kernels = "CompressedTensorsW4AFP8MoE" if w4a8 else "MoE WNA16 kernels"
    refused = f.sglang_refusals
    sglang = [f"SGLang: none; SGLang 0.5.23 does not load this checkpoint: {'; '.join(refused)}.",
              ""] if refused else [
        f"SGLang ({sglang_kernels}):",
        "",
        "```bash",
        f"python -m sglang.launch_server --model-path {model} --tp {f.tp}"
        + (" --disable-shared-experts-fusion" if f.sglang_no_shared_fusion else ""),
        "```",
        "",
    ]
    lines = [
        "## Serving",
        "",
        f"vLLM ({vllm_kernels}):",
        "",
        "```bash",
        f"vllm serve {model} --tensor-parallel-size {f.tp}",
        "```",
        "",
        *sglang,
    ]
    if width:
        lines += [width, ""]
    lines.append("Weights need about the per-GPU figure in the size table plus KV cache and "
                 "activations; add `--enable-expert-parallel` (vLLM) / `--ep-size` (SGLang) to "
                 "shard experts instead of slicing them.")
    if f.sglang_no_shared_fusion and not refused:
        lines += ["", ("`--disable-shared-experts-fusion`: the shared experts are BF16 and the routed "
                       "ones INT4, and SGLang fuses the shared expert into the routed MoE kernel "
                       "only when both share a scheme.")]
    if f.model_type == "glm4_moe" and "shared" in f.targets and not refused:
        lines += ["", ("SGLang: keep its shared-experts fusion on, as the command does (its default "
                       "on H100 / H200). SGLang 0.5.23 builds GLM-4.x's shared experts unfused "
                       "only from BF16 weights: with `--disable-shared-experts-fusion`, or "
                       "`--ep-size` above 1 (which turns the fusion off), it fails on these INT4 "
                       "shared experts before loading.")]
    if w4a8:
        lines += ["", ("W4AFP8: the INT4 weights are the same as a W4A16 checkpoint's at group 128; "
                       "the config declares dynamic per-token FP8 input activations, which the "
                       "W4A8 kernels need hidden size and `expert width / TP` to be multiples of "
                       "256 for (the TP sizes above are checked for it).")]
    if not f.symmetric:
        lines += ["", ("Asymmetric (zero-point) weights: vLLM's Marlin reads the zero points; "
                       "SGLang's MoE WNA16 path and transformers expect symmetric weights.")]
    return lines


def _provenance(f: CardFacts) -> list[str]:
    cmd = f.command or "(not recorded: converted through the Python API)"
    ct = f", compressed-tensors {f.compressed_tensors_version}" if f.compressed_tensors_version else ""
    return [
        "## How this was made",
        "",
        f"glm-int4-quantize {f.tool_version}{ct}:",
        "",
        "```bash",
        cmd,
        "```",
        "",
        ("`quantize-manifest.json` lists every file with its sha256; `verify.json` holds the "
         "per-tensor results."),
    ]


def _pictures(f: CardFacts) -> list[str]:
    if not f.pictures:
        return []
    lines = ["## Pictures", ""]
    for name, caption in f.pictures:
        lines += [f"![{caption}]({name})", "", f"*{caption[0].upper() + caption[1:]}.*", ""]
    return lines


def render_card(f: CardFacts) -> str:
    """The README.md text for one output folder."""
    name = f.repo_id or f"{(f.base_model or f.source_name).rstrip('/').split('/')[-1]}-INT4"
    title = f"# {name.split('/')[-1]}"
    parts = [_front_matter(f), [title, ""], _what(f), [""], _sizes(f), [""], _results(f), [""],
             _pictures(f), _serving(f), [""], _provenance(f)]
    return "\n".join(line for part in parts for line in part) + "\n"
