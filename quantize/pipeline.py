"""The conversion recipe.

    1. open the source: config, index, every shard header; validate (no data read)
    2. plan: every output tensor, shard and byte; refuse what the engines cannot serve
    3. check every FP8 scale is finite (small: one float per 128x128 block)
    4. prepare the output folder (never inside the source; a folder with a manifest is resumed,
       any other non-empty one refused unless --overwrite)
    5. stream shard by shard: read a source tensor, dequantize / quantize / copy, append to the
       shard, commit the shard atomically and record its sha256 in the manifest; a shard the
       manifest already records with a matching sha256 is kept; a calibrated run checkpoints
       its state between layers in DST/calibration/state and resumes from there
    6. write config.json (compressed-tensors quantization_config), the index, copy the
       tokenizer and other non-weight files, mark the manifest complete
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quantize import __version__
from quantize.calib.distributed import Dist
from quantize.disk import MAX_CHECKPOINTS, check_disk
from quantize.errors import Problem, QuantizeError
from quantize.names import (
    AWQ_SCALES,
    CALIB_REPORT,
    CALIB_STATE,
    CARD,
    EVAL_JSON,
    INDEX_NAME,
    MANIFEST,
    VERIFY_JSON,
    WEIGHT_SUFFIXES,
)
from quantize.options import ConvertOptions
from quantize.overlap import STREAM_AHEAD, Readahead, readahead_bytes
from quantize.plan import Plan, Shard, Unit, make_plan
from quantize.rounding.int4 import int4_outputs, quantize_rtn
from quantize.source.checkpoint import Checkpoint, open_checkpoint
from quantize.source.weights import (
    _nonfinite,
    aux_files,
    finite_hint,
    read_unit,
    resolve_device,
    source_weight,
)
from quantize.write.deleting import TRASH, Deleting
from quantize.write.manifest import Manifest, read_manifest
from quantize.write.qconfig import quantization_config
from quantize.write.shards import (
    ShardWriter,
    copy_file_atomic,
    folder_lock,
    partial_name,
    sha256_file,
    stall_point,
    write_json_atomic,
)

if TYPE_CHECKING:
    from quantize.calib.loop import Calibrator

__all__ = [
    "WEIGHT_SUFFIXES", "ConvertResult", "compute_unit", "convert", "quantization_config", "read_unit",
    "resolve_device", "source_weight",
]



@dataclass(frozen=True)
class ConvertResult:
    out_dir: Path
    plan: Plan
    written: list[str]  # shards written by this run
    skipped: list[str]  # shards kept from an earlier run (resume)
    device: str
    calibration: dict | None = None  # calibration-report.json, when a calibrated method ran


def _init_cuda(dev: torch.device) -> None:
    try:
        torch.empty(1, device=dev)
    except RuntimeError:  # a broken device: the first real use raises it with its context
        pass


def compute_unit(ckpt: Checkpoint, unit: Unit, opts: ConvertOptions, device: torch.device,
                 raw: dict[str, torch.Tensor] | None = None, calib: Calibrator | None = None
                 ) -> list[torch.Tensor]:
    """The output tensors of one unit, in plan order (`raw`: its tensors already read;
    `calib`: calibrated results first)."""
    outs, finite = _compute(ckpt, unit, opts, device, raw, calib)
    _check_finite(ckpt, unit, finite)
    return outs


def _compute(ckpt: Checkpoint, unit: Unit, opts: ConvertOptions, device: torch.device,
             raw: dict[str, torch.Tensor] | None, calib: Calibrator | None
             ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """`compute_unit` without waiting for the device: the outputs (on `device`) and a 0-d
    bool tensor, True when the values checked are finite (None: nothing to check). Reading
    the flag is what synchronizes, so the streaming loop leaves that to its writer thread."""
    # a calibrated layer's result, taken from the layer thread as a value (quantize/calib/handoff.py):
    # INT4 outputs it packed (on the host), or a BF16 tensor AWQ rescaled (norm, router,
    # non-target Linear); None for the rest, converted here
    done = calib.result(unit) if calib is not None else None
    if done is not None:
        return done, None
    raw = raw if raw is not None else read_unit(ckpt, unit, device)
    if unit.action == "copy":
        t = raw[unit.source]
        return [t], finite_hint(t) if t.is_floating_point() else None
    if unit.action == "keep":  # FP8 weight and its scale, byte for byte (the scale renamed)
        w, sc = raw[unit.source], raw[unit.scale]
        return [w, sc], torch.isfinite(w.float()).all() & torch.isfinite(sc.float()).all()
    W = source_weight(ckpt, unit, device, raw)  # (N, K) float32
    if unit.action == "dequant":
        return [W.to(torch.bfloat16)], finite_hint(W)
    q = quantize_rtn(W, opts.group_size, opts.symmetric)
    # A NaN or Inf anywhere in W makes its group's range, hence its scale, non-finite (amax
    # propagates NaN), so the scales (1/group_size of W) are the cheaper place to look.
    return int4_outputs(q), torch.isfinite(q.scale).all()


def _check_finite(ckpt: Checkpoint, unit: Unit, finite: torch.Tensor | None) -> None:
    """Raise the error for a unit whose finiteness flag (`_compute`'s) failed. Its source is
    read again, so only the failure path pays for the details; a copied or widened tensor
    that is finite after all passes (its flag is `finite_hint`'s, which a finite tensor's
    overflowing sum can fail)."""
    if finite is None or bool(finite):
        return
    raw = read_unit(ckpt, unit)
    t = raw[unit.source] if unit.action == "copy" else source_weight(ckpt, unit, torch.device("cpu"), raw)
    if unit.action in ("copy", "dequant") and bool(torch.isfinite(t).all()):
        return
    raise _nonfinite(ckpt, unit.source, t)


def _read_plain(ckpt: Checkpoint, unit: Unit, device: torch.device, calib: Calibrator | None
                ) -> dict[str, torch.Tensor] | None:
    """`read_unit`, except for a unit the calibration provides (None: nothing to read)."""
    if calib is not None and calib.provides(unit):
        return None
    return read_unit(ckpt, unit, device)


def _write_unit(w: ShardWriter, ckpt: Checkpoint, unit: Unit, tensors: list[torch.Tensor],
                finite: torch.Tensor | None) -> None:
    """The writer thread's part of a unit: check, copy to the host, hash and write."""
    _check_finite(ckpt, unit, finite)
    for t in tensors:
        w.write(t)


def _same_folder(a: Path, b: Path) -> bool:
    """Whether two paths name one folder by device and inode (os.path.samefile): one folder
    seen through two mounts (`/scratch` and `/home/u/scratch`, a container's bind mount) has
    two path strings; False where either does not exist."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _check_out_path(src: Path, out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse an output folder inside (or around) the source, a file, or contradictory flags."""
    if resume and overwrite:
        raise QuantizeError("--resume and --overwrite contradict each other", [Problem(
            str(out), None, "both flags", "at most one of them",
            "--resume keeps the finished shards, --overwrite deletes them; choose one")])
    s, o = src.resolve(), out.resolve()
    if o == s or _same_folder(o, s):
        raise QuantizeError("the output folder is the source", [Problem(
            str(out), None, f"the source folder {src}", "a folder outside the source checkpoint",
            "choose an output folder next to the source, e.g. ./MODEL-INT4")])
    if s in o.parents or any(_same_folder(p, s) for p in o.parents):
        raise QuantizeError("the output folder is inside the source", [Problem(
            str(out), None, f"inside {src}", "a folder outside the source checkpoint",
            "choose an output folder next to the source, e.g. ./MODEL-INT4")])
    if o in s.parents or any(_same_folder(o, p) for p in s.parents):
        raise QuantizeError("the output folder contains the source", [Problem(
            str(out), None, f"a parent of {src}", "a separate folder",
            "choose an empty output folder next to the source")])
    if out.exists() and not out.is_dir():
        raise QuantizeError("the output is not a folder", [Problem(
            str(out), None, "an existing file", "a new or empty folder", "choose another path")])


def _our_partials(plan: Plan, aux: list[Path]) -> set[str]:
    """The `.partial` names a conversion of `plan` writes in its output folder: its shards,
    index, config, manifest, model card, report, and the copied files, each plus PARTIAL."""

    names = [s.file for s in plan.shards] + [p.name for p in aux] + [
        INDEX_NAME, "config.json", MANIFEST, CARD, CALIB_REPORT, VERIFY_JSON,
        EVAL_JSON]
    return {partial_name(n) for n in names}


def _prepare_out(out: Path, overwrite: bool, partials: set[str]) -> tuple[dict | None, Deleting | None]:
    """Empty or resume the (locked) output folder; return the previous manifest when resuming,
    and the deletion of old contents still running (or None).

    A folder holding a manifest is resumed whether or not --resume was given (re-running the
    same command continues it; `Manifest.resume` refuses other options or a changed source).
    Any other non-empty folder is refused unless --overwrite, which moves its contents aside
    and deletes them in the background (write/deleting.py), as it does a TRASH folder a killed
    run left. Half-written files of a killed run are deleted before we start: only files whose
    names are in `partials` (`_our_partials`: what this conversion writes, + `.partial`); any
    other `*.partial` entry is the user's and counts as content like any other file.
    """
    previous = None if overwrite else read_manifest(out)
    # (a link at one of those names is removed, never followed: the write makes its file fresh)
    mine = [p for p in out.iterdir() if p.name in partials and (p.is_symlink() or p.is_file())]
    trash = out / TRASH
    left = trash.is_dir() and not trash.is_symlink()  # (a killed run's: ours)
    other = [p for p in out.iterdir() if p not in mine and not (left and p == trash)]
    if other and not overwrite and previous is None:
        raise QuantizeError("the output folder is not empty", [Problem(
            str(out), None, f"{len(other)} existing file(s) (e.g. {min(other).name}), no {MANIFEST}",
            "an empty or new folder, or one holding an earlier conversion's manifest",
            "choose a new folder, or pass --overwrite to delete its contents")])
    deleting = Deleting(out, other if overwrite else []) if overwrite and other or left else None
    for p in mine:
        p.unlink()  # half-written files of an interrupted run (the lock says it is not running)
    return previous, deleting


def _check_disk(out: Path, plan: Plan, previous: dict | None, dev: torch.device,
                checkpoint_interval: float, log: Callable[[str], None] | None, least: int,
                deleting: Deleting | None) -> int:
    """disk.check_disk on the space free now. While old contents are still being deleted, a
    run that needs their space (or would keep fewer calibration checkpoints without it) waits
    for the deletion and is checked again."""
    if deleting is not None and deleting.busy:
        try:
            at_once = check_disk(out, plan, previous, dev, checkpoint_interval, None, least)
            if at_once in (0, MAX_CHECKPOINTS):
                return at_once
        except QuantizeError:
            pass
        deleting.wait()
    return check_disk(out, plan, previous, dev, checkpoint_interval, log, least)


def _check_scales(ckpt: Checkpoint, plan: Plan) -> None:
    problems = []
    for name in ckpt.nonfinite([u.scale for u in plan.units if u.scale is not None]):
        problems.extend(_nonfinite(ckpt, name, ckpt.read(name).float()).problems)
    if problems:
        raise QuantizeError("non-finite FP8 scales in the source", problems)


def _early_readahead(ckpt: Checkpoint, plan: Plan, out: Path, overwrite: bool) -> Readahead | None:
    """RTN reads the whole source in plan order. Into a fresh output (no manifest to resume,
    or --overwrite) it reads ahead from the plan on: the disk works through the driver's
    start-up and the checks (on the H200 the first tensor came 3-6.5 s after the plan line,
    the disk idle; BENCHMARKS.md). None otherwise (a resume reads ahead once it knows the
    shards it keeps; a calibration reads each layer ahead itself)."""
    if plan.options.method != "rtn" or (not overwrite and out.is_dir() and read_manifest(out) is not None):
        return None
    return _source_readahead(ckpt, plan)


def _source_readahead(ckpt: Checkpoint, plan: Plan, kept: set[str] = frozenset()) -> Readahead:
    """The stream's read-ahead of the source: the tensors of the shards still to write, in the
    order the stream reads them."""
    return Readahead(ckpt, plan.read_order(kept), ahead=readahead_bytes(STREAM_AHEAD))


def _check_name(out: Path) -> None:
    """DST's name goes into the card, the manifest and the Hub repo's files as UTF-8 text: a
    name that is not UTF-8 (a byte the file system kept as is) is refused before any work."""
    try:
        str(out).encode("utf-8")
    except UnicodeEncodeError:
        raise QuantizeError("the output folder's name is not UTF-8", [Problem(
            ascii(str(out)), None, "a byte that is not UTF-8 in the name",
            "a UTF-8 folder name (the card and the manifest quote it)",
            "choose another DST, e.g. with only ASCII letters, digits, '-' and '_'")]) from None


def convert(
    src: str | Path,
    out: str | Path,
    opts: ConvertOptions,
    device: str = "auto",
    resume: bool = False,
    overwrite: bool = False,
    on_unit: Callable[[Unit], None] | None = None,
    command: str | None = None,
    log: Callable[[str], None] | None = None,
    tp: int = 8,
    checkpoint_interval: float = 300.0,
    dist: Dist | None = None,
    max_gpu_memory: int | None = None,
    base_model: str | None = None,
    planned: tuple[Checkpoint, Plan] | None = None,
) -> ConvertResult | None:
    """`planned`: SRC opened and planned by the caller with these `opts` and `tp` (the CLI
    prints the plan first; GLM-5.2's 118,629 tensors take seconds to open and plan again).
    `base_model`: the Hub repo id SRC is a copy of (the manifest and card name it; default:
    the repo of a Hub-cache snapshot). `tp`: the tensor-parallel size the output is meant to be served at: the plan's checks
    use it and the manifest records it for the model card's serving commands.
    `checkpoint_interval`: calibrated runs save their resume state at most this often
    (seconds; 0: after every layer a resume can start from). `dist`: this process's rank
    under torchrun (quantize/calib/distributed.py): rank 0 converts and writes, the other ranks
    take their share of the calibration and write nothing (None is returned on them).
    `max_gpu_memory`: bytes the calibration may hold on its GPU (None: all of it)."""
    src, out = Path(src), Path(out)
    _check_name(out)
    if planned is None:
        ckpt = open_checkpoint(src)
        planned = ckpt, make_plan(ckpt, opts, tp)
    ckpt, plan = planned
    if plan.options != opts or plan.tp != tp:
        raise ValueError("convert: the plan handed in was made with other options or tp")
    dev = resolve_device(device) if dist is None else dist.device
    if dist is not None and not dist.leader:
        if opts.method != "rtn":  # RTN is rank 0's alone: it is bound by the disk
            from quantize.calib.loop import Calibrator

            with Calibrator(ckpt, plan, opts, dev, dist=dist, max_gpu_memory=max_gpu_memory,
                            checkpoint_interval=checkpoint_interval) as calib:
                calib.use_state(out / CALIB_STATE, None)  # rank 0's manifest identity, received
                calib.run_all()
                calib.finish_rank()
        return None
    early = _early_readahead(ckpt, plan, out, overwrite)
    calib = None
    try:
        if dev.type == "cuda":  # the driver's start-up (~0.4 s on an H200) overlaps the checks
            threading.Thread(target=_init_cuda, args=(dev,), daemon=True).start()
        aux = aux_files(src)
        _check_scales(ckpt, plan)  # all that is checkable without the weights, before writing
        _check_out_path(src, out, resume, overwrite)
        if opts.method != "rtn":  # calibration data and layer classes, checked before any output
            from quantize.calib.loop import Calibrator

            calib = Calibrator(ckpt, plan, opts, dev, log=log,  # log: one line per layer
                               checkpoint_interval=checkpoint_interval, dist=dist,
                               max_gpu_memory=max_gpu_memory)
        # config.json's quantization_config: compressed-tensors' schema, built without importing
        # it (write/qconfig.py: its import cost an RTN conversion seconds after its last shard)
        qconfig = quantization_config(plan)
        with folder_lock(out):  # one conversion per output folder at a time
            previous, deleting = _prepare_out(out, overwrite, _our_partials(plan, aux))
            if deleting is not None and log is not None:
                log(f"deleting {out.name}'s previous contents in the background ({TRASH})")
            at_once = _check_disk(out, plan, previous, dev, checkpoint_interval, log,
                                  1 if dist is None else 2, deleting)
            return _write(ckpt, plan, out, previous, aux, opts, dev, on_unit,
                          {"command": command, "source_format": ckpt.source_format,
                           "model_type": ckpt.model_type, "tp": tp}, qconfig, calib, base_model,
                          at_once, early, deleting)
    finally:
        if early is not None:
            early.close()  # (a check refused to start, or the stream is done)
        if calib is not None:
            calib.close()  # stops its layer thread (also when an error or Ctrl-C propagates)


def _write_shard(ckpt: Checkpoint, shard: Shard, out: Path, opts: ConvertOptions, plain: torch.device,
                 calib: Calibrator | None, on_unit: Callable[[Unit], None] | None) -> tuple[int, str]:
    """One shard written (atomically, ShardWriter); its bytes and sha256."""
    # Three stages overlap: the reader thread fetches unit i+1 (onto the GPU when there is
    # one), this thread launches unit i's work, the writer thread brings unit i-1 to the
    # host, checks it, hashes and writes it (torch, hashlib and file I/O release the GIL).
    # Only the writer waits for the device, so this thread never stalls the GPU's queue.
    # At most three units' tensors are in memory; the write order is the plan's.
    with ShardWriter(out / shard.file, shard.tensors) as w, \
            ThreadPoolExecutor(1) as reader, ThreadPoolExecutor(1) as writer:
        ahead = reader.submit(_read_plain, ckpt, shard.units[0], plain, calib)
        written_prev = None
        for i, unit in enumerate(shard.units):
            raw = ahead.result()
            if i + 1 < len(shard.units):
                ahead = reader.submit(_read_plain, ckpt, shard.units[i + 1], plain, calib)
            outs, finite = _compute(ckpt, unit, opts, plain, raw, calib)
            del raw
            if written_prev is not None:
                written_prev.result()  # re-raises a write error (e.g. disk full) here
                stall_point("unit", w.f)  # test hook (shards.py): the shard is half written
            written_prev = writer.submit(_write_unit, w, ckpt, unit, outs, finite)
            if on_unit:
                on_unit(unit)
        if written_prev is not None:
            written_prev.result()
    return w.nbytes, w.sha256


def _write_rest(ckpt: Checkpoint, plan: Plan, out: Path, aux: list[Path], manifest: Manifest,
                qconfig: dict, calib: Calibrator | None) -> dict | None:
    """After the shards: the index, config.json (`qconfig`: its quantization_config), the
    source's other files and the calibration's report, each recorded in the manifest; the
    calibration report (None: none)."""
    weight_map = {t.name: s.file for s in plan.shards for t in s.tensors}
    write_json_atomic(out / INDEX_NAME, {
        "metadata": {"total_size": plan.output_bytes},
        "weight_map": dict(sorted(weight_map.items())),
    })
    config = dict(ckpt.config)
    config["quantization_config"] = qconfig
    config.setdefault("torch_dtype", "bfloat16")
    write_json_atomic(out / "config.json", config)
    for p in aux:
        copy_file_atomic(p, out / p.name)
    names = [p.name for p in aux]
    report = None
    if calib is not None:
        kept = [n for n in (CALIB_REPORT, AWQ_SCALES) if n in manifest.data["files"]]
        if CALIB_REPORT in kept and all(manifest.holds(n) for n in kept):
            names += kept  # a finished conversion run again: its report needs no layer rerun
            report = json.loads((out / CALIB_REPORT).read_text())
        else:
            names += calib.write_outputs(out)  # calibration-report.json, AWQ scales
            report = json.loads((out / CALIB_REPORT).read_text())
    for name in [INDEX_NAME, "config.json", *names]:
        manifest.data["files"][name] = {"bytes": (out / name).stat().st_size,
                                        "sha256": sha256_file(out / name)}
    return report


def _write(ckpt: Checkpoint, plan: Plan, out: Path, previous: dict | None, aux: list[Path],
           opts: ConvertOptions, dev: torch.device, on_unit: Callable[[Unit], None] | None,
           extra: dict, qconfig: dict, calib: Calibrator | None = None,
           base_model: str | None = None, at_once: int = 0,
           early: Readahead | None = None, deleting: Deleting | None = None) -> ConvertResult:
    """Steps 5 and 6 of the recipe, in the prepared and locked output folder (`at_once`: the
    calibration checkpoints the disk has room for; `early`: the source's read-ahead, started
    with every shard to write; `deleting`: the old contents' deletion, waited for before the
    folder is declared complete)."""
    # what a resume must match besides the options: kept shards from other calibration tokens
    # or another device's arithmetic would mix two calibrations in one checkpoint
    calibration = None if calib is None else calib.identity()
    if previous is not None:
        manifest = Manifest.resume(out, ckpt, plan, previous, calibration)
    else:
        manifest = Manifest.start(out, ckpt, plan,
                                  extra if calibration is None else {**extra, "calibration": calibration},
                                  base_model)
    if calib is not None:
        calib.use_state(out / CALIB_STATE, manifest.identity(), at_once or MAX_CHECKPOINTS)

    # With a calibration, its layer thread has the GPU; the tensors it does not produce (copied,
    # BF16-widened, RTN-rounded: exact, the same bytes on either device) are computed on the
    # host, so the writer never waits for the device's queue of calibration work.
    plain = torch.device("cpu") if calib is not None else dev
    # Without a calibration the stream reads every source byte once, in plan order: a thread
    # reads ahead into the page cache (a calibration reads each layer ahead itself)
    # (a resume re-hashes each kept shard: once, here)
    kept = {s.file for s in plan.shards if manifest.holds(s.file)}
    if early is not None and kept:  # (it read shards a resume keeps: started over without them)
        early.close()
        early = None
    ahead = early if early is not None else _source_readahead(ckpt, plan, kept) if calib is None else None
    # and each tensor it has read leaves the page cache, which keeps the pages read ahead (with
    # a source larger than the memory, or a memory cgroup, those were evicted first and read
    # twice: BENCHMARKS.md, "verify reads the output once")
    ckpt.drop_read = calib is None

    def seen(u: Unit) -> None:
        if ahead is not None:
            ahead.consumed(u.source_bytes)
        if on_unit:
            on_unit(u)

    written, skipped = [], []
    try:
        for shard in plan.shards:
            if shard.file in kept:
                skipped.append(shard.file)
                if on_unit:
                    for u in shard.units:
                        on_unit(u)
                continue
            if calib is not None:
                calib.start_shard(shard)  # resumes from a checkpoint; deletes those no longer needed
            nbytes, sha = _write_shard(ckpt, shard, out, opts, plain, calib, seen)
            manifest.record(shard.file, nbytes, sha)
            written.append(shard.file)
    finally:
        if ahead is not None:
            ahead.close()
        ckpt.drop_read = False

    stall_point("finish")
    if deleting is not None:
        deleting.wait()  # (a complete folder holds no TRASH)
    report = _write_rest(ckpt, plan, out, aux, manifest, qconfig, calib)
    manifest.finish(ckpt, tool_version=__version__, tp=plan.tp)  # a resume may serve at another TP
    if calib is not None:
        calib.discard_state()  # complete: the layer checkpoints are no longer needed
    from quantize.publish.readme import write_readme  # local: readme -> verify -> pipeline

    write_readme(out, plan)  # the model card; a report, so not among the manifest's files
    return ConvertResult(out, plan, written, skipped, str(dev), report)
