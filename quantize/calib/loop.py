"""Calibrated rounding (GPTQ, AWQ, AWQ+GPTQ), layer by layer, memory bounded by one layer.

    tokens  = load_calibration(...)                      (num_samples, seq_len) int64
    h       = embed_tokens[tokens]                       (num_samples, seq_len, H), in chunks
    for L in 0 .. num_hidden_layers - 1:                 on the layer thread, one layer ahead
        layer = decoder.load_layer(...)                  of the shard writer (pipeline.py)
        pass 1: run it over h, the MLP's inputs fed to capture.moe_forward / dense_forward
                (explicit calls, or a forward pre-hook), which fill `MLPStats` (Hessians,
                routed token counts, activation samples)
        quantize the layer's target Linears (batched over experts), AWQ scales folded exactly
        pass 2: h = layer(h) with the quantized weights (what the engines will compute)
        hand the layer's INT4 outputs to the writer (handoff.py); checkpoint h (resume.py)

The modules of this folder: `decoder.py` builds and runs a decoder layer (transformers' own
classes) and holds the activations between layers; `capture.py` is the MLP's calibration
forward and its statistics; `round_layer.py` rounds one layer's MLP from them (which weights,
which Hessians, what batches), `rounding/gptq.py` / `rounding/awq.py` being the rounding as
pure functions; `layer.py` is one layer's calibration (`LayerRunner`: load, rounding, the RTN
guard), `passes.py` its forwards over the carried chunks (`LayerPasses`: pass 1, pass 2) and
what is carried between layers (`Carry`); `mtp.py` the MTP layer's
inputs; this module is the loop (`Calibrator`: the layer thread, handing each layer's result to
the writer: handoff.py); `report.py` writes its reports; `resume.py` / `state.py` keep the
checkpoints for resume; `distributed.py` the ranks under torchrun.

The rounding of a layer's MLP from its statistics (AWQ folds, GPTQ batched over experts and
across ranks, RTN; the starved-expert fallback) is `round_layer.LayerRounding`. GLM-5.2 worked
number, routed statistics at 512 x 2048 tokens: hidden states 12.9 GB (bf16) (+ DSA top-k 4.3 GB
of int16 where the indexer's is computed), down Hessians 4.3 GB, the layer's BF16 experts 19.3 GB, a batch of 32 solves ~16 GB;
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
(quantize/calib/state.py), and `start_shard` jumps to the newest usable checkpoint before the
layers a shard needs, so a resumed run recomputes at most the layers since that checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from quantize.calib.data import CalibrationSet, checkpoint_calibration
from quantize.calib.decoder import (
    HiddenStates,
    build_skeleton,
    chunk_tokens,
    embed,
    layer_inputs,
    limit_gpu_memory,
    mlp_target,
)
from quantize.calib.distributed import Dist
from quantize.calib.fold_probe import prove_folds_up_front
from quantize.calib.handoff import Handoff, LayerFeed, LayerResult
from quantize.calib.layer import Carry, LayerRunner, check_mlps
from quantize.calib.mtp import mtp_config, mtp_inputs, mtp_runnable, rtn_entries
from quantize.calib.report import write_reports
from quantize.calib.resume import Resume
from quantize.disk import MAX_CHECKPOINTS
from quantize.errors import Problem, QuantizeError
from quantize.options import ConvertOptions
from quantize.plan import Plan, Shard, Unit
from quantize.source.checkpoint import Checkpoint
from quantize.source.layout import layer_of

__all__ = ["Calibrator"]
class _Stopped(Exception):
    """`Calibrator.close()` was called while a layer ran: the layer thread leaves it."""


class Calibrator:
    """Runs the layers in order on its own thread (`_run_layers`, the loop) and hands each
    layer's result to the writer as a value (quantize/calib/handoff.py); `result(unit)` is the
    writer's side: a target unit's calibrated INT4 outputs, an AWQ-folded unit's rescaled
    tensor, or None (the plain path applies).

    The layer thread runs one layer ahead of the writer: while the shard writer writes layer
    L's results, layer L+1 is computed (and layer L+2's source bytes are read into the page
    cache); it starts layer L+2 only once the writer took layer L+1, so at most two layers'
    results are held. Layer index num_layers is the MTP layer; `last_layer` is the last one run
    (the MTP layer when the plan has one). With `use_state`, the state after layer L is
    checkpointed in the background (resume.py) when a shard's first layer is
    L+1 (where a resume can start) and `checkpoint_interval` seconds have passed since the last
    one, and after `last_layer`. `close()` stops the thread (always call it, e.g. `with`)."""

    def __init__(self, ckpt: Checkpoint, plan: Plan, opts: ConvertOptions, device: torch.device,
                 log: Callable[[str], None] | None = None, calib: CalibrationSet | None = None,
                 checkpoint_interval: float = 300.0, dist: Dist | None = None,
                 max_gpu_memory: int | None = None) -> None:
        """`calib`: token ids to use instead of loading `opts.calib` (benchmarks);
        `checkpoint_interval`: seconds between resume checkpoints at least (0: every layer a
        resume can start after); `dist`: this rank of several (quantize/calib/distributed.py): its
        share of the samples, the experts it owns; `max_gpu_memory`: bytes this process may
        hold on its GPU (`decoder.limit_gpu_memory`; None: all of it)."""
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
        check_mlps(self.skeleton, self.units)
        if "awq" in opts.method:  # a family AWQ cannot fold into: refused before any output
            prove_folds_up_front(ckpt.config, ckpt.model_type)
        self.calib = calib or checkpoint_calibration(ckpt.root, opts)
        c = self.calib
        # this rank's samples (all of them in one process)
        self.tokens = c.tokens if dist is None else c.tokens[dist.samples(c.tokens.shape[0])]
        if calib is None and opts.calib_bos:  # what each window begins with, as requests do
            self.log(f"calibration windows begin with {''.join(c.prefix)} (the tokenizer's start "
                     "tokens), then the text" if c.prefix else "calibration windows: the tokenizer "
                     "puts nothing before a text and the chat template writes no special tokens "
                     "before the messages, so the windows are text alone")
        if c.overlapping:
            n, L = c.tokens.shape
            self.log(f"warning: {Path(c.source).name} holds {c.stream_tokens:,} tokens, fewer than "
                     f"--num-samples {n} x --seq-len {L} = {n * L:,}: the windows overlap, so some "
                     "text is counted more than once; add data (the default set, shipped:large, "
                     "holds ~1.5 M tokens besides eval's share) or lower --num-samples")
        self.inputs = layer_inputs(self.skeleton, self.calib.tokens.shape[1], device, self.dtype)
        self.next_layer = 0
        self.last_layer = max((min(L, self.num_layers) for u in plan.units
                               if (L := layer_of(u.source)) is not None), default=-1)
        # the MTP layer's own skeleton, built now: a config it cannot take fails before output
        self._mtp_skeleton = build_skeleton(mtp_config(ckpt, self.num_layers)) \
            if self.last_layer == self.num_layers and \
            mtp_runnable(ckpt, self.num_layers, self.calib.tokens.shape[1]) else None
        # each layer's result is handed to the writer as a value when the layer is done: `feed`
        # is the writer's side (quantize/calib/handoff.py)
        self._handoff = Handoff()
        self.feed = LayerFeed(self._handoff, self._start_runner)
        self._runner: threading.Thread | None = None
        self._failed: BaseException | None = None  # what stopped the layer thread
        self._stop = False
        self._prefetch = ThreadPoolExecutor(1, thread_name_prefix="quantize-prefetch")
        self._layer_sources: dict[int, list[str]] = {}  # source tensors (+ scales) per layer
        for u in plan.units:
            if (L := layer_of(u.source)) is not None:
                self._layer_sources.setdefault(min(L, self.num_layers), []).extend(
                    [u.source] + ([u.scale] if u.scale else []))
        self.carry = Carry()  # the hidden states, report entries, AWQ scales between layers
        self.resume = Resume(plan, self.num_layers, self.last_layer, self.carry, device, dist,
                             self.log, checkpoint_interval)  # checkpoints (after `use_state`)
        self.runner = LayerRunner(ckpt, self.units, opts, device, self.dtype, dist, self.skeleton,
                                  self.inputs, self.carry, self.num_layers, self.log,
                                  self._check_stop, self._before_overwrite, self._warm)
        if not opts.stats_prefix:  # the statistics from the text positions alone
            self.runner.skip = len(c.prefix)
        if dist is not None:  # the report's per-layer errors over the samples a one-process
            # run's first chunk holds (0 .. min(chunk, n) - 1): this rank's rows of them
            n = c.tokens.shape[0]
            first = min(self._chunk_samples(), n)
            self.runner.report_rows = max(0, first - dist.samples(n).start)

    def write_outputs(self, out: Path) -> list[str]:
        """Write CALIB_REPORT (and AWQ_SCALES when AWQ ran) into `out`; their names. Layers no
        written shard needed (a resume that kept the last shards) are run, or loaded, first."""


        # a resume whose every shard was kept: from the last checkpoint
        self.next_layer = self.resume.reach(self.last_layer, self.next_layer, self._runner is not None)
        self.feed.finish()  # every layer run (a resume that kept the last shards runs them now)
        self._join_runner()  # (its checkpoint after the last layer comes after handing it over)
        self.resume.wait()
        return write_reports(out, self.report(), self.carry, self.opts.method)

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
            if self.dist is not None:
                self.next_layer = self.resume.jump_together(self.next_layer)
            while self.next_layer <= self.last_layer:
                self._check_stop()
                M = self.next_layer
                self._handoff.offer(self._run_layer(M))
                self.resume.checkpoint(M)
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
        self.resume.abandon()  # (a checkpoint waiting for the writer gives up)
        while self._runner is not None and self._runner.is_alive():
            self._handoff.release()  # a result the writer will not take
            self._runner.join(timeout=0.05)
        with contextlib.suppress(BaseException):
            self.resume.wait()
        self.runner.close()
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
                "min_expert_tokens": o.min_expert_tokens, "expert_coverage": o.expert_coverage,
                "percdamp": o.percdamp, "hessian_shrink": o.hessian_shrink, "descend": o.descend,
                "mse_clip": o.mse_clip, "mse_norm": o.mse_norm,
                "mse_weight_power": o.mse_weight_power, "mse_norm_routed": o.mse_norm_routed,
                "mse_weight_power_routed": o.mse_weight_power_routed, "scale_refit": o.scale_refit,
                "scale_refit_routed": o.scale_refit_routed,
                "gptaq": o.gptaq, "gptaq_active": self.plan.gptaq_active,
                "sequential_mlp_active": self.plan.sequential_active,
                "scale_refits": self.plan.scale_refits,
                "clip_settings": {k: list(v) for k, v in self.plan.clip_settings.items()},
                "group_size": o.group_size, "calibration": self.calib.summary(),
                "device": str(self.device), "compute_dtype": str(self.dtype).replace("torch.", ""),
                "layers": self.carry.layers + rtn_entries(self.plan, self.num_layers, self.carry)}

    # -- checkpoints for resume (quantize/calib/state.py) -------------------------------------

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

    def use_state(self, root: Path, run: dict, at_once: int = MAX_CHECKPOINTS) -> None:
        """Checkpoint into `root` (DST/CALIB_STATE) and resume from there (resume.py); `run`:
        what the manifest requires to resume, `identity()` as its "calibration"; `at_once`:
        the checkpoints the disk has room for."""
        self.resume.use(root, run, at_once)

    def start_shard(self, shard: Shard) -> None:
        """Called before `shard` is written, every shard before it recorded in the manifest:
        continue from the newest usable checkpoint before the shard's first layer when that is
        ahead of where the calibration stands, and delete checkpoints no resume can need."""
        self.next_layer = self.resume.start_shard(shard, self.next_layer, self._runner is not None)

    def discard_state(self) -> None:
        """The conversion is complete: its checkpoints deleted (resume.py)."""
        self.resume.discard()

    def finish_rank(self) -> None:
        """A rank other than 0, its layers done: its last checkpoint written, then wait for
        rank 0 to finish the output."""
        self.resume.finish_rank()

    def _run_layer(self, M: int) -> LayerResult:
        """Layer M run (the MTP layer when M == num_layers); its result (layer thread)."""
        result = self._run(M) if M < self.num_layers else self._run_mtp(M)
        self.next_layer += 1
        return result

    def _run_mtp(self, L: int) -> LayerResult:
        """The MTP layer on its real inputs (mtp.py), through its own skeleton."""
        if self._mtp_skeleton is None:
            self.carry.mtp_skip[L] = "no eh_proj / enorm / hnorm in the checkpoint: rounded to nearest"
            return LayerResult(L)
        skeleton = self._mtp_skeleton
        mtp_inputs(self.ckpt, L, skeleton, self.carry, self.tokens, self.device, self.dtype,
                   self._before_overwrite)
        self.skeleton = self.runner.skeleton = skeleton
        S = self.calib.tokens.shape[1]
        self.inputs = self.runner.inputs = layer_inputs(skeleton, S - 1, self.device, self.dtype)
        result = self._run(L)
        self.carry.layers[-1]["mtp"] = True
        return result

    def _run(self, L: int) -> LayerResult:
        """Decoder layer L's calibration (layer.LayerRunner) on the carried hidden states
        (the tokens embedded first); its report entry kept, its result returned."""
        if self.carry.hidden is None:
            self._embed()
        entry, result = self.runner.run(L)
        self.carry.layers.append(entry)
        return result

    def _before_overwrite(self) -> None:
        """Before the hidden states are replaced: a checkpoint in flight has its host copy."""
        self.resume.wait_copied()

    def _warm(self, L: int) -> None:
        """Read layer L's source tensors into the page cache on the prefetch thread."""
        names = self._layer_sources.get(L)
        if names and not self._stop:
            self._prefetch.submit(self.ckpt.prefetch, names, stop=lambda: self._stop)

    # -- internals -----------------------------------------------------------------------------

    def _chunk_samples(self) -> int:
        """Calibration samples per chunk of hidden states (as `_embed` makes the chunks)."""
        return max(1, chunk_tokens(self.device) // self.calib.tokens.shape[1])

    def _embed(self) -> None:
        emb = self.ckpt.read("model.embed_tokens.weight", self.device)  # (V, H)
        n, S = self.tokens.shape
        b = self._chunk_samples()
        chunks = [embed(self.skeleton, emb, self.tokens[i: i + b].to(self.device)).to(self.dtype)
                  for i in range(0, n, b)]  # (b, S, H) each
        nbytes = n * S * emb.shape[1] * torch.finfo(self.dtype).bits // 8
        streams = 2 if self.plan.gptaq_active else 1  # --gptaq: the unrounded model's stream too
        where = HiddenStates.placement(streams * nbytes, self.device)
        self.carry.hidden = HiddenStates(chunks, self.device, where)
        self.carry.topk = [None] * len(chunks)
        if self.plan.gptaq_active:
            self.carry.fp = HiddenStates(chunks, self.device, where)  # (chunks are never
            self.carry.fp_topk = [None] * len(chunks)  # modified in place: shared until put)
        self.carry.spilled = where != "device"
