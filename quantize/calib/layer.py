"""One decoder layer's calibration, the body of the calibration's loop (loop.py runs it
layer after layer on its thread):

    layer   = load_layer(...)                          the source's weights, dequantized (loaded
                                                       ahead: during the previous layer's pass 2)
    pass 1  statistics of the MLP's inputs             passes.LayerPasses, capture.py (Hessians,
                                                       routed tokens, samples)
    round   the MLP's target Linears                   rounding.LayerRounding (AWQ / GPTQ / RTN),
                                                       published by outputs.LayerOutputs
    check   the MLP's output error against RTN's       REGRESSION_MARGIN: stop, or --rtn-fallback
    pass 2  the carried hidden states through the rounded layer (the next layer's inputs)

`Carry` (passes.py) is what goes from one layer to the next (and into a resume checkpoint): the
hidden states in chunks, the DSA top-k, the report's entries, the AWQ scales as applied. With
`--gptaq` it also carries the unrounded model's hidden states (`fp`, and their top-k): pass 1
runs the unrounded layer on them too (their MLP inputs paired with the rounded stream's for the
statistics' D terms, their outputs the next layer's `fp`), and the RTN guard measures both
candidates against the unrounded model's layer output, the target GPTAQ fits.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from quantize.calib.capture import MLPStats
from quantize.calib.decoder import (
    MOE_CLASSES,
    HiddenStates,
    every_key_on,
    free_bytes,
    free_layer,
    load_layer,
    mlp_kind,
    round_in_place,
    run_layer,
)
from quantize.calib.distributed import Dist
from quantize.calib.folds import NormFold, find_norm_fold
from quantize.calib.handoff import LayerResult
from quantize.calib.outputs import LayerOutputs, set_weight
from quantize.calib.passes import Carry, LayerPasses
from quantize.calib.round_layer import (
    LayerRounding,
    LayerWeights,
    Part,
    Sections,
    Target,
    gptq_reserve,
)
from quantize.errors import Problem, QuantizeError
from quantize.options import ConvertOptions
from quantize.plan import Unit
from quantize.rounding.int4 import Int4Weight, quantize_rtn
from quantize.source.checkpoint import Checkpoint, torch_dtype

__all__ = ["PROFILE_ENV", "REGRESSION_MARGIN", "Carry", "LayerRunner", "mlp_targets"]
# a folder: the first calibrated layer runs under torch.profiler, its tables written there
PROFILE_ENV = "QUANTIZE_TORCH_PROFILE"
# A calibrated layer whose MLP output error (chunk 0, against the unrounded layer) exceeds this
# many times round-to-nearest's on the same tokens stops the run (`--rtn-fallback`: that layer is
# rounded to nearest instead). A coarse guard, verify's layer check the finer one: in sample,
# GPTQ and AWQ+GPTQ land below RTN (six tiny families: 0.2-0.95x; Gemma-3-270M: 0.31-0.63x and
# 0.40-1.04x), AWQ alone can land a little above it (Gemma-3-270M layer 5: 1.19x: its search
# bounds each Linear's error, not the layer's); the Gemma3 fold into the wrong norm landed at
# 1.85-7.0x on the real model and 0.5-2.2x on the tiny ones, where GPTQ hides it in sample
# (verify's layer check, on other text, is the finer check: quantize/check/layercheck.py).
REGRESSION_MARGIN = 1.5


class _Clock:
    """Wall-clock laps of a layer's phases (device-synchronized), and on CUDA each phase's peak
    allocated memory, for the report."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.laps, self.peaks, self.t = device, {}, {}, time.perf_counter()

    def lap(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peaks[name] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
            # the layer's peak is the max over phases; the next phase starts from here
            torch.cuda.reset_peak_memory_stats(self.device)
        now = time.perf_counter()
        self.laps[name] = round(now - self.t, 3)
        self.t = now


def _relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def mlp_targets(units: dict[str, Unit], L: int) -> dict[str, Target]:
    """Layer L's MLP Linears, each with whether it is rounded to INT4."""
    prefix = f"model.layers.{L}.mlp."
    return {n: Target(n, u.action == "quantize") for n, u in units.items()
            if n.startswith(prefix) and n.endswith("_proj.weight")}


def check_mlps(skeleton, units: dict[str, Unit]) -> None:
    """Refuse, before any output exists, a layer whose MLP has INT4 targets but a class the
    calibration forward does not mirror (e.g. Qwen3-MoE's or Mixtral's MoE blocks)."""
    problems = [Problem("config.json", f"model.layers.{L}.mlp", type(layer.mlp).__name__,
                        f"an MoE block of {', '.join(MOE_CLASSES)} or a gate/up/down MLP",
                        "use --method rtn for this model")
                for L, layer in enumerate(skeleton.model.layers)
                if mlp_kind(layer.mlp) == "unsupported"
                and any(t.quantize for t in mlp_targets(units, L).values())]
    if problems:
        raise QuantizeError("calibration does not know this MLP", problems[:3])


@contextlib.contextmanager
def torch_profile(L: int, device: torch.device, profiled: set[int]):
    """The first calibrated layer (or layer $QUANTIZE_TORCH_PROFILE_LAYER) under torch.profiler
    when PROFILE_ENV names a folder (its tables written there); nothing otherwise. `profiled`:
    the layers profiled so far (one per run)."""
    pdir = os.environ.get(PROFILE_ENV)
    want = os.environ.get(PROFILE_ENV + "_LAYER")
    if not pdir or profiled or (want is not None and int(want) != L):
        yield
        return
    profiled.add(L)
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        yield
    Path(pdir).mkdir(parents=True, exist_ok=True)
    for key in ("cuda_time_total", "cpu_time_total") if cuda else ("cpu_time_total",):
        (Path(pdir) / f"layer{L}-{key}.txt").write_text(
            prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=70))


class LayerLoader:
    """Decoder layers' weights loaded on a thread of their own, one layer ahead: `ahead(L)`
    starts loading layer L while the current layer finishes (the disk reads, copies to the
    device and dequantization overlap its last forward), `take(L)` returns it, or loads it
    then. Not the MTP layer (L == num_layers: its own skeleton, set up when it starts). The
    loads' kernels share the device's default stream with the layer thread's (no memory
    crosses streams); their host reads release the GIL."""

    def __init__(self, ckpt: Checkpoint, units: dict[str, Unit], device: torch.device,
                 dtype: torch.dtype, num_layers: int) -> None:
        self.ckpt, self.units, self.device, self.dtype = ckpt, units, device, dtype
        self.num_layers = num_layers
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="quantize-load")
        self.pending: tuple[int, Future] | None = None  # (layer, its load)

    def ahead(self, skeleton, L: int) -> None:
        """Start loading decoder layer L of `skeleton`, where the free memory holds twice the
        layer (a small GPU keeps its room for the forward) and no load is pending."""
        if L >= self.num_layers or self.pending is not None:
            return
        p, item = f"model.layers.{L}.", torch.empty(0, dtype=self.dtype).element_size()
        need = sum(math.prod(self.ckpt.tensors[n].shape) * item for n in self.units if n.startswith(p))
        if free_bytes(self.device) < 2 * need:
            return
        dev = self.device

        def load() -> torch.nn.Module:
            if dev.type == "cuda" and dev.index is not None:
                torch.cuda.set_device(dev)  # (the thread's current device: cuda:N)
            with torch.no_grad():
                return load_layer(skeleton, self.ckpt, self.units, L, dev, self.dtype)

        self.pending = (L, self.pool.submit(load))

    def take(self, skeleton, L: int) -> torch.nn.Module:
        """Layer L: the one loaded ahead (its load's error raised here, as a load's would be),
        else loaded now (a layer loaded ahead for another L, after resume jumped, is freed)."""
        if self.pending is not None and self.pending[0] == L:
            fut, self.pending = self.pending[1], None
            return fut.result()
        self.drop()
        return load_layer(skeleton, self.ckpt, self.units, L, self.device, self.dtype)

    def drop(self) -> None:
        """A layer loaded ahead that will not run (a stop, an error, a resume's jump): waited
        for and freed."""
        pending, self.pending = self.pending, None
        if pending is not None:
            with contextlib.suppress(BaseException):  # (its error belongs to a run that is not)
                free_layer(pending[1].result())

    def close(self) -> None:
        self.drop()
        self.pool.shutdown()


class LayerRunner:
    """Runs one decoder layer's calibration on the carried hidden states (`run`). `skeleton` and
    `inputs` are the model the layer comes from and its rotary / masks (the MTP layer swaps in
    its own); `check_stop` raises to leave a layer, `before_overwrite` waits for a checkpoint
    still copying the hidden states, `warm(L)` reads layer L's bytes ahead. The forwards over
    the hidden states are passes.LayerPasses."""

    def __init__(self, ckpt: Checkpoint, units: dict[str, Unit], opts: ConvertOptions,
                 device: torch.device, dtype: torch.dtype, dist: Dist | None, skeleton, inputs,
                 carry: Carry, num_layers: int, log: Callable[[str], None],
                 check_stop: Callable[[], None], before_overwrite: Callable[[], None],
                 warm: Callable[[int], None]) -> None:
        self.ckpt, self.units, self.opts, self.device, self.dtype = ckpt, units, opts, device, dtype
        self.dist, self.skeleton, self.inputs, self.carry = dist, skeleton, inputs, carry
        self.num_layers, self.log = num_layers, log
        self.check_stop, self.before_overwrite, self.warm = check_stop, before_overwrite, warm
        self.report_rows = 0  # several ranks: this rank's chunk-0 rows the errors are taken over
        self.skip = 0  # positions at each window's start left out of the MLP statistics
        self.paces: list[float] = []  # the last layers' seconds, for the time left the log says
        # the rounded weights: into the layer for pass 2, to the host for the writer
        self.outputs = LayerOutputs(device, dist)
        # the next decoder layer's weights, loaded during this layer's pass 2 (`load_ahead`)
        self.loader = LayerLoader(ckpt, units, device, dtype, num_layers)
        self._profiled: set[int] = set()  # (torch_profile: the layers profiled)

    @torch.no_grad()
    def run(self, L: int) -> tuple[dict, LayerResult]:
        """Layer L over the carried hidden states (replaced by its outputs through the rounded
        layer); its report entry and its result for the writer."""
        t0 = time.perf_counter()
        result = self.outputs.start(L)
        every_key = every_key_on()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        layer = self.loader.take(self.skeleton, L)
        t_loaded = time.perf_counter()  # (load_layer ends on a device sync: its finite check)
        self.warm(L + 1)  # the next layer's bytes into the page cache while this one runs
        kind = mlp_kind(layer.mlp)
        targets = mlp_targets(self.units, L)
        active = any(t.quantize for t in targets.values())
        entry: dict = {"layer": L, "mlp": kind, "load_s": round(t_loaded - t0, 3)}
        passes = LayerPasses(L, layer, self.skeleton, self.inputs, self.carry, self.device, self.skip,
                             self.check_stop, self.before_overwrite, self.log)
        if not active:
            self.load_ahead(L + 1)  # (a forward only: little memory of its own)
            passes.forward()
            entry["quantized"] = 0
        else:
            with torch_profile(L, self.device, self._profiled):
                entry.update(self._calibrate(L, layer, kind, targets, passes))
        if every_key and not every_key_on():
            self.log(f"warning: layer {L}: its DSA indexer, which selects every key at this "
                     "sequence length, gave another forward when skipped (run_layer's proof); "
                     "it is computed from here on")
        t_end = time.perf_counter()
        free_layer(layer)
        self.outputs.wait()  # the layer's outputs are all on the host
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            entry["peak_gpu_gib"] = max([round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2),
                                         *entry.get("peak_gpu_gib_by_phase", {}).values()])
        entry["finish_s"] = round(time.perf_counter() - t_end, 3)  # the host copies' tail
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        fb = entry.get("fallback") or []
        pace = self.paces = [*self.paces[-2:], entry["seconds"]]
        left = max(self.num_layers - 1 - L, 0) * sorted(pace)[len(pace) // 2]  # the last 3's median
        self.log(f"layer {L}{' (MTP)' if L >= self.num_layers else ''}: "
                 f"{entry.get('quantized', 0)} Linears {self.opts.method}"
                 + (f", experts {[f['expert'] for f in fb]} below --min-expert-tokens: all-token "
                    "statistics" if fb else "") + f", {entry['seconds']} s"
                 + (f"; {L + 1} of {self.num_layers} decoder layers, ~{left / 60:.1f} min left at "
                    "this pace" if L < self.num_layers else ""))
        return entry, result

    def load_ahead(self, L: int) -> None:
        """Decoder layer L (the next one) loaded meanwhile on the loader's thread (LayerLoader)."""
        self.loader.ahead(self.skeleton, L)

    def close(self) -> None:
        """The threads stopped: queued host copies cancelled, a layer loaded ahead freed."""
        self.outputs.close()
        self.loader.close()

    def _calibrate(self, L: int, layer, kind: str, targets: dict[str, Target],
                   passes: LayerPasses) -> dict:
        o = self.opts
        method = o.method
        mlp = layer.mlp
        E = mlp.experts.num_experts if kind == "moe" else 0
        fold = self._norm_fold(L, layer, targets) if "awq" in method else None
        # the routed Hessians keep the layer's MLP inputs (one more copy of the hidden states)
        # where they fit in a quarter of the free memory; else running sums (bounded size)
        kept = self._inputs_nbytes()
        stats = MLPStats(kind, hessians="gptq" in method, samples="awq" in method,
                         all_experts=o.expert_calibration == "all", num_experts=E,
                         router_weighted=o.expert_calibration == "routed-weighted",
                         cover=o.expert_coverage if kind == "moe" else 0,
                         store_tokens=not self.carry.spilled and not HiddenStates.should_spill(2 * kept, self.device))
        clock = _Clock(self.device)
        ref0, h0, fp0 = passes.pass1(kind, stats, self._keep_mlp_inputs)
        # the errors below: each candidate's layer output (its change to the residual stream)
        # against the unrounded layer's on the same inputs, or with --gptaq against the
        # unrounded model's (fp0: its output and input on chunk 0), the target GPTAQ fits
        want = (ref0 - h0) if fp0 is None else (fp0[0] - fp0[1])
        clock.lap("pass1_forward_statistics")
        stats.all_reduce(self.dist, self.device)  # several ranks: counts and shared statistics summed
        if kind == "moe":  # --expert-coverage: before round_in_place (the unrounded experts)
            stats.top_up(mlp.experts, self.dist)
        quant = [n for n, t in targets.items() if t.quantize]
        # what round-to-nearest would give on chunk 0 (the module's targets rounded in place:
        # the rounding below reads the source from the checkpoint and overwrites every one)
        round_in_place(layer, L, quant, o.group_size, o.symmetric)
        rtn_err = self._err(passes.chunk0_output() - h0, want)
        clock.lap("rtn_reference")

        rounding = LayerRounding(L, mlp, kind, targets, stats, self.ckpt, self.units, o,
                                 self.device, self.dtype, self.dist, self.check_stop, fold,
                                 # (this module's clock, read when called: as _Clock's)
                                 Sections(self.device, lambda: time.perf_counter()),
                                 mlp_inputs=passes.mlp_inputs)
        nq = 0

        def done(n: str, w: Int4Weight) -> None:
            nonlocal nq
            nq += 1
            self.outputs.emit(layer, L, n, w)

        def done_rows(w: Int4Weight, parts: list[Part]) -> None:
            nonlocal nq
            nq += len(parts)
            self.outputs.emit_rows(layer, L, w, parts)

        report = rounding.run(done, clock.lap, done_rows)
        if kind == "moe" and stats.routed_hessians:  # how the routed gate/up Hessians got their inputs
            report["routed_inputs"] = "running sums" if not stats.store_tokens else \
                "recomputed" if stats.x_of is not None else "kept"
        stats.x_store.clear()  # (the kept MLP inputs: free before pass 2)
        mods = rounding.mods
        for n, t in mods.items():  # the BF16 tensors AWQ rescaled, as they will be written
            t = t.to(torch_dtype(self.units[n].outputs[0].dtype))
            self.outputs.results.rescaled[n] = t.cpu()
            set_weight(layer, L, n, t.float())
        clock.lap("rounding")
        self.load_ahead(L + 1)  # past the rounding's peak: the next layer's weights meanwhile

        # ---- the calibrated layer against round-to-nearest, on chunk 0 (in sample)
        err = self._err(passes.chunk0_output() - h0, want)
        report["check"] = {"chunk0_rel_error": err, "rtn_rel_error": rtn_err,
                           "margin": REGRESSION_MARGIN}
        if self._worse_than_rtn(L, err, rtn_err):
            self._fall_back_to_rtn(L, layer, quant, mods)
            mods = {}
            report["rtn_fallback"] = {"method": method, "rel_error": err, "rtn_rel_error": rtn_err}
            report.pop("awq", None)
        else:
            self.carry.awq_scales.update(rounding.awq_scales)

        # ---- pass 2: the next layer's inputs through the quantized layer
        out0 = passes.pass2()
        report["output_rel_error"] = self._err(out0 - h0, want)
        D_in = stats.D_in
        if D_in is not None:  # how far the streams had drifted, relative to H
            report["gptaq"] = {"fraction": o.gptaq, "tokens": stats.n_asym,
                               "D_in_rel": float(D_in.norm() / stats.H_in.norm().clamp(min=1e-30)),
                               "D_down_rel": float(stats.D_down.norm() / stats.H_down.norm().clamp(min=1e-30))}
        report["attention_once"] = passes.halves is not None
        clock.lap("pass2_forward")
        report["timing_s"] = clock.laps
        if clock.peaks:
            report["peak_gpu_gib_by_phase"] = clock.peaks
        report["quantized"] = nq
        report["modified_bf16"] = sorted(mods)
        return report

    def _worse_than_rtn(self, L: int, err: float, rtn_err: float) -> bool:
        """Whether the calibrated layer's error exceeds REGRESSION_MARGIN times round-to-nearest's
        (the same answer on every rank): without --rtn-fallback that stops the run, with it the
        caller rounds the layer to nearest instead (said in the log)."""
        o = self.opts
        worse = err > REGRESSION_MARGIN * rtn_err + 1e-12
        if self.dist is not None:  # every rank takes the same branch (collectives follow)
            worse = bool(self.dist.all_reduce(torch.tensor([int(worse)])).item())
        if worse:
            where = f"layer {L}{' (MTP)' if L >= self.num_layers else ''}"
            if not o.rtn_fallback:
                raise QuantizeError(
                    f"{where}: --method {o.method} made the MLP's output worse than round-to-nearest "
                    f"(relative error {err:.4g}, RTN's {rtn_err:.4g} on the same tokens, margin "
                    f"{REGRESSION_MARGIN}x); stopped. Fix: pass --rtn-fallback to round such layers "
                    "to nearest (the report and the card list them), or use --method gptq / rtn")
            self.log(f"warning: {where}: {o.method} error {err:.4g} > {REGRESSION_MARGIN} x RTN's "
                     f"{rtn_err:.4g}: rounded to nearest instead (--rtn-fallback)")
        return worse

    def _err(self, a: torch.Tensor, b: torch.Tensor) -> float:
        """||a - b|| / ||b|| over chunk 0 (rows: samples). Under torchrun over the samples one
        process's first chunk holds, each rank's share of them summed, so the report's
        per-layer errors measure the same tokens at every world size (one process: chunk 0,
        as `_relerr`)."""
        if self.dist is None:
            return _relerr(a, b)
        r = max(0, min(a.shape[0], self.report_rows))
        d, ref = a[:r].float() - b[:r].float(), b[:r].float()
        sums = self.dist.all_reduce(torch.stack([d.pow(2).sum(), ref.pow(2).sum()]).double())
        return float(sums[0].sqrt() / sums[1].sqrt().clamp(min=1e-30))

    def _fall_back_to_rtn(self, L: int, layer, quant: list[str], mods: dict) -> None:
        """The layer rounded to nearest from the source instead (`--rtn-fallback`): every target
        re-emitted, every tensor AWQ rescaled back to the source's value (and not written:
        the plain path copies it), the layer's AWQ scales dropped."""
        W = LayerWeights(self.ckpt, self.units, self.device)
        for n in quant:
            self.outputs.emit(layer, L, n, quantize_rtn(W.source(n), self.opts.group_size,
                                                        self.opts.symmetric))
        for n in mods:
            self.outputs.results.rescaled.pop(n, None)
            set_weight(layer, L, n, W.source(n))

    def _norm_fold(self, L: int, layer, targets: dict[str, Target]) -> NormFold | None:
        """Where this layer's AWQ input scale goes (folds.find_norm_fold, proven on the layer
        with one sample of chunk 0), when AWQ rounds a gate/up target; else None. The probe is
        one plain forward (`every_key=False`): where a DSA top-k holds every key (GLM-5.2's
        2048 at 2,048-token windows) run_layer's first forward runs the layer twice as its
        proof, and the probe would count the norm's two calls."""
        if not any(t.quantize and n.endswith(("gate_proj.weight", "up_proj.weight"))
                   for n, t in targets.items()):
            return None
        h = self.carry.hidden.on_device(0)[:1]
        topk = None if self.carry.topk[0] is None else self.carry.topk[0][:1]
        return find_norm_fold(layer, lambda: run_layer(self.skeleton, layer, self.inputs, h, topk,
                                                       every_key=False),
                              L, self.ckpt.model_type)

    def _keep_mlp_inputs(self, experts: torch.nn.Module) -> bool:
        """Whether the routed Hessians keep the layer's MLP inputs from pass 1 (one more copy
        of the hidden states: GLM-5.2 at 512 x 2048, 12.9 GB) instead of recomputing them from
        the hidden states for every GPTQ batch (the layer's norm per chunk: ~1.5 s per MoE
        layer on an H200, benchmarks/h200_profile_routed_hessians.json): where they fit
        beside what full GPTQ batches want (`gptq_reserve`), so keeping them never shrinks
        a batch."""
        nbytes = self._inputs_nbytes()
        if not nbytes:
            return False
        E, two_i, K = experts.gate_up_proj.shape
        return free_bytes(self.device) - nbytes >= gptq_reserve((two_i // 2, K), E)

    def _inputs_nbytes(self) -> int:
        """Bytes of one copy of the layer's MLP inputs (the hidden states' size); 0 when the
        hidden states are spilled off the device (no copy of them is kept there)."""
        h = self.carry.hidden
        return 0 if self.carry.spilled else sum(h.get(i).numel() for i in range(len(h))) * self.dtype.itemsize
