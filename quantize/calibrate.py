"""Calibrated rounding (GPTQ, AWQ, AWQ+GPTQ), layer by layer, memory bounded by one layer.

    tokens  = load_calibration(...)                      (num_samples, seq_len) int64
    h       = embed_tokens[tokens]                       (num_samples, seq_len, H), in chunks
    for L in 0 .. num_hidden_layers - 1:                 on the layer thread, one layer ahead
        layer = layers.load_layer(...)                   of the shard writer (pipeline.py)
        pass 1: run it over h with the MLP replaced by capture.moe_forward / dense_forward,
                which compute the same output and feed `MLPStats` (Hessians, routed token
                counts, activation samples)
        quantize the layer's target Linears (batched over experts), AWQ scales folded exactly
        pass 2: h = layer(h) with the quantized weights (what the engines will compute)
        publish the layer's INT4 outputs to the writer; checkpoint h (calib_state.py)

The modules: `layers.py` builds and runs a decoder layer (transformers' own classes) and holds
the activations between layers; `capture.py` is the MLP's calibration forward and its
statistics; `rounding.py` rounds one layer's MLP from them (which weights, which Hessians, what
batches), `gptq.py` / `awq.py` being the rounding as pure functions; this module drives the
layers (`Calibrator`: the layer thread, the two passes, handing results to the writer) and
writes the report; `calib_state.py` keeps the checkpoints for resume; `distributed.py` the
ranks under torchrun.

The rounding of a layer's MLP from its statistics (AWQ folds, GPTQ batched over experts and
across ranks, RTN; the starved-expert fallback) is `rounding.LayerRounding`. GLM-5.2 worked
number, routed statistics at 512 x 2048 tokens: hidden states 12.9 GB (bf16) + DSA top-k 4.3 GB
(int16), down Hessians 4.3 GB, the layer's BF16 experts 19.3 GB, a batch of 32 solves ~16 GB;
256 gate/up Hessians held at once would be 6144^2 float32 x 256 = 38.6 GB, hence batches whose
routed gate/up Hessians are built from the layer's MLP inputs, recomputed per batch from the
hidden states (a norm of the residual stream after the attention, which pass 1 leaves there).

Passes: a layer's attention runs once (`SplitLayer`, proved bit for bit on chunk 0 of every
layer, else whole-layer forwards): pass 1 computes h1 = h + attention(h) per chunk, replaces the
chunk by it and runs the MLP's statistics forward on groups of chunks (MLP_GROUP_TOKENS, no
outputs); pass 2 runs only the MLP half, through the rounded weights, from h1.

The MTP layer (index num_hidden_layers, dropped by transformers on load) is run too, on its
real inputs: eh_proj([enorm(embed(token i+1)), hnorm(h_i)]) from the last layer's outputs h,
through the same decoder-layer class built for that index. Further MTP layers, or one whose
eh_proj / norms are missing, are rounded to nearest and the report says so.

Resume: given the output folder (`use_state`), the state after a layer a resume can start from
is checkpointed there in the background, at most every `checkpoint_interval` seconds
(quantize/calib_state.py), and `start_shard` jumps to the newest usable checkpoint before the
layers a shard needs, so a resumed run recomputes at most the layers since that checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from quantize import SCHEMA_VERSION
from quantize.calib_data import CalibrationSet, load_calibration
from quantize.calib_state import Checkpointer, StateDir
from quantize.capture import MLPStats, dense_forward, moe_forward
from quantize.checkpoint import Checkpoint, torch_dtype
from quantize.distributed import Dist
from quantize.errors import Problem, QuantizeError
from quantize.folds import FOLD_KEY, NormFold, find_norm_fold, fold_tensor
from quantize.handoff import Handoff, LayerFeed, LayerResult
from quantize.int4 import Int4Weight, dequantize, int4_outputs, quantize_rtn
from quantize.layers import (
    MOE_CLASSES,
    HiddenStates,
    SplitLayer,
    build_skeleton,
    chunk_tokens,
    embed,
    free_layer,
    layer_inputs,
    layer_weight,
    limit_gpu_memory,
    load_layer,
    mlp_group_tokens,
    mlp_kind,
    mlp_target,
    round_in_place,
    run_layer,
)
from quantize.layout import layer_of
from quantize.names import AWQ_SCALES, CALIB_REPORT, CALIB_TIMINGS, ROUTED_PICTURE
from quantize.options import ConvertOptions
from quantize.plan import Plan, Shard, Unit
from quantize.rounding import LayerRounding, LayerWeights, Target, awq_expected
from quantize.staging import to_host

__all__ = ["AWQ_SCALES", "CALIB_REPORT", "Calibrator", "LayerWeights", "Target", "awq_expected"]
# a folder: the first calibrated layer runs under torch.profiler, its tables written there
PROFILE_ENV = "QUANTIZE_TORCH_PROFILE"
# Per layer: wall-clock seconds and peak GPU memory (CALIB_TIMINGS, a report beside the output,
# like verify.json: not in the manifest, so that the same inputs give the same checksummed bytes)
TIMING_KEYS = ("seconds", "timing_s", "peak_gpu_gib", "peak_gpu_gib_by_phase")
# The AWQ scales as applied (AWQ_SCALES), for `verify` (a subfolder: engines never load it):
#   model.layers.L.mlp.awq_input_scale (H,): the MLP input's norm output is divided by it (the
#       norm and its formula beside it as model.layers.L.mlp.awq_norm_fold: folds.NormFold,
#       e.g. written norm = norm / s, or (1 + norm) / s - 1 for Gemma's), and every reader of
#       it (experts' and shared gate/up, dense gate/up, router) has written = source * s along
#       its input columns;
#   <...>.down_proj.awq_input_scale (I,): written down_proj = source * s (columns) and the same
#       expert's / MLP's up_proj = source / s (rows).
# A calibrated layer whose MLP output error (chunk 0, against the unrounded layer) exceeds this
# many times round-to-nearest's on the same tokens stops the run (`--rtn-fallback`: that layer is
# rounded to nearest instead). A coarse guard, verify's layer check the finer one: in sample,
# GPTQ and AWQ+GPTQ land below RTN (six tiny families: 0.2-0.95x; Gemma-3-270M: 0.31-0.63x and
# 0.40-1.04x), AWQ alone can land a little above it (Gemma-3-270M layer 5: 1.19x: its search
# bounds each Linear's error, not the layer's); the Gemma3 fold into the wrong norm landed at
# 1.85-7.0x on the real model and 0.5-2.2x on the tiny ones, where GPTQ hides it in sample
# (verify's layer check, on other text, is the finer check: quantize/layercheck.py).
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


class _Stopped(Exception):
    """`Calibrator.close()` was called while a layer ran: the layer thread leaves it."""


class Calibrator:
    """Runs the layers in order on its own thread (`_run_layers`, the loop) and hands each
    layer's result to the writer as a value (quantize/handoff.py); `result(unit)` is the
    writer's side: a target unit's calibrated INT4 outputs, an AWQ-folded unit's rescaled
    tensor, or None (the plain path applies).

    The layer thread runs one layer ahead of the writer: while the shard writer writes layer
    L's results, layer L+1 is computed (and layer L+2's source bytes are read into the page
    cache); it starts layer L+2 only once the writer took layer L+1, so at most two layers'
    results are held. Layer index num_layers is the MTP layer; `last_layer` is the last one run
    (the MTP layer when the plan has one). With `use_state`, the state after layer L is
    checkpointed in the background (calib_state.Checkpointer) when a shard's first layer is
    L+1 (where a resume can start) and `checkpoint_interval` seconds have passed since the last
    one, and after `last_layer`. `close()` stops the thread (always call it, e.g. `with`)."""

    def __init__(self, ckpt: Checkpoint, plan: Plan, opts: ConvertOptions, device: torch.device,
                 log: Callable[[str], None] | None = None, calib: CalibrationSet | None = None,
                 checkpoint_interval: float = 300.0, dist: Dist | None = None,
                 max_gpu_memory: int | None = None) -> None:
        """`calib`: token ids to use instead of loading `opts.calib` (benchmarks);
        `checkpoint_interval`: seconds between resume checkpoints at least (0: every layer a
        resume can start after); `dist`: this rank of several (quantize/distributed.py): its
        share of the samples, the experts it owns; `max_gpu_memory`: bytes this process may
        hold on its GPU (`layers.limit_gpu_memory`; None: all of it)."""
        self.ckpt, self.plan, self.opts, self.device = ckpt, plan, opts, device
        if max_gpu_memory is not None and device.type == "cuda":
            limit_gpu_memory(device, max_gpu_memory)
        self.dist = dist
        if dist is not None and "awq" in opts.method:
            raise QuantizeError("AWQ runs in one process", [Problem(
                "--method", None, f"{opts.method} under torchrun ({dist.world} processes)",
                "gptq or rtn with several processes",
                "run AWQ methods without torchrun, or use --method gptq")])
        if dist is not None and opts.num_samples < dist.world:
            raise QuantizeError("fewer calibration samples than processes", [Problem(
                "--num-samples", None, str(opts.num_samples), f"at least {dist.world}, one per rank",
                f"pass --num-samples {dist.world} or more")])
        self.log = log or (lambda msg: None)
        self.units = {u.source: u for u in plan.units}
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        limit = ckpt.config.get("max_position_embeddings")
        if calib is None and limit and opts.seq_len > limit:
            raise QuantizeError("calibration sequences longer than the model's context", [Problem(
                "config.json", None, f"--seq-len {opts.seq_len}",
                f"at most max_position_embeddings {limit}", f"pass --seq-len {min(limit, 2048)}")])
        self.skeleton = build_skeleton(ckpt.config)  # the config first: it names the problem
        self.num_layers = len(self.skeleton.model.layers)
        self._check_mlps()
        self.calib = calib or self._load_calibration()
        c = self.calib
        # this rank's samples (all of them in one process)
        self.tokens = c.tokens if dist is None else c.tokens[dist.samples(c.tokens.shape[0])]
        if c.overlapping:
            n, L = c.tokens.shape
            self.log(f"warning: {Path(c.source).name} holds {c.stream_tokens:,} tokens, fewer than "
                     f"--num-samples {n} x --seq-len {L} = {n * L:,}: the windows overlap, so some "
                     "text is counted more than once; add data or lower --num-samples")
        self.inputs = layer_inputs(self.skeleton, self.calib.tokens.shape[1], device, self.dtype)
        self.next_layer = 0
        self.last_layer = max((min(L, self.num_layers) for u in plan.units
                               if (L := layer_of(u.source)) is not None), default=-1)
        # the MTP layer's own skeleton, built now: a config it cannot take fails before output
        self._mtp_skeleton = build_skeleton(self._mtp_config(self.num_layers)) \
            if self.last_layer == self.num_layers and self._mtp_runnable(self.num_layers) else None
        # after these layers a resume can start: a shard's first layer, minus one
        self._save_after = {L - 1 for s in plan.shards if (L := self._first_layer(s)) is not None}
        self._save_after.add(self.last_layer)
        self.state: StateDir | None = None
        self._saver: Checkpointer | None = None
        self._jump_to = -1  # several ranks: the layer rank 0's writer may resume after
        self.checkpoint_interval = checkpoint_interval
        self._keep_after = -1  # the last layer a resume can start after (older: deletable)
        # the layer in progress's results (layer thread), handed to the writer as a value when
        # the layer is done: `feed` is the writer's side (quantize/handoff.py)
        self.results = LayerResult(-1)
        self._handoff = Handoff()
        self.feed = LayerFeed(self._handoff, self._start_runner)
        self._runner: threading.Thread | None = None
        self._failed: BaseException | None = None  # what stopped the layer thread
        self._stop = False
        self._host = ThreadPoolExecutor(1, thread_name_prefix="quantize-d2h")
        self._prefetch = ThreadPoolExecutor(1, thread_name_prefix="quantize-prefetch")
        self._layer_sources: dict[int, list[str]] = {}  # source tensors (+ scales) per layer
        for u in plan.units:
            if (L := layer_of(u.source)) is not None:
                self._layer_sources.setdefault(min(L, self.num_layers), []).extend(
                    [u.source] + ([u.scale] if u.scale else []))
        self._profiled = False
        self.layers: list[dict] = []
        self._mtp_skip: dict[int, str] = {}  # MTP layers not calibrated, and why
        self.awq_scales: dict[str, torch.Tensor] = {}  # AWQ_SCALES, float32 on the host
        self.hidden: HiddenStates | None = None
        self.topk: list[torch.Tensor | None] = []

    def write_outputs(self, out: Path) -> list[str]:
        """Write CALIB_REPORT (and AWQ_SCALES when AWQ ran) into `out`; their names. Layers no
        written shard needed (a resume that kept the last shards) are run, or loaded, first."""
        from safetensors.torch import save

        from quantize.shards import write_bytes_atomic, write_failed, write_json_atomic

        self._keep_after = self.last_layer
        if self._runner is None:  # a resume whose every shard was kept: the last checkpoint
            if self.dist is None:
                self._jump(self.last_layer)
            else:
                self._jump_to = self.last_layer
        self.feed.finish()  # every layer run (a resume that kept the last shards runs them now)
        self._join_runner()  # (its checkpoint after the last layer comes after handing it over)
        if self._saver is not None:
            self._saver.wait()
        # the report in the manifest holds what the same inputs always give; the wall-clock
        # times and memory peaks go beside it, into a report that is not checksummed (last)
        full = self.report()
        write_json_atomic(out / CALIB_REPORT, {"schema_version": SCHEMA_VERSION, **full, "layers": [
            {k: v for k, v in lay.items() if k not in TIMING_KEYS} for lay in full["layers"]]})
        names = [CALIB_REPORT]
        try:
            (out / AWQ_SCALES).parent.mkdir(exist_ok=True)  # (calibration/, also the timings')
        except OSError as e:
            raise write_failed((out / AWQ_SCALES).parent, e) from None
        if "awq" in self.opts.method:  # (no scales at all when every layer fell back to RTN)
            # serialized in memory (a few floats per channel), written like every other output:
            # atomically, and a full disk is the same clean error
            # each MLP input scale's norm fold (folds.NormFold), so verify re-applies the same:
            # as tensors beside it (safetensors' metadata is a map written in no fixed order;
            # these bytes must be the same for the same inputs)
            folds = {f"model.layers.{lay['layer']}.mlp.{FOLD_KEY}": fold_tensor(NormFold(
                f["norm"], f["formula"], f["bias"])) for lay in self.layers
                if (f := (lay.get("awq") or {}).get("norm_fold"))}
            write_bytes_atomic(out / AWQ_SCALES, save({**self.awq_scales, **folds},
                                                      metadata={"format": "pt"}))
            names.append(AWQ_SCALES)
        from quantize import plots

        plots.routed_tokens(full, out / ROUTED_PICTURE)  # (a report, not
        # checksummed: None without matplotlib)
        write_json_atomic(out / CALIB_TIMINGS, {"schema_version": SCHEMA_VERSION, "layers": [
            {k: lay[k] for k in ("layer", *TIMING_KEYS) if k in lay} for lay in full["layers"]]})
        return names

    def _load_calibration(self) -> CalibrationSet:
        from transformers import AutoTokenizer

        o, root = self.opts, str(self.ckpt.root)
        # trust_remote_code=False: a tokenizer_config.json `auto_map` naming the checkpoint's own
        # code is refused (ValueError), never imported; unset, transformers would ask on stdin
        try:
            tok = AutoTokenizer.from_pretrained(root, trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise QuantizeError("calibration needs the checkpoint's tokenizer", [Problem(
                root, None, f"no loadable tokenizer ({e.__class__.__name__})",
                "tokenizer.json / tokenizer_config.json next to config.json, with a tokenizer "
                "class of transformers (a tokenizer's own code is never run)",
                "copy the tokenizer files from the model release, or use --method rtn")]) from None
        return load_calibration(o.calib, tok, o.num_samples, o.seq_len, o.seed)

    # -- the writer's side: pipeline.compute_unit --------------------------------------------

    def provides(self, unit: Unit) -> bool:
        """Whether `result(unit)` is certainly not None (the writer need not read the unit's
        source): a quantized Linear of a calibrated layer. AWQ-rescaled BF16 tensors are
        known only once their layer ran."""
        L = layer_of(unit.source)
        return unit.action == "quantize" and L is not None and L < self.num_layers and \
            mlp_target(unit.source)

    def result(self, unit: Unit) -> list[torch.Tensor] | None:
        """The tensors to write for `unit` from its layer's result (taken from the layer thread
        in layer order); None: the plain path applies."""
        L = layer_of(unit.source)
        if L is None:
            return None
        # further MTP layers: rounded to nearest after the first
        return self.feed.layer(min(L, self.num_layers)).outputs(unit.source)

    def run_all(self) -> None:
        """Run every layer (a rank other than 0: its share of the calibration, nothing written)."""
        self.feed.finish()
        self._join_runner()

    def _join_runner(self) -> None:
        """Until the layer thread has finished its last layer's checkpoint and exited (its
        collectives done too); re-raises its error."""
        if self._runner is not None:
            self._runner.join()
        if self._failed is not None:
            raise self._failed

    def _start_runner(self) -> None:
        if self._runner is None:
            self._runner = threading.Thread(target=self._run_layers, daemon=True,
                                            name="quantize-calibrate")
            self._runner.start()

    def _run_layers(self) -> None:
        """The layer thread, the loop of the calibration: each layer run (load -> capture ->
        round -> propagate), its result handed to the writer, a checkpoint where one is due;
        the next layer starts once the writer took this one. Ends with `None` handed over
        (or the error that stopped it)."""
        try:
            if self.device.type == "cuda" and self.device.index is not None:
                torch.cuda.set_device(self.device)  # (the thread's current device: cuda:N)
            if self.dist is not None and self.state is not None:
                self._jump_together()
            while self.next_layer <= self.last_layer:
                self._check_stop()
                M = self.next_layer
                self._handoff.offer(self._run_layer(M))
                self._checkpoint(M)
                self._handoff.wait_taken()
            self._handoff.offer(None)  # the end
        except _Stopped:
            return
        except BaseException as e:  # noqa: BLE001 - re-raised on the writer's thread
            self._failed = e
            self._handoff.offer(e)

    def close(self) -> None:
        """Stop the layer thread (it leaves the layer in progress at its next forward chunk or
        GPTQ batch: within a second or so, also after Ctrl-C) and wait for a checkpoint being
        written (errors are dropped: this runs while another error propagates, or after
        `write_outputs`, which raised them)."""
        self._stop = True
        while self._runner is not None and self._runner.is_alive():
            self._handoff.release()  # a result the writer will not take
            self._runner.join(timeout=0.05)
        if self._saver is not None:
            with contextlib.suppress(BaseException):
                self._saver.wait()
        self._host.shutdown(cancel_futures=True)
        self._prefetch.shutdown(cancel_futures=True)

    def _check_stop(self) -> None:
        """Leave the layer in progress when `close()` was called (layer thread)."""
        if self._stop:
            raise _Stopped

    def __enter__(self) -> Calibrator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def report(self) -> dict:
        o = self.opts
        return {"method": o.method, "expert_calibration": o.expert_calibration,
                "min_expert_tokens": o.min_expert_tokens, "percdamp": o.percdamp,
                "mse_clip": o.mse_clip,
                "group_size": o.group_size, "calibration": self.calib.summary(),
                "device": str(self.device), "compute_dtype": str(self.dtype).replace("torch.", ""),
                "layers": self.layers + self._rtn_mtp()}

    # -- checkpoints for resume (quantize/calib_state.py) -------------------------------------

    def identity(self) -> dict:
        """What a resumed run must share with the one it continues, beyond the options (the
        manifest records it, `Manifest.resume` compares it): the calibration tokens (the --calib
        file, seed, sizes and tokenizer all end up in them) and the compute device type and
        dtype (bf16 on CUDA, float32 on the CPU: other Hessians, other rounding)."""
        ident = {"tokens_sha256": hashlib.sha256(self.calib.tokens.numpy().tobytes()).hexdigest(),
                 "device": self.device.type, "compute_dtype": str(self.dtype).replace("torch.", "")}
        if self.dist is not None:  # sums in another order: other float rounding, other integers
            ident["processes"] = self.dist.world
        return ident

    def use_state(self, root: Path, run: dict) -> None:
        """Checkpoint into `root` (DST/CALIB_STATE), and resume from there. `run`: what the
        manifest requires to resume (options, source, tool version, and `identity()` as its
        "calibration"); the library versions are added to the fingerprint."""
        import transformers

        d = self.dist
        if d is not None:  # every rank checkpoints its own samples, in its own folder
            run = d.broadcast_object(run if d.leader else None)  # (rank 0 holds the manifest)
            root = root / f"rank-{d.rank}-of-{d.world}"
        fp = {"run": run, "torch": torch.__version__, "transformers": transformers.__version__}
        if d is not None:
            fp["rank"] = [d.rank, d.world]
        self.state = StateDir(root, hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest())
        self._saver = Checkpointer(self.state, self.checkpoint_interval, lambda: self._keep_after)

    def start_shard(self, shard: Shard) -> None:
        """Called before `shard` is written, every shard before it recorded in the manifest:
        continue from the newest usable checkpoint before the shard's first layer when that is
        ahead of where the calibration stands, and delete checkpoints no resume can need."""
        L = self._first_layer(shard)
        if L is None or self.state is None:
            return
        self._keep_after = L - 1
        if self._runner is None:  # (once running, the layer thread is ahead of every shard)
            if self.dist is None:
                self._jump(L - 1)
            else:  # every rank must start from the same layer: agreed on the layer thread
                self._jump_to = L - 1
        self.state.prune(self._keep_after)

    def discard_state(self) -> None:
        """Delete the checkpoints: the conversion is complete (several ranks: once every rank
        has written its last one, rank 0 deletes them all)."""
        if self.state is None:
            return
        self._saver.wait()
        if self.dist is None:
            self.state.remove()
            return
        self.dist.barrier()  # (the other ranks wait here in `finish_rank`)
        if self.dist.leader:
            self.state.remove(siblings=True)

    def finish_rank(self) -> None:
        """A rank other than 0, its layers done: its last checkpoint written, then wait for
        rank 0 to finish the output (`discard_state`)."""
        if self.state is not None:
            self._saver.wait()
            self.dist.barrier()

    def _first_layer(self, shard: Shard) -> int | None:
        return next((min(L, self.num_layers) for u in shard.units
                     if (L := layer_of(u.source)) is not None), None)

    def _jump(self, upto: int) -> None:
        """Load the newest usable checkpoint after a layer in [next_layer, upto], if any."""
        if self.state is None:
            return
        for c in reversed([c for c in self.state.layers() if self.next_layer <= c <= upto]):
            why = self.state.problem(c)
            if why is not None:
                self.log(f"ignoring calibration checkpoint {self.state.path(c)}: {why}")
                continue
            self._load(c)
            self.log(f"resuming calibration at layer {c + 1} from {self.state.path(c)}")
            return
        if self.next_layer == 0 and upto >= 0:  # a resumed run with nothing to start from
            self.log(f"no usable calibration checkpoint before layer {upto + 1}: "
                     "computing from layer 0")

    def _jump_together(self) -> None:
        """Several ranks: rank 0 says up to which layer a resume may jump (the writer's first
        unfinished shard), every rank says which of its checkpoints up to there are usable,
        and all load the newest layer every rank has (or none: from layer 0)."""
        d = self.dist
        upto = d.broadcast_object(self._jump_to if d.leader else None)
        usable = [c for c in self.state.layers() if self.next_layer <= c <= upto
                  and self.state.problem(c) is None]
        everyone = d.all_gather_object(usable)
        common = set(everyone[0]).intersection(*everyone[1:])
        if common:
            c = max(common)
            self._load(c)
            self.log(f"resuming calibration at layer {c + 1} from {self.state.path(c)} "
                     f"(and the other ranks' checkpoints of that layer)")
        elif upto >= 0:
            self.log(f"no calibration checkpoint before layer {upto + 1} that every rank has: "
                     "computing from layer 0")

    def _load(self, c: int) -> None:
        saved = self.state.read(c)
        self.layers, self._mtp_skip = saved.entries, saved.mtp_skip
        self.awq_scales = saved.awq_scales
        self.next_layer = c + 1  # (no shard needs the results of the layers up to c)
        self.hidden, self.topk = None, []
        if saved.chunks:
            h, _ = saved.chunk(0)
            where = HiddenStates.placement(h.nbytes * saved.chunks, self.device)  # as _embed
            self.hidden, self.spilled = HiddenStates([], self.device, where), where != "device"
            for i in range(saved.chunks):
                h, topk = saved.chunk(i)
                self.hidden.append(h)
                self.topk.append(None if topk is None else topk.to(self.device))

    def _save(self, L: int) -> None:
        last = L == self.last_layer  # nothing left to run: no hidden states
        n = 0 if last else len(self.hidden)
        # hidden states spilled to files are overwritten by the next layer: written first
        background = not last and not self.hidden.on_disk
        self._saver.save(L, [self.hidden.get(i) for i in range(n)], self.topk[:n], self.layers,
                         self._mtp_skip, self.awq_scales, background=background)

    def _run_layer(self, M: int) -> LayerResult:
        """Layer M run (the MTP layer when M == num_layers); its result (layer thread)."""
        self.results = LayerResult(M)
        if M < self.num_layers:
            self._run(M)
        else:
            self._run_mtp(M)
        self.next_layer += 1
        return self.results

    def _checkpoint(self, M: int) -> None:
        """The state after layer M saved, where a resume can start and one is due."""
        if self.state is not None and M in self._save_after:
            save = M == self.last_layer or self._saver.due()
            if self.dist is not None:  # rank 0's clock and writer decide for every rank
                save, self._keep_after = self.dist.broadcast_object(
                    (save, self._keep_after) if self.dist.leader else None)
            if save:
                self._save(M)

    def _before_overwrite(self) -> None:
        """Before the hidden states are replaced: a checkpoint in flight has its host copy."""
        if self._saver is not None:
            self._saver.wait_copied()

    def _warm(self, L: int) -> None:
        """Read layer L's source tensors into the page cache on the prefetch thread."""
        names = self._layer_sources.get(L)
        if names and not self._stop:
            self._prefetch.submit(self.ckpt.prefetch, names, stop=lambda: self._stop)

    def _rtn_mtp(self) -> list[dict]:
        """Report entries of MTP layers rounded to nearest: their quantized units that got no
        calibrated result (from the plan, so a resumed run reports the same)."""
        ran = {e["layer"] for e in self.layers}
        out: dict[int, dict] = {}
        for u in self.plan.units:
            L = layer_of(u.source)
            if L is None or L < self.num_layers or u.action != "quantize":
                continue
            p = f"model.layers.{L}.mlp."
            if L in ran and u.source.startswith(p) and u.source.endswith("_proj.weight"):
                continue  # calibrated (`_targets` of the MTP layer)
            entry = out.setdefault(L, {"layer": L, "mtp": True, "method": "rtn", "modules": 0,
                                       "reason": self._mtp_skip.get(L, "only the first MTP layer is run")})
            entry["modules"] += 1
        return list(out.values())

    # -- internals -----------------------------------------------------------------------------

    def _embed(self) -> None:
        emb = self.ckpt.read("model.embed_tokens.weight", self.device)  # (V, H)
        n, S = self.tokens.shape
        b = max(1, chunk_tokens(self.device) // S)
        chunks = [embed(self.skeleton, emb, self.tokens[i: i + b].to(self.device)).to(self.dtype)
                  for i in range(0, n, b)]  # (b, S, H) each
        nbytes = n * S * emb.shape[1] * torch.finfo(self.dtype).bits // 8
        where = HiddenStates.placement(nbytes, self.device)
        self.hidden = HiddenStates(chunks, self.device, where)
        self.topk = [None] * len(chunks)
        self.spilled = where != "device"

    def _run_mtp(self, L: int) -> None:
        """The MTP layer (index num_hidden_layers), run on its real inputs: at position i,
        eh_proj([enorm(embed(token i+1)), hnorm(h_i)]) with h_i the last layer's output, over
        the first S-1 positions (the last has no next token)."""
        ck, dev, dt = self.ckpt, self.device, self.dtype
        p = f"model.layers.{L}."
        if self._mtp_skeleton is None:
            self._mtp_skip[L] = "no eh_proj / enorm / hnorm in the checkpoint: rounded to nearest"
            return
        cfg, skeleton = self._mtp_config(L), self._mtp_skeleton
        H = cfg["hidden_size"]
        norm_cls = type(skeleton.model.norm)
        eps = cfg.get("rms_norm_eps", 1e-6)
        enorm, hnorm = norm_cls(H, eps=eps).to(dev, dt), norm_cls(H, eps=eps).to(dev, dt)
        with torch.no_grad():
            enorm.weight.copy_(ck.read(p + "enorm.weight", dev))
            hnorm.weight.copy_(ck.read(p + "hnorm.weight", dev))
            eh = ck.read(p + "eh_proj.weight", dev).to(dt)  # (H, 2H)
            emb = ck.read("model.embed_tokens.weight", dev)  # (V, H)
            S = self.calib.tokens.shape[1]
            self.topk = [None] * len(self.hidden)  # the MTP layer computes its own top-k
            self._before_overwrite()
            first = 0  # the chunk's first sample (chunks as _embed, or a checkpoint, made them)
            for i in range(len(self.hidden)):  # each chunk replaced in turn: no second copy
                h = self.hidden.on_device(i)
                t = self.tokens[first:first + h.shape[0], 1:].to(dev)  # (b, S-1) next tokens
                first += h.shape[0]
                x = torch.cat([enorm(emb[t].to(dt)), hnorm(h[:, :-1])], -1)
                del h
                self.hidden.put(i, F.linear(x, eh))  # (b, S-1, H)
                del x
        del emb
        self.skeleton = skeleton
        self.inputs = layer_inputs(skeleton, S - 1, dev, dt)
        self._run(L)
        self.layers[-1]["mtp"] = True

    def _mtp_runnable(self, L: int) -> bool:
        need = [f"model.layers.{L}.{n}.weight" for n in ("eh_proj", "enorm", "hnorm")]
        return all(n in self.ckpt.tensors for n in need) and self.calib.tokens.shape[1] >= 2

    def _mtp_config(self, L: int) -> dict:
        """config.json for a model of L+1 decoder layers, the MTP layer L the last: every
        per-layer list (`layer_types`, `mlp_layer_types`, ... as transformers writes them)
        extended by its last entry, DSA `indexer_types` from the tensors (which layers have
        their own indexer)."""
        ck = self.ckpt
        n = ck.num_hidden_layers
        cfg = dict(ck.config, num_hidden_layers=L + 1)
        for k, v in ck.config.items():
            if isinstance(v, list) and v and len(v) == n and k.endswith("_types"):
                cfg[k] = list(v) + [v[-1]] * (L + 1 - n)
        if ck.model_type == "glm_moe_dsa":
            cfg["indexer_types"] = ["full" if f"model.layers.{i}.self_attn.indexer.wq_b.weight"
                                    in ck.tensors else "shared" for i in range(L + 1)]
        return cfg

    def _check_mlps(self) -> None:
        """Refuse, before any output exists, a layer whose MLP has INT4 targets but a class
        the calibration forward does not mirror (e.g. Qwen3-MoE's or Mixtral's MoE blocks)."""
        problems = [Problem("config.json", f"model.layers.{L}.mlp", type(layer.mlp).__name__,
                            f"an MoE block of {', '.join(MOE_CLASSES)} or a gate/up/down MLP",
                            "use --method rtn for this model")
                    for L, layer in enumerate(self.skeleton.model.layers)
                    if mlp_kind(layer.mlp) == "unsupported"
                    and any(t.quantize for t in self._targets(L, layer).values())]
        if problems:
            raise QuantizeError("calibration does not know this MLP", problems[:3])

    def _targets(self, L: int, layer: torch.nn.Module) -> dict[str, Target]:
        prefix = f"model.layers.{L}.mlp."
        return {n: Target(n, u.action == "quantize") for n, u in self.units.items()
                if n.startswith(prefix) and n.endswith("_proj.weight")}

    @torch.no_grad()
    def _run(self, L: int) -> None:
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.hidden is None:
            self._embed()
        layer = load_layer(self.skeleton, self.ckpt, self.units, L, self.device, self.dtype)
        self._warm(L + 1)  # the next layer's bytes into the page cache while this one runs
        kind = mlp_kind(layer.mlp)
        targets = self._targets(L, layer)
        active = any(t.quantize for t in targets.values())
        entry: dict = {"layer": L, "mlp": kind}
        if not active:
            self._before_overwrite()
            for i in range(len(self.hidden)):
                self._check_stop()
                h, self.topk[i] = run_layer(self.skeleton, layer, self.inputs, self.hidden.on_device(i),
                                            self.topk[i])
                self.hidden.put(i, h)
            entry["quantized"] = 0
        else:
            with self._profile(L):
                entry.update(self._calibrate(L, layer, kind, targets))
        free_layer(layer)
        self.results.on_host()  # the layer's outputs are all on the host
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            entry["peak_gpu_gib"] = max([round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2),
                                         *entry.get("peak_gpu_gib_by_phase", {}).values()])
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        self.layers.append(entry)
        fb = entry.get("fallback") or []
        self.log(f"layer {L}{' (MTP)' if L >= self.num_layers else ''}: "
                 f"{entry.get('quantized', 0)} Linears {self.opts.method}"
                 + (f", experts {[f['expert'] for f in fb]} below --min-expert-tokens: all-token "
                    "statistics" if fb else "") + f", {entry['seconds']} s")

    @contextlib.contextmanager
    def _profile(self, L: int):
        """The first calibrated layer (or layer $QUANTIZE_TORCH_PROFILE_LAYER) under
        torch.profiler when PROFILE_ENV names a folder (its tables written there); nothing
        otherwise."""
        pdir = os.environ.get(PROFILE_ENV)
        want = os.environ.get(PROFILE_ENV + "_LAYER")
        if not pdir or self._profiled or (want is not None and int(want) != L):
            yield
            return
        self._profiled = True
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            yield
        Path(pdir).mkdir(parents=True, exist_ok=True)
        for key in ("cuda_time_total", "cpu_time_total") if cuda else ("cpu_time_total",):
            (Path(pdir) / f"layer{L}-{key}.txt").write_text(
                prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=70))

    def _calibrate(self, L: int, layer, kind: str, targets: dict[str, Target]) -> dict:
        o = self.opts
        method = o.method
        mlp = layer.mlp
        E = mlp.experts.num_experts if kind == "moe" else 0
        fold = self._norm_fold(L, layer, targets) if "awq" in method else None
        # the routed Hessians keep the layer's MLP inputs (one more copy of the hidden states)
        # where they fit in a quarter of the free memory; else running sums (bounded size)
        kept = 0 if self.spilled else \
            sum(self.hidden.get(i).numel() for i in range(len(self.hidden))) * self.dtype.itemsize
        stats = MLPStats(kind, hessians="gptq" in method, samples="awq" in method,
                         all_experts=o.expert_calibration == "all", num_experts=E,
                         store_tokens=not self.spilled and not HiddenStates.should_spill(2 * kept, self.device))
        clock = _Clock(self.device)
        ref0, h0, halves = self._pass1(L, layer, kind, stats)
        clock.lap("pass1_forward_statistics")
        self._reduce_stats(stats)  # several ranks: counts and shared statistics summed
        quant = [n for n, t in targets.items() if t.quantize]
        # what round-to-nearest would give on chunk 0 (the module's targets rounded in place:
        # the rounding below reads the source from the checkpoint and overwrites every one)
        round_in_place(layer, L, quant, o.group_size, o.symmetric)
        rtn_err = _relerr(self._chunk0_output(layer, halves) - h0, ref0 - h0)
        clock.lap("rtn_reference")

        rounding = LayerRounding(L, mlp, kind, targets, stats, self.ckpt, self.units, o,
                                 self.device, self.dtype, self.dist, self._check_stop, fold)
        nq = 0

        def done(n: str, w: Int4Weight) -> None:
            nonlocal nq
            nq += 1
            self._emit(L, layer, n, w)

        report = rounding.run(done, clock.lap)
        mods = rounding.mods
        for n, t in mods.items():  # the BF16 tensors AWQ rescaled, as they will be written
            t = t.to(torch_dtype(self.units[n].outputs[0].dtype))
            self.results.rescaled[n] = t.cpu()
            self._set_weight(L, layer, n, t.float())
        clock.lap("rounding")

        # ---- the calibrated layer against round-to-nearest, on chunk 0 (in sample)
        err = _relerr(self._chunk0_output(layer, halves) - h0, ref0 - h0)
        report["check"] = {"chunk0_rel_error": err, "rtn_rel_error": rtn_err,
                           "margin": REGRESSION_MARGIN}
        worse = err > REGRESSION_MARGIN * rtn_err + 1e-12
        if self.dist is not None:  # every rank takes the same branch (collectives follow)
            worse = bool(self.dist.all_reduce(torch.tensor([int(worse)])).item())
        if worse:
            where = f"layer {L}{' (MTP)' if L >= self.num_layers else ''}"
            if not o.rtn_fallback:
                raise QuantizeError(
                    f"{where}: --method {method} made the MLP's output worse than round-to-nearest "
                    f"(relative error {err:.4g}, RTN's {rtn_err:.4g} on the same tokens, margin "
                    f"{REGRESSION_MARGIN}x); stopped. Fix: pass --rtn-fallback to round such layers "
                    "to nearest (the report and the card list them), or use --method gptq / rtn")
            self.log(f"warning: {where}: {method} error {err:.4g} > {REGRESSION_MARGIN} x RTN's "
                     f"{rtn_err:.4g}: rounded to nearest instead (--rtn-fallback)")
            self._fall_back_to_rtn(L, layer, quant, mods)
            mods = {}
            report["rtn_fallback"] = {"method": method, "rel_error": err, "rtn_rel_error": rtn_err}
            report.pop("awq", None)
        else:
            self.awq_scales.update(rounding.awq_scales)

        # ---- pass 2: the next layer's inputs through the quantized layer
        out0 = self._pass2(layer, halves)
        report["output_rel_error"] = _relerr(out0 - h0, ref0 - h0)
        report["attention_once"] = halves is not None
        clock.lap("pass2_forward")
        report["timing_s"] = clock.laps
        if clock.peaks:
            report["peak_gpu_gib_by_phase"] = clock.peaks
        report["quantized"] = nq
        report["modified_bf16"] = sorted(mods)
        return report

    def _emit(self, L: int, layer, n: str, w: Int4Weight) -> None:
        """A rounded weight: into the module for pass 2, packed to the host for the writer."""
        self._set_weight(L, layer, n, dequantize(w, torch.float32))
        if self.dist is not None and not self.dist.leader:
            return  # only rank 0 writes the output
        outs = int4_outputs(w)  # packed where it was computed: 1/2 of the int8 codes' bytes
        if self.device.type == "cuda":  # to the host on a copy thread and stream: the
            # solves queued behind it go on (resolved in `result`, at the latest at layer end)
            self.results.int4[n] = self._host.submit(lambda ts: [to_host(t) for t in ts], outs)
        else:
            self.results.int4[n] = outs

    def _fall_back_to_rtn(self, L: int, layer, quant: list[str], mods: dict) -> None:
        """The layer rounded to nearest from the source instead (`--rtn-fallback`): every target
        re-emitted, every tensor AWQ rescaled back to the source's value (and not written:
        the plain path copies it), the layer's AWQ scales dropped."""
        W = LayerWeights(self.ckpt, self.units, self.device)
        for n in quant:
            self._emit(L, layer, n, quantize_rtn(W.source(n), self.opts.group_size,
                                                 self.opts.symmetric))
        for n in mods:
            self.results.rescaled.pop(n, None)
            self._set_weight(L, layer, n, W.source(n))

    def _chunk0_output(self, layer, halves: SplitLayer | None) -> torch.Tensor:
        """Chunk 0's layer output through the layer as it is now (after pass 1: chunk 0 holds
        h1 where the layer splits, else the layer's input)."""
        if halves is not None:
            return halves.mlp(self.hidden.on_device(0))
        return run_layer(self.skeleton, layer, self.inputs, self.hidden.on_device(0), self.topk[0])[0]

    def _norm_fold(self, L: int, layer, targets: dict[str, Target]) -> NormFold | None:
        """Where this layer's AWQ input scale goes (folds.find_norm_fold, proven on the layer
        with one sample of chunk 0), when AWQ rounds a gate/up target; else None."""
        if not any(t.quantize and n.endswith(("gate_proj.weight", "up_proj.weight"))
                   for n, t in targets.items()):
            return None
        h = self.hidden.on_device(0)[:1]
        topk = None if self.topk[0] is None else self.topk[0][:1]
        return find_norm_fold(layer, lambda: run_layer(self.skeleton, layer, self.inputs, h, topk),
                              L, self.ckpt.model_type)

    def _pass1(self, L: int, layer, kind: str, stats: MLPStats
               ) -> tuple[torch.Tensor, torch.Tensor, SplitLayer | None]:
        """Pass 1: the layer over every chunk, the MLP's statistics on. Where the layer splits
        into its halves (`SplitLayer.check` on chunk 0, bit for bit), the attention runs once
        per chunk, its output h1 replaces the chunk (pass 2 starts there), and the statistics
        forward runs on groups of chunks without computing outputs nobody reads; else whole
        layers. Returns (chunk 0's output through the unrounded layer, chunk 0's input, the
        split or None)."""
        fwd = moe_forward if kind == "moe" else dense_forward
        mlp = layer.mlp
        h0 = self.hidden.on_device(0)
        halves = SplitLayer(self.skeleton, layer, self.inputs)
        ok, ref0, h1, topk1, x0 = halves.check(h0, self.topk[0])
        if not ok:
            self.log(f"layer {L}: its forward is not attention + MLP on one residual, bit for "
                     "bit: whole-layer forwards in both passes")
            # the statistics of the MLP's input, captured by a pre-hook as the class's own
            # forward runs (the layer's output is not kept: pass 2 computes it after rounding)
            hook = mlp.register_forward_pre_hook(lambda m, args: fwd(m, args[0], stats, outputs=False))
            try:
                for i in range(len(self.hidden)):
                    self._check_stop()
                    run_layer(self.skeleton, layer, self.inputs, self.hidden.on_device(i), self.topk[i])
            finally:
                hook.remove()
            return ref0, h0, None
        # several chunks per statistics call (all-expert mode: one, its (e, T, I) activations
        # grow with T); the routed Hessians recompute a call's MLP inputs from the hidden
        # states (h1 after this pass) instead of keeping a copy of them
        group = 0 if stats.all_experts else mlp_group_tokens(self.device)
        calls: list[list[int]] = []  # the chunks of each statistics call
        pending: list[torch.Tensor] = []
        if stats.routed_hessians and kind == "moe":
            stats.store_tokens = True
            stats.x_of = lambda c: torch.cat([halves.mlp_input(self.hidden.on_device(i)).flatten(0, -2)
                                              for i in calls[c]])

        def flush(upto: int) -> None:
            if pending:
                x = pending[0] if len(pending) == 1 else torch.cat(pending)
                start = calls[-1][-1] + 1 if calls else 0
                calls.append(list(range(start, upto + 1)))
                pending.clear()
                fwd(mlp, x, stats, outputs=False)

        def take(x: torch.Tensor) -> None:
            pending.append(x.reshape(-1, x.shape[-1]))

        self._before_overwrite()
        for i in range(len(self.hidden)):
            self._check_stop()
            if i == 0:
                take(x0)
                h1_i, topk_i = h1, topk1
            else:
                h1_i, topk_i = halves.attention(self.hidden.on_device(i), self.topk[i], take)
            self.topk[i] = topk_i  # what the layer passes on (pass 2 does not recompute it)
            self.hidden.put(i, h1_i)
            if sum(p.shape[0] for p in pending) >= group:
                flush(i)
        flush(len(self.hidden) - 1)
        return ref0, h0, halves

    def _pass2(self, layer, halves: SplitLayer | None) -> torch.Tensor:
        """Pass 2: every chunk through the rounded layer, replaced by the output (the next
        layer's input); from h1 through the MLP half, several chunks at once, when split.
        Returns chunk 0's output."""
        self._before_overwrite()
        out0 = None
        if halves is None:
            for i in range(len(self.hidden)):
                self._check_stop()
                out, self.topk[i] = run_layer(self.skeleton, layer, self.inputs,
                                              self.hidden.on_device(i), self.topk[i])
                out0 = out if i == 0 else out0
                self.hidden.put(i, out)
            return out0
        group, start = mlp_group_tokens(self.device, pass2=True), 0
        while start < len(self.hidden):
            self._check_stop()
            hs = [self.hidden.on_device(start)]
            while start + len(hs) < len(self.hidden) and \
                    sum(h.shape[0] * h.shape[1] for h in hs) < group:
                hs.append(self.hidden.on_device(start + len(hs)))
            out = halves.mlp(hs[0] if len(hs) == 1 else torch.cat(hs))
            # a chunk of its own (a checkpoint saves each chunk: never a view of the group)
            parts = [out] if len(hs) == 1 else [o.clone() for o in out.split([h.shape[0] for h in hs])]
            del out, hs
            for j, o in enumerate(parts):
                self.hidden.put(start + j, o)
            out0 = parts[0] if start == 0 else out0
            start += len(parts)
        return out0

    def _reduce_stats(self, stats: MLPStats) -> None:
        """Several ranks: token counts summed on every rank, the all-token and dense / shared
        Hessians summed (weighted by tokens) on every rank, rank 0's all-token input sample on
        every rank. The routed experts' Hessians are summed onto their owners later, one GPTQ
        batch at a time (`_gptq_routed_ranks`)."""
        d = self.dist
        if d is None:
            return
        E = stats.num_experts
        counts = torch.tensor([stats.tokens, stats.n_down, *stats.expert_tokens,
                               *[stats.n_down_e.get(e, 0) for e in range(E)]], dtype=torch.int64)
        c = d.all_reduce(counts).tolist()
        n_in, n_down = stats.tokens, stats.n_down
        stats.tokens, stats.n_down = c[0], c[1]
        stats.expert_tokens = c[2:2 + E]
        stats.n_down_e = {e: n for e, n in enumerate(c[2 + E:]) if n}
        if stats.H_in is not None:  # 2 XᵀX / n per rank -> over every rank's tokens
            stats.H_in = d.all_reduce(stats.H_in * (n_in / stats.tokens))
        if stats.H_down is not None:
            stats.H_down = d.all_reduce(stats.H_down * (n_down / stats.n_down))
        xs = torch.cat(stats.x_sample) if stats.x_sample else None
        shape = d.broadcast_object(None if xs is None else tuple(xs.shape))
        if shape is not None:
            buf = xs.contiguous() if d.leader else torch.empty(shape, device=self.device)
            stats.x_sample = [d.broadcast(buf, 0)]

    def _set_weight(self, L: int, layer, name: str, t: torch.Tensor) -> None:
        """Copy a written value into the module (fused experts included)."""
        with torch.no_grad():
            layer_weight(layer, L, name).copy_(t)
