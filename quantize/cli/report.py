"""Rich tables and JSON summaries for inspect / plan / convert / verify / eval (no computation here)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from quantize.plan import Plan, clip_words, gptq_extras
from quantize.sizes import fmt_bytes
from quantize.source.checkpoint import Checkpoint
from quantize.source.layout import layer_of, linear_role, module_of

if TYPE_CHECKING:
    from quantize.check.verify import VerifyReport

__all__ = ["eval_tables", "fmt_bytes", "inspect_data", "inspect_table", "plan_data", "plan_tables",
           "verify_table"]



def _role(name: str, ndim: int) -> str:
    if name.endswith(("weight_scale_inv", "weight_scale")):
        return "fp8 scales"
    if name.endswith(".weight") and ndim == 2 and "embed_tokens" not in name:
        return linear_role(module_of(name))
    if "embed_tokens" in name:
        return "embedding"
    return "norms/biases/other"


def _tally(tensors, role_of) -> tuple[dict[str, dict], set[int], set[str]]:
    """Tensors, bytes and dtypes by `role_of(tensor)`; the layers and routed experts seen."""
    by_role: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "dtypes": set()})
    layers, experts = set(), set()
    for t in tensors:
        r = by_role[role_of(t)]
        r["tensors"] += 1
        r["bytes"] += t.nbytes
        r["dtypes"].add(t.dtype)
        if (layer := layer_of(t.name)) is not None:
            layers.add(layer)
        if ".experts." in t.name:
            experts.add(t.name.split(".experts.")[1].split(".")[0])
    return by_role, layers, experts


def inspect_data(ckpt: Checkpoint) -> dict:
    by_role, layers, experts = _tally(ckpt.tensors.values(), lambda t: _role(t.name, len(t.shape)))
    L = ckpt.num_hidden_layers
    return {
        "source": ckpt.name,
        "model_type": ckpt.model_type,
        "format": ckpt.source_format,
        "block_size": list(ckpt.block_size) if ckpt.block_size else None,
        "num_hidden_layers": L,
        "layers_on_disk": len(layers),
        "mtp_layers": sorted(x for x in layers if x >= L),
        "routed_experts_per_layer": len(experts),
        "expert_width": ckpt.config.get("moe_intermediate_size"),
        "hidden_size": ckpt.config.get("hidden_size"),
        "tensors": len(ckpt.tensors),
        "shards": len(ckpt.files),
        "bytes": ckpt.total_bytes,
        "by_role": {k: {**v, "dtypes": sorted(v["dtypes"])} for k, v in sorted(by_role.items())},
    }


INT4_PARTS = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point")


def int4_folder(path: str | Path) -> bool:
    """Whether `path` is a local folder holding a pack-quantized INT4 checkpoint (ours)."""
    import json

    cfg = Path(path) / "config.json"
    try:  # a regular file only (a FIFO would block the read for ever); open_checkpoint says why
        if not cfg.is_file() or cfg.stat().st_size > 1 << 24:
            return False
        qc = json.loads(cfg.read_text()).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return qc.get("format") in ("pack-quantized", "mixed-precision")


def inspect_int4_data(dst: str | Path, tp: int = 8) -> dict:
    """What an INT4 output holds (`inspect` / `plan` on it): its scheme, INT4 Linears by role,
    bytes by category (packed weights, scales, everything kept), the recorded conversion when a
    manifest is there, and the serving kernels' checks at each TP size."""
    from quantize.check.int4view import open_output
    from quantize.options import ConvertOptions
    from quantize.plan import tp_checks
    from quantize.write.manifest import read_manifest

    view = open_output(dst)
    qc = view.config.get("quantization_config") or {}
    groups = list((qc.get("config_groups") or {}).values())
    group = next(g for g in groups if (g.get("weights") or {}).get("type") == "int")
    fp8_group = next((g for g in groups if (g.get("weights") or {}).get("type") == "float"), None)
    w = group.get("weights") or {}
    linears: dict[str, int] = defaultdict(int)
    packed_modules = set(view.packed.values())

    def role_of(t) -> str:
        part = next((x for x in INT4_PARTS if t.name.endswith(x)
                     and t.name[: -len(x)] in packed_modules), None)
        if part is None:
            return _role(t.name, len(t.shape))
        if part == ".weight_packed":
            linears[linear_role(t.name[: -len(part)])] += 1
        return f"{linear_role(t.name[: -len(part)])} INT4"

    # (the view's virtual float weights left out)
    by_role, layers, experts = _tally([t for t in view.tensors.values() if t.name not in view.packed],
                                      role_of)
    manifest = read_manifest(Path(dst))
    acts = group.get("input_activations") or {}
    fp8_acts = acts.get("type") == "float" and acts.get("num_bits") == 8
    g, sym = int(w.get("group_size", 32)), bool(w.get("symmetric", True))
    opts = ConvertOptions(group_size=g, symmetric=sym, targets=frozenset(linears) or frozenset({"routed"}),
                          scheme="w4afp8" if fp8_acts and g == 128 and sym else "w4a16")
    width = view.config.get("moe_intermediate_size")
    checks = {t: [c.__dict__ for c in tp_checks(view, opts, t, width)] for t in (1, 2, 4, 8, 16)}
    L = view.num_hidden_layers
    return {
        "source": view.name, "model_type": view.model_type,
        "format": f"pack-quantized INT{w.get('num_bits', 4)}",
        "group_size": opts.group_size, "symmetric": opts.symmetric,
        "scheme": "w4afp8" if fp8_acts else "w4a16",
        "input_activations": group.get("input_activations"),
        "fp8_kept": None if fp8_group is None else {
            "weights": fp8_group.get("weights"), "targets": len(fp8_group.get("targets") or [])},
        "ignore": len(qc.get("ignore") or []),
        "int4_linears": dict(sorted(linears.items())),
        "num_hidden_layers": L, "layers_on_disk": len(layers),
        "mtp_layers": sorted(x for x in layers if x >= L),
        "routed_experts_per_layer": len(experts), "expert_width": width,
        "hidden_size": view.config.get("hidden_size"),
        "tensors": sum(1 for n in view.tensors if n not in view.packed),
        "shards": len(view.files), "bytes": view.total_bytes,
        "by_role": {k: {**v, "dtypes": sorted(v["dtypes"])} for k, v in sorted(by_role.items())},
        "conversion": None if manifest is None else {
            k: manifest.get(k) for k in ("status", "tool_version", "command", "tp")}
        | {"method": (manifest.get("options") or {}).get("method"),
           "source": (manifest.get("source") or {}).get("name")},
        "valid_tp": [t for t, cs in checks.items() if all(c["level"] != "fail" for c in cs)],
        "checks_at_tp": {"tp": tp, "checks": checks.get(tp) or [c.__dict__ for c in tp_checks(view, opts, tp, width)]},
    }


def inspect_int4_table(d: dict) -> Table:
    conv = d.get("conversion") or {}
    made = f", {conv.get('method')} from {conv.get('source')}" if conv else ""
    return _bytes_table(
        f"{d['source']}: {d['model_type']}, {d['format']} g{d['group_size']} "
        f"{'symmetric' if d['symmetric'] else 'asymmetric'}{made}; "
        f"{d['num_hidden_layers']} layers + MTP {d['mtp_layers'] or 'none'}, "
        f"{d['routed_experts_per_layer']} experts x {d['expert_width']}; "
        f"serves at TP {', '.join(map(str, d['valid_tp'])) or 'none of 1..16'}", d)


def inspect_table(d: dict) -> Table:
    return _bytes_table(f"{d['source']}: {d['model_type']}, {d['format']}"
                        f"{' ' + str(d['block_size']) if d['block_size'] else ''}, "
                        f"{d['num_hidden_layers']} layers + MTP {d['mtp_layers'] or 'none'}, "
                        f"{d['routed_experts_per_layer']} experts x {d['expert_width']}", d)


def _bytes_table(title: str, d: dict) -> Table:
    """inspect's table: tensors, dtypes and bytes by category, and the total."""
    t = Table(title=title)
    for c in ("category", "tensors", "dtypes", "bytes", "share"):
        t.add_column(c, justify="right" if c in ("tensors", "bytes", "share") else "left")
    for role, v in sorted(d["by_role"].items(), key=lambda kv: -kv[1]["bytes"]):
        t.add_row(role, f"{v['tensors']:,}", ",".join(v["dtypes"]), fmt_bytes(v["bytes"]),
                  f"{100 * v['bytes'] / max(d['bytes'], 1):.1f}%")
    t.add_row("total", f"{d['tensors']:,}", "", fmt_bytes(d["bytes"]), "100%", style="bold")
    return t


def plan_data(plan: Plan, gpu_memory: int | None = None, mem_fraction: float | None = None,
              config: dict | None = None) -> dict:
    """`gpu_memory` (bytes) and the model's `config`: also the KV-cache room per GPU
    (kvcache.kv_room) for the source's and the output's weights."""
    tp = plan.tp
    kv = None
    if gpu_memory is not None and config is not None:
        from quantize.kvcache import describe, kv_room

        room = kv_room(config, tp, gpu_memory, plan.source_bytes / tp, plan.output_bytes / tp,
                       mem_fraction)
        kv = {**room.to_json(), "assumptions": describe(room)}
    return {
        "kv_cache": kv,
        "format_in": plan.source_format,
        "options": plan.options.to_json(),
        "source_bytes": plan.source_bytes,
        "output_bytes": plan.output_bytes,
        "output_file_bytes": plan.output_file_bytes,
        "ratio": plan.output_bytes / plan.source_bytes,
        "tp": tp,
        "per_gpu_source_bytes": plan.source_bytes / tp,
        "per_gpu_output_bytes": plan.output_bytes / tp,
        "shards": len(plan.shards),
        "quantized_linears": sum(u.action == "quantize" for u in plan.units),
        "by_role": {k: {"source_bytes": s, "output_bytes": o} for k, (s, o) in plan.bytes_by("role").items()},
        "ignore": list(plan.ignore),
        "checks": [{"level": c.level, "what": c.what, "detail": c.detail} for c in plan.checks],
        "disk": _disk(plan),
        # calibrated methods: what GPTQ does beyond the column loop, per kind of target
        "calibration": None if "gptq" not in plan.options.method else {
            "gptaq": plan.options.gptaq if plan.gptaq_active else 0,
            "scale_refit": plan.scale_refits, "sequential_mlp": plan.sequential_active,
            "clip": {k: list(v) for k, v in plan.clip_settings.items()}},
    }


def _disk(plan: Plan) -> dict:
    """What a conversion writes into its output folder, calibration checkpoints included
    (bf16 hidden states, as on a GPU)."""
    from quantize.disk import disk_needed

    return disk_needed(plan, "cuda")


def plan_tables(d: dict) -> list[Table]:
    o = d["options"]
    t = Table(title=f"plan: INT4 {'sym' if o['symmetric'] else 'asym'} group {o['group_size']}, "
                    f"targets {','.join(o['targets'])}, method {o['method']}")
    t.add_column("")
    t.add_column("source", justify="right")
    t.add_column("output", justify="right")
    t.add_row("checkpoint", fmt_bytes(d["source_bytes"]), fmt_bytes(d["output_bytes"]))
    t.add_row(f"per GPU at TP{d['tp']} (even split)", fmt_bytes(int(d["per_gpu_source_bytes"])),
              fmt_bytes(int(d["per_gpu_output_bytes"])))
    t.add_row("ratio", "", f"{d['ratio']:.3f}")
    t.add_row("files (shards, headers incl.)", "", f"{d['shards']} / {fmt_bytes(d['output_file_bytes'])}")
    disk = d.get("disk") or {}
    cal = d.get("calibration")
    if cal:
        t.add_row("GPTQ group scales", "", clip_words(o.get("mse_clip", False), cal["clip"]))
        extra = gptq_extras(cal["gptaq"], cal["scale_refit"], cal.get("sequential_mlp", False))
        t.add_row("GPTQ beyond the column loop", "", "; ".join(extra) or "none")
    if disk.get("checkpoint"):
        both = "; two streams: GPTAQ" if cal and cal["gptaq"] else ""
        t.add_row(f"+ calibration checkpoints ({o['num_samples']} x {o['seq_len']} tokens, GPU{both})", "",
                  f"up to {disk['at_once']} x {fmt_bytes(disk['checkpoint'])}")
        t.add_row("disk needed", "", f"{fmt_bytes(disk['shards'] + disk['checkpoint'])} at least "
                  f"(1 checkpoint), {fmt_bytes(disk['total'])} for {disk['at_once']}")
    r = Table(title="bytes by role")
    for c in ("role", "source", "output"):
        r.add_column(c, justify="left" if c == "role" else "right")
    for role, v in sorted(d["by_role"].items(), key=lambda kv: -kv[1]["source_bytes"]):
        r.add_row(role, fmt_bytes(v["source_bytes"]), fmt_bytes(v["output_bytes"]))
    tables = [t, r]
    if d.get("kv_cache"):
        kv = d["kv_cache"]
        k = Table(title=f"KV cache per GPU after the weights (TP {kv['tp']}, tokens)")
        for col in ("weights", "BF16 cache", "FP8 cache"):
            k.add_column(col, justify="left" if col == "weights" else "right")
        for side in ("source", "output"):
            k.add_row(f"{side} ({fmt_bytes(int(kv['weights_' + side]))} a GPU)",
                      *(f"{kv['tokens'][side][dt]:,}" for dt in ("bf16", "fp8")))
        k.caption = "\n".join(kv["assumptions"])
        tables.append(k)
    c = Table(title="serving checks")
    for col in ("", "check", "detail"):
        c.add_column(col)
    style = {"ok": Text("ok", style="green"), "warn": Text("warn", style="yellow"),
             "fail": Text("FAIL", style="red")}
    for ch in d["checks"]:
        c.add_row(style[ch["level"]], ch["what"], ch["detail"])
    return [*tables, c]


def verify_table(rep: VerifyReport) -> Table:
    s = rep.summary()
    lc = s.get("layer_check") or {}
    if "skipped" in lc:
        layers = f"; layer check skipped ({lc['skipped']})"
    elif lc.get("worst_ratio") is not None:
        layers = (f"; layers {'ok' if lc['ok'] else 'FAIL'}: worst {lc['worst_ratio']:.2f}x "
                  f"RTN's error (bound {lc['max_ratio']:g}x)")
    else:
        layers = ""
    t = Table(title=Text.assemble(
        "verify: ", ("PASS", "green") if rep.ok else ("FAIL", "red"),
        f"  {s['quantized']} INT4 tensors, min SQNR {s['min_sqnr_db']:.2f} dB, "
        f"mean {s['mean_sqnr_db']:.2f} dB; exact {s['exact_ok']}/{s['exact_total']}{layers}"))
    for c in ("worst tensors", "rel err", "SQNR dB", "ok"):
        # names fold onto a second line in a narrow terminal instead of losing their end
        t.add_column(c, justify="left" if c == "worst tensors" else "right",
                     overflow="fold" if c == "worst tensors" else "ellipsis")
    for w in rep.worst(10):
        t.add_row(w.name, f"{w.rel_err:.4f}", f"{w.sqnr_db:.2f}", "yes" if w.ok else Text(str(w.note), style="red"))
    return t


def eval_tables(rep: dict) -> list[Table]:
    """eval.json as two tables: the hidden-state error per layer, then the summary."""
    d = rep["data"]
    t = Table(title=f"eval: quantized vs source hidden states, {d['num_samples']} x {d['seq_len']} "
                    f"tokens ({rep['compute_dtype']} on {rep['device']})")
    for c in ("layer", "INT4 Linears", "relative error", "s"):
        t.add_column(c, justify="right")
    for lay in rep["layers"]:
        t.add_row(str(lay["layer"]), str(lay["int4_linears"]), f"{lay['rel_error']:.4f}",
                  f"{lay['seconds']:.1f}")
    s = rep["summary"]
    u = Table(title=f"eval: {rep['method']} output against its source")
    u.add_column("metric")
    u.add_column("value", justify="right")
    u.add_row("perplexity, source", f"{s['ppl_source']:.4f}")
    u.add_row("perplexity, quantized", f"{s['ppl_quantized']:.4f}")
    u.add_row("ratio", f"{s['ppl_ratio']:.4f}")
    u.add_row("KL(source || quantized) per token", f"{s['kl_mean']:.5f}")
    u.add_row("top-1 agreement", f"{100 * s['top1_agreement']:.2f}%")
    u.add_row("scored tokens", f"{s['tokens']:,}")
    u.add_row("data", s["data"])
    u.add_row("calibration", d["calibration"])
    o = rep.get("out_of_domain")
    if o:
        u.add_row("out of domain: ratio", f"{o['ppl_ratio']:.4f}")
        u.add_row("out of domain: KL per token", f"{o['kl_mean']:.5f}")
        u.add_row("out of domain: top-1 agreement", f"{100 * o['top1_agreement']:.2f}%")
        u.add_row("out of domain: data", o["data"])
    return [t, u]
