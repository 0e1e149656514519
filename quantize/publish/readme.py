"""Write README.md, the model card, into an output folder: gather the facts, render with card.py.

The facts come from the folder itself: quantize-manifest.json (options, command, tool version,
the TP it was planned for, the source's name, repo id and commit, the plan's size figures),
config.json (`quantization_config`), the index,
calibration-report.json (a calibrated method: data, tokens, per-expert token counts,
fallbacks), verify.json and eval.json when they exist. The size figures are the plan's, recorded in
the manifest at convert time (older manifests: recomputed from the source's headers when it is
still where they say, else the output-side figures alone).

No local path is written into anything `push` uploads: the manifest names the source by repo
id (from the Hub cache path `.../models--ORG--NAME/snapshots/SHA` or `convert --base-model`) and
commit (the snapshot's, or the one `hf download --local-dir` recorded), else by folder name.

README.md is not among the manifest's checksummed files: like verify.json it is a report about
the checkpoint, rewritten by convert, verify and push, and verify never fails because of it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from quantize import __version__
from quantize.errors import QuantizeError
from quantize.lint import needs_shared_fusion_off, sglang_refusals
from quantize.names import CALIB_REPORT, CARD, EVAL_JSON, PICTURES, VERIFY_JSON
from quantize.options import ConvertOptions
from quantize.plan import Plan, clip_words, gptq_extras, make_plan, tp_checks
from quantize.publish.card import CalibrationFacts, CardFacts, Sizes, render_card
from quantize.source.checkpoint import INDEX_NAME, Checkpoint, open_checkpoint
from quantize.source.hub import hub_source, source_license, valid_repo_id
from quantize.write.manifest import read_manifest
from quantize.write.shards import read_own_json, write_bytes_atomic

__all__ = ["CARD", "EVAL_JSON", "card_facts", "card_text", "hub_source", "refresh_readme",
           "write_readme"]

TP_SIZES = (1, 2, 4, 8, 16)


def _source_plan(manifest: dict) -> Plan | None:
    """The plan recomputed from the source headers, or None when the source is gone."""
    path = (manifest.get("source") or {}).get("path")
    if not path or not Path(path).is_dir():
        return None
    try:
        return make_plan(open_checkpoint(path), ConvertOptions.from_json(manifest["options"]))
    except (QuantizeError, ValueError, OSError):
        return None  # moved or changed since conversion: fall back to the output's own figures


def _data_name(source: str) -> str:
    """The calibration source as the card names it: a Hub dataset whole (ORG/NAME@SHA:SPLIT,
    the owner included), a file by its name (reports from before sha256 was recorded held a
    local path)."""
    if re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{7,40}(:[\w./-]+)?", source):
        return source
    return Path(source).name


def _calibration(report: dict | None, opts: ConvertOptions) -> CalibrationFacts | None:
    """The card's calibration figures from calibration-report.json (None: rtn, or no report)."""
    if report is None or opts.method == "rtn":
        return None
    c = report["calibration"]
    moe = [lay for lay in report["layers"] if lay.get("expert_tokens")]
    return CalibrationFacts(
        data=_data_name(c["source"]),
        shipped=opts.calib is None or opts.calib.startswith("shipped:"),
        sha256=c.get("sha256"),
        documents=c["documents"],
        num_samples=c["num_samples"],
        seq_len=c["seq_len"],
        overlapping=c["overlapping"],
        prefix=tuple(c.get("prefix") or ()),
        expert_calibration=report["expert_calibration"],
        min_expert_tokens=report["min_expert_tokens"],
        moe_layers=len(moe),
        expert_tokens=tuple(n for lay in moe for n in lay["expert_tokens"]),
        fallbacks=tuple((lay["layer"], f["expert"], f["tokens"]) for lay in moe
                        for f in lay.get("fallback") or ()),
        rounded=tuple((lay["layer"], lay.get("reason", "")) for lay in report["layers"]
                      if lay.get("method") == "rtn") + tuple(
            (lay["layer"], (f"{fb['method']} made its output worse than round-to-nearest "
                            f"(relative error {fb['rel_error']:.3g} vs {fb['rtn_rel_error']:.3g}; "
                            "--rtn-fallback)"))
            for lay in report["layers"] if (fb := lay.get("rtn_fallback"))),
        gptq=_gptq_settings(report) if "gptq" in opts.method else "",
        coverage=report.get("expert_coverage", 0),
        topped_up=tuple((lay["layer"], t["expert"], t["tokens"], t["added"]) for lay in moe
                        for t in lay.get("topped_up") or ()),
    )


def _gptq_settings(r: dict) -> str:
    """GPTQ's settings as the calibration report records them, in words (keys a report from
    an earlier version lacks are left out)."""
    parts = []
    if "mse_clip" in r:
        # (a report without clip_settings: one setting for every target; without mse_norm and
        # mse_weight_power: the activation-weighted clip of power 2)
        every = (r.get("mse_norm", 2), r.get("mse_weight_power", 1))
        parts.append(clip_words(r["mse_clip"], r.get("clip_settings", {"": every})))
    if "percdamp" in r:
        parts.append(f"dampening {r['percdamp']:g}")
    # ({kind of target present: rounds} for the re-fit)
    parts += gptq_extras(r["gptaq"] if r.get("gptaq_active") else 0, r.get("scale_refits") or {},
                         bool(r.get("sequential_mlp_active")))
    return "; ".join(parts)


def _sizes(manifest: dict, index: dict, plan: Plan | None) -> Sizes:
    """The card's sizes: from the plan (given, or rebuilt for manifests from before the sizes
    were recorded), the manifest's record, or the index and files alone."""
    names = index["weight_map"]
    shard_files = sorted(set(names.values()))
    recorded_sizes = manifest.get("sizes")
    if plan is None and recorded_sizes is None:
        plan = _source_plan(manifest)  # manifests from before the sizes were recorded
    if plan is not None:
        by_role = tuple((r, s, o) for r, (s, o) in sorted(plan.bytes_by("role").items(),
                                                           key=lambda kv: -kv[1][0]))
        return Sizes(plan.source_bytes, plan.output_bytes, plan.output_file_bytes, len(plan.shards),
                     by_role)
    if recorded_sizes is not None:
        z = recorded_sizes
        return Sizes(z["source_bytes"], z["output_bytes"], z["output_file_bytes"], z["shards"],
                     tuple(tuple(r) for r in z["by_role"]))
    files = manifest["files"]
    return Sizes(None, int(index["metadata"]["total_size"]),
                 sum(files[f]["bytes"] for f in shard_files if f in files), len(shard_files))


def _tp(dst: Path, config: dict, opts, manifest: dict, tp: int | None) -> tuple[int, tuple[int, ...]]:
    """The TP size the card's commands use, and the sizes the kernels accept: --tp as given,
    else convert's recorded --tp when valid, else 8 (one H200/H100 node) unless refused."""
    width = config.get("moe_intermediate_size")
    probe = Checkpoint(None, str(dst), config, {}, [], {}, "compressed-tensors")
    valid = tuple(t for t in TP_SIZES
                  if all(c.level != "fail" for c in tp_checks(probe, opts, t, width)))
    recorded = manifest.get("tp")  # convert --tp (`make TP=`); absent in older manifests
    if tp is None and isinstance(recorded, int) and (recorded in valid or not valid):
        tp = recorded
    if tp is None:  # 8 (one H200/H100 node) unless the kernels refuse it
        tp = 8 if (8 in valid or not valid) else max((t for t in valid if t <= 8), default=min(valid))
    return tp, valid


def card_facts(dst: str | Path, plan: Plan | None = None, repo_id: str | None = None,
               base_model: str | None = None, tp: int | None = None) -> CardFacts:
    """Everything the card says about `dst`, read from the folder (and the source's headers)."""
    dst = Path(dst)
    manifest = read_manifest(dst)
    if manifest is None:
        raise QuantizeError(f"{dst} is not an output of `quantize convert` (no manifest)")
    opts = ConvertOptions.from_json(manifest["options"])
    config = json.loads((dst / "config.json").read_text())
    index = json.loads((dst / INDEX_NAME).read_text())
    names = index["weight_map"]
    packed = [n[: -len(".weight_packed")] for n in names if n.endswith(".weight_packed")]
    int4_outputs = sum(f"{m}.{s}" in names for m in packed for s in
                       ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"))

    sizes = _sizes(manifest, index, plan)
    source = manifest.get("source") or {}
    src_path = source.get("path") or ""  # (manifests from before names replaced paths)
    hub_repo, hub_rev = hub_source(src_path)
    hub_repo, hub_rev = source.get("repo_id") or hub_repo, source.get("revision") or hub_rev
    named = config.get("_name_or_path", "")
    base = base_model or hub_repo or (named if valid_repo_id(named or "") else None)
    source_name = source.get("name") or (Path(src_path).name if src_path else "unknown")

    width = config.get("moe_intermediate_size")
    tp, valid = _tp(dst, config, opts, manifest, tp)
    qc = config.get("quantization_config") or {}
    eval_ = read_own_json(dst / EVAL_JSON)
    return CardFacts(
        source_name=source_name,
        base_model=base,
        base_revision=hub_rev,
        repo_id=repo_id,
        model_type=str(config.get("model_type", "unknown")),
        method=opts.method,
        num_bits=opts.num_bits,
        group_size=opts.group_size,
        symmetric=opts.symmetric,
        targets=tuple(sorted(opts.targets)),
        ignore=tuple(qc.get("ignore") or ()),
        int4_linears=len(packed),
        kept_tensors=len(names) - int4_outputs,
        sizes=sizes,
        tp=tp,
        valid_tp=valid,
        expert_width=int(width) if width else None,
        calibration=_calibration(read_own_json(dst / CALIB_REPORT), opts),
        verify=read_own_json(dst / VERIFY_JSON),
        eval=(eval_.get("summary", eval_) if isinstance(eval_, dict) else None),
        eval_verdict=eval_.get("verdict") if isinstance(eval_, dict) else None,
        tool_version=manifest.get("tool_version") or __version__,
        compressed_tensors_version=qc.get("version"),
        command=manifest.get("command"),
        license=source.get("license") or source_license(src_path),
        pictures=tuple((n, c) for n, c in PICTURES.items() if (dst / n).is_file()),
        scheme=opts.scheme,
        mtp=opts.mtp,
        keep_fp8=opts.keep_fp8,
        sglang_no_shared_fusion=needs_shared_fusion_off(names),
        sglang_refusals=tuple(sglang_refusals(qc, names)),
    )


def card_text(dst: str | Path, plan: Plan | None = None, repo_id: str | None = None,
              base_model: str | None = None, tp: int | None = None) -> str:
    return render_card(card_facts(dst, plan, repo_id, base_model, tp))


def write_readme(dst: str | Path, plan: Plan | None = None, repo_id: str | None = None,
                 base_model: str | None = None, tp: int | None = None) -> Path:
    """(Re)write DST/README.md; return its path."""
    p = Path(dst) / CARD
    text = card_text(dst, plan, repo_id, base_model, tp)  # (any error: nothing written yet)
    write_bytes_atomic(p, text.encode("utf-8"))  # (through a fresh .partial: no link followed)
    return p


def refresh_readme(dst: str | Path) -> Path | None:
    """Rewrite the card after verify / eval. A folder too broken to describe (a missing index or
    config: exactly what verify reports as a problem) keeps its previous card; returns None then."""
    try:
        return write_readme(dst)
    except (QuantizeError, OSError, KeyError, ValueError):
        return None
