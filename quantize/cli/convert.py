"""`quantize convert`: SRC -> an INT4 checkpoint in DST, with progress lines, the run record
and the calibration's summary table."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import typer

from quantize.cli.app import Failed, app, err, out, print_json, progress, reporters, tag
from quantize.cli.convert_params import (
    BaseModel,
    CalibBos,
    CalibOpt,
    CheckpointInterval,
    ConfigOpt,
    ConvertDst,
    ConvertSrc,
    ExpertCalibrationOpt,
    ExpertCoverage,
    FromOpt,
    JsonSummary,
    MaxGpuMemory,
    MethodOpt,
    MinExpertTokens,
    NumSamples,
    Overwrite,
    Percdamp,
    RecipeOpt,
    ResumeOpt,
    RtnFallback,
    Seed,
    SeqLen,
)
from quantize.cli.params import (
    Asym,
    Debug,
    Device,
    ExpertCalibration,
    GptaqOpt,
    GroupSize,
    HelpAll,
    KeepFp8,
    MaxShardSize,
    Method,
    MseClipOpt,
    MseNormOpt,
    MseNormRoutedOpt,
    MseWeightPowerOpt,
    MseWeightPowerRoutedOpt,
    Mtp,
    MtpOpt,
    Revision,
    ScaleRefitOpt,
    Scheme,
    SchemeOpt,
    SequentialOpt,
    Targets,
    Tp,
    convert_options,
    value,
)
from quantize.cli.run_record import (
    RESOLVED_KEYS,
    RUN_KEYS,
    public_command,
    read_run_file,
    write_run_record,
)
from quantize.errors import Problem, QuantizeError
from quantize.names import CALIB_REPORT, CALIB_TIMINGS, RUN_RECORD


@app.command()
def convert(
    ctx: typer.Context,
    src: ConvertSrc = None,
    dst: ConvertDst = None,
    recipe: RecipeOpt = None,
    method: MethodOpt = Method.rtn,
    group_size: GroupSize = 32,
    scheme: SchemeOpt = Scheme.w4a16,
    mtp: MtpOpt = Mtp.int4,
    keep_fp8: KeepFp8 = False,
    targets: Targets = "routed",
    asymmetric: Asym = False,
    max_shard_size: MaxShardSize = "5GB",
    calib: CalibOpt = None,
    num_samples: NumSamples = 128,
    seq_len: SeqLen = 2048,
    seed: Seed = 0,
    calib_bos: CalibBos = True,
    expert_calibration: ExpertCalibrationOpt = ExpertCalibration.routed,
    min_expert_tokens: MinExpertTokens = 16,
    expert_coverage: ExpertCoverage = 0,
    percdamp: Percdamp = 0.1,
    mse_clip: MseClipOpt = None,
    mse_norm: MseNormOpt = None,
    mse_weight_power: MseWeightPowerOpt = None,
    mse_norm_routed: MseNormRoutedOpt = None,
    mse_weight_power_routed: MseWeightPowerRoutedOpt = None,
    scale_refit: ScaleRefitOpt = None,
    gptaq: GptaqOpt = None,
    sequential_mlp: SequentialOpt = None,
    rtn_fallback: RtnFallback = False,
    checkpoint_interval: CheckpointInterval = 300.0,
    max_gpu_memory: MaxGpuMemory = None,
    device: Device = "auto",
    resume: ResumeOpt = False,
    overwrite: Overwrite = False,
    tp: Tp = 8,
    revision: Revision = None,
    base_model: BaseModel = None,
    json_: JsonSummary = False,
    config: ConfigOpt = None,
    from_: FromOpt = None,
    debug: Debug = False,
    help_all: HelpAll = False,
) -> None:
    """Convert SRC to a compressed-tensors pack-quantized INT4 checkpoint in DST.

    Streams one tensor at a time; each shard is written atomically and recorded in the
    manifest, so rerunning an interrupted command resumes it. The run's options are kept in
    DST/quantize-run.toml.

    Examples:
      quantize convert ./GLM-5.2-FP8 ./GLM-5.2-INT4 --recipe recommended
      quantize convert ./GLM-5.2-FP8 ./GLM-5.2-INT4          # RTN: no data
      quantize convert ./GLM-5.2-FP8 ./GLM-5.2-INT4 --recipe recommended --calib my.jsonl
      quantize convert zai-org/GLM-5.2-FP8 ./GLM-5.2-INT4    # from the Hub
      quantize convert --help-all             # every option (docs/recipes.md)
      torchrun --nproc-per-node 8 -m quantize convert SRC DST --recipe recommended
    """
    given = dict(locals())  # every parameter as resolved (flags, --config, --from, defaults)
    from quantize.calib.distributed import init
    from quantize.write.manifest import manifest_status

    src, dst = _src_dst(src, dst, from_)
    _refuse_unused_flags(ctx, value(method))
    record = _run_record(given, src)
    command = public_command(sys.argv[1:], src, dst, base_model) \
        if sys.argv[0].endswith("quantize") else None
    d = init(device)  # under torchrun: this rank (rank 0 prints and writes, the others compute)
    # what DST held when this run began (--overwrite: nothing kept), for the failure's hint
    before = None if overwrite else manifest_status(dst)
    t0 = time.perf_counter()
    res, total, opts = _run_or_fail(src, dst, given, command, d, before)
    if res is None:  # a rank other than 0: its share is done, rank 0 reports
        return
    resolved = {k: getattr(opts, k) for k in RESOLVED_KEYS if record.get(k) is None}
    write_run_record(dst, record | resolved)
    _summary(res, src, dst, total, time.perf_counter() - t0, value(method), json_)


def _src_dst(src: str | None, dst: Path | None, from_: Path | None) -> tuple[str, Path]:
    """SRC and DST as this run takes them: `--from OLD NEW` makes NEW the DST and SRC the
    recorded one; both required."""
    if dst is None and from_ is not None and src is not None:  # `--from OLD NEW`: NEW is DST
        dst, src = Path(src), read_run_file(from_ / RUN_RECORD, "--from").get("src")
    if src is None or dst is None:
        raise typer.BadParameter("SRC and DST are required (SRC may come from --from or --config)",
                                 param_hint="SRC DST")
    return src, Path(dst)


def _run_record(given: dict, src: str) -> dict:
    """The run record's options as given; SRC as a local path resolved (`--from` replays this
    folder's source from any working folder; the record stays local: never pushed), a Hub id
    as typed; --calib alike (a Hub dataset as typed)."""
    from quantize.source.hub import is_dataset_spec

    calib = given["calib"]
    return {k: given[k] for k in RUN_KEYS} | {
        "src": str(Path(src).resolve()) if Path(src).exists() else src,
        "calib": None if calib is None or is_dataset_spec(calib) else str(Path(calib).resolve())}


def _run_or_fail(src: str, dst: Path, given: dict, command: str | None, d, before):
    """`_run`, with our errors turned into a one-line failure that says what DST holds now
    (`before`: what it held when the run began; a rank other than 0 says which it is), an
    interrupt into exit 130; under torchrun the process group ended after."""
    from quantize.write.manifest import output_state

    quiet = d is not None and not d.leader
    try:
        res, total, opts = _run(src, dst, given, command, d, quiet)
    except (QuantizeError, ValueError) as e:
        raise Failed(e, f"(rank {d.rank} of {d.world})" if quiet else output_state(dst, before)) from None
    except KeyboardInterrupt:
        err.print(f"interrupted: {output_state(dst, before)}", highlight=False)
        raise typer.Exit(130) from None
    if d is not None:
        import torch.distributed

        torch.distributed.destroy_process_group()
    return res, total, opts


# convert's options that only GPTQ reads (with --method awq they would do nothing)
# the options only a calibrated method reads (those typed with --method rtn are refused)
CALIBRATED_ONLY = frozenset({
    "calib", "num_samples", "seq_len", "seed", "calib_bos", "expert_calibration",
    "min_expert_tokens", "expert_coverage", "percdamp", "mse_clip", "mse_norm", "mse_weight_power",
    "mse_norm_routed", "mse_weight_power_routed", "scale_refit", "gptaq", "sequential_mlp",
    "rtn_fallback", "checkpoint_interval", "max_gpu_memory"})
GPTQ_ONLY = ("percdamp", "mse_clip", "mse_norm", "mse_weight_power", "mse_norm_routed",
             "mse_weight_power_routed", "scale_refit", "gptaq", "sequential_mlp", "expert_coverage")


def _refuse_unused_flags(ctx: typer.Context, method: str) -> None:
    """Options typed on the command line that the method would ignore: calibration options
    with --method rtn (the default), GPTQ's with --method awq. Refused by name with the fix,
    instead of a run that ignores them. (Values from --config or --from are not: a run
    record holds every option.)"""
    def typed_here(name: str) -> bool:  # (click's ParameterSource, by name: typer vendors click)
        return getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"

    if method == "rtn":
        typed = [p.opts[0] for p in ctx.command.params if p.name in CALIBRATED_ONLY and typed_here(p.name)]
        want = "the calibrated methods; --method rtn (the default) rounds to nearest without " \
               "calibration. Add --method gptq (or awq, awq+gptq)"
    elif method == "awq":
        typed = [p.opts[0] for p in ctx.command.params if p.name in GPTQ_ONLY and typed_here(p.name)]
        want = "GPTQ; --method awq searches scales and rounds to nearest. Use --method awq+gptq " \
               "(or gptq)"
    else:
        return
    if typed:
        one = len(typed) == 1
        raise typer.BadParameter(f"{', '.join(typed)} appl{'ies' if one else 'y'} to {want}, or "
                                 f"drop {'it' if one else 'them'}", param_hint="--method")


def _checked_numbers(checkpoint_interval: float, max_gpu_memory: float | None) -> int | None:
    """--checkpoint-interval and --max-gpu-memory checked by name (nan, negative, an overflowing
    size); the memory limit in bytes."""
    if math.isnan(checkpoint_interval) or checkpoint_interval < 0:
        raise ValueError(f"--checkpoint-interval {checkpoint_interval}: expected seconds >= 0 "
                         "(0: after every layer; inf: no checkpoints)")
    if max_gpu_memory is None:
        return None
    if not math.isfinite(max_gpu_memory) or max_gpu_memory <= 0 or max_gpu_memory > 2**20:
        raise ValueError(f"--max-gpu-memory {max_gpu_memory}: expected GiB, a number above 0 "
                         "(e.g. 75); leave it out to use the whole GPU")
    return int(max_gpu_memory * 2**30)


def _run(src: str, dst: Path, a: dict, command: str | None, d, quiet: bool):
    """Options, source, plan and the conversion with its progress bar and timestamped lines;
    (the pipeline's result or None on a rank other than 0, the source bytes)."""
    from quantize.pipeline import convert as run_convert
    from quantize.plan import make_plan
    from quantize.sizes import fmt_bytes
    from quantize.source.checkpoint import open_checkpoint
    from quantize.source.hub import is_repo_id, resolve_source
    from quantize.write.manifest import read_manifest

    opts = convert_options(a["method"], a["group_size"], a["targets"], a["asymmetric"],
                           a["max_shard_size"], calib=a["calib"], num_samples=a["num_samples"],
                           seq_len=a["seq_len"], seed=a["seed"], calib_bos=a["calib_bos"],
                           expert_calibration=a["expert_calibration"],
                           min_expert_tokens=a["min_expert_tokens"],
                           expert_coverage=a["expert_coverage"], percdamp=a["percdamp"],
                           mse_clip=a["mse_clip"], mse_norm=a["mse_norm"],
                           mse_weight_power=a["mse_weight_power"],
                           mse_norm_routed=a["mse_norm_routed"],
                           mse_weight_power_routed=a["mse_weight_power_routed"],
                           scale_refit=a["scale_refit"], gptaq=a["gptaq"],
                           sequential_mlp=a["sequential_mlp"], scheme=a["scheme"],
                           mtp=a["mtp"],
                           keep_fp8=a["keep_fp8"], rtn_fallback=a["rtn_fallback"])
    gpu_bytes = _checked_numbers(a["checkpoint_interval"], a["max_gpu_memory"])
    if a["base_model"] is not None and not is_repo_id(a["base_model"]):
        raise QuantizeError("--base-model is not a Hub repo id", [Problem(
            "--base-model", None, repr(a["base_model"]), "ORG/NAME, e.g. zai-org/GLM-5.2-FP8",
            "pass the repo id the source was downloaded from")])
    local = resolve_source(src, a["revision"], headers_only=False)
    ckpt = open_checkpoint(local)
    plan = make_plan(ckpt, opts, a["tp"])
    for c in plan.checks:
        if c.level != "ok" and not quiet:
            err.print(tag("warning:", "yellow"), f"{c.what}: {c.detail}", highlight=False)
    prev = read_manifest(dst) if dst.is_dir() and not a["overwrite"] and not quiet else None
    if prev is not None:
        done = sum(s.file in prev.get("files", {}) for s in plan.shards)
        if prev.get("status") == "complete":
            err.print(f"found a finished conversion in {dst} ({done} of {len(plan.shards)} shards): "
                      "re-hashing its files; only a changed or missing one is written again "
                      "(--overwrite starts over)", highlight=False)
        else:
            err.print(f"found an interrupted conversion in {dst} ({done} of {len(plan.shards)} "
                      "shards done): resuming it; finished shards are re-hashed and kept "
                      "(--overwrite starts over)", highlight=False)
    total = sum(u.source_bytes for u in plan.units)
    calibrated = opts.method != "rtn"  # its time goes by layers, not bytes: said per layer
    with progress(disable=quiet, eta=not calibrated) as bar:
        step, line = reporters(bar, "convert", total, quiet, eta=not calibrated)
        line(f"convert {src} -> {dst}: {fmt_bytes(total)} to read, {len(plan.shards)} shard(s) "
             f"of {fmt_bytes(plan.output_bytes)}, method {opts.method}"
             + (" (" + "; ".join([plan.clip_words(),
                                  f"dampening {opts.percdamp:g}", *plan.gptq_extras()]) + ")"
                if "gptq" in opts.method else "") + f", device {a['device']}"
             + (f"; {d.world} processes (torchrun): each calibrates its share, rank 0 writes"
                if d is not None else ""))
        res = run_convert(local, dst, opts, device=a["device"], resume=a["resume"],
                          overwrite=a["overwrite"], on_unit=step, command=command, log=line,
                          tp=a["tp"], checkpoint_interval=a["checkpoint_interval"], dist=d,
                          base_model=a["base_model"], max_gpu_memory=gpu_bytes,
                          planned=(ckpt, plan))
    return res, total, opts


def _summary(res, src: str, dst: Path, total: int, dt: float, method: str, json_: bool) -> None:
    """The closing lines (and --json's object, the calibration's table)."""
    from quantize.sizes import fmt_bytes

    if json_:
        print_json({"output": dst.name, "device": str(res.device), "seconds": round(dt, 1),
                    "shards_written": res.written, "shards_kept": res.skipped,
                    "output_bytes": res.plan.output_bytes, "source_bytes": total,
                    "method": method,
                    "calibration_layers": None if res.calibration is None
                    else len(res.calibration.get("layers", []))})
    err.print(tag("done", "green"), f"in {dt:.1f} s on {res.device}: {len(res.written)} shard(s) written, "
              f"{len(res.skipped)} kept from an earlier run; {fmt_bytes(res.plan.output_bytes)} "
              f"({fmt_bytes(total)} read, {total / dt / 2**20:,.0f} MiB/s)", highlight=False)
    if res.calibration is not None:  # a table: stdout, unless stdout is the JSON's
        calibration_table(res.calibration, dst, err if json_ else out)
    err.print(f"next: quantize verify {src} {dst}", highlight=False)


def calibration_table(rep: dict, dst: Path, console) -> None:
    """Per layer: Linears rounded, tokens, experts' routed-token range, fallbacks, time."""
    from rich.table import Table

    c = rep["calibration"]
    from quantize.write.shards import read_own_json

    timings = read_own_json(dst / CALIB_TIMINGS, max_bytes=1 << 24)  # beside the report, not in it
    try:
        seconds = {lay["layer"]: lay.get("seconds", 0) for lay in (timings or {}).get("layers", [])}
    except (KeyError, TypeError, AttributeError):
        seconds = {}
    t = Table(title=f"calibration: {rep['method']}, {c['num_samples']} x {c['seq_len']} tokens "
                    f"from {c['source']}, experts {rep['expert_calibration']}")
    for col in ("layer", "MLP", "Linears", "expert tokens min/median/max", "fallback experts", "s"):
        t.add_column(col, justify="left" if col in ("MLP", "fallback experts") else "right")
    for lay in rep["layers"]:
        et = sorted(lay.get("expert_tokens") or [])
        spread = f"{et[0]:,} / {et[len(et) // 2]:,} / {et[-1]:,}" if et else "-"
        fb = lay.get("fallback") or []
        t.add_row(str(lay["layer"]), str(lay.get("mlp", "-")), str(lay.get("quantized", 0)), spread,
                  (", ".join(str(f["expert"]) for f in fb[:12]) + (" ..." if len(fb) > 12 else ""))
                  if fb else "-", f"{seconds.get(lay['layer'], 0):.1f}")
    console.print(t)
    if c.get("overlapping"):
        from quantize.calib.data import DEFAULT_CALIB

        more = (f" (the default set, {DEFAULT_CALIB.name}, holds ~1.5 M tokens to calibrate on)"
                if c["source"] != DEFAULT_CALIB.name else "")
        err.print(tag("note:", "yellow"), f"the {c['num_samples']} calibration windows overlap: "
                  f"{c['source']} holds {c['stream_tokens']:,} tokens{more}", highlight=False)
    n_fb = sum(len(lay.get("fallback") or []) for lay in rep["layers"])
    if n_fb:
        err.print(tag("note:", "yellow"), f"{n_fb} expert(s) had fewer than --min-expert-tokens "
                  f"{rep['min_expert_tokens']} routed tokens and used all-token statistics; "
                  f"see {dst / CALIB_REPORT}", highlight=False)
    n_up = sum(len(lay.get("topped_up") or []) for lay in rep["layers"])
    if n_up:
        err.print(f"note: {n_up} expert(s) were routed fewer than --expert-coverage "
                  f"{rep['expert_coverage']} tokens and had their statistics topped up with the "
                  f"tokens their router ranks highest; see {dst / CALIB_REPORT}", highlight=False)
