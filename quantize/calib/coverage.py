"""--expert-coverage N: the tokens a routed expert's statistics are topped up with when fewer
than N were routed to it.

    c = Candidates(N, weighted)
    c.observe(logits, topk_indices, x, topk_weights)   per calibration chunk (capture.moe_forward)
    added, rows = c.choose(expert_tokens, dist)        after the pass, the counts summed

Per expert, the candidates are the tokens not routed to it with the highest router logits (the
tokens the router nearly sent it), the best N over the whole pass: kept as (E, N) logits and
their (E, N, H) MLP inputs, merged chunk by chunk. `choose` gives an expert routed n < N tokens
its N - n best candidates; under torchrun (`dist`) over every rank's candidates (each rank
contributes those of its own above the expert's threshold), so the added tokens are those one
process would choose, up to ties. For a sigmoid router (GLM, DeepSeek-V3) the logit orders an
expert's tokens as its score and its selection score do (the bias is per expert).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["Candidates"]


class Candidates:
    """Each routed expert's best `cover` tokens not routed to it (module docstring)."""

    def __init__(self, cover: int, weighted: bool = False) -> None:
        """`weighted` (--expert-calibration routed-weighted): an added token's row is scaled by
        the expert's mean routing weight over its routed tokens (1 with none)."""
        self.cover, self.weighted = cover, weighted
        self.s: torch.Tensor | None = None  # (E, <=N) the best logits so far, best first
        self.x: torch.Tensor | None = None  # (E, <=N, H) those tokens' MLP inputs
        self.w_sum: torch.Tensor | None = None  # (E + 1,) routed weights' sums (weighted)

    def observe(self, logits: torch.Tensor, topk_indices: torch.Tensor, x: torch.Tensor,
                topk_weights: torch.Tensor) -> None:
        """One chunk: router logits (T, E), routed expert ids and weights (T, k), inputs (T, H)."""
        T, E = logits.shape
        with torch.no_grad():
            ids = topk_indices.long()
            # routed pairs are no candidates (an id of E, expert parallelism's sentinel, lands
            # in the extra column)
            s = torch.cat([logits.detach().float(), logits.new_zeros(T, 1, dtype=torch.float32)], 1)
            s = s.scatter_(1, ids, float("-inf"))[:, :E]
            if self.weighted:
                if self.w_sum is None:
                    self.w_sum = torch.zeros(E + 1, device=x.device)
                self.w_sum.index_add_(0, ids.reshape(-1), topk_weights.float().reshape(-1))
            v, i = s.topk(min(self.cover, T), dim=0)  # (k, E): each expert's best tokens here
            v, i = v.t(), i.t()  # (E, k)
            if self.s is None:
                self.s, self.x = v, x[i]  # (E, k), (E, k, H)
                return
            n_old = self.s.shape[1]  # merged with the best so far: the rows of the winners
            v, pos = torch.cat([self.s, v], 1).topk(min(self.cover, n_old + v.shape[1]), dim=1)
            rows = self.x.gather(1, pos.clamp(max=n_old - 1)[..., None].expand(-1, -1, x.shape[-1]))
            new = pos >= n_old
            rows[new] = x[i.gather(1, (pos - n_old).clamp(min=0))[new]]
            self.s, self.x = v, rows

    def choose(self, expert_tokens: list[int], d=None
               ) -> tuple[list[int], dict[int, tuple[torch.Tensor, torch.Tensor | None]]]:
        """The tokens added per expert (over every rank; `expert_tokens`: routed counts over
        every rank), and this rank's added rows per expert: (inputs (m, H), each row's weight
        (m,) or None)."""
        E = len(expert_tokens)
        s, x = self.s, self.x
        if s.shape[1] < self.cover:  # (fewer tokens seen than `cover`: every rank's one width)
            pad = self.cover - s.shape[1]
            s = F.pad(s, (0, pad), value=float("-inf"))
            x = F.pad(x, (0, 0, 0, pad))
        N = self.cover
        need = torch.tensor([max(0, N - n) for n in expert_tokens], device=s.device)
        if d is not None:  # every rank's candidates (the min of the negated: a gather by reduction)
            buf = torch.full((d.world, E, N), float("inf"), device=s.device)
            buf[d.rank] = -s
            alls = -d.all_reduce(buf, op="min")  # (world, E, N)
        else:
            alls = s[None]
        allv = alls.permute(1, 0, 2).reshape(E, -1).sort(dim=1, descending=True).values
        k = torch.clamp(need, max=allv.shape[1]).long()
        # each expert's threshold: its k-th best logit over every rank (none taken where k = 0)
        thr = allv.gather(1, torch.clamp(k - 1, min=0)[:, None])[:, 0]
        thr = torch.where(k > 0, thr, float("inf"))
        take = (s >= thr[:, None]) & torch.isfinite(s)  # (E, N), best first per expert
        take &= torch.arange(N, device=s.device)[None] < k[:, None]
        local = take.sum(1)
        added = [int(a) for a in (d.all_reduce(local.clone()) if d is not None else local).tolist()]
        w_sum = None
        if self.weighted:
            w_sum = self.w_sum if self.w_sum is not None else torch.zeros(E + 1, device=s.device)
            w_sum = (d.all_reduce(w_sum) if d is not None else w_sum).tolist()
        rows = {}
        for e in torch.nonzero(local).flatten().tolist():
            xe = x[e][take[e]]  # (m, H)
            w = None
            if w_sum is not None:
                n = expert_tokens[e]
                w = torch.full((xe.shape[0],), w_sum[e] / n if n else 1.0, device=xe.device)
            rows[e] = (xe, w)
        self.s = self.x = None
        return added, rows
