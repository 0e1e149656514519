"""Several processes, one per GPU, through torch.distributed: who owns what, and the few
collectives the calibration needs.

    torchrun --nproc-per-node 8 -m quantize convert SRC DST --method gptq
    torchrun --nnodes 2 --node-rank R --master-addr HOST --nproc-per-node 8 -m quantize convert ...

`torchrun` sets RANK, WORLD_SIZE and LOCAL_RANK; `init()` joins the group (NCCL when the
processes compute on GPUs, gloo on the CPU) and gives rank r the device cuda:LOCAL_RANK. What the
ranks share in a calibrated conversion (quantize/calib/loop.py):

    tokens     rank r runs the samples [r n / W, (r + 1) n / W) through every layer: the hidden
               states, and the host and GPU memory they take, are split W ways
    experts    rank r owns the routed experts [r E / W, (r + 1) E / W) (`owned`): their Hessians
               are summed onto it (`reduce_to`) from every rank's tokens, it runs their GPTQ
               solves, and sends the rounded weights to every rank (`broadcast`) for the second
               forward
    the rest   statistics of the dense / shared MLP are summed on every rank (`all_reduce`), so
               their GPTQ runs everywhere on the same numbers and gives the same integers
    output     rank 0 alone writes the output folder (shards, manifest, report): each file once
    resume     each rank checkpoints its own samples (state.py, `state/rank-R-of-W/`) when
               rank 0 says so; a resumed run loads the newest layer that every rank has

GLM-5.2 at W = 8: 32 experts per rank, one GPTQ batch; the Hessians reduced per layer are
256 x (6144^2 + 2048^2) x 4 B = 43 GB, over NVLink well under a second.
The sums arrive in another order than in one process, so a calibrated W-rank output differs
from the one-process output by float rounding in the Hessians (tests/test_distributed.py bounds
it); RTN runs on rank 0 only and is byte-identical.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (torch is imported where a group is joined: the CLI asks `init` before
    import torch  # it checks its arguments, and a single process needs no torch for that)

__all__ = ["Dist", "init", "owned"]


@dataclass(frozen=True)
class Dist:
    """This process's place in the group."""

    rank: int
    world: int
    device: torch.device  # where this rank computes
    backend: str = "gloo"  # "nccl": collectives on the GPU; "gloo": through host memory

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _dist(self):
        import torch.distributed as dist

        return dist

    def _on(self, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """`t` where the backend wants it: NCCL on the rank's GPU, gloo on the host."""
        import torch

        want = self.device if self.backend == "nccl" else torch.device("cpu")
        return (t, False) if t.device == want else (t.to(want), True)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The sum (or "min") over ranks, into `t` on every rank."""
        dist = self._dist()
        x, moved = self._on(t)
        dist.all_reduce(x, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.SUM)
        return t.copy_(x) if moved else t

    def reduce_to(self, t: torch.Tensor, dst: int) -> torch.Tensor:
        """The sum over ranks, into `t` on rank `dst` (other ranks' `t`: undefined)."""
        x, moved = self._on(t)
        self._dist().reduce(x, dst)
        return t.copy_(x) if moved and self.rank == dst else t

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Rank `src`'s `t`, into `t` on every rank (same shape and dtype everywhere)."""
        x, moved = self._on(t)
        self._dist().broadcast(x, src)
        return t.copy_(x) if moved else t

    def broadcast_object(self, obj, src: int = 0):
        box = [obj]
        self._dist().broadcast_object_list(box, src, device=self._collective_device())
        return box[0]

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world
        self._dist().all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.backend == "nccl":
            self._dist().barrier(device_ids=[self.device.index])
        else:
            self._dist().barrier()

    def _collective_device(self) -> torch.device | None:
        return self.device if self.backend == "nccl" else None

    def samples(self, n: int) -> slice:
        """This rank's calibration samples of `n` (contiguous; every rank gets at least one)."""
        return slice(self.rank * n // self.world, (self.rank + 1) * n // self.world)


def owned(e: int, experts: int, world: int) -> int:
    """The rank that owns routed expert e of `experts`: contiguous blocks (GLM-5.2 at 8 ranks:
    experts 0-31 on rank 0, 32-63 on rank 1, ...)."""
    return e * world // experts


def init(device: str) -> Dist | None:
    """Join the torchrun group when WORLD_SIZE > 1 (None: a single process). `device`: the
    --device option; "auto"/"cuda" become cuda:LOCAL_RANK when GPUs are visible."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    import torch
    import torch.distributed as dist

    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    gpu = device != "cpu" and torch.cuda.is_available()
    # QUANTIZE_DIST_BACKEND=gloo: collectives through the host even with GPUs, so that several
    # ranks can share one GPU (a functional check on a one-GPU machine; NCCL refuses that)
    backend = os.environ.get("QUANTIZE_DIST_BACKEND") or ("nccl" if gpu else "gloo")
    dev = torch.device("cuda", local % torch.cuda.device_count()) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        minutes = float(os.environ.get("QUANTIZE_DIST_TIMEOUT_MIN", "60"))
        dist.init_process_group(backend, timeout=timedelta(minutes=minutes),
                                **({"device_id": dev} if backend == "nccl" else {}))
    return Dist(rank, world, dev, backend)
