"""A calibrated layer's rounded weights, published as they come (LayerOutputs): dequantized
into the layer's modules, which pass 2 then runs, and packed for the shard writer, moved to the
host on a copy thread (the layer's LayerResult holds a Future per tensor while it is copied;
the solves queued behind go on).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from quantize.calib.decoder import layer_weight
from quantize.calib.distributed import Dist
from quantize.calib.handoff import LayerResult
from quantize.calib.round_layer import Part, part_of
from quantize.overlap import Bounded
from quantize.rounding.int4 import Int4Weight, dequantize, int4_outputs, pack_int4
from quantize.source.staging import to_host

__all__ = ["D2H_PENDING", "LayerOutputs", "set_weight"]

# The rounded Linears' packed outputs on the GPU waiting for the copy thread at most (bytes).
# A layer's are ~5 GB for GLM-5.2; unbounded, a copy thread slower than the solves would hold
# them on top of the rounding's own peak. (The H200 runs' occasional 8 GiB above the usual
# peak were not these but a reference cycle in the fused GPTQ solve: gptq._fused_level.)
D2H_PENDING = 1 << 30


def set_weight(layer, L: int, name: str, t: torch.Tensor) -> None:
    """Copy a written value into layer L's module (fused experts included)."""
    with torch.no_grad():
        layer_weight(layer, L, name).copy_(t)


class LayerOutputs:
    """The rounded weights of the layer in progress (`start(L)`): `emit` one Linear, `emit_rows`
    a batch of routed experts; `results` what the writer takes; `wait` until every copy to the
    host is done (the layer's end); `close` cancels the copies still queued. Several ranks: each
    rank sets its module's weights, rank 0 alone keeps what is written."""

    def __init__(self, device: torch.device, dist: Dist | None) -> None:
        self.device, self.dist = device, dist
        self.results = LayerResult(-1)
        self.host = ThreadPoolExecutor(1, thread_name_prefix="quantize-d2h")
        self.copies = Bounded(self.host, D2H_PENDING)

    def start(self, L: int) -> LayerResult:
        self.results = LayerResult(L)
        return self.results

    def wait(self) -> None:
        self.copies.wait_all()

    def close(self) -> None:
        self.host.shutdown(cancel_futures=True)

    def emit(self, layer, L: int, n: str, w: Int4Weight) -> None:
        """A rounded weight: into the module for pass 2, packed to the host for the writer."""
        set_weight(layer, L, n, dequantize(w, torch.float32))
        if self.dist is not None and not self.dist.leader:
            return  # only rank 0 writes the output
        outs = int4_outputs(w)  # packed where it was computed: 1/2 of the int8 codes' bytes
        if self.device.type == "cuda":  # to the host on the copy thread and its stream
            self.results.int4[n] = self.copies.submit(lambda ts: [to_host(t) for t in ts],
                                                      sum(t.nbytes for t in outs), outs)
        else:
            self.results.int4[n] = outs

    def emit_rows(self, layer, L: int, w: Int4Weight, parts: list[Part]) -> None:
        """A batch of rounded experts, w (e, R, K), each part one Linear's rows of one expert:
        as `emit` for each part, with the batch dequantized and packed at once and moved to
        the host in one copy (per Linear: ~10 small kernels, a copy and a thread hand-off, for
        768 Linears a GLM-5.2 layer). One process only (LayerRounding.run's `done_rows`).
        Asymmetric codes go part by part (their zero points are packed along the rows)."""
        if w.zero_point is not None:
            for n, i, rows in parts:
                self.emit(layer, L, n, part_of(w, i, rows))
            return
        e, R, K = w.q.shape
        flat = Int4Weight(w.q.reshape(e * R, K), w.scale.reshape(e * R, -1), None)
        deq = dequantize(flat, torch.float32).view(e, R, K)
        for n, i, rows in parts:
            set_weight(layer, L, n, deq[i, rows])
        del deq
        packed = pack_int4(flat.q).view(e, R, -1)
        shapes = w.q.to("meta")  # the codes' shapes for int4_outputs, not their memory

        def outputs(ph: torch.Tensor, sh: torch.Tensor, i: int, rows: slice) -> list[torch.Tensor]:
            # (views of the batch's host copy: contiguous rows)
            return int4_outputs(Int4Weight(shapes[i, rows], sh[i, rows], None), packed=ph[i, rows])

        futs = {n: Future() for n, _, _ in parts}  # (the CPU too: to_host returns its tensors)

        def split(batch: Future) -> None:  # (on the copy thread, once the batch is on the host)
            try:
                ph, sh = batch.result()
                for n, i, rows in parts:
                    futs[n].set_result(outputs(ph, sh, i, rows))
            except BaseException as exc:  # noqa: BLE001 - raised where the writer reads them
                for f in futs.values():
                    if not f.done():
                        f.set_exception(exc)

        batch = self.copies.submit(lambda p, s: (to_host(p), to_host(s)), packed.nbytes + w.scale.nbytes,
                                   packed, w.scale)
        batch.add_done_callback(split)
        self.results.int4.update(futs)
