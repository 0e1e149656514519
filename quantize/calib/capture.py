"""The calibration forwards of a layer's MLP, and the statistics they collect (`MLPStats`).

transformers v5 fuses a MoE block's experts into 3-D parameters (`experts.gate_up_proj`
(E, 2I, H), `experts.down_proj` (E, H, I)) and exposes no per-expert inputs, so the calibration
runs the MLP through `moe_forward` / `dense_forward`: the same output as the module's forward,
op for op (tests/test_calibrate.py proves them equal), feeding each Linear's inputs to `MLPStats`.

MoE statistics (`expert_calibration`):
    routed  expert e's gate/up Hessian from the tokens routed to e, its down Hessian from its
            intermediate activations on those tokens (an expert below `min_expert_tokens`
            falls back to all-token statistics: the caller decides, the report says so)
            With `cover` N (`--expert-coverage`), an expert routed fewer than N tokens has its
            statistics topped up to N with the tokens its router logit ranks highest among
            those not routed to it (the tokens the router nearly sent it; coverage.py),
            instead of the all-token fallback; the report says which and how many
    routed-weighted
            the same, each token's row scaled by its routing weight w_t (the expert's output
            enters the layer's as w_t y_t, so sum_t w_t^2 x_t x_tᵀ weighs its rounding error as
            the layer output sees it); still divided by the token count (GPTQ and the MSE clip
            do not depend on a Hessian's scale)
    all     every expert's statistics from every token: the gate/up Hessian is the layer's
            single all-token Hessian, the down Hessians from every token through every expert;
            only routed outputs flow on

`--gptaq` (asymmetric calibration): the forwards also take `x_fp`, the same tokens' MLP inputs in
the unrounded model (the calibration carries that stream too), and the dense / shared Linears
get D = 2 (Xf - X)ᵀ X / n beside H = 2 XᵀX / n (`D_in`, `D_down`; the down projection's inputs
in both streams through the unrounded gate/up), kept as the cross term C = 2 Xfᵀ X / n (one
GEMM as H's: bf16 inputs, float32 accumulation on CUDA) so that D = C - H. Routed experts keep
plain GPTQ: which tokens reach an expert differs between the two streams.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from quantize.calib import moe_triton
from quantize.calib.coverage import Candidates
from quantize.calib.decoder import MOE_CLASSES
from quantize.rounding.gptq import accumulate_hessian, xtx

__all__ = ["EXPERT_BATCH", "SAMPLE_EXPERT_TOKENS", "SAMPLE_TOKENS", "MLPStats", "dense_forward",
           "expert_inter", "grouped_linear", "moe_forward", "moe_output",
           "moe_output_forward", "rounded_down_stats"]

SAMPLE_TOKENS = 2048  # all-token MLP inputs kept for AWQ's search and expert fallbacks
SAMPLE_EXPERT_TOKENS = 256  # routed intermediate activations kept per expert for AWQ
EXPERT_BATCH = 32  # experts per AWQ search / all-expert pass (bounds their GPU memory)
# Rows per routed gate/up XᵀX GEMM: an expert's routed rows of several statistics calls are
# gathered into one block first. GLM-5.2 (width 6144) on an H200: ~2,000 rows (what one
# 64k-token call routes to an expert) run at 515 TFLOP/s, 8,192 at 773
# (benchmarks/h200_profile_routed_hessians.json); a batch of 32 experts then holds at most
# ~3.2 GB of pending rows.
ROWS_PER_XTX = 8192




@dataclass
class MLPStats:
    """What pass 1 collects for one layer's MLP; which parts are filled depends on the method.

    A routed expert's gate/up Hessian 2 XᵀX / n is built when its GPTQ batch is solved
    (`experts_H_in`), from the layer's MLP inputs and the rows routed to it, instead of 256
    float32 (H, H) running sums held through the whole pass (GLM-5.2: 38.7 GB). The inputs are
    either kept (`x_store`: GLM-5.2 at 512 x 2048 tokens, 12.9 GB of bf16) or, with `x_of`,
    recomputed per statistics call c when a batch needs them (the calibration's hidden states
    hold the layer's residual stream after the attention: x is its norm, a cheap pass; the
    layer runner chooses, `LayerRunner._keep_mlp_inputs`). An expert's rows are summed in
    blocks of at least ROWS_PER_XTX, gathered across the calls. With
    `store_tokens` off the sums are kept instead, a size that does not grow with the
    calibration set.
    """

    kind: str  # "moe" | "dense"
    hessians: bool  # GPTQ needs them
    samples: bool  # AWQ needs activation samples
    all_experts: bool  # expert_calibration == "all"
    router_weighted: bool = False  # expert_calibration == "routed-weighted"
    num_experts: int = 0
    store_tokens: bool = True  # routed gate/up Hessians from the inputs (else running sums)
    x_of: Callable[[int], torch.Tensor] | None = None  # call c's MLP inputs, recomputed (not kept)
    tokens: int = 0
    H_in: torch.Tensor | None = None  # (H, H) all MLP-input tokens
    H_down: torch.Tensor | None = None  # dense / shared down_proj (I, I)
    n_down: int = 0
    expert_tokens: list[int] = field(default_factory=list)  # routed tokens per expert
    x_store: list[torch.Tensor] = field(default_factory=list)  # MLP inputs (T_c, H) per chunk
    # (chunk, rows, routing weights or None) per expert
    rows_e: dict[int, list[tuple[int, torch.Tensor, torch.Tensor | None]]] = field(default_factory=dict)
    S_in_e: dict[int, torch.Tensor] = field(default_factory=dict)  # XᵀX sums (no store_tokens)
    S_down_e: dict[int, torch.Tensor] = field(default_factory=dict)  # down inputs' XᵀX sums
    S_down_all: torch.Tensor | None = None  # (E, I, I) the same, all-expert mode
    n_down_e: dict[int, int] = field(default_factory=dict)
    x_sample: list[torch.Tensor] = field(default_factory=list)  # all-token MLP inputs (float32)
    inter_sample: list[torch.Tensor] = field(default_factory=list)  # dense/shared down inputs
    inter_e: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # routed down inputs
    C_in: torch.Tensor | None = None  # --gptaq: 2 Xfᵀ X / n of the MLP inputs (H, H)
    C_down: torch.Tensor | None = None  # --gptaq: the same of the dense / shared down inputs
    n_asym: int = 0  # tokens in C_in and C_down (every token of H_in and H_down)
    cover: int = 0  # --expert-coverage N: routed experts' statistics topped up to N tokens
    candidates: Candidates | None = None  # (with cover: kept through the pass, until top_up)
    added: list[int] = field(default_factory=list)  # tokens added per expert (every rank's)
    near_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # this rank's added rows

    def __post_init__(self) -> None:
        self.expert_tokens = [0] * self.num_experts
        self.added = [0] * self.num_experts

    def covered(self, e: int) -> int:
        """Tokens in expert e's routed statistics: routed to it, plus those `top_up` added."""
        return self.expert_tokens[e] + self.added[e]

    @property
    def routed_hessians(self) -> bool:
        return self.hessians and not self.all_experts

    @staticmethod
    def _keep(buf: list[torch.Tensor], x: torch.Tensor, limit: int) -> None:
        have = sum(t.shape[0] for t in buf)
        if have < limit:
            buf.append(x[: limit - have].float().clone())

    def all_reduce(self, d, device: torch.device) -> None:
        """Several ranks (`d`: distributed.Dist; None: one process, nothing to do): token
        counts summed on every rank, the all-token and dense / shared Hessians summed (weighted
        by tokens) on every rank, rank 0's all-token input sample on every rank. The routed
        experts' Hessians are summed onto their owners later, one GPTQ batch at a time
        (round_layer's `_gptq_routed`, one batch per step)."""
        if d is None:
            return
        E = self.num_experts
        counts = torch.tensor([self.tokens, self.n_down, *self.expert_tokens,
                               *[self.n_down_e.get(e, 0) for e in range(E)]], dtype=torch.int64)
        c = d.all_reduce(counts).tolist()
        n_in, n_down = self.tokens, self.n_down
        self.tokens, self.n_down = c[0], c[1]
        self.expert_tokens = c[2:2 + E]
        self.n_down_e = {e: n for e, n in enumerate(c[2 + E:]) if n}
        if self.H_in is not None:  # 2 XᵀX / n per rank -> over every rank's tokens
            self.H_in = d.all_reduce(self.H_in * (n_in / self.tokens))
        if self.H_down is not None:
            self.H_down = d.all_reduce(self.H_down * (n_down / self.n_down))
        if self.C_in is not None:  # (--gptaq: every rank carries both streams)
            n_a = self.n_asym
            self.n_asym = int(d.all_reduce(torch.tensor([n_a], dtype=torch.int64)).item())
            self.C_in = d.all_reduce(self.C_in * (n_a / self.n_asym))
            self.C_down = d.all_reduce(self.C_down * (n_a / self.n_asym))
        xs = torch.cat(self.x_sample) if self.x_sample else None
        shape = d.broadcast_object(None if xs is None else tuple(xs.shape))
        if shape is not None:
            buf = xs.contiguous() if d.leader else torch.empty(shape, device=device)
            self.x_sample = [d.broadcast(buf, 0)]

    def mlp_input(self, x: torch.Tensor) -> None:  # x (T, H); after the chunk's routed() calls
        self.tokens += x.shape[0]
        if self.hessians:
            self.H_in, _ = accumulate_hessian(self._zeros(self.H_in, x.shape[-1], x), x,
                                              self.tokens - x.shape[0])
        if self.kind == "moe" and self.routed_hessians and self.store_tokens:
            # call index len(x_store) - 1, as routed() recorded; None: `x_of` recomputes it
            self.x_store.append(x if self.x_of is None else None)
        self._keep(self.x_sample, x, SAMPLE_TOKENS)

    def asym(self, xf: torch.Tensor, x: torch.Tensor, interf: torch.Tensor,
             inter: torch.Tensor) -> None:
        """--gptaq: the same tokens' MLP inputs (T, H) and down inputs (T, I) in the unrounded
        model's stream (xf, interf) and in the rounded one's (x, inter), into the running means
        C = 2 Xfᵀ X / n (the same tokens then go to `mlp_input` / `down_input`)."""
        if xf.shape != x.shape or interf.shape != inter.shape:
            raise ValueError(f"MLPStats.asym: the streams' shapes differ ({tuple(xf.shape)} vs "
                             f"{tuple(x.shape)}, {tuple(interf.shape)} vs {tuple(inter.shape)})")
        n_old, self.n_asym = self.n_asym, self.n_asym + x.shape[0]
        self.C_in = _cross_mean(self.C_in, xf, x, n_old, self.n_asym)
        self.C_down = _cross_mean(self.C_down, interf, inter, n_old, self.n_asym)

    @property
    def D_in(self) -> torch.Tensor | None:
        """--gptaq: D = 2 (Xf - X)ᵀ X / n of the MLP inputs, C - H (None without it)."""
        return self._D(self.C_in, self.H_in, self.tokens)

    @property
    def D_down(self) -> torch.Tensor | None:
        """--gptaq: the same of the dense / shared down_proj inputs."""
        return self._D(self.C_down, self.H_down, self.n_down)

    def _D(self, C: torch.Tensor | None, H: torch.Tensor | None, n: int) -> torch.Tensor | None:
        if C is None:
            return None
        if H is None or n != self.n_asym:  # C and H must cover the very same tokens
            raise RuntimeError(f"MLPStats: GPTAQ's cross term covers {self.n_asym} tokens, the "
                               f"Hessian {n}: the two streams were not fed together")
        return C - H

    def down_input(self, inter: torch.Tensor) -> None:  # dense / shared (T, I)
        if self.hessians:
            self.H_down, self.n_down = accumulate_hessian(
                self._zeros(self.H_down, inter.shape[-1], inter), inter, self.n_down)
        if self.samples:
            self._keep(self.inter_sample, inter, SAMPLE_TOKENS)

    def routed(self, e: int, x: torch.Tensor, inter: torch.Tensor, rows: torch.Tensor,
               weights: torch.Tensor | None = None) -> None:
        """Expert e's routed tokens of the current chunk: inputs x (n, H) = the chunk's rows
        `rows`, its down_proj inputs inter (n, I), and their routing weights (n,) (used with
        `router_weighted`)."""
        self.expert_tokens[e] += x.shape[0]
        if self.routed_hessians:
            w = weights if self.router_weighted else None
            if self.store_tokens:
                self.rows_e.setdefault(e, []).append((len(self.x_store), rows, w))
            else:
                self.S_in_e[e] = xtx(_weighted(x, w), self.S_in_e.get(e))
            self.expert_down(e, _weighted(inter, w))
        if self.samples:
            self._keep(self.inter_e.setdefault(e, []), inter, SAMPLE_EXPERT_TOKENS)

    def nearest(self, logits: torch.Tensor, topk_indices: torch.Tensor, x: torch.Tensor,
                topk_weights: torch.Tensor) -> None:
        """--expert-coverage: the chunk's router logits (T, E), routed expert ids and weights
        (T, k) and MLP inputs x (T, H), to the candidates (coverage.Candidates)."""
        if self.cover and self.routed_hessians:
            if self.candidates is None:
                self.candidates = Candidates(self.cover, self.router_weighted)
            self.candidates.observe(logits, topk_indices, x, topk_weights)

    def top_up(self, experts: torch.nn.Module, d=None) -> None:
        """--expert-coverage, after the pass (and after `all_reduce`'s counts): each expert
        routed fewer than `cover` tokens (over every rank) gets the candidates with the highest
        logits (over every rank), up to `cover` in all; their inputs go into its gate/up
        statistics (`experts_H_in`), their down_proj inputs through `experts`' weights (the
        unrounded layer's, as its routed tokens') into its down statistics; `added` says how
        many per expert."""
        if self.candidates is None:
            return
        self.added, rows = self.candidates.choose(self.expert_tokens, d)
        self.candidates = None
        W = experts.gate_up_proj
        for e, (x, w) in rows.items():
            gate, up = F.linear(x.to(W.dtype), W[e]).chunk(2, dim=-1)
            inter = experts.act_fn(gate) * up
            self.near_rows[e] = _weighted(x, w)  # (as routed() weighs a routed token's rows)
            self.S_down_e[e] = xtx(_weighted(inter, w), self.S_down_e.get(e))
        for e, a in enumerate(self.added):
            if a:
                self.n_down_e[e] = self.n_down_e.get(e, 0) + a

    def expert_down(self, e: int, inter: torch.Tensor) -> None:
        self.S_down_e[e] = xtx(inter, self.S_down_e.get(e))
        self.n_down_e[e] = self.n_down_e.get(e, 0) + inter.shape[0]

    def experts_down(self, es: range, inter: torch.Tensor) -> None:
        """All-expert mode: the down_proj inputs of experts `es` on every token (e, T, I),
        summed into one (E, I, I) tensor with one batched matmul."""
        if self.S_down_all is None:
            I = inter.shape[-1]
            self.S_down_all = torch.zeros(self.num_experts, I, I, device=inter.device)
        xtx(inter, self.S_down_all[es.start:es.stop])
        for e in es:
            self.n_down_e[e] = self.n_down_e.get(e, 0) + inter.shape[1]

    def expert_H_in(self, e: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """2 XᵀX / n over the tokens routed to expert e (None if it got none); its statistics
        are released. `out`: a (H, H) float32 tensor to write it into."""
        K = self.H_in.shape[-1]
        buf = torch.empty(1, K, K, device=self.H_in.device) if out is None else out[None]
        return buf[0] if self.experts_H_in([e], buf)[0] else None

    def experts_H_in(self, es: list[int], out: torch.Tensor, skip: set[int] = frozenset()
                     ) -> list[bool]:
        """2 XᵀX / n over the tokens routed to each expert es[j], into out[j] ((H, H) float32;
        zeros where it got none or is in `skip`); which got any. Their statistics are released.
        Each call's inputs are read (or recomputed) once for the whole batch."""
        have = [False] * len(es)
        want = {e: j for j, e in enumerate(es) if e not in skip}
        near_of = {e: self.near_rows.pop(e, None) for e in es}  # (--expert-coverage: top_up's rows)
        if not self.store_tokens:
            for e, j in want.items():
                S = self.S_in_e.pop(e, None)
                near = near_of[e]
                if near is not None:
                    S = xtx(near, S)
                if S is None:
                    out[j].zero_()
                else:
                    torch.mul(S, 2.0 / self.covered(e), out=out[j])
                    have[j] = True
            return have
        by_call: dict[int, list[tuple[int, torch.Tensor, torch.Tensor | None]]] = {}
        for e in es:
            for c, r, w in self.rows_e.pop(e, None) or []:
                if e in want:
                    by_call.setdefault(c, []).append((want[e], r, w))
        for j in range(len(es)):
            out[j].zero_()
        pending: dict[int, list[torch.Tensor]] = {}  # expert j's gathered rows, not yet summed
        rows = [0] * len(es)

        def flush(j: int) -> None:
            block = pending.pop(j)
            xtx(block[0] if len(block) == 1 else torch.cat(block), acc=out[j])
            rows[j] = 0
            have[j] = True

        for c in sorted(by_call):
            x = self.x_store[c] if self.x_store[c] is not None else self.x_of(c)
            for j, r, w in by_call[c]:
                pending.setdefault(j, []).append(_weighted(x.index_select(0, r), w))
                rows[j] += r.numel()
                if rows[j] >= ROWS_PER_XTX:
                    flush(j)
            del x
        for j in list(pending):
            flush(j)
        for e, j in want.items():
            if near_of[e] is not None:
                xtx(near_of[e], acc=out[j])
                have[j] = True
            if have[j]:
                out[j].mul_(2.0 / self.covered(e))
        return have

    def expert_H_down(self, e: int) -> torch.Tensor | None:
        """2 XᵀX / n of expert e's down_proj inputs (None if it got none), released."""
        if self.S_down_all is not None:
            return self.S_down_all[e] * (2.0 / self.n_down_e[e])
        S = self.S_down_e.pop(e, None)
        return None if S is None else S.mul_(2.0 / self.n_down_e[e])

    @staticmethod
    def _zeros(H: torch.Tensor | None, K: int, like: torch.Tensor) -> torch.Tensor:
        return H if H is not None else torch.zeros(K, K, device=like.device)


def _cross_mean(C: torch.Tensor | None, xf: torch.Tensor, x: torch.Tensor, n_old: int,
                n: int) -> torch.Tensor:
    """The running mean 2 Xfᵀ X / n, float32, updated with one batch of rows, as
    `accumulate_hessian` updates H (the same GEMM: `xtx`)."""
    step = xtx(xf.to(x.dtype), Y=x)
    # (the very arithmetic of accumulate_hessian: where the streams agree, C - H is exactly 0)
    return step * (2.0 / n) if C is None else C * (n_old / n) + step * (2.0 / n)


def rounded_down_stats(mlp_inputs: Callable[[Callable[[torch.Tensor], None]], None],
                       act: Callable[[torch.Tensor], torch.Tensor],
                       gate: tuple[torch.Tensor, torch.Tensor], up: tuple[torch.Tensor, torch.Tensor],
                       dtype: torch.dtype, s_in: torch.Tensor | None = None, cross: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """--sequential-mlp: a gate/up/down MLP's down_proj statistics after its gate/up are
    rounded. `mlp_inputs(sink)` hands every token's MLP input x (T, H) to sink; gate and up are
    (unrounded, rounded) weights in `dtype`; s_in: AWQ's input scale (x / s_in, as the weights'
    columns * s_in). Returns H = 2 XqᵀXq / n of Xq = act(gate_q x) * up_q x, with `cross` the
    running mean C = 2 XuᵀXq / n of the unrounded Xu beside it (D = C - H: what rounding gate/up
    moved, as `MLPStats.asym` keeps the streams' drift), and n."""
    (g_u, g_q), (u_u, u_q) = gate, up
    H: torch.Tensor | None = None
    C: torch.Tensor | None = None
    n = 0

    def sink(x: torch.Tensor) -> None:
        nonlocal H, C, n
        x = x.reshape(-1, x.shape[-1]).to(dtype)
        if s_in is not None:
            x = x / s_in.to(dtype)
        xq = act(F.linear(x, g_q)) * F.linear(x, u_q)
        if cross:
            C = _cross_mean(C, act(F.linear(x, g_u)) * F.linear(x, u_u), xq, n, n + xq.shape[0])
        H0 = torch.zeros(xq.shape[-1], xq.shape[-1], device=xq.device) if H is None else H
        H, n = accumulate_hessian(H0, xq, n)

    mlp_inputs(sink)
    if H is None:
        raise RuntimeError("rounded_down_stats: no MLP inputs were handed over")
    return H, C, n


def _weighted(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """Rows of x (n, K) scaled by w (n,) in x's dtype (None: x itself), so that XᵀX sums
    w_t^2 x_t x_tᵀ."""
    return x if w is None else x * w.to(x.dtype)[:, None]


def expert_inter(experts: torch.nn.Module, es: range, x: torch.Tensor) -> torch.Tensor:
    """act(gate_e x) * up_e x for experts `es` on all tokens x (T, H) -> (len(es), T, I)."""
    gu = torch.matmul(x.unsqueeze(0), experts.gate_up_proj[es.start:es.stop].transpose(1, 2))
    gate, up = gu.chunk(2, dim=-1)  # (e, T, I) each
    return experts.act_fn(gate) * up


def grouped_mm(x: torch.Tensor, W: torch.Tensor) -> Callable | None:
    """The grouped GEMM `grouped_linear` runs, or None for a loop of GEMMs: bf16 on CUDA where
    torch's grouped_mm runs (F.grouped_mm, torch >= 2.10, or torch._grouped_mm >= 2.9: compute
    capability 8.0 and later; torch._grouped_mm before 2.9: Hopper only, as transformers' own
    check says)."""
    if not (x.is_cuda and x.dtype == W.dtype == torch.bfloat16):
        return None
    cc = torch.cuda.get_device_capability(x.device)
    if hasattr(F, "grouped_mm"):
        return F.grouped_mm if cc >= (8, 0) else None
    if hasattr(torch, "_grouped_mm"):
        major, minor = (int(v) for v in torch.__version__.split(".")[:2])
        runs = cc >= (8, 0) if (major, minor) >= (2, 9) else cc[0] == 9
        return torch._grouped_mm if runs else None
    return None


def grouped_linear(x: torch.Tensor, W: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """x (S, K) whose rows come grouped by expert (counts[e] rows of expert e, in expert
    order), W (E, N, K) -> (S, N): each group's rows times its expert's W[e]ᵀ. One grouped GEMM
    where `grouped_mm` finds one (the kernel transformers' fused experts run on CUDA), else
    one F.linear per expert (the very ops of transformers' eager loop)."""
    fn = grouped_mm(x, W)
    if fn is not None:
        offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32).to(x.device, non_blocking=True)
        return fn(x, W.transpose(-2, -1), offs=offs)
    out = x.new_empty(x.shape[0], W.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start:start + n] = F.linear(x[start:start + n], W[e])
        start += n
    return out


def _route(moe: torch.nn.Module, x: torch.Tensor, token_major: bool
           ) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor, torch.Tensor]:
    """The router on x (..., H) (T tokens), its (token, top-k slot) pairs grouped by expert with one
    stable sort and one host read of the counts: (the pairs' flat positions in expert order,
    the routing weights (T, k), each expert's pair count (E entries), the (T, k) expert ids,
    the router's logits (T, E)).
    `token_major`: positions p = token * k + slot (ascending within an expert), else
    p = slot * T + token, the order transformers' eager loop visits an expert's pairs
    (torch.where over its (k, T) one-hot mask). An id of E (expert parallelism's sentinel)
    is dropped."""
    logits, topk_weights, topk_indices = moe.gate(x)  # (T, E), (T, k), (T, k)
    E = moe.experts.num_experts
    with torch.no_grad():
        flat = (topk_indices if token_major else topk_indices.t()).reshape(-1)
        order = torch.argsort(flat, stable=True)  # grouped by expert, p ascending within one
        counts = torch.bincount(flat, minlength=E + 1).tolist()[:E]
    return order[:sum(counts)], topk_weights, counts, topk_indices, logits


def moe_forward(moe: torch.nn.Module, x: torch.Tensor, stats: MLPStats | None = None,
                outputs: bool = True, x_fp: torch.Tensor | None = None) -> torch.Tensor | None:
    """`GlmMoeDsaMoE.forward` / `Glm4MoeMoE.forward`, op for op, exposing each expert's routed
    tokens (and, with `stats.all_experts`, every expert's activations on every token).
    `outputs=False`: statistics only, returns None (no down projections, no sum). `x_fp`: the
    same tokens in the unrounded model's stream (--gptaq: the shared experts' D terms).
    (One GEMM per expert, as transformers' eager loop: on an H200 a grouped GEMM of every
    expert's gate/up made this statistics forward no faster, 1.36 against 1.33 s per 1 M
    GLM-5.2 tokens, and its gathered rows cost 12 GB more at 65k tokens a call:
    benchmarks/h200_moe_forward.json.)"""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])  # (T, H)
    experts = moe.experts
    E = experts.num_experts
    out = torch.zeros_like(xf) if outputs else None
    T = xf.shape[0]
    p_all, topk_weights, counts, topk_indices, logits = _route(moe, x, token_major=False)
    if stats is not None:
        stats.nearest(logits, topk_indices, xf, topk_weights)
    start = 0
    for e, n in enumerate(counts):
        p, start = p_all[start:start + n], start + n
        if n == 0:
            continue
        top_k_pos, token_idx = p // T, p % T
        current = xf[token_idx]
        gate, up = F.linear(current, experts.gate_up_proj[e]).chunk(2, dim=-1)
        inter = experts.act_fn(gate) * up
        w = topk_weights[token_idx, top_k_pos]  # (n,) the routing weight of each pair
        if outputs:
            y = F.linear(inter, experts.down_proj[e]) * w[:, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        if stats is not None:
            stats.routed(e, current, inter, token_idx, w)
    sh = moe.shared_experts
    inter_s = sh.act_fn(sh.gate_proj(x)) * sh.up_proj(x)
    if stats is not None:
        if x_fp is not None:
            _asym(stats, sh, x_fp, x, inter_s)
        stats.mlp_input(xf)
        stats.down_input(inter_s.reshape(-1, inter_s.shape[-1]))
        if stats.all_experts and stats.hessians:
            for s in range(0, E, EXPERT_BATCH):
                es = range(s, min(s + EXPERT_BATCH, E))
                stats.experts_down(es, expert_inter(experts, es, xf))  # (e, T, I)
    return out.view(*shape) + sh.down_proj(inter_s) if outputs else None


# Tokens per step of `moe_output`'s weighted sum over the top-k outputs (its float32 scratch:
# GLM-5.2, 8 x 6144 floats a token, 1.6 GB per 8,192 tokens)
COMBINE_TOKENS = 8192


def moe_output(moe: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MoE block's output on x (..., H), as `GlmMoeDsaMoE.forward` / `Glm4MoeMoE.forward`
    compute it with transformers' grouped_mm experts (the router; each expert's rows through
    gate/up, the activation and down, one grouped GEMM a projection; the top-k outputs times
    their float32 routing weights summed in float32; + the shared experts), for pass 2: with
    the routed rows sorted once (token-major, so the sum is deterministic) and the weighted
    sum one kernel on CUDA (`moe_triton.combine_topk`), else done in steps of COMBINE_TOKENS,
    its scratch is bf16 rows, not a float32 copy of every routed row, so a call can take
    more tokens."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])  # (T, H)
    experts = moe.experts
    p, topk_weights, counts, idx, _ = _route(moe, x, token_major=True)
    T, k = idx.shape
    gate, up = grouped_linear(xf.index_select(0, p // k), experts.gate_up_proj, counts).chunk(2, dim=-1)
    inter = experts.act_fn(gate) * up
    del gate, up
    y = grouped_linear(inter, experts.down_proj, counts)  # (S, H) in expert order
    del inter
    if y.shape[0] != T * k:  # (an expert-parallel module's sentinel id: never built here)
        raise RuntimeError(f"moe_output: {T * k - y.shape[0]} of {T * k} routed pairs name no expert")
    # back to token-major rows (T, k, H): a gather by the inverse permutation (an H200 gathers
    # these rows ~3.5x faster than it scatters them)
    inv = torch.empty_like(p)
    inv[p] = torch.arange(p.numel(), device=p.device)
    if moe_triton.available(y) and topk_weights.dtype == torch.float32:
        out = moe_triton.combine_topk(y, inv, topk_weights, xf.dtype)  # the same sum, one kernel
    else:
        rows = y.index_select(0, inv).view(T, k, -1)
        out = torch.empty_like(xf)
        for s in range(0, T, COMBINE_TOKENS):
            t = slice(s, min(s + COMBINE_TOKENS, T))
            out[t] = (rows[t] * topk_weights[t, :, None]).sum(dim=1).to(out.dtype)
        del rows
    del y
    return out.view(*shape) + moe.shared_experts(x)


@contextlib.contextmanager
def moe_output_forward(mlp: torch.nn.Module):
    """Within it, a MoE block of MOE_CLASSES answers its forward with `moe_output` (pass 2:
    the layer's own forward around it, its MLP half computed so); any other MLP as it is."""
    if type(mlp).__name__ not in MOE_CLASSES:
        yield
        return
    mlp.forward = lambda h: moe_output(mlp, h)
    try:
        yield
    finally:
        del mlp.forward


def _asym(stats: MLPStats, mlp: torch.nn.Module, x_fp: torch.Tensor, x: torch.Tensor,
          inter: torch.Tensor) -> None:
    """--gptaq: a gate/up/down MLP's (dense, or the shared experts) D terms from the unrounded
    model's inputs x_fp and the rounded one's x (its intermediate `inter` already computed)."""
    inter_fp = mlp.act_fn(mlp.gate_proj(x_fp)) * mlp.up_proj(x_fp)
    H, I = x.shape[-1], inter.shape[-1]
    stats.asym(x_fp.reshape(-1, H), x.reshape(-1, H), inter_fp.reshape(-1, I), inter.reshape(-1, I))


def dense_forward(mlp: torch.nn.Module, x: torch.Tensor, stats: MLPStats | None = None,
                  outputs: bool = True, x_fp: torch.Tensor | None = None) -> torch.Tensor | None:
    """`down_proj(act_fn(gate_proj(x)) * up_proj(x))` (GLM / Llama MLP), feeding `stats`
    (`x_fp`: the same tokens in the unrounded model's stream, --gptaq)."""
    inter = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
    if stats is not None:
        if x_fp is not None:
            _asym(stats, mlp, x_fp, x, inter)
        stats.mlp_input(x.reshape(-1, x.shape[-1]))
        stats.down_input(inter.reshape(-1, inter.shape[-1]))
    return mlp.down_proj(inter) if outputs else None
