"""The rounding of one calibrated layer's MLP, from the statistics its first pass gathered.

    r = LayerRounding(L, mlp, kind, targets, stats, ...)       after pass 1 (capture.MLPStats)
    report = r.run(done)          AWQ scales searched and folded (exactly, before rounding), then
                                  GPTQ batched over experts (across ranks under torchrun) or RTN;
                                  every INT4 result handed to `done(name, Int4Weight)` as soon
                                  as it exists; `r.mods` the BF16 tensors AWQ rescaled

The layer's driver (layer.LayerRunner) owns what happens to a result (into the module for the
second pass, to the host for the writer); this module owns which weights are read with which
scales (`round_awq.LayerWeights`), which Hessian each solve gets, and in what batches.

Statistics of a starved expert: with `--expert-coverage` N, one routed fewer than N tokens has
its Hessians topped up to N tokens by the tokens its router logit ranks highest among the rest
(capture.MLPStats.top_up; the report's `topped_up`). One whose statistics still cover fewer than
`min_expert_tokens` tokens falls back to all-token statistics (the layer's all-token gate/up
Hessian; down Hessian from a sample of all tokens run through it), and the report says which
and why.

AWQ folds: round_awq.py (which scales go where; quantize/rounding/awq.py searches them).

GPTQ runs batched over experts (quantize/rounding/gptq.py): gate and up of an expert share its Hessian,
so one (2I, H) solve per expert, up to GPTQ_BATCH experts at once (fewer when a quarter of the
free GPU memory does not hold them, `gptq_batch`). Routed gate/up Hessians are built per batch
from the layer's MLP inputs and each expert's routed rows (`MLPStats.experts_H_in`). Under
torchrun (`dist`) rank r owns a block of the experts: in step j every owner's j-th batch gets
its Hessians summed from every rank's tokens, each owner solves its batch, and every solved
expert goes to every rank in expert order; one process is the same loop with one owner.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.profiler import record_function

from quantize.calib.capture import EXPERT_BATCH, MLPStats, rounded_down_stats
from quantize.calib.decoder import ReadAhead, device_free
from quantize.calib.distributed import Dist, owned
from quantize.calib.folds import NormFold, awq_expected
from quantize.calib.round_awq import AWQ_SEARCH_EXPERTS, LayerWeights, search_and_fold
from quantize.options import ConvertOptions
from quantize.plan import Unit
from quantize.rounding.awq import AWQConfig
from quantize.rounding.gptq import GPTQConfig, accumulate_hessian, gptq_quantize
from quantize.rounding.int4 import Int4Weight, dequantize, quantize_rtn
from quantize.source.checkpoint import Checkpoint

__all__ = ["AWQ_SEARCH_EXPERTS", "GPTQ_BATCH", "LayerRounding", "LayerWeights", "Part", "Target",
           "awq_expected", "gptq_batch", "gptq_reserve", "part_of"]
# Experts per batched GPTQ solve at most: 32 GLM-5.2 experts (6144^2 factorizations, 2 x 2048
# rows each) already keep an H200 busy (measured: a batch of 32 takes 0.6 s, 19 ms/expert),
# and a larger batch only adds memory (~0.5 GB per expert).
GPTQ_BATCH = 32


class Sections:
    """Where the rounding phase goes, by section, without a synchronization inside it: on CUDA
    a pair of events around each section (the GPU time between them, read at the end), and
    everywhere the host's wall time in it (which on CUDA is the time to queue the work, unless
    the host waits: for weights, or a result). Each section is also a profiler range
    (`calib.<name>`). `seconds()`: {"gpu": {name: s}, "host": {name: s}} ("gpu" empty on CPU)."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> None:
        self.cuda, self.clock = device.type == "cuda", clock
        self.spans: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.host: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t = self.clock()
        with record_function(f"calib.{name}"):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            yield
            if self.cuda:
                b.record()
                self.spans.append((name, a, b))
        self.host[name] = self.host.get(name, 0.0) + self.clock() - t

    def seconds(self) -> dict:
        gpu: dict[str, float] = {}
        out: dict = {}
        try:
            if self.spans:
                self.spans[-1][2].synchronize()
                for name, a, b in self.spans:
                    gpu[name] = gpu.get(name, 0.0) + a.elapsed_time(b) / 1000
        except RuntimeError as e:  # a timing report is not worth a conversion: said, not raised
            gpu, out["gpu_error"] = {}, f"{type(e).__name__}: {e}"[:300]
        return {"gpu": {k: round(v, 3) for k, v in gpu.items()},
                "host": {k: round(v, 3) for k, v in self.host.items()}, **out}


@dataclass
class Target:
    """One Linear weight of the layer's MLP: where it lives on disk and in the module."""

    name: str  # checkpoint tensor name (`...weight`)
    quantize: bool  # a --targets Linear (else a BF16 tensor that AWQ may rescale)


def gptq_batch(shape: tuple[int, ...], E: int, device: torch.device, dist: Dist | None) -> int:
    """Experts per batched GPTQ solve: all of them when a quarter of the free device memory
    holds their gate/up working set (W, H, Hinv in float32, ~(2 K^2 + 4 I K) * 4 bytes), else as
    many as fit (GLM-5.2: K 6144, I 2048 -> 0.5 GB per expert), at most GPTQ_BATCH; at least 1.
    On the CPU: EXPERT_BATCH. The same on every rank (their collectives follow the batches)."""
    if device.type != "cuda":
        return min(EXPERT_BATCH, E)
    nb = max(1, min(E, GPTQ_BATCH, device_free(device) // gptq_reserve(shape, 1)))
    if dist is not None:
        nb = int(dist.all_reduce(torch.tensor([nb]), op="min").item())
    return nb


def gptq_reserve(shape: tuple[int, ...], E: int) -> int:
    """The free device memory `gptq_batch` wants for full batches of routed experts of
    gate/up weight `shape` (I, K): four times their working set (GLM-5.2: 64 GB)."""
    I, K = shape
    return 4 * min(E, GPTQ_BATCH) * (2 * K * K + 4 * I * K) * 4


# One Linear's part of a batch of experts' results: (its name, the expert's index in the batch,
# its rows of that expert's rows)
Part = tuple[str, int, slice]


def part_of(w: Int4Weight, i, sl=slice(None)) -> Int4Weight:
    zp = None if w.zero_point is None else w.zero_point[i][sl]
    return Int4Weight(w.q[i][sl], w.scale[i][sl], zp)


def _H_scaled(H: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    return H if s is None else H / (s.unsqueeze(-1) * s.unsqueeze(-2))  # inputs x / s


class LayerRounding:
    """One layer's MLP rounded from its statistics (module docstring). `run(done)` returns the
    report entries (tokens, expert counts, fallbacks, AWQ and GPTQ figures); afterwards `mods`
    holds the non-target tensors AWQ rescaled (norm, router, BF16 Linears), float32, and
    `awq_scales` the scales as applied (float32 on the host)."""

    def __init__(self, L: int, mlp: torch.nn.Module, kind: str, targets: dict[str, Target],
                 stats: MLPStats, ckpt: Checkpoint, units: dict[str, Unit], opts: ConvertOptions,
                 device: torch.device, dtype: torch.dtype, dist: Dist | None = None,
                 check_stop: Callable[[], None] = lambda: None,
                 norm_fold: NormFold | None = None, sections: Sections | None = None,
                 mlp_inputs: Callable[[Callable[[torch.Tensor], None]], None] | None = None) -> None:
        """`norm_fold`: where the MLP input's AWQ scale goes (folds.find_norm_fold on this
        layer); needed when AWQ rounds gate/up targets. `mlp_inputs(sink)`: hands every
        calibration token's MLP input (rounded stream, (T, H) at a time) to `sink` again, for
        `--sequential-mlp` (None: not available; pass 1's statistics are used)."""
        self.norm_fold, self.mlp_inputs = norm_fold, mlp_inputs
        self.L, self.mlp, self.kind, self.targets, self.stats = L, mlp, kind, targets, stats
        self.ckpt, self.opts, self.device, self.dtype, self.dist = ckpt, opts, device, dtype, dist
        self.check_stop = check_stop
        self.gptq_cfg = GPTQConfig(group_size=opts.group_size, symmetric=opts.symmetric,
                                   percdamp=opts.percdamp, mse_clip=opts.mse_clip,
                                   mse_norm=opts.mse_norm, mse_weight_power=opts.mse_weight_power,
                                   scale_refit=opts.scale_refit,
                                   gptaq=opts.gptaq, shrink=opts.hessian_shrink,
                                   descend=opts.descend)
        # routed experts: their own rounds of the scale re-fit (0 by default: its cost there) and
        # their own clip settings (the activation-weighted clip by default: options.py)
        self.gptq_cfg_routed = replace(self.gptq_cfg, scale_refit=opts.scale_refit_routed,
                                       mse_norm=opts.mse_norm_routed,
                                       mse_weight_power=opts.mse_weight_power_routed)
        self.awq_cfg = AWQConfig(group_size=opts.group_size, symmetric=opts.symmetric)
        self.p = f"model.layers.{L}.mlp."
        self.W = LayerWeights(ckpt, units, device)
        self.E = mlp.experts.num_experts if kind == "moe" else 0
        self.fallback: list[dict] = []
        self.topped_up: list[dict] = []  # (--expert-coverage)
        # AWQ's samples come from routed tokens only: an expert routed too few (topped up or
        # not) searches on the all-token sample
        self.few: set[int] = set()
        low = max(opts.min_expert_tokens, 1)
        if kind == "moe" and not stats.all_experts:  # (with "all" every expert saw every token)
            for e, n in enumerate(stats.expert_tokens):
                added = stats.added[e]
                if added:
                    self.topped_up.append({"expert": e, "tokens": n, "added": added})
                if n < low:
                    self.few.add(e)
                if stats.covered(e) < low and (stats.hessians or stats.samples):
                    more = f" + {added} added" if added else ""
                    self.fallback.append({"expert": e, "tokens": n, "reason":
                                          f"{n} routed tokens{more} < --min-expert-tokens "
                                          f"{opts.min_expert_tokens}: all-token statistics"})
        self.fb = {f["expert"] for f in self.fallback}
        self.x_sample = torch.cat(stats.x_sample)  # (T', H) float32, all tokens
        self.s_in: torch.Tensor | None = None  # AWQ's scale of the norm's output, when searched
        self.mods: dict[str, torch.Tensor] = {}
        self.awq_scales: dict[str, torch.Tensor] = {}
        self._damps: list[torch.Tensor] = []
        self._retries = 0
        # the rounding phase's split (the timings report; layer.LayerRunner's clock)
        self.sections = sections or Sections(device)

    # -- the layer ------------------------------------------------------------------------------

    def run(self, done: Callable[[str, Int4Weight], None],
            lap: Callable[[str], None] = lambda phase: None,
            done_rows: Callable[[Int4Weight, list[Part]], None] | None = None) -> dict:
        """Round the layer; `lap("awq_search")` once the AWQ scales are folded (the report's
        phase timing). `done_rows(w, parts)`, where given, takes a batch of routed experts'
        results at once (w (e, R, K); each part one Linear's rows of one expert) instead of
        `done` per Linear (one process only: several hand results on by expert)."""
        stats = self.stats
        report: dict = {"tokens": stats.tokens}
        if self.kind == "moe":
            report["expert_tokens"] = list(stats.expert_tokens)
            report["fallback"] = self.fallback
            if self.topped_up:
                report["topped_up"] = self.topped_up
        if "awq" in self.opts.method:
            f = search_and_fold(self.L, self.kind, self.E,
                                {n: t.quantize for n, t in self.targets.items()}, stats, self.W,
                                self.norm_fold, self.awq_cfg, self.x_sample,
                                self.expert_inter_sample, self.dtype)
            report["awq"], self.s_in, self.mods, self.awq_scales = f.report, f.s_in, f.mods, f.scales
        lap("awq_search")
        quant = [n for n, t in self.targets.items() if t.quantize]
        if "gptq" not in self.opts.method:
            with ReadAhead(self.W.__getitem__, quant, depth=32) as R:
                for n in quant:
                    done(n, quantize_rtn(R[n], self.opts.group_size, self.opts.symmetric))
        else:
            report.update(self._gptq(quant, done, done_rows))
            report["rounding_sections_s"] = self.sections.seconds()
        for n, t in self.targets.items():  # BF16 Linears AWQ rescaled, as they will be written
            if not t.quantize and self.W.scaled(n):
                self.mods[n] = self.W[n]
        return report

    def expert_inter_sample(self, e: int) -> torch.Tensor:
        """Expert e's down_proj inputs: its routed sample, or all-token sample through it."""
        stats, p = self.stats, self.p
        if e in self.few or stats.all_experts or e not in stats.inter_e:
            W_gu = torch.cat([self.W.source(f"{p}experts.{e}.gate_proj.weight"),
                              self.W.source(f"{p}experts.{e}.up_proj.weight")])  # unscaled
            gate, up = (self.x_sample @ W_gu.t()).chunk(2, dim=-1)
            return self.mlp.experts.act_fn(gate) * up
        return torch.cat(stats.inter_e[e])

    # -- GPTQ -----------------------------------------------------------------------------------

    def _solve(self, Ws: torch.Tensor, H: torch.Tensor, D: torch.Tensor | None = None,
               routed: bool = False) -> Int4Weight:
        r = gptq_quantize(Ws, H, self.gptq_cfg_routed if routed else self.gptq_cfg, D)
        self._damps.append(r.damp.max())  # a device scalar: read once at the end, no sync here
        self._retries += r.retries
        return r.weight

    def _gptq(self, quant: list[str], done: Callable[[str, Int4Weight], None],
              done_rows: Callable[[Int4Weight, list[Part]], None] | None) -> dict:
        stats, W, p = self.stats, self.W, self.p
        report: dict = {}
        H_in = _H_scaled(stats.H_in, self.s_in)
        routed = [e for e in range(self.E) if f"{p}experts.{e}.gate_proj.weight" in quant]
        nb = gptq_batch(W.shape(f"{p}experts.{routed[0]}.gate_proj.weight"), len(routed),
                        self.device, self.dist) if routed else 1
        report["gptq_expert_batch"] = nb
        if routed:
            self._gptq_routed(routed, nb, H_in, done, done_rows)
        rest = [n for n in quant if ".experts." not in n]  # shared experts / dense MLP
        gu = [n for n in rest if n.endswith(("gate_proj.weight", "up_proj.weight"))]
        with self.sections("gptq_shared_or_dense"):
            # (--gptaq: the asymmetric terms, scaled as their Hessians; None without it)
            D_in = None if stats.D_in is None else _H_scaled(stats.D_in, self.s_in)
            rounded: dict[str, tuple[torch.Tensor, Int4Weight]] = {}  # gate/up: (source, INT4)
            if gu:
                W_gu = torch.cat([W[n] for n in gu])  # (len(gu) * I, H); the solve leaves it as is
                w = self._solve(W_gu, H_in, D_in)
                rows = w.q.shape[0] // len(gu)
                for i, n in enumerate(gu):
                    rows_i = slice(i * rows, (i + 1) * rows)
                    rounded[n] = (W_gu[rows_i], part_of(w, rows_i))
                    done(n, rounded[n][1])
            for n in rest:
                if n.endswith("down_proj.weight"):
                    sc = W.col.get(n)
                    H_dn = _H_scaled(stats.H_down, sc)
                    D_dn = None if stats.D_down is None else _H_scaled(stats.D_down, sc)
                    if self.opts.sequential_mlp and rounded and self.mlp_inputs is not None:
                        H_dn, D_dn, report["sequential_mlp"] = self._sequential_down(n, rounded, D_dn)
                    done(n, self._solve(W[n], H_dn, D_dn))
        report["gptq"] = {"damp_max": float(torch.stack(self._damps).max()) if self._damps else None,
                          "retries": self._retries}
        return report

    def _sequential_down(self, down: str, rounded: dict[str, tuple[torch.Tensor, Int4Weight]],
                         D_pass1: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """--sequential-mlp: down_proj's H (and with GPTAQ its D: pass 1's plus the within-layer
        term) from the rounded gate/up's activations on every calibration token's MLP input
        (`capture.rounded_down_stats`), in the scaled space its weight is rounded in (AWQ: the
        inputs / s_in; up's rows / s are in its weight), summed over the ranks. Returns (H, D,
        the report's figures). `rounded`: the rounded gate/up, each with the source weight (as
        scaled) it was solved from, so that it is not read again."""
        stem = down[: -len("down_proj.weight")]
        dt = self.dtype

        def pair(proj: str) -> tuple[torch.Tensor, torch.Tensor]:  # (unrounded, as rounded), dt
            n = stem + proj + ".weight"
            if n not in rounded:  # (not a target: the source on both sides)
                u = self.W[n].to(dt)
                return u, u
            src, w = rounded[n]
            return src.to(dt), dequantize(w, dt)

        act = (self.mlp.shared_experts if self.kind == "moe" else self.mlp).act_fn
        H, C, n = rounded_down_stats(self.mlp_inputs, act, pair("gate_proj"), pair("up_proj"), dt,
                                     self.s_in, cross=D_pass1 is not None)
        if self.dist is not None:  # each rank's tokens: means over every rank's
            n_all = int(self.dist.all_reduce(torch.tensor([n], dtype=torch.int64)).item())
            H = self.dist.all_reduce(H * (n / n_all))
            C = None if C is None else self.dist.all_reduce(C * (n / n_all))
            n = n_all
        fig: dict = {"tokens": n}
        if C is None:
            return H, None, fig
        D_within = C - H
        fig["D_within_rel"] = float(D_within.norm() / H.norm().clamp(min=1e-30))
        return H, D_pass1 + D_within, fig

    def _gptq_routed(self, routed: list[int], nb: int, H_in: torch.Tensor,
                     done: Callable[[str, Int4Weight], None],
                     done_rows: Callable[[Int4Weight, list[Part]], None] | None) -> None:
        """The routed experts' GPTQ in batches of nb, their owners' batches in step (one
        process: one owner). Per step: each owner's gate/up and down Hessians (summed onto it
        from every rank's tokens), its solves, its results to `done` (every rank: in expert
        order, broadcast from the owner); the next batches' weights read meanwhile."""
        stats, W, d, fb, dev, sec = self.stats, self.W, self.dist, self.fb, self.device, self.sections
        world, rank = (1, 0) if d is None else (d.world, d.rank)
        own = [[e for e in routed if owned(e, self.E, world) == o] for o in range(world)]
        mine = own[rank]
        name = f"{self.p}experts.{{}}.{{}}.weight".format
        I, K = W.shape(name(routed[0], "gate_proj"))
        order = [name(e, proj) for c in range(0, len(mine), nb)
                 for proj in ("gate_proj", "up_proj", "down_proj") for e in mine[c: c + nb]]
        steps = max(-(-len(x) // nb) for x in own)

        def publish(w: Int4Weight, parts: list[Part], emit: Callable[[str, Int4Weight], None]) -> None:
            if d is None and done_rows is not None:  # the batch at once
                done_rows(w, parts)
            else:
                for n, i, rows in parts:
                    emit(n, part_of(w, i, rows))

        with ReadAhead(W.__getitem__, order, depth=min(2 * nb, 64)) as R:
            for j in range(steps):
                if d is None:
                    self.check_stop()  # (ranks leave together, at the layer's end)
                H_gu, H_dn = self._batch_hessians(own, j * nb, (j + 1) * nb, K, I)
                got: dict[str, Int4Weight] = {}
                emit = done if d is None else got.__setitem__
                es = mine[j * nb:(j + 1) * nb]
                if es:
                    with sec("read_weights"):
                        Ws = torch.stack([torch.cat([R[name(e, "gate_proj")], R[name(e, "up_proj")]])
                                          for e in es])  # (e, 2I, H)
                    if stats.all_experts:  # one Hessian for every expert: one solve of e*2I rows
                        w = self._solve(Ws.reshape(-1, K), H_in, routed=True)
                        w = Int4Weight(*(None if t is None else t.reshape(len(es), -1, t.shape[-1])
                                         for t in w))
                    else:  # gate and up of an expert share its routed-token Hessian
                        for i, e in enumerate(es):
                            if e in fb:  # a starved expert: all-token statistics (scaled)
                                H_gu[i] = H_in
                            elif self.s_in is not None:
                                H_gu[i] = _H_scaled(H_gu[i], self.s_in)
                        with sec("gptq_gate_up"):
                            w = self._solve(Ws, H_gu, routed=True)
                    del Ws, H_gu
                    with sec("publish"):
                        publish(w, [(name(e, proj), i, rows) for i, e in enumerate(es) for proj, rows
                                    in (("gate_proj", slice(0, I)), ("up_proj", slice(I, None)))], emit)
                    for i, e in enumerate(es):
                        n = name(e, "down_proj")
                        if e in fb:  # all-token statistics for a starved expert
                            H_dn[i], _ = accumulate_hessian(torch.zeros(I, I, device=dev),
                                                            self.expert_inter_sample(e), 0)
                        H_dn[i] = _H_scaled(H_dn[i], W.col.get(n))
                    with sec("gptq_down"):
                        w = self._solve(torch.stack([R[name(e, "down_proj")] for e in es]), H_dn,
                                        routed=True)
                    del H_dn
                    with sec("publish"):
                        publish(w, [(name(e, "down_proj"), i, slice(None)) for i, e in enumerate(es)], emit)
                if d is not None:  # every solved expert to every rank, in expert order
                    self._share_results(own, j * nb, (j + 1) * nb, got, done)

    def _batch_hessians(self, own: list[list[int]], a: int, b: int, K: int, I: int
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This rank's batch of routed Hessians, gate/up (e, K, K) (None when every expert
        shares H_in) and down (e, I, I), summed over every rank's tokens: each owner's batch
        own[o][a:b] in turn, reduced onto it."""
        stats, d, fb, dev = self.stats, self.dist, self.fb, self.device
        rank = 0 if d is None else d.rank
        H_gu = H_dn = None
        for o, experts in enumerate(own):
            es = experts[a:b]
            if not es:
                continue
            if not stats.all_experts:  # (all-expert gate/up share H_in)
                Hb = torch.empty(len(es), K, K, device=dev)  # (e, H, H)
                with self.sections("routed_hessians"):
                    stats.experts_H_in(es, Hb, skip=fb)  # this rank's share, or 0
                if d is not None:
                    d.reduce_to(Hb, o)
                H_gu = Hb if o == rank else H_gu
                del Hb
            Hd = torch.zeros(len(es), I, I, device=dev)  # (e, I, I)
            for i, e in enumerate(es):
                H = stats.expert_H_down(e)  # (released)
                if e not in fb and H is not None:
                    Hd[i] = H
            if d is not None:
                d.reduce_to(Hd, o)
            H_dn = Hd if o == rank else H_dn
            del Hd
        return H_gu, H_dn

    def _share_results(self, own: list[list[int]], a: int, b: int, got: dict[str, Int4Weight],
                       done: Callable[[str, Int4Weight], None]) -> None:
        """Several ranks: every owner's solved experts own[o][a:b] broadcast to every rank and
        handed to `done` in expert order (`got`: this rank's own results)."""
        d, W, g, dev = self.dist, self.W, self.opts.group_size, self.device
        name = f"{self.p}experts.{{}}.{{}}.weight".format
        for o in range(d.world):
            for e in own[o][a:b]:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    n = name(e, proj)
                    N_, K_ = W.shape(n)
                    w = got.pop(n, None)
                    if w is None:  # another rank's: room for it
                        q = torch.empty(N_, K_, dtype=torch.int8, device=dev)
                        sc = torch.empty(N_, K_ // g, dtype=torch.bfloat16, device=dev)
                        zp = None if self.opts.symmetric else torch.empty_like(q[:, :K_ // g])
                        w = Int4Weight(q, sc, zp)
                    done(n, Int4Weight(*(None if t is None else d.broadcast(t.contiguous(), o)
                                         for t in w)))
