"""Pinned host buffers for moving tensors between the disk and a CUDA device.

A page-cache read into fresh pageable memory faults in every page, and a pageable copy to or
from the GPU goes through the driver's own bounce buffer. Measured on an H200 host
(BENCHMARKS.md), 12.6 MB expert tensors reached the GPU at 3.4 GB/s from one thread and
6 GB/s from four that way; read into reused pinned buffers and copied asynchronously they
reached 4.5 GB/s from one thread and 16 GB/s from four.

A `Staging` is two pinned chunks and a copy stream: one chunk is filled (from the file, or
from the GPU) while the other one's copy runs. Stagings are pooled per device and handed to
one thread at a time (`staging(device)`), so their pinned memory is allocated once per
concurrently reading or writing thread, never per tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["CHUNK", "Staging", "device_chunks", "staging", "to_host"]

CHUNK = 32 * 2**20  # a GLM-5.2 expert (12.6 MB FP8) in one chunk; 128 MB pinned per 2 stagings


class Staging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bufs = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.views = [memoryview(b.numpy()) for b in self.bufs]
        self.done = [torch.cuda.Event() for _ in range(2)]
        self.stream = torch.cuda.Stream(device)


_free: dict[torch.device, list[Staging]] = {}
_lock = threading.Lock()


@contextmanager
def staging(device: torch.device) -> Iterator[Staging]:
    with _lock:
        pool = _free.setdefault(device, [])
        st = pool.pop() if pool else None
    if st is None:
        st = Staging(device)
    try:
        yield st
    finally:
        with _lock:
            _free[device].append(st)


def device_chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The bytes of a CUDA tensor, CHUNK at a time, as uint8 slices of pinned host memory:
    chunk i+1 is copied while the caller consumes chunk i. Each slice is valid until the next
    one is requested; the copies are ordered after the work queued on the caller's stream."""
    src = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = src.numel()
    starts = list(range(0, n, CHUNK))
    with staging(t.device) as st:
        st.stream.wait_stream(torch.cuda.current_stream(t.device))  # t's producer has run

        def launch(i: int) -> None:
            b, off = i % 2, starts[i]
            m = min(CHUNK, n - off)
            with torch.cuda.stream(st.stream):
                st.bufs[b][:m].copy_(src[off:off + m], non_blocking=True)
                st.done[b].record(st.stream)

        if starts:
            launch(0)
        for i, off in enumerate(starts):
            if i + 1 < len(starts):
                launch(i + 1)  # into the other buffer, whose chunk the caller has consumed
            st.done[i % 2].synchronize()
            yield st.bufs[i % 2][:min(CHUNK, n - off)]
        st.stream.synchronize()  # every copy finished before src may be freed or reused


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` (itself if it is on the host), through `device_chunks`. The copies
    out of the pinned chunks are torch copies, which release the GIL (a memoryview assignment
    would hold it: measured, that stalled the calibration's main thread)."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype)
    if t.numel():
        dst = host.reshape(-1).view(torch.uint8)
        off = 0
        for chunk in device_chunks(t):
            dst[off:off + chunk.numel()].copy_(chunk)
            off += chunk.numel()
    return host
