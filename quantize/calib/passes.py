"""One decoder layer's forwards over the carried hidden states: the two passes of its
calibration (layer.py drives them and rounds between them, round_layer.py does the rounding):

    pass 1   every chunk through the unrounded layer, the MLP's statistics on (capture.py).
             Where the layer splits into attention + MLP on one residual (`SplitLayer.check`,
             bit for bit on chunk 0) the attention runs once per chunk, its output h1 replaces
             the chunk, and the statistics forward runs on groups of chunks; else whole layers
    between  chunk 0's output through the layer as it is (the RTN guard), every chunk's MLP
             input again (routed Hessians recomputed per GPTQ batch)
    pass 2   every chunk through the rounded layer (from h1 through the MLP half when split),
             replaced by its output: the next layer's input

`Carry` is what goes from one layer to the next (and into a resume checkpoint): the hidden
states in chunks, the DSA top-k, the report's entries, the AWQ scales as applied. With
`--gptaq` it also carries the unrounded model's hidden states (`fp`, and their top-k): pass 1
runs the unrounded layer on them too (their MLP inputs paired with the rounded stream's for the
statistics' D terms, their outputs the next layer's `fp`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from quantize.calib.capture import MLPStats, dense_forward, moe_forward, moe_output_forward
from quantize.calib.decoder import (
    HiddenStates,
    SplitLayer,
    mlp_group_tokens,
    mlp_input_whole,
    run_layer,
)

__all__ = ["Carry", "LayerPasses"]


@dataclass
class Carry:
    """What the calibration carries from layer to layer, and what a resume checkpoint holds:
    the hidden states of the calibration tokens (chunks; None before the embedding), the DSA
    top-k each chunk passes on, whether the hidden states live off the GPU, the report's entry
    of every layer run, the AWQ scales as applied, and the MTP layers not calibrated (why);
    with --gptaq the unrounded model's hidden states and top-k (`fp`, `fp_topk`)."""

    hidden: HiddenStates | None = None
    topk: list[torch.Tensor | None] = field(default_factory=list)
    spilled: bool = False
    layers: list[dict] = field(default_factory=list)
    awq_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    mtp_skip: dict[int, str] = field(default_factory=dict)
    fp: HiddenStates | None = None  # --gptaq: the unrounded model's hidden states, chunked alike
    fp_topk: list[torch.Tensor | None] = field(default_factory=list)


class LayerPasses:
    """Layer L's forwards over `carry`'s chunks. `skeleton` and `inputs` are the model the layer
    comes from and its rotary / masks; `skip` the positions at each window's start left out of
    the MLP statistics; `check_stop` raises to leave the layer, `before_overwrite` waits for a
    checkpoint still copying the chunks a pass is about to replace. `halves`: the layer's split
    once pass 1 proved it, else None (whole-layer forwards in both passes)."""

    def __init__(self, L: int, layer: torch.nn.Module, skeleton, inputs, carry: Carry,
                 device: torch.device, skip: int, check_stop: Callable[[], None],
                 before_overwrite: Callable[[], None], log: Callable[[str], None]) -> None:
        self.L, self.layer, self.skeleton, self.inputs, self.carry = L, layer, skeleton, inputs, carry
        self.device, self.skip = device, skip
        self.check_stop, self.before_overwrite, self.log = check_stop, before_overwrite, log
        self.halves: SplitLayer | None = None

    def forward(self) -> None:
        """A layer with nothing to round: every chunk of both streams through it, replaced by
        its output."""
        self.before_overwrite()
        streams = [(self.carry.hidden, self.carry.topk)]
        if self.carry.fp is not None:
            streams.append((self.carry.fp, self.carry.fp_topk))
        for hs, topk in streams:
            for i in range(len(hs)):
                self.check_stop()
                h, topk[i] = run_layer(self.skeleton, self.layer, self.inputs, hs.on_device(i), topk[i])
                hs.put(i, h)

    def chunk0_output(self) -> torch.Tensor:
        """Chunk 0's layer output through the layer as it is now (after pass 1: chunk 0 holds
        h1 where the layer splits, else the layer's input)."""
        if self.halves is not None:
            return self.halves.mlp(self.carry.hidden.on_device(0))
        return run_layer(self.skeleton, self.layer, self.inputs, self.carry.hidden.on_device(0),
                         self.carry.topk[0])[0]

    def _stat_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP inputs (windows, positions, features) the statistics take: without the first
        `skip` positions of each window (ConvertOptions.stats_prefix off), as rows."""
        if self.skip:
            x = x[:, self.skip:]
        return x.reshape(-1, x.shape[-1])

    def pass1(self, kind: str, stats: MLPStats, keep_inputs: Callable[[torch.nn.Module], bool]
              ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Pass 1: the layer over every chunk, the MLP's statistics on. Where the layer splits
        into its halves (`SplitLayer.check` on chunk 0, bit for bit: `halves` set), the attention
        runs once per chunk, its output h1 replaces the chunk (pass 2 starts there), and the
        statistics forward runs on groups of chunks without computing outputs nobody reads; else
        whole layers. --gptaq: the unrounded model's stream through the unrounded layer too,
        chunk by chunk beside the rounded one's (its MLP inputs paired with theirs in the
        statistics, its outputs replacing its chunks). `keep_inputs(experts)`: whether the
        routed Hessians keep the MLP inputs (else recomputed from the chunks per call). Returns
        (chunk 0's output through the unrounded layer, chunk 0's input, and with --gptaq the
        unrounded stream's chunk-0 output and input, else None)."""
        fwd = moe_forward if kind == "moe" else dense_forward
        mlp = self.layer.mlp
        fp = self.carry.fp
        h0 = self.carry.hidden.on_device(0)
        fp0 = None if fp is None else (None, fp.on_device(0))
        halves = SplitLayer(self.skeleton, self.layer, self.inputs)
        ok, ref0, h1, topk1, x0 = halves.check(h0, self.carry.topk[0])
        if not ok:
            self.log(f"layer {self.L}: its forward is not attention + MLP on one residual, bit for "
                     "bit: whole-layer forwards in both passes")
            return ref0, h0, self._pass1_whole(fwd, stats, fp0)
        self.halves = halves
        # several chunks per statistics call (all-expert mode: one, its (e, T, I) activations
        # grow with T); the routed Hessians recompute a call's MLP inputs from the hidden
        # states (h1 after this pass) instead of keeping a copy of them
        group = 0 if stats.all_experts else mlp_group_tokens(self.device)
        calls: list[list[int]] = []  # the chunks of each statistics call
        pending: list[torch.Tensor] = []
        pending_fp: list[torch.Tensor] = []  # --gptaq: the same tokens' unrounded-stream inputs
        if stats.routed_hessians and kind == "moe":
            stats.store_tokens = True
            if not keep_inputs(mlp.experts):
                stats.x_of = lambda c: torch.cat([self._stat_rows(halves.mlp_input(self.carry.hidden.on_device(i)))
                                                  for i in calls[c]])

        def flush(upto: int) -> None:
            if pending:
                x = pending[0] if len(pending) == 1 else torch.cat(pending)
                x_fp = None if not pending_fp else \
                    pending_fp[0] if len(pending_fp) == 1 else torch.cat(pending_fp)
                start = calls[-1][-1] + 1 if calls else 0
                calls.append(list(range(start, upto + 1)))
                pending.clear()
                pending_fp.clear()
                fwd(mlp, x, stats, outputs=False, x_fp=x_fp)

        def take(x: torch.Tensor) -> None:
            pending.append(self._stat_rows(x))

        def take_fp(x: torch.Tensor) -> None:
            pending_fp.append(self._stat_rows(x))

        self.before_overwrite()
        for i in range(len(self.carry.hidden)):
            self.check_stop()
            if i == 0:
                take(x0)
                h1_i, topk_i = h1, topk1
            else:
                h1_i, topk_i = halves.attention(self.carry.hidden.on_device(i), self.carry.topk[i], take)
            self.carry.topk[i] = topk_i  # what the layer passes on (pass 2 does not recompute it)
            self.carry.hidden.put(i, h1_i)
            if fp is not None:  # the unrounded stream: its whole layer now, the MLP unrounded
                h1_f, self.carry.fp_topk[i] = halves.attention(fp.on_device(i), self.carry.fp_topk[i], take_fp)
                out_f = halves.mlp(h1_f)
                fp0 = (out_f, fp0[1]) if i == 0 else fp0
                fp.put(i, out_f)
                del h1_f, out_f
            if sum(p.shape[0] for p in pending) >= group:
                flush(i)
        flush(len(self.carry.hidden) - 1)
        return ref0, h0, fp0

    def _pass1_whole(self, fwd, stats: MLPStats,
                     fp0: tuple[torch.Tensor | None, torch.Tensor] | None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Pass 1 in whole-layer forwards (a layer `SplitLayer.check` refused): the statistics
        of the MLP's input, captured by a pre-hook as the class's own forward runs (the layer's
        output is not kept: pass 2 computes it after rounding); --gptaq: each unrounded-stream
        chunk first, its MLP input kept for the pair, its output replacing it. Returns `fp0`
        with the unrounded stream's chunk-0 output filled in (None without --gptaq)."""
        fp, layer = self.carry.fp, self.layer
        x_fp: list[torch.Tensor] = []

        def pre(m, args):
            x = self._stat_rows(args[0])
            if x_fp and x_fp[-1] is None:  # the unrounded stream's forward
                x_fp[-1] = x
            else:
                fwd(m, x, stats, outputs=False, x_fp=x_fp.pop() if x_fp else None)

        hook = layer.mlp.register_forward_pre_hook(pre)
        if fp is not None:
            self.before_overwrite()  # (the unrounded stream's chunks are replaced here)
        try:
            for i in range(len(self.carry.hidden)):
                self.check_stop()
                if fp is not None:
                    x_fp.append(None)
                    out_f, self.carry.fp_topk[i] = run_layer(
                        self.skeleton, layer, self.inputs, fp.on_device(i), self.carry.fp_topk[i])
                    fp0 = (out_f, fp0[1]) if i == 0 else fp0
                    fp.put(i, out_f)
                run_layer(self.skeleton, layer, self.inputs, self.carry.hidden.on_device(i), self.carry.topk[i])
        finally:
            hook.remove()
        return fp0

    def mlp_inputs(self, sink: Callable[[torch.Tensor], None]) -> None:
        """Every chunk's MLP input in the rounded stream to `sink` (between the passes: the
        carried chunks hold h1 where the layer splits, several chunks at once through its norm;
        else the layer's inputs, through whole forwards whose MLP answers 0)."""
        hs = self.carry.hidden
        if self.halves is None:
            for i in range(len(hs)):
                self.check_stop()
                sink(self._stat_rows(mlp_input_whole(self.skeleton, self.layer, self.inputs,
                                                     hs.on_device(i), self.carry.topk[i])))
            return
        for _, part in self._chunk_groups(mlp_group_tokens(self.device)):
            sink(self._stat_rows(self.halves.mlp_input(part[0] if len(part) == 1 else torch.cat(part))))

    def _chunk_groups(self, group: int):
        """The carried chunks on the device in runs of consecutive chunks of about `group`
        tokens (at least one chunk each): yields (index of the run's first chunk, its chunks;
        a consumer done with them clears that list, so that they are not held here)."""
        hs, start = self.carry.hidden, 0
        while start < len(hs):
            self.check_stop()
            part = [hs.on_device(start)]
            while start + len(part) < len(hs) and sum(h.shape[0] * h.shape[1] for h in part) < group:
                part.append(hs.on_device(start + len(part)))
            n = len(part)
            yield start, part
            start += n

    def pass2(self) -> torch.Tensor:
        """Pass 2: every chunk through the rounded layer, replaced by the output (the next
        layer's input); from h1 through the MLP half, several chunks at once, when split; a
        MoE block's output by `capture.moe_output`. Returns chunk 0's output."""
        self.before_overwrite()
        with moe_output_forward(self.layer.mlp):
            return self._pass2_chunks()

    def _pass2_chunks(self) -> torch.Tensor:
        out0 = None
        if self.halves is None:
            for i in range(len(self.carry.hidden)):
                self.check_stop()
                out, self.carry.topk[i] = run_layer(self.skeleton, self.layer, self.inputs,
                                                    self.carry.hidden.on_device(i), self.carry.topk[i])
                out0 = out if i == 0 else out0
                self.carry.hidden.put(i, out)
            return out0
        for start, hs in self._chunk_groups(mlp_group_tokens(self.device, pass2=True)):
            out = self.halves.mlp(hs[0] if len(hs) == 1 else torch.cat(hs))
            # a chunk of its own (a checkpoint saves each chunk: never a view of the group)
            parts = [out] if len(hs) == 1 else [o.clone() for o in out.split([h.shape[0] for h in hs])]
            del out
            hs.clear()  # (the group's inputs released before their chunks are replaced)
            for j, o in enumerate(parts):
                self.carry.hidden.put(start + j, o)
            out0 = parts[0] if start == 0 else out0
        return out0
