"""AWQ on one calibrated layer's MLP: the scales searched and folded, exactly, before rounding.

    W = LayerWeights(ckpt, units, device)       the Linears as they will be rounded, read on demand
    f = search_and_fold(L, kind, E, targets, stats, W, norm_fold, cfg, x_sample, inter_sample, dtype)
                                  W.col / W.row hold the scales; f.mods the BF16 tensors rescaled,
                                  f.scales the scales as applied, f.s_in the MLP input's, f.report

The search is quantize/rounding/awq.py's; this module says what is searched on which tokens and
where each scale goes. Each down_proj's input scale s (I,) goes into the same expert's up_proj
rows; the MLP input's scale s (H,) into the norm that produces it (quantize/calib/folds.py finds
which norm and its formula on the layer itself: GLM / Llama / Qwen's post-attention norm, w / s;
Gemma3's pre-feedforward norm, (1 + w) / s - 1), with every reader (all experts' and the shared
gate/up, the router) multiplied by s. In a MoE layer that s is rounded to powers of two, so the
BF16 norm and router are scaled exactly and no token changes experts; it is searched on the
shared expert and the AWQ_SEARCH_EXPERTS busiest experts. The scales as applied go to
`awq_scales` (`folds.awq_expected` re-applies them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantize.calib.capture import EXPERT_BATCH, MLPStats
from quantize.calib.folds import NormFold
from quantize.plan import Unit
from quantize.rounding.awq import AWQConfig, awq_search, fold_into_linear_rows, scale_linear_inputs
from quantize.source.checkpoint import Checkpoint, torch_dtype

__all__ = ["AWQ_SEARCH_EXPERTS", "AWQFolds", "LayerWeights", "search_and_fold"]
AWQ_SEARCH_EXPERTS = 32  # routed experts the shared gate/up input scale is searched on


class LayerWeights:
    """The MLP's Linear weights as they will be rounded, read on demand (never all held):
    float32 source (FP8 dequantized) * AWQ column scales / AWQ row scales."""

    def __init__(self, ckpt: Checkpoint, units: dict[str, Unit], device: torch.device) -> None:
        self.ckpt, self.units, self.device = ckpt, units, device
        self.col: dict[str, torch.Tensor] = {}  # name -> (K,) input scales (weight columns * s)
        self.row: dict[str, torch.Tensor] = {}  # name -> (N,) output scales (weight rows / s)

    def source(self, name: str) -> torch.Tensor:
        from quantize.source.weights import source_weight

        return source_weight(self.ckpt, self.units[name], self.device)  # (N, K) float32

    def shape(self, name: str) -> tuple[int, ...]:
        return self.ckpt.tensors[name].shape

    def scaled(self, name: str) -> bool:
        return name in self.col or name in self.row

    def __getitem__(self, name: str) -> torch.Tensor:
        w = self.source(name)
        if name in self.col:
            w = scale_linear_inputs(w, self.col[name])
        if name in self.row:
            w = fold_into_linear_rows(w, self.row[name])
        return w


@dataclass
class AWQFolds:
    """What `search_and_fold` leaves besides W's scales."""

    report: dict  # the layer report's "awq" entry
    s_in: torch.Tensor | None  # the MLP input's scale as the stored norm applies it (None: not searched)
    mods: dict[str, torch.Tensor]  # norm (and bias), router: rescaled, float32
    scales: dict[str, torch.Tensor]  # checkpoint name -> scale as applied, float32 on the host


def search_and_fold(L: int, kind: str, E: int, targets: Mapping[str, bool], stats: MLPStats,
                    W: LayerWeights, norm_fold: NormFold | None, cfg: AWQConfig,
                    x_sample: torch.Tensor, inter_sample: Callable[[int], torch.Tensor],
                    dtype: torch.dtype) -> AWQFolds:
    """Search the scales and fold them into the producing ops (exactly, before rounding): into
    W.col / W.row for the Linears, into the returned `mods` for the norm and the router.
    `targets`: the MLP's Linears, name -> quantized (a --targets Linear); `x_sample` (T', H)
    all tokens' MLP inputs; `inter_sample(e)` routed expert e's down_proj inputs; `norm_fold`
    (folds.find_norm_fold) needed when gate/up are quantized."""
    p = f"model.layers.{L}.mlp."
    ckpt, device = W.ckpt, W.device
    awq: dict = {}
    s_in: torch.Tensor | None = None
    mods: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    alphas = []
    stems = ([(f"{p}experts.{e}.", e) for e in range(E)] if kind == "moe" else []) + \
        [(p + ("shared_experts." if kind == "moe" else ""), None)]
    stems = [(st, e) for st, e in stems if targets.get(st + "down_proj.weight")]
    for c in range(0, len(stems), EXPERT_BATCH):  # down_proj: one search per expert, batched
        chunk = stems[c: c + EXPERT_BATCH]
        Xs = [inter_sample(e) if e is not None else torch.cat(stats.inter_sample)
              for _, e in chunk]
        T = max(x.shape[0] for x in Xs)
        X = torch.stack([F.pad(x, (0, 0, 0, T - x.shape[0])) for x in Xs])  # (e, T, I)
        Wd = torch.stack([W[st + "down_proj.weight"] for st, _ in chunk])  # (e, H, I)
        r = awq_search([Wd], X, cfg)  # zero rows pad: no effect on s or error
        for i, (st, _) in enumerate(chunk):
            W.col[st + "down_proj.weight"] = r.scales[i]  # down_proj columns * s
            W.row[st + "up_proj.weight"] = r.scales[i]  # its own up_proj rows / s: exact
            scales[st + "down_proj.awq_input_scale"] = r.scales[i].float().cpu()
        alphas += r.alpha.tolist()
    gate_up = [n for n, q in targets.items() if q and
               n.endswith(("gate_proj.weight", "up_proj.weight"))]
    if gate_up:
        # One s for every reader of the norm's output, searched on the shared / dense
        # projections and the AWQ_SEARCH_EXPERTS most-routed experts (bounded memory;
        # the error of the busiest experts dominates the layer's), as (sum N, H).
        busiest = sorted(range(E), key=lambda e: -stats.expert_tokens[e])[:AWQ_SEARCH_EXPERTS]
        keep = {f"{p}experts.{e}." for e in busiest}
        search = [n for n in gate_up if ".experts." not in n or n.rsplit(".", 2)[0] + "." in keep]
        r = awq_search([torch.cat([W[n].to(dtype) for n in search])], x_sample, cfg)
        # MoE: powers of two, so dividing the BF16 norm and multiplying the BF16 router
        # (and non-target shared experts) is exact and no token changes its experts
        # (bf16-rounded arbitrary scales flipped near-tie routings and cost more than they
        # gained on the tiny models: layer error 0.141 vs 0.137 glm4_moe). Dense MLPs:
        # the exact scales (the norm's bf16 rounding, 2^-9 relative, is negligible).
        s_in = torch.exp2(torch.round(torch.log2(r.scales))) if kind == "moe" else r.scales
        if norm_fold is None:
            raise RuntimeError(f"internal: layer {L}: AWQ on gate/up without a norm fold")
        norm = norm_fold.tensor(L)
        w_norm = ckpt.read(norm, device).float()
        # the scale the stored norm really applies (folds.NormFold.realized: the powers of
        # two of a MoE layer's x * w norm are exact, s_eff == s)
        s_in = norm_fold.realized(w_norm, s_in, torch_dtype(W.units[norm].outputs[0].dtype))
        scales[p + "awq_input_scale"] = s_in.float().cpu()
        for n in targets:  # every consumer of the norm's output
            if n.endswith(("gate_proj.weight", "up_proj.weight")):
                W.col[n] = s_in
        mods[norm] = norm_fold.apply(w_norm, s_in)
        if norm_fold.bias:
            b = norm_fold.tensor(L, "bias")
            mods[b] = norm_fold.apply_bias(ckpt.read(b, device).float(), s_in)
        awq["norm_fold"] = {"norm": norm_fold.module, "formula": norm_fold.formula,
                            "bias": norm_fold.bias}
        if kind == "moe":
            router = p + "gate.weight"
            mods[router] = scale_linear_inputs(ckpt.read(router, device).float(), s_in)
        awq["alpha_in"] = float(r.alpha)
        awq["error_in"] = {"rtn": float(r.err_before), "awq": float(r.err_after)}
    if alphas:
        awq["alpha_down_mean"] = sum(alphas) / len(alphas)
    return AWQFolds(awq, s_in, mods, scales)
