"""The calibration's layer results, handed from its layer thread to the shard writer as values.

    layer thread                              writer (pipeline._write)
    ------------                              ------------------------
    result = LayerResult(L, int4, rescaled)
    handoff.offer(result)          ------>    feed.layer(L)  (takes results in layer order)
    checkpoint after L (maybe)                writes layer L's units from result.outputs(name)
    handoff.wait_taken()
    layer L+1 ...
    handoff.offer(None)            ------>    feed.finish()  (after the last layer)

`offer` and `take` pass one value at a time (a queue of one); the layer thread starts layer
L+2 only once the writer has taken layer L+1, so at most two layers' results exist at once:
the one being written and the one being computed.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

__all__ = ["Handoff", "LayerFeed", "LayerResult"]


@dataclass
class LayerResult:
    """What one calibrated layer gives the writer: per written tensor name, the packed INT4
    outputs of a rounded Linear (a Future while they are copied to the host), or the BF16
    tensor AWQ rescaled (a norm, a router, a Linear it does not round)."""

    layer: int
    int4: dict[str, list[torch.Tensor] | Future] = field(default_factory=dict)
    rescaled: dict[str, torch.Tensor] = field(default_factory=dict)

    def outputs(self, name: str) -> list[torch.Tensor] | None:
        """The tensors to write for source tensor `name`; None: not this layer's business
        (the writer's plain path reads, converts or copies it)."""
        r = self.int4.get(name)
        if r is not None:
            return r.result() if isinstance(r, Future) else r
        t = self.rescaled.get(name)
        return None if t is None else [t]


class Handoff:
    """One value at a time from the layer thread to the writer: a LayerResult, or the error
    that stopped the layer thread (raised where the writer takes it)."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=1)

    def offer(self, item: LayerResult | BaseException) -> None:  # layer thread
        self._q.put(item)

    def wait_taken(self) -> None:  # layer thread: until the writer took what was offered
        self._q.join()

    def take(self) -> LayerResult | None:  # writer; None: the layer thread has finished
        item = self._q.get()
        self._q.task_done()
        if isinstance(item, BaseException):
            raise item
        return item

    def release(self) -> None:
        """Drop what was offered and not taken (the writer stopped): the layer thread's
        `wait_taken` returns."""
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                return
            self._q.task_done()


class LayerFeed:
    """The writer's side: `layer(L)` is layer L's result, taken in layer order (results of
    layers before L that no shard needs are taken and dropped). `start` runs once, before the
    first take (it starts the layer thread)."""

    def __init__(self, handoff: Handoff, start: Callable[[], None]) -> None:
        self._handoff, self._start = handoff, start
        self.current: LayerResult | None = None
        self.ended = False  # the layer thread handed over its last result

    def _next(self) -> None:
        self.current = None  # (the older layer is released before the next is taken)
        self.current = self._handoff.take()
        self.ended = self.current is None

    def layer(self, L: int) -> LayerResult:
        self._start()
        while not self.ended and (self.current is None or self.current.layer < L):
            self._next()
        if self.current is None or self.current.layer != L:
            raise RuntimeError(f"internal: layer {L} requested, the layer thread is at "
                               f"{'its end' if self.current is None else self.current.layer}")
        return self.current

    def finish(self) -> None:
        """Take (and drop) every result left until the layer thread's end."""
        self._start()
        while not self.ended:
            self._next()
