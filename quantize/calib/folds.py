"""Where AWQ's input scale of a layer's MLP is folded: found from the layer, not from a name.

AWQ divides the MLP's input by s (H,) and multiplies every reader's weight columns by s
(quantize/rounding/awq.py). The division goes into the op whose output *is* the MLP's input: a norm.
Which norm, and how its weight enters its output, differs by family:

    family                 the MLP reads                        the norm computes
    Llama, Qwen2/3, GLM    post_attention_layernorm(h1)         x_hat * w
    Gemma3                 pre_feedforward_layernorm(h1)        x_hat * (1 + w)
                           (post_attention_layernorm normalizes the attention's output
                           before the residual add: folding there changes the residual)

so the fold is `w / s` for the first form and `(1 + w) / s - 1` for the second (a bias, where
a norm has one, is divided by s too). `find_norm_fold` proves both on the layer itself:

1. a probe forward with hooks: the one submodule of the layer (outside its attention and MLP)
   whose output is the tensor the MLP receives, called once, with a weight of the hidden size,
   and whose output the attention does not also read (a parallel block could not take a fold);
2. the formula: the norm run (float32, a copy) with each candidate fold of a random positive s
   must give its output divided by s (relative error < 1e-4); exactly one form may pass.

Anything else is refused before the layer is rounded, naming the layer, the family and why.
The fold found is recorded beside the scales (`fold_tensor`: its JSON record as bytes under
model.layers.L.mlp.awq_norm_fold in calibration/awq-scales.safetensors), so `verify` re-applies
the same fold; outputs written before the record existed carry none and were folded as `LEGACY`
says.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantize.errors import Problem, QuantizeError
from quantize.rounding.awq import fold_into_linear_rows, scale_linear_inputs
from quantize.source.layout import layer_of

__all__ = ["FOLD_KEY", "FORMULAS", "LEGACY", "NormFold", "awq_expected", "find_norm_fold",
           "fold_tensor", "read_folds"]

FORMULAS = ("x*w", "x*(1+w)")


@dataclass(frozen=True)
class NormFold:
    """The norm AWQ's MLP input scale goes into: its module path inside the decoder layer
    (e.g. "pre_feedforward_layernorm"), how its weight scales its output, whether it has a bias."""

    module: str
    formula: str = "x*w"
    bias: bool = False

    def tensor(self, L: int, param: str = "weight") -> str:
        return f"model.layers.{L}.{self.module}.{param}"

    def apply(self, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """The norm weight whose output is the old one divided by s; dtype kept (the arithmetic
        in float64: one rounding, to the stored dtype)."""
        w64, s64 = w.double(), s.to(w.device).double()
        out = (1 + w64) / s64 - 1 if self.formula == "x*(1+w)" else w64 / s64
        return out.to(w.dtype)

    def realized(self, w: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The scale the stored norm really divides its output by: folded with s and stored in
        `dtype`, the norm computes g(w_stored) = g(w) / s_eff (g(w) = w, or 1 + w), and s_eff is
        not exactly s. The readers' columns are multiplied by s_eff instead, which keeps the
        layer exact whatever the storage rounding: in Gemma's 1 + w form it is not small
        (w' = (1 + w) / s - 1 near -1 keeps few bits of 1 + w'; the real Gemma-3-270M lost
        layers to it). A channel whose stored value would vanish or change sign keeps s = 1;
        one whose g(w) is 0 outputs 0 whatever s is. float32 (as recorded)."""
        g = (lambda t: 1 + t) if self.formula == "x*(1+w)" else (lambda t: t)
        num = g(w.double())
        den = g(self.apply(w, s).to(dtype).double())
        s64 = s.to(w.device).double()
        s_eff = num / den
        bad = ~torch.isfinite(s_eff) | (s_eff <= 0)
        s_eff = torch.where(num == 0, s64, torch.where(bad, torch.ones_like(s_eff), s_eff))
        return s_eff.float()

    def apply_bias(self, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (b.double() / s.to(b.device).double()).to(b.dtype)

    def to_meta(self) -> str:
        return json.dumps({"norm": self.module, "formula": self.formula, "bias": self.bias},
                          sort_keys=True)

    @staticmethod
    def from_meta(text: str | None) -> NormFold:
        if not text:
            return LEGACY
        d = json.loads(text)
        if d.get("formula") not in FORMULAS or not isinstance(d.get("norm"), str):
            raise ValueError(f"an AWQ fold record {text!r}: expected a norm name and one of "
                             f"{', '.join(FORMULAS)}")
        return NormFold(d["norm"], d["formula"], bool(d.get("bias")))


# What every AWQ output written before folds were found from the layer assumed (GLM, Llama, Qwen)
LEGACY = NormFold("post_attention_layernorm", "x*w", False)


def _refuse(L: int, family: str, found: str, fix: str = "use --method gptq or rtn for this model"
            ) -> QuantizeError:
    return QuantizeError("AWQ cannot fold its input scale into this layer", [Problem(
        "config.json", f"model.layers.{L}.mlp", f"{family}: {found}",
        "one norm whose output only the MLP reads, computing x_hat * w or x_hat * (1 + w)", fix)])


def _formula(norm: torch.nn.Module, H: int) -> str | None:
    """Which of FORMULAS the norm's weight follows, proven numerically on a float32 copy."""
    m = copy.deepcopy(norm).float()
    gen = torch.Generator().manual_seed(0)
    dev = next(m.parameters()).device
    x = torch.randn(16, H, generator=gen).to(dev)
    s = (0.5 + 1.5 * torch.rand(H, generator=gen)).to(dev)
    w0 = m.weight.detach().clone()
    b0 = m.bias.detach().clone() if getattr(m, "bias", None) is not None else None
    with torch.no_grad():
        want = m(x) / s
        ok = []
        for f in FORMULAS:
            fold = NormFold("", f, b0 is not None)
            m.weight.copy_(fold.apply(w0, s))
            if b0 is not None:
                m.bias.copy_(fold.apply_bias(b0, s))
            got = m(x)
            rel = float((got - want).norm() / want.norm().clamp(min=1e-30))
            if rel < 1e-4:
                ok.append(f)
    return ok[0] if len(ok) == 1 else None


def find_norm_fold(layer: torch.nn.Module, run: Callable[[], object], L: int, family: str
                   ) -> NormFold:
    """The norm whose output is `layer.mlp`'s input, and its formula (module docstring). `run()`
    runs the layer's forward once (any input); raises QuantizeError when it cannot be proven."""
    got: dict[str, list[torch.Tensor]] = {}
    seen: dict[str, torch.Tensor] = {}
    handles = []

    def first_tensor(args, kwargs):
        if args and torch.is_tensor(args[0]):
            return args[0]
        return kwargs.get("hidden_states")

    def keep_out(name):
        def hook(mod, args, out):
            if torch.is_tensor(out):
                got.setdefault(name, []).append(out)
        return hook

    def keep_in(name):
        def hook(mod, args, kwargs):
            x = first_tensor(args, kwargs)
            if x is not None:
                seen.setdefault(name, x)
        return hook

    subtrees = ("mlp", "self_attn")
    for name, mod in layer.named_modules():
        if not name or name.split(".")[0] in subtrees:
            continue
        handles.append(mod.register_forward_hook(keep_out(name)))
    for name in subtrees:
        if hasattr(layer, name):
            handles.append(getattr(layer, name).register_forward_pre_hook(keep_in(name),
                                                                          with_kwargs=True))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    x = seen.get("mlp")
    if x is None:
        raise _refuse(L, family, "the probe forward never reached the MLP")
    H = x.shape[-1]
    same = [n for n, outs in got.items()
            if any(o is x or (o.shape == x.shape and torch.equal(o, x)) for o in outs)]
    cands = [n for n in same if getattr(layer.get_submodule(n), "weight", None) is not None
             and tuple(layer.get_submodule(n).weight.shape) == (H,)]
    if len(cands) != 1:
        raise _refuse(L, family, f"the MLP's input is the output of {len(cands)} norm-like "
                      f"modules ({', '.join(cands) or 'none'}; equal outputs: "
                      f"{', '.join(same) or 'none'})")
    name = cands[0]
    if len(got[name]) != 1:
        raise _refuse(L, family, f"{name} runs {len(got[name])} times in one forward")
    a = seen.get("self_attn")
    if a is not None and a.shape == x.shape and (a is x or torch.equal(a, x)):
        raise _refuse(L, family, f"the attention reads {name}'s output too (a parallel block)")
    norm = layer.get_submodule(name)
    formula = _formula(norm, H)
    if formula is None:
        raise _refuse(L, family, f"{type(norm).__name__} ({name}) scales its output by neither "
                      "w nor 1 + w")
    return NormFold(name, formula, getattr(norm, "bias", None) is not None)


def awq_expected(name: str, W: torch.Tensor, scales: dict[str, torch.Tensor],
                 folds: dict[str, NormFold] | None = None) -> torch.Tensor:
    """The source tensor `name` (float) with the AWQ folds of AWQ_SCALES applied: what the
    output holds (before INT4 rounding for targets). `verify` compares against this. `folds`:
    per `model.layers.L.mlp.awq_input_scale`, the norm it went into (folds.NormFold, recorded
    beside it in the scales file: `read_folds`; absent: `folds.LEGACY`)."""
    L = layer_of(name)
    if L is None:
        return W
    key = f"model.layers.{L}.mlp.awq_input_scale"
    s_in = scales.get(key)
    if s_in is not None:
        fold = (folds or {}).get(key, LEGACY)
        if name == fold.tensor(L):
            W = fold.apply(W, s_in)
        elif fold.bias and name == fold.tensor(L, "bias"):
            W = fold.apply_bias(W, s_in)
        elif ".mlp." in name and (name.endswith(("gate_proj.weight", "up_proj.weight"))
                                  or name == f"model.layers.{L}.mlp.gate.weight"):
            W = scale_linear_inputs(W, s_in.to(W.device))
    stem = name.rsplit(".", 2)[0]  # <...>.mlp[.experts.E | .shared_experts]
    s_down = scales.get(f"{stem}.down_proj.awq_input_scale")
    if s_down is not None and name.endswith("down_proj.weight"):
        W = scale_linear_inputs(W, s_down.to(W.device))
    elif s_down is not None and name.endswith("up_proj.weight"):
        W = fold_into_linear_rows(W, s_down.to(W.device))
    return W


FOLD_KEY = "awq_norm_fold"  # model.layers.L.mlp.awq_norm_fold: the fold's record, UTF-8 bytes


def fold_tensor(fold: NormFold) -> torch.Tensor:
    """The fold's record as a uint8 tensor (stored beside the scales it belongs to)."""
    return torch.tensor(list(fold.to_meta().encode()), dtype=torch.uint8)


def read_folds(path) -> tuple[dict[str, torch.Tensor], dict[str, NormFold]]:
    """An AWQ scales file (names.AWQ_SCALES): its scales and, per MLP input scale, the
    recorded norm fold (none recorded, as in files written before the record: `LEGACY`)."""
    from safetensors.torch import load_file

    scales, records = {}, {}
    for k, t in load_file(str(path)).items():
        if k.endswith("." + FOLD_KEY):
            records[k[: -len(FOLD_KEY)] + "awq_input_scale"] = bytes(t.tolist()).decode()
        else:
            scales[k] = t
    folds = {k: NormFold.from_meta(records.get(k)) for k in scales
             if k.endswith(".mlp.awq_input_scale")}
    return scales, folds
