"""Reload a converted checkpoint and prove it against its source.

For every planned output (the plan is recomputed from the source with the options recorded
in the manifest):

    quantize   unpack `weight_packed`, dequantize with `weight_scale` (and zero point) as the
               engines do, compare with the FP8-dequantized source weight in float32:
               rel_err = ||W_q - W|| / ||W||,  SQNR = 20 log10(||W|| / ||W_q - W||) dB.
               Gaussian weights at group 32 give ~20 dB; the default floor of 12 dB catches a
               wrong scale or a scrambled nibble order (both give < 3 dB), not honest INT4 error.
    dequant    must equal bf16(FP8 dequant of the source) bit for bit
    copy       must equal the source bytes bit for bit
    AWQ        (method awq, awq+gptq) the reference is the source with the folds recorded in
               calibration/awq-scales.safetensors re-applied (`folds.awq_expected`, each norm
               by its recorded formula): the rescaled norms, routers and up_proj rows must
               equal it exactly in their dtype, INT4 targets are compared with it as above
    layers     then the function (quantize/check/layercheck.py): every decoder layer of the output as
               written against the source's on the same hidden states, its error bounded by
               3x round-to-nearest's; a fold into the wrong norm agrees with every weight
               check above and fails this

plus: the manifest is `complete` and every file's sha256 matches it, each file read from the
disk once (quantize/check/integrity.py), no weight file lies in the folder that the manifest
does not list (an engine globbing `*.safetensors` would load a stray shard with the
checkpoint; the reports written after conversion, README.md, verify.json, eval.json, are not
weights), the index lists exactly the planned tensors in the planned shards, `total_size` is
right, and config.json carries the expected `quantization_config`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from quantize import SCHEMA_VERSION
from quantize.check.integrity import Reads, changed, files_problems, options_of
from quantize.errors import Problem, QuantizeError
from quantize.names import (
    AWQ_SCALES,
    ROUTED_PICTURE,
    SQNR_PICTURE,
    VERIFY_JSON,
)
from quantize.options import ConvertOptions
from quantize.overlap import HashAhead, Readahead
from quantize.plan import Unit, make_plan
from quantize.rounding.int4 import REFIT_RANGE, Int4Weight, dequantize, rtn_qparams, unpack_int4
from quantize.source.checkpoint import INDEX_NAME, Checkpoint, open_checkpoint, read_tensor_table
from quantize.source.layout import layer_of
from quantize.source.weights import resolve_device, source_weight
from quantize.write.manifest import MANIFEST, finished_manifest, index_sha256
from quantize.write.qconfig import quantization_config, quantization_config_difference
from quantize.write.shards import sha256_file

__all__ = ["TensorCheck", "VerifyReport", "verify"]

_ABSENT = object()  # a config field one side does not have


@dataclass(frozen=True)
class TensorCheck:
    name: str  # source tensor name
    action: str
    rel_err: float  # 0.0 for exact checks that pass
    sqnr_db: float  # inf for exact
    ok: bool
    note: str = ""


@dataclass
class VerifyReport:
    src: str
    dst: str
    min_sqnr_db: float
    tensors: list[TensorCheck] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    layer_check: dict | None = None  # quantize/check/layercheck.py's report, or {"skipped": why}
    notes: list[str] = field(default_factory=list)  # said, not failed (e.g. a file of the user's)

    @property
    def ok(self) -> bool:
        return not self.problems and all(t.ok for t in self.tensors)

    def worst(self, n: int = 10) -> list[TensorCheck]:
        q = [t for t in self.tensors if t.action == "quantize"]
        return sorted(q, key=lambda t: t.sqnr_db)[:n]

    def summary(self) -> dict:
        q = [t for t in self.tensors if t.action == "quantize"]
        return {
            "ok": self.ok,
            "tensors_checked": len(self.tensors),
            "quantized": len(q),
            "exact_ok": sum(t.ok for t in self.tensors if t.action != "quantize"),
            "exact_total": sum(t.action != "quantize" for t in self.tensors),
            "min_sqnr_db": min((t.sqnr_db for t in q), default=float("inf")),
            "mean_sqnr_db": sum(t.sqnr_db for t in q) / len(q) if q else float("inf"),
            "max_rel_err": max((t.rel_err for t in q), default=0.0),
            "failed": [t.name for t in self.tensors if not t.ok][:50],
            "problems": self.problems,
            "layer_check": None if self.layer_check is None else
            {k: v for k, v in self.layer_check.items() if k != "layers"},
        }

    def to_json(self) -> dict:
        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None  # SQNR of an exact tensor: no error, null

        return {
            "schema_version": SCHEMA_VERSION,
            "src": self.src, "dst": self.dst, "min_sqnr_db_threshold": self.min_sqnr_db,
            "summary": {k: (num(v) if isinstance(v, float) else v) for k, v in self.summary().items()},
            "worst": [asdict(t) | {"sqnr_db": num(t.sqnr_db)} for t in self.worst()],
            "layer_check": self.layer_check,
            "notes": self.notes,
            "tensors": [asdict(t) | {"sqnr_db": num(t.sqnr_db)} for t in self.tensors],
        }


def _error_stats(W: torch.Tensor, Wq: torch.Tensor) -> tuple[float, float]:
    """(relative error, SQNR in dB) of Wq against W. Each row's norm in float32 (torch's
    vector_norm, rows of K values: ~1e-8 relative to float64), their squares summed in float64
    (tests/test_convert.py::test_error_stats_match_float64); on the CPU the difference is taken
    128 rows at a time, so no (N, K) buffer is written (6.4 ms per GLM-5.2 expert there,
    against 128 ms in float64: BENCHMARKS.md). Float64
    throughout where a square overflows float32 (|w| > ~1.8e19)."""
    if W.numel() == 0:
        return 0.0, float("inf")
    rows = W.shape[0] if W.dim() > 1 else 1
    W2, Q2 = W.float().reshape(rows, -1), Wq.float().reshape(rows, -1)
    step = rows if W2.is_cuda else 128

    def sq(norms: list[torch.Tensor]) -> float:
        return float(torch.cat(norms).double().square().sum())

    err2 = sq([torch.linalg.vector_norm(Q2[i:i + step] - W2[i:i + step], dim=1) for i in range(0, rows, step)])
    sig2 = sq([torch.linalg.vector_norm(W2, dim=1)])
    if not (math.isfinite(sig2) and math.isfinite(err2)):  # overflow (or NaN: the same below)
        W64, d64 = W.double(), Wq.double() - W.double()
        sig2, err2 = float(W64.square().sum()), float(d64.square().sum())
    sig, err = math.sqrt(sig2), math.sqrt(err2)
    if err == 0:
        return 0.0, float("inf")
    if sig == 0:
        return float("inf"), float("-inf")
    return err / sig, 20 * math.log10(sig / err)


def _check_unit(src: Checkpoint, dst: Checkpoint, unit: Unit, opts: ConvertOptions,
                min_sqnr: float, device: torch.device,
                awq_scales: tuple[dict, dict] | None = None) -> TensorCheck:
    if awq_scales:
        from quantize.calib.folds import awq_expected

        W = source_weight(src, unit, device)
        want = awq_expected(unit.source, W, *awq_scales)
        if want is not W and unit.action != "quantize":  # a norm, router or expert AWQ rescaled
            got = dst.read(unit.source, device)
            same = torch.equal(got, want.to(got.dtype))
            rel, sq = _error_stats(want, got.float())
            return TensorCheck(unit.source, unit.action, rel, sq, same,
                               "AWQ-folded" if same else "differs from the AWQ-folded source")
        if unit.action == "quantize":
            return _check_quantized(dst, unit, opts, min_sqnr, device, want)
    if unit.action == "keep":  # --keep-fp8: the FP8 weight and its scale, byte for byte
        scale_out = unit.source[: -len("weight")] + "weight_scale"
        same = torch.equal(_bytes(src, unit.source), _bytes(dst, unit.source)) and \
            torch.equal(_bytes(src, unit.scale), _bytes(dst, scale_out))
        return TensorCheck(unit.source, "keep", 0.0 if same else float("nan"), float("inf"), same,
                           "" if same else "FP8 weight or scale bytes differ from the source")
    if unit.action == "copy":
        same = torch.equal(_bytes(src, unit.source), _bytes(dst, unit.source))
        return TensorCheck(unit.source, "copy", 0.0 if same else float("nan"), float("inf"), same,
                           "" if same else "bytes differ from the source")
    W = source_weight(src, unit, device)
    if unit.action == "dequant":
        got = dst.read(unit.source, device)
        same = torch.equal(got, W.to(torch.bfloat16))
        rel, sq = _error_stats(W, got.float())
        return TensorCheck(unit.source, "dequant", rel, sq, same,
                           "" if same else "differs from the BF16 dequant of the FP8 source")
    return _check_quantized(dst, unit, opts, min_sqnr, device, W)


def _check_quantized(dst: Checkpoint, unit: Unit, opts: ConvertOptions, min_sqnr: float,
                     device: torch.device, W: torch.Tensor) -> TensorCheck:
    """Unpack and dequantize `unit`'s INT4 output; compare it with W (the float reference)."""
    m = unit.source[: -len(".weight")]
    N, K = (int(x) for x in dst.read(m + ".weight_shape"))
    q = unpack_int4(dst.read(m + ".weight_packed", device), K)
    scale = dst.read(m + ".weight_scale", device)
    zp = None
    if not opts.symmetric:
        zp = unpack_int4(dst.read(m + ".weight_zero_point", device), N, dim=0)
    notes = []
    if (N, K) != tuple(W.shape):
        notes.append(f"weight_shape {[N, K]} != source {list(W.shape)}")
    if not (torch.isfinite(scale.float()).all() and (scale.float() > 0).all()):
        notes.append("non-finite or non-positive scale")
    if notes:
        return TensorCheck(unit.source, "quantize", float("nan"), float("-inf"), False, "; ".join(notes))
    refit = opts.scale_refit_routed if unit.role == "routed" else opts.scale_refit
    if (groups := _group_problems(W, scale, zp, opts, refit)) is not None:
        rel, sq = _error_stats(W, dequantize(Int4Weight(q, scale, zp), torch.float32))
        return TensorCheck(unit.source, "quantize", rel, sq, False, groups)
    Wq = dequantize(Int4Weight(q, scale, zp), torch.float32)
    rel, sq = _error_stats(W, Wq)
    tiny = torch.finfo(torch.float32).tiny  # 1.2e-38, bf16's smallest normal too
    lo, hi = torch.aminmax(W)  # (one pass, no |W| copy)
    if 0 < max(-float(lo), float(hi)) < tiny:
        # every value subnormal: no bf16 group scale can resolve it, INT4 writes 0 (what bf16
        # products with such a weight give anyway); right when the output is that small too
        ok = bool((Wq.abs() <= tiny).all())
        return TensorCheck(unit.source, "quantize", rel, sq, ok,
                           "subnormal source (every |w| < 1.2e-38): zero codes" if ok else
                           "subnormal source, but the output is not: wrong scale")
    ok = sq >= min_sqnr
    return TensorCheck(unit.source, "quantize", rel, sq, ok,
                       "" if ok else f"SQNR {sq:.1f} dB below the {min_sqnr} dB floor")


def _group_problems(W: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None,
                    opts: ConvertOptions, refit: int = 0) -> str | None:
    """Group by group, the written scales (and zero points) against the rule every method
    uses (static groups: `int4.rtn_qparams` of the reference weight W; `--mse-clip` may only
    shrink a group's range, to 0.80 of it; `--scale-refit` moves it within 0.75-1.25 of it,
    int4.REFIT_RANGE, and keeps the zero points): a single tampered group fails its tensor, which a
    tensor-wide SQNR would average away (4 doubled groups of 1,280 kept 12+ dB)."""
    want_s, want_z = rtn_qparams(W, opts.group_size, opts.symmetric)
    s, w = scale.float(), want_s.float()
    # 1 %: one bf16 step (0.8 %) of slack for a reference recomputed on another device
    if refit:  # (the tensor's rounds: --scale-refit, routed experts their own)
        lo, hi = REFIT_RANGE
        bad = (s > w * hi * 1.01) | (s < w * lo * 0.99)
    else:
        bad = (s > w * 1.01) | (s < w * 0.79) if opts.mse_clip else (s - w).abs() > 0.01 * w
    if zp is not None and want_z is not None and not opts.mse_clip:
        bad |= (zp.to(torch.int32) - want_z.to(torch.int32)).abs() > 1
    n = int(bad.sum())
    if n == 0:
        return None
    r, g = (int(i) for i in bad.nonzero()[0])
    return (f"{n} of {bad.numel():,} group scales{'/zero points' if zp is not None else ''} differ "
            f"from the rounding rule's (first: row {r}, group {g}: scale {s[r, g].item():.4g}, "
            f"the rule gives {w[r, g].item():.4g})")


def _bytes(ckpt: Checkpoint, name: str) -> torch.Tensor:
    t = ckpt.read(name)
    return (t.reshape(1) if t.dim() == 0 else t).view(torch.uint8)


DEFAULT_MIN_SQNR_DB = 12.0  # verify's floor; push refuses a report checked against a lower one


def verify(src: str | Path, dst: str | Path, min_sqnr_db: float = DEFAULT_MIN_SQNR_DB, device: str = "cpu",
           on_unit: Callable[[Unit], None] | None = None, write: bool = True,
           on_start: Callable[[int], None] | None = None, layer_check: bool = True,
           log: Callable[[str], None] | None = None) -> VerifyReport:
    """Check `dst` against `src`; write `dst/verify.json`; return the report.
    `on_start(source_bytes)` once the tensors are about to be read, `on_unit(unit)` after each;
    `layer_check`: also run every decoder layer of both (quantize/check/layercheck.py); `log`: its
    per-layer lines."""
    dst = Path(dst)
    manifest = finished_manifest(dst)
    manifest_sha = _manifest_sha(dst, manifest)  # the report names this one, and only this one
    _same_source(Path(src), manifest)
    # names, not this machine's paths (verify.json is published beside the weights): SRC's repo
    # id, else the name the conversion recorded for its source, else the folder's name
    from quantize.source.hub import source_identity

    ident = source_identity(src) if Path(src).exists() else {"repo_id": str(src)}
    src_name = ident["repo_id"] or (manifest.get("source") or {}).get("name") or Path(src).name
    report = VerifyReport(src_name, dst.name, min_sqnr_db)
    dev = resolve_device(device)  # auto: the GPU when there is one; cuda without one: exit 2
    reads = Reads.start(src, dst, manifest)
    # the layer check's transformers (seconds to import, tens on a cold busy disk), classes and
    # tokens load on a thread while this one checks the tensors (nothing else needs them:
    # config.json's quantization_config is compared without compressed-tensors)
    from quantize.check.layercheck import prepare_in_background

    loading = prepare_in_background(reads.src, log) if layer_check else _done(None)
    reads.shards.yield_to(loading)
    try:
        return _verify(_Run(report, src, dst, manifest, manifest_sha, reads, loading, min_sqnr_db,
                            dev, on_unit, on_start, layer_check, log, write))
    finally:  # never return with the preparation still building on its thread: transformers
        # sets torch's process-wide default dtype while it builds (a later build in this
        # process would take BF16 as the default to restore)
        reads.close()
        loading.exception()


@dataclass
class _Run:
    """One verify call: its report, what it checks and how, and its reads under way (handed
    from step to step)."""
    report: VerifyReport
    src: str | Path
    dst: Path
    manifest: dict
    manifest_sha: str  # the sha256 of the manifest's bytes as verify read them at its start
    reads: Reads
    loading: Future  # the layer check's preparation on its thread (done at once without it)
    min_sqnr_db: float
    dev: torch.device
    on_unit: Callable[[Unit], None] | None
    on_start: Callable[[int], None] | None
    layer_check: bool
    log: Callable[[str], None] | None
    write: bool


def _done(value) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _shards(reads: Reads) -> str:
    n = len(reads.streamed)
    return f"{n} weight shard{'' if n == 1 else 's'}"


def _verify(run: _Run) -> VerifyReport:
    """verify()'s checks once the report is started, the files are being hashed and the layer
    check's preparation is loading."""
    report, dst, reads, log, write = run.report, run.dst, run.reads, run.log, run.write
    files = run.manifest["files"]
    problems, notes = files_problems(Path(run.src), dst, files, reads.rest.result(), set(reads.streamed))
    report.problems += problems
    report.notes += notes
    if log:
        log(f"{len(files) - len(reads.streamed)} files checked against the manifest's sha256 "
            f"in {time.perf_counter() - reads.t0:.1f} s; {_shards(reads)} "
            f"hashed beside the tensor checks")
    if report.problems:
        return _finish(report, dst, write, run.manifest_sha)
    try:
        _check_output(run)
    except Exception as e:
        # a shard changed after conversion can fail any check that reads it (a header that no
        # longer parses): the change is what to report. Hashed for that: the shards the error
        # names and those already being read (not the whole output: on a large model that is
        # minutes, for an error that may be the source's)
        digests = reads.shard_digests(started=True)
        named = {Path(p.file).name for p in getattr(e, "problems", [])}
        digests |= {n: sha256_file(dst / n) for n in reads.streamed if n in named and n not in digests}
        if bad := changed(files, digests, [n for n in reads.streamed if n in digests]):
            report.problems += bad
            return _finish(report, dst, write, run.manifest_sha)
        raise
    report.problems += changed(files, reads.shard_digests(), reads.streamed)
    if log:
        log(f"{_shards(reads)} checked against the manifest's sha256 "
            f"({reads.shards.read_bytes / 1e9:.1f} GB) in {time.perf_counter() - reads.t0:.1f} s")
    return _finish(report, dst, write, run.manifest_sha)


def _check_output(run: _Run) -> None:
    """The output's layout against the plan, then every tensor and layer against the source,
    from `run.reads` (told how far the checks have read), then config.json's
    quantization_config."""
    t0 = time.perf_counter()
    report, dst, reads, log = run.report, run.dst, run.reads, run.log
    opts = options_of(run.manifest)
    src_ckpt = reads.src if reads.src is not None else open_checkpoint(run.src)
    plan = reads.plan if reads.plan is not None else make_plan(src_ckpt, opts)
    tensors, files, sizes = read_tensor_table(dst)
    config = json.loads((dst / "config.json").read_text())
    dst_ckpt = Checkpoint(dst, str(dst), config, tensors, files, sizes, "compressed-tensors")

    _layout_problems(report, src_ckpt, plan, dst, tensors, config)
    if log:
        log(f"{len(tensors)} tensors, the index and config.json's fields checked against the "
            f"plan in {time.perf_counter() - t0:.1f} s")
    if not report.problems:
        _check_against_source(run, src_ckpt, dst_ckpt, plan, opts)
    _config_problems(report, plan, config, tensors, log)


def _check_against_source(run: _Run, src_ckpt: Checkpoint, dst_ckpt: Checkpoint, plan,
                          opts: ConvertOptions) -> None:
    """Every tensor and layer of the output against the source's."""
    awq_scales = None
    if AWQ_SCALES in run.manifest["files"]:  # AWQ folded scales into norms, routers and weights
        from quantize.calib.folds import read_folds

        awq_scales = read_folds(run.dst / AWQ_SCALES)
    elif "awq" in opts.method:
        run.report.problems.append(f"{AWQ_SCALES}: missing, but the manifest says method {opts.method}")
        return
    checker = _layer_check(run, src_ckpt, plan, opts)
    _check_tensors_and_layers(run, src_ckpt, dst_ckpt, plan, opts, awq_scales, checker)


def _layout_problems(report: VerifyReport, src_ckpt: Checkpoint, plan, dst: Path,
                     tensors: dict, config: dict) -> None:
    """The output's tensors, index total and every config field but quantization_config
    (`_config_problems`) as the plan implies."""
    planned = {t.name: (s.file, t.dtype, t.shape) for s in plan.shards for t in s.tensors}
    actual = {n: (t.file, t.dtype, t.shape) for n, t in tensors.items()}
    L0 = src_ckpt.num_hidden_layers
    for n in sorted(set(planned) - set(actual)):
        mtp = (L := layer_of(n)) is not None and L >= L0
        report.problems.append(f"{n}: planned but missing from the output index" + (
            " (an MTP-layer tensor: engines load the speculative-decoding draft without it and "
            "accept almost none of its tokens)" if mtp else ""))
    for n in sorted(set(actual) - set(planned)):
        report.problems.append(f"{n}: in the output but not planned")
    for n in sorted(set(planned) & set(actual)):
        if planned[n] != actual[n]:
            report.problems.append(f"{n}: output {actual[n]} != planned {planned[n]}")
    index = json.loads((dst / INDEX_NAME).read_text())
    total = sum(t.nbytes for t in tensors.values())
    if index.get("metadata", {}).get("total_size") != total:
        report.problems.append(f"{INDEX_NAME}: total_size {index.get('metadata', {}).get('total_size')}"
                               f" != {total} bytes of tensors")
    # every other field is the source's, as convert copies it (an edited routed_scaling_factor
    # or rms_norm_eps would change what the engines compute, with every weight intact)
    want = {**src_ckpt.config, "torch_dtype": src_ckpt.config.get("torch_dtype", "bfloat16")}
    for k in sorted((set(want) | set(config)) - {"quantization_config"}):
        if config.get(k, _ABSENT) != want.get(k, _ABSENT):
            shown = [repr(v) if v is not _ABSENT else "(absent)"
                     for v in (config.get(k, _ABSENT), want.get(k, _ABSENT))]
            report.problems.append(f"config.json: {k} = {shown[0][:80]}, the source has {shown[1][:80]}")


def _config_problems(report: VerifyReport, plan, config: dict, tensors: dict,
                     log: Callable[[str], None] | None) -> None:
    """config.json's quantization_config as the plan implies (compressed-tensors' schema, read
    as compressed-tensors reads it: write/qconfig.py), and the known-bad layouts (lint)."""
    t0 = time.perf_counter()
    diff = quantization_config_difference(config.get("quantization_config") or {}, quantization_config(plan))
    if diff is not None:
        report.problems.append(f"config.json: quantization_config differs from the one the plan "
                               f"implies ({diff})")
    from quantize.lint import lint

    actual = {n: (t.file, t.dtype, t.shape) for n, t in tensors.items()}
    report.problems += [f"config.json / index: {c.what}: {c.detail}"
                        for c in lint(config.get("quantization_config") or {}, actual) if c.level == "fail"]
    if log:
        log(f"config.json's quantization_config checked against the plan in "
            f"{time.perf_counter() - t0:.1f} s")


def _check_tensors_and_layers(run: _Run, src_ckpt: Checkpoint, dst_ckpt: Checkpoint, plan,
                              opts: ConvertOptions, awq_scales, checker) -> None:
    """Every planned unit checked tensor by tensor, in plan order; each decoder layer run by
    `checker` (or none) once its tensors are checked, from the same reads; `run.reads` (the
    output's hashing and the source's read-ahead) told how far they have got."""
    report, reads, log = run.report, run.reads, run.log
    if checker is not None:  # a layer's reads, kept until its forward ran: the per-tensor
        # checks read DST's stored tensors, the layers its dequantized view of the same ones
        src_ckpt.memo = {}
        dst_ckpt.memo = checker.dst.memo = {}
    if run.on_start:
        run.on_start(sum(u.source_bytes for u in plan.units))
    # each byte is read once: what a check has read is dropped from the page cache, which
    # keeps it for the reads ahead (a memory cgroup, or a model larger than the memory,
    # evicted those first and read them twice: a page read twice counts as in use)
    src_ckpt.drop_read = dst_ckpt.drop_read = True
    source = Readahead(src_ckpt, [n for u in plan.units for n in (u.source, u.scale) if n],
                       ahead=reads.ahead, yield_to=run.loading)  # (started here: `Reads` says why)
    try:
        checker = _check_units(run, src_ckpt, dst_ckpt, plan, opts, awq_scales, checker,
                               (source, reads.shards), _lag_bytes(reads.ahead, run.dev))
    finally:
        source.close()
    if checker is not None:
        checker = _run_layers(checker, checker.num_layers - 1, report, opts, log)
    if dst_ckpt.memo is not None:
        dst_ckpt.memo.clear()  # (the layer view's too)
    src_ckpt.memo = dst_ckpt.memo = None
    if checker is not None:
        report.layer_check = checker.report()
        report.problems += checker.problems()


def _lag_bytes(ahead: int, dev: torch.device) -> int:
    """How many bytes of checked tensors may wait for the layer check while its classes are
    still being built, where they wait: on a GPU a quarter of its free memory, on the host
    half the read-ahead budget (which is bounded by the memory). (On the H200, with half the
    read-ahead budget on the GPU too, 8 GiB, the checks of the GLM-5.2-shaped slice stopped
    at 45 % for 17 s until transformers had loaded: BENCHMARKS.md.)"""
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0] // 4
    return ahead // 2


def _check_units(run: _Run, src_ckpt: Checkpoint, dst_ckpt: Checkpoint, plan,
                 opts: ConvertOptions, awq_scales, checker, ahead: tuple[Readahead, HashAhead],
                 lag: int):
    """The units in plan order, each decoder layer run by `checker` once the next layer's
    units begin; the checker (None once the layers turned out unbuildable). While the
    checker's classes are still being built on their thread, the checks go on and the layers
    wait, their reads kept, up to `lag` bytes. `ahead`: the source's and the output's reads
    ahead, told what each unit took."""
    report, log = run.report, run.log
    current = None
    kept = 0  # bytes read since the layers last ran (the memo's)
    for unit in plan.units:
        L = layer_of(unit.source)
        if checker is not None and L != current:
            if current is not None and (kept > lag or not checker.preparing()):
                # the tensors of the layers up to `current` were all checked: run them
                checker = _run_layers(checker, current, report, opts, log)
                kept = 0
                if checker is None:  # (skipped: nothing more to keep)
                    src_ckpt.memo = dst_ckpt.memo = None
                else:
                    src_ckpt.memo.clear()
                    dst_ckpt.memo.clear()  # (the view's too: one dict)
            current = L
        report.tensors.append(_check_unit(src_ckpt, dst_ckpt, unit, opts, run.min_sqnr_db,
                                          run.dev, awq_scales))
        kept += unit.source_bytes + unit.nbytes
        ahead[0].consumed(unit.source_bytes)
        ahead[1].consumed(unit.nbytes)
        if run.on_unit:
            run.on_unit(unit)
    return checker


def _run_layers(checker, upto: int, report: VerifyReport, opts: ConvertOptions,
                log: Callable[[str], None] | None):
    """The layer check up to layer `upto`; the checker, or None once it turned out that the
    layers cannot be built (an RTN output of a model transformers does not know: skipped)."""
    if log and checker.preparing():  # (silent otherwise: tens of seconds beside a busy disk)
        log("the layer check waits for transformers to build the model's layer classes")
    try:
        checker.run(upto, log)
        return checker
    except QuantizeError as e:
        return _unbuildable(e, report, opts, log)


def _unbuildable(e: QuantizeError, report: VerifyReport, opts: ConvertOptions,
                 log: Callable[[str], None] | None) -> None:
    """The layers cannot be built: an RTN output's layer check is skipped (said in the report);
    a calibrated output's cannot be (its conversion built them): the error stands. So does a
    chat template that does not finish (the check's windows begin as requests do: unknowable)."""
    from quantize.calib.data import ChatTemplateTimeout

    if opts.method != "rtn" or isinstance(e, ChatTemplateTimeout):
        raise e
    report.layer_check = {"skipped": f"the layers cannot be built: {e.summary}"}
    if log:
        log(f"note: layer check skipped ({e.summary})")


def _layer_check(run: _Run, src: Checkpoint, plan, opts: ConvertOptions):
    """The function check (quantize/check/layercheck.py), or None with the reason in the report:
    turned off, or a model whose layers the installed transformers cannot build (RTN outputs
    of such models are checked tensor by tensor only; calibrated ones cannot exist). Its
    preparation is `run.loading` where verify opened the source early; otherwise `run.loading`
    is transformers' import alone, and the preparation is done here once that has finished."""
    if not run.layer_check:
        run.report.layer_check = {"skipped": "--no-layer-check"}
        return None
    from quantize.check.int4view import open_output
    from quantize.check.layercheck import LayerCheck

    prep = run.loading if run.reads.src is not None else None
    if prep is None:
        run.loading.exception()
    try:
        return LayerCheck(src, {u.source: u for u in plan.units}, open_output(run.dst), opts,
                          run.dev, prep)
    except QuantizeError as e:
        return _unbuildable(e, run.report, opts, run.log)


def _same_source(src: Path, manifest: dict) -> None:
    """A local SRC whose index is not the one the conversion recorded is another checkpoint:
    said as that, before any file is compared (its files would each read as missing from the
    output, with "reconvert" as the fix)."""
    from quantize.names import INDEX_NAME

    recorded = (manifest.get("source") or {}).get("index_sha256")
    now = index_sha256(src) if src.is_dir() else None
    if recorded and now is not None and now != recorded:
        raise QuantizeError("SRC is not the checkpoint this output was converted from", [Problem(
            str(src / INDEX_NAME), None, "a weight index other than the one the conversion recorded "
            f"(source {(manifest.get('source') or {}).get('name')!r})",
            "the source the output was converted from",
            "pass that checkpoint as SRC (the output's quantize-manifest.json names it)")])


def _manifest_sha(dst: Path, manifest: dict) -> str:
    """The sha256 of the manifest verify checks against: its bytes read once more and proven to
    hold what `finished_manifest` parsed (a conversion rewriting the folder in between: refused)."""
    import hashlib

    raw = (dst / MANIFEST).read_bytes()
    try:
        same = json.loads(raw) == manifest
    except ValueError:
        same = False
    if not same:
        raise _changed_under_us(dst)
    return hashlib.sha256(raw).hexdigest()


def _changed_under_us(dst: Path) -> QuantizeError:
    return QuantizeError("the output changed while verify ran", [Problem(
        str(dst / MANIFEST), None, "rewritten since verify began (a conversion ran into this folder)",
        "the manifest verify began with, unchanged to the end",
        "run verify again once the conversion has finished (no report was written)")])


def _finish(report: VerifyReport, dst: Path, write: bool, manifest_sha: str) -> VerifyReport:
    if write:
        # Not through the manifest: verify.json is a report about the checkpoint, not part of it.
        # It names the manifest it checked (its sha256: every file's sha256 is in it), so `push`
        # can tell a report of this conversion from one copied from another folder. That is the
        # manifest read at the start: one rewritten since (convert --overwrite into this folder
        # while verify ran) fails the run, and no report of the old bytes names the new manifest.
        data = report.to_json()
        now = sha256_file(dst / MANIFEST) if (dst / MANIFEST).is_file() else None
        if now != manifest_sha:
            raise _changed_under_us(dst)
        data["manifest_sha256"] = manifest_sha
        from quantize.publish import plots
        from quantize.publish.readme import refresh_readme  # local: readme imports this module
        from quantize.write.shards import json_text, write_bytes_atomic

        drawn = plots.sqnr_by_layer(data, dst / SQNR_PICTURE)  # (None without matplotlib)
        # the pictures push may publish beside this report, bound to it by their sha256: the
        # SQNR picture just drawn, and the calibration's routed-token picture convert drew
        data["pictures"] = {name: sha256_file(dst / name) for name in (
            *([SQNR_PICTURE] if drawn is not None else []), ROUTED_PICTURE)
            if (dst / name).is_file() and not (dst / name).is_symlink()}
        write_bytes_atomic(dst / VERIFY_JSON, (json_text(data) + "\n").encode())
        refresh_readme(dst)  # the card shows these results
    return report
