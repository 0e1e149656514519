"""The calibration's resume, as its loop sees it: which layers are checkpointed, jumping ahead
to a usable checkpoint, and deleting those no resume can need.

    r = Resume(plan, num_layers, last_layer, carry, device, dist, log, interval)
    r.use(DST/CALIB_STATE, run)          checkpoint there; resume from there
    next = r.reach(L - 1, next, running) before a shard whose first layer is L: jump ahead
    r.checkpoint(M)                      after layer M, where a resume can start and one is due
    r.discard() / r.finish_rank()        the conversion complete

The files themselves (one folder per checkpointed layer, the background writer) are state.py.
The state after layer L is saved only where a shard's first layer is L+1 (a resume starts at a
shard), at most every `interval` seconds, and after the last layer. Under torchrun every rank
checkpoints its own samples in its own folder; rank 0's clock and writer decide when, and all
ranks jump to the newest layer every rank has.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch

from quantize.calib.decoder import HiddenStates
from quantize.calib.distributed import Dist
from quantize.calib.layer import Carry
from quantize.calib.state import Checkpointer, StateDir, moved, stored
from quantize.disk import MAX_CHECKPOINTS, plan_topk_bytes
from quantize.plan import Plan, Shard
from quantize.sizes import fmt_bytes
from quantize.source.layout import layer_of

__all__ = ["Resume"]


class Resume:
    """Checkpoints of the carried state (`Carry`: hidden states, DSA top-k, report entries, AWQ
    scales) after chosen layers, and the jump to the newest usable one. Does nothing until
    `use` names the folder."""

    def __init__(self, plan: Plan, num_layers: int, last_layer: int, carry: Carry,
                 device: torch.device, dist: Dist | None, log: Callable[[str], None],
                 interval: float) -> None:
        self.num_layers, self.last_layer, self.carry = num_layers, last_layer, carry
        self.device, self.dist, self.log, self.interval = device, dist, log, interval
        # after these layers a resume can start: a shard's first layer, minus one
        self.save_after = {L - 1 for s in plan.shards if (L := self.first_layer(s)) is not None}
        self.save_after.add(last_layer)
        self.state: StateDir | None = None
        self.saver: Checkpointer | None = None
        self.topk_budget = plan_topk_bytes(plan)  # the top-k bytes the disk check counted
        self.oversize = False  # a checkpoint outgrew that: no more are written
        self.jump_to = -1  # several ranks: the layer rank 0's writer may resume after
        self.keep_after = -1  # the last layer a resume can start after (older: deletable)

    def first_layer(self, shard: Shard) -> int | None:
        return next((min(L, self.num_layers) for u in shard.units
                     if (L := layer_of(u.source)) is not None), None)

    def use(self, root: Path, run: dict, at_once: int = MAX_CHECKPOINTS) -> None:
        """Checkpoint into `root` (DST/CALIB_STATE), and resume from there. `run`: what the
        manifest requires to resume (options, source, tool version, and the calibration's
        identity); the library versions are added to the fingerprint. `at_once`: the
        checkpoints the disk has room for (disk.check_disk)."""
        import transformers

        d = self.dist
        if d is not None:  # every rank checkpoints its own samples, in its own folder
            # (rank 0 holds the manifest and checked the disk)
            run, at_once = d.broadcast_object((run, at_once) if d.leader else None)
            root = root / f"rank-{d.rank}-of-{d.world}"
        fp = {"run": run, "torch": torch.__version__, "transformers": transformers.__version__}
        if d is not None:
            fp["rank"] = [d.rank, d.world]
        self.state = StateDir(root, hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest())
        self.saver = Checkpointer(self.state, self.interval, lambda: self.keep_after, at_once=at_once)

    def reach(self, upto: int, next_layer: int, running: bool) -> int:
        """The writer needs no layer up to `upto` any more: checkpoints before it may go, and
        when the layer thread has not started, jump to the newest usable checkpoint in
        [next_layer, upto] (several ranks: agreed on the layer thread, `jump_together`).
        The layer to run next."""
        self.keep_after = upto
        if not running:  # (once running, the layer thread is ahead of every shard)
            if self.dist is None:
                next_layer = self._jump(next_layer, upto)
            else:
                self.jump_to = upto
        return next_layer

    def start_shard(self, shard: Shard, next_layer: int, running: bool) -> int:
        """Before `shard` is written: `reach` the layer before its first, and delete the
        checkpoints no resume can need. The layer to run next."""
        L = self.first_layer(shard)
        if L is None or self.state is None:
            return next_layer
        next_layer = self.reach(L - 1, next_layer, running)
        self.state.prune(self.keep_after)
        return next_layer

    def _jump(self, next_layer: int, upto: int) -> int:
        """Load the newest usable checkpoint after a layer in [next_layer, upto], if any."""
        if self.state is None:
            return next_layer
        for c in reversed([c for c in self.state.layers() if next_layer <= c <= upto]):
            why = self.state.problem(c)
            if why is not None:
                self.log(f"ignoring calibration checkpoint {self.state.path(c)}: {why}")
                continue
            next_layer = self._load(c)
            self.log(f"resuming calibration at layer {c + 1} from {self.state.path(c)}")
            return next_layer
        if next_layer == 0 and upto >= 0:  # a resumed run with nothing to start from
            self.log(f"no usable calibration checkpoint before layer {upto + 1}: "
                     "computing from layer 0")
        return next_layer

    def jump_together(self, next_layer: int) -> int:
        """Several ranks, on the layer thread: rank 0 says up to which layer a resume may jump
        (the writer's first unfinished shard), every rank says which of its checkpoints up to
        there are usable, and all load the newest layer every rank has (or none: from layer 0).
        The layer to run next."""
        if self.state is None:
            return next_layer
        d = self.dist
        upto = d.broadcast_object(self.jump_to if d.leader else None)
        usable = [c for c in self.state.layers() if next_layer <= c <= upto
                  and self.state.problem(c) is None]
        everyone = d.all_gather_object(usable)
        common = set(everyone[0]).intersection(*everyone[1:])
        if common:
            c = max(common)
            next_layer = self._load(c)
            self.log(f"resuming calibration at layer {c + 1} from {self.state.path(c)} "
                     f"(and the other ranks' checkpoints of that layer)")
            return next_layer
        if upto >= 0:
            self.log(f"no calibration checkpoint before layer {upto + 1} that every rank has: "
                     "computing from layer 0")
        return next_layer

    def _load(self, c: int) -> int:
        """The state after layer c into the carry; the next layer, c + 1 (no shard needs the
        results of the layers up to c)."""
        saved, carry = self.state.read(c), self.carry
        carry.layers, carry.mtp_skip, carry.awq_scales = saved.entries, saved.mtp_skip, saved.awq_scales
        carry.hidden, carry.topk, carry.fp, carry.fp_topk = None, [], None, []
        if saved.chunks:
            t = saved.parts(0)
            fp = "fp" in t  # --gptaq: the unrounded model's stream too
            where = HiddenStates.placement(t["hidden"].nbytes * saved.chunks * (2 if fp else 1),
                                           self.device)  # as the embedding's
            carry.hidden, carry.spilled = HiddenStates([], self.device, where), where != "device"
            if fp:
                carry.fp = HiddenStates([], self.device, where)
            for i in range(saved.chunks):
                t = t if i == 0 else saved.parts(i)
                for hs, topk, hk, kk in [(carry.hidden, carry.topk, "hidden", "topk")] + \
                        ([(carry.fp, carry.fp_topk, "fp", "fp_topk")] if fp else []):
                    hs.append(t[hk])
                    k = t.get(kk)
                    topk.append(None if k is None else moved(k, self.device))
            del t
        return c + 1

    def checkpoint(self, M: int) -> None:
        """The state after layer M saved, where a resume can start and one is due."""
        if self.state is None or M not in self.save_after:
            return
        save = M == self.last_layer or (self.saver.due() and not self._oversize(M))
        if self.dist is not None:  # rank 0's clock and writer decide for every rank
            save, self.keep_after = self.dist.broadcast_object(
                (save, self.keep_after) if self.dist.leader else None)
        if not save:
            return
        carry, last = self.carry, M == self.last_layer  # nothing left to run: no hidden states
        n = 0 if last else len(carry.hidden)
        # hidden states spilled to files are overwritten by the next layer: written first
        background = not last and not carry.hidden.on_disk
        fp = None if carry.fp is None else [carry.fp.get(i) for i in range(n)]
        self.saver.save(M, [carry.hidden.get(i) for i in range(n)], carry.topk[:n], carry.layers,
                        carry.mtp_skip, carry.awq_scales, background=background, fp=fp,
                        fp_topk=None if fp is None else carry.fp_topk[:n])

    def _oversize(self, M: int) -> bool:
        """Whether the state after layer M holds more DSA top-k bytes than the disk check
        counted (the top-k holds every key and is carried as one row, unless run_layer's
        proof switched that off: then it is stored whole); such a checkpoint and all later ones
        are skipped, so that the output's disk is never overrun (said once in the log)."""
        if not self.oversize:
            n = len(self.carry.hidden)
            top = [k for k in self.carry.topk[:n] + self.carry.fp_topk[:n] if k is not None]
            nbytes = sum(stored(k).numel() * k.element_size() for k in top)
            rows = sum(k.shape[-1] * k.element_size() for k in top)  # (one row per chunk)
            if nbytes > self.topk_budget + rows:
                self.oversize = True
                self.log(f"warning: no calibration checkpoints from layer {M} on: the DSA "
                         f"top-k the state after layer {M} carries takes {fmt_bytes(nbytes)}, "
                         f"beyond the {fmt_bytes(self.topk_budget)} the disk check counted (the "
                         "every-key indexer shortcut was switched off, see the warning above); "
                         "a crash resumes from the last checkpoint written")
        return self.oversize

    def wait(self) -> None:
        """Until a checkpoint being written is on disk (its errors raised)."""
        if self.saver is not None:
            self.saver.wait()

    def abandon(self) -> None:
        """The run stops: a checkpoint waiting for room is dropped."""
        if self.saver is not None:
            self.saver.abandon()

    def wait_copied(self) -> None:
        """Before the hidden states are replaced: a checkpoint in flight has its host copy."""
        if self.saver is not None:
            self.saver.wait_copied()

    def discard(self) -> None:
        """Delete the checkpoints: the conversion is complete (several ranks: once every rank
        has written its last one, rank 0 deletes them all)."""
        if self.state is None:
            return
        self.saver.wait()
        if self.dist is None:
            self.state.remove()
            return
        self.dist.barrier()  # (the other ranks wait here in `finish_rank`)
        if self.dist.leader:
            self.state.remove(siblings=True)

    def finish_rank(self) -> None:
        """A rank other than 0, its layers done: its last checkpoint written, then wait for
        rank 0 to finish the output (`discard`)."""
        if self.state is not None:
            self.saver.wait()
            self.dist.barrier()
