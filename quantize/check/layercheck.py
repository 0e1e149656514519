"""verify's function check: every decoder layer of the output, as written, against the source's.

Weights can each look fine while the layer computes something else (an AWQ scale folded into
the wrong norm passes a weight comparison that assumes the same fold). So verify also runs the
layers, on the same hidden states, three ways:

    h                      LAYER_CHECK_SAMPLES x up to LAYER_CHECK_SEQ tokens of the shipped
                           out-of-domain text (calib_data/heldout_english.md, the source's own
                           tokenizer; seeded random ids when it has none), each window beginning
                           with what every served request begins with (Gemma's BOS, GLM's
                           [gMASK]<sop>), through the source's embedding, then the source's layers
    y_s = source layer L (h)        transformers' decoder layer filled from SRC (FP8 dequantized)
    y_r = the same layer with its INT4 targets rounded to nearest (RTN, the group size and
          symmetry of the conversion) and its FP8 tensors widened to BF16 as convert writes
          them: what the plainest correct output computes (an RTN output: y_r == y_q)
    y_q = output layer L (h)        filled purely from DST (INT4 unpacked and dequantized as the
                                    engines do; AWQ-folded norms, routers, rescaled rows as written)

    error(x) = ||x - y_s|| / ||y_s - h||        relative to the layer's own update

A layer with INT4 targets passes when error(y_q) <= MAX_LAYER_ERROR_RATIO x error(y_r) (+1e-6):
a bound relative to RTN on the same inputs, so it means the same at every width and group size.
Correct outputs land near or below RTN, a little above where a method fits its calibration
text at the expense of other text: the tiny fixtures of six families stay under 1.25x;
Gemma-3-270M at group 128 on this text: GPTQ 0.46-0.88x per layer, AWQ+GPTQ 0.57-0.94x but
1.84x at layer 6 (64 x 512 calibration tokens; windows without the BOS after the first; its
eval: perplexity +10.8 %, out of domain +11.6 %, better than GPTQ's +24.7 %); with 16 x 512
tokens and every window beginning with the BOS, GPTQ up to 1.26x, AWQ+GPTQ up to 2.50x at layer
6 (BENCHMARKS.md). Broken outputs land far above: the Gemma3 fold into the wrong norm, which every
weight check agreed with, measured 4.6-4,089x on the real model (perplexity x4,919; 8.3-4,108x
on the BOS windows); on the
tiny models it needs loud channels to show (norm outliers x30: 3.6-6.1x; x6: 1.8-3x, which
the bound lets through); a norm scaled by 2 lands far above. Hence 3x: between the two.

Cost: one layer of each model at a time; the tensors come from the per-tensor checks' reads of
the same layer (`Checkpoint.memo`), so the data are read once.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from quantize.calib.decoder import (
    build_skeleton,
    embed,
    free_layer,
    layer_inputs,
    layer_weight,
    load_layer,
    round_in_place,
    run_layer,
)
from quantize.errors import QuantizeError
from quantize.options import ConvertOptions
from quantize.overlap import background
from quantize.plan import Unit
from quantize.source.checkpoint import Checkpoint
from quantize.source.layout import layer_of

__all__ = ["LAYER_CHECK_SAMPLES", "LAYER_CHECK_SEQ", "MAX_LAYER_ERROR_RATIO", "LayerCheck",
           "Prepared", "prepare", "prepare_in_background"]

MAX_LAYER_ERROR_RATIO = 3.0
LAYER_CHECK_SAMPLES = 2
LAYER_CHECK_SEQ = 128  # capped to max_position_embeddings


def _rel(a: torch.Tensor, ref: torch.Tensor, h: torch.Tensor) -> float:
    den = float((ref.double() - h.double()).norm())
    return float((a.double() - ref.double()).norm()) / max(den, 1e-30)


def _text_tokens(src: Checkpoint, n: int, S: int
                 ) -> tuple[torch.Tensor | None, str | None, tuple[str, ...]]:
    """(n, S) token ids of the shipped out-of-domain text (calib_data/heldout_english.md, in no
    calibration set) by the source's own tokenizer.json (the `tokenizers` library: its Rust
    parser loads Gemma's 262k-entry vocabulary in a third of transformers' time), each window
    beginning with the tokens every served request begins with (`served_prefix`, as the
    calibration's and eval's windows: Gemma's BOS, GLM's chat-template `[gMASK]<sop>`), then
    the text; the text's name and the prefix's tokens. (None, None, ()) when the source has no
    tokenizer.json or the text is too short for it."""
    from tokenizers import Tokenizer

    from quantize.calib.data import HELDOUT_ENGLISH, served_prefix

    path = src.root / "tokenizer.json" if src.root is not None else None
    if path is None or not path.is_file():
        return None, None, ()
    try:
        tok = Tokenizer.from_file(str(path))
        template, names = _chat_template(src.root)
        added = tok.get_added_tokens_decoder()
        prefix = served_prefix(lambda t, sp: tok.encode(t, add_special_tokens=sp).ids, template,
                               names, lambda i: i in added and added[i].special)
        ids = tok.encode(HELDOUT_ENGLISH.read_text(encoding="utf-8"), add_special_tokens=False).ids
    except QuantizeError:  # (a chat template that does not finish: said, not waited for)
        raise
    except Exception:  # noqa: BLE001 - any tokenizer the library refuses: random ids instead
        return None, None, ()
    V = int(src.tensors["model.embed_tokens.weight"].shape[0])
    body = S - len(prefix)
    if body < 1 or len(ids) < n * body or max(ids[: n * body] + prefix) >= V:
        return None, None, ()
    text = torch.tensor(ids[: n * body]).reshape(n, body)
    head = torch.tensor(prefix, dtype=text.dtype).expand(n, len(prefix))
    return (torch.cat([head, text], dim=1), HELDOUT_ENGLISH.name,
            tuple(tok.id_to_token(i) for i in prefix))


def _chat_template(root) -> tuple[str | None, dict[str, str]]:
    """The source's chat template (tokenizer_config.json's `chat_template`, or the
    chat_template.jinja transformers writes beside it) and its special tokens by name."""
    cfg: dict = {}
    f = root / "tokenizer_config.json"
    if f.is_file():
        cfg = json.loads(f.read_text(encoding="utf-8"))
    template = cfg.get("chat_template")
    if not isinstance(template, str) and (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text(encoding="utf-8")
    names = {}
    for k, v in cfg.items():
        if k.endswith("_token") and isinstance(v, dict):  # (an AddedToken written out)
            v = v.get("content")
        if k.endswith("_token") and isinstance(v, str):
            names[k] = v
    return template, names


@dataclass
class Prepared:
    """What the check needs before its first layer: the model's layer classes and the tokens."""

    skeleton: object
    tokens: torch.Tensor  # int64 (LAYER_CHECK_SAMPLES, S)
    text: str | None  # the text's name; None: seeded random ids
    prefix: tuple[str, ...] = ()  # the tokens each window begins with


def prepare(src: Checkpoint, seed: int = 0) -> Prepared:
    """The skeleton (transformers imported, the layer classes built on the meta device) and the
    tokens (the source's tokenizer loaded): seconds on a CPU, so verify starts it on a thread
    (`prepare_in_background`) while it hashes the files and checks the first tensors."""
    skeleton = build_skeleton(src.config)
    S = min(LAYER_CHECK_SEQ, int(src.config.get("max_position_embeddings") or LAYER_CHECK_SEQ))
    tokens, text, prefix = _text_tokens(src, LAYER_CHECK_SAMPLES, S)
    if tokens is None:  # no tokenizer: seeded random ids
        V = int(src.tensors["model.embed_tokens.weight"].shape[0])
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, V, (LAYER_CHECK_SAMPLES, S), generator=gen)
    return Prepared(skeleton, tokens, text, prefix)


def prepare_in_background(src: Checkpoint | None, log: Callable[[str], None] | None = None) -> Future:
    """`prepare(src)` on its own thread, transformers imported there first; the Future holds
    its result (None without `src`: the import alone) or its error; `log`: one line with the
    time it took, said before the Future is done. The calling thread goes on meanwhile; it
    must not import transformers itself until the Future is done (two threads initializing it
    at once can see it half-made: "cannot import name 'AutoConfig'")."""
    t0 = time.perf_counter()

    def run() -> Prepared | None:
        from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

        prepared = prepare(src) if src is not None else None
        if log:
            what = "transformers, layer classes and tokens" if src is not None else "transformers"
            log(f"the layer check's {what} loaded in {time.perf_counter() - t0:.1f} s")
        return prepared

    return background(run)


class LayerCheck:
    """The layers of SRC and DST side by side on one hidden-state stream; `run(L)` checks the
    layers up to L (in order, each once), `report()` the figures for verify.json. `prepared`:
    `prepare`'s result or its Future (waited for at the first layer); None: prepared here."""

    def __init__(self, src: Checkpoint, units: dict[str, Unit], dst: Checkpoint,
                 opts: ConvertOptions, device: torch.device,
                 prepared: Prepared | Future | None = None,
                 max_ratio: float = MAX_LAYER_ERROR_RATIO) -> None:
        self.src, self.units, self.dst, self.opts, self.device = src, units, dst, opts, device
        self.max_ratio = max_ratio
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self._prepared = prepared if prepared is not None else prepare(src)
        self.num_layers = src.num_hidden_layers
        self.skeleton = self.tokens = self.text = self.inputs = None
        self.prefix: tuple[str, ...] = ()
        self.h: torch.Tensor | None = None
        self.topk: torch.Tensor | None = None
        self.next = 0
        self.layers: list[dict] = []
        self.targets: dict[int, list[str]] = {}  # per layer: its INT4 targets
        self.widened: dict[int, list[str]] = {}  # per layer: its FP8 tensors written as BF16
        for n, u in units.items():
            if (L := layer_of(n)) is None or L >= self.num_layers:
                continue
            if u.action == "quantize":
                self.targets.setdefault(L, []).append(n)
            elif u.action == "dequant":
                self.widened.setdefault(L, []).append(n)

    def preparing(self) -> bool:
        """Whether the skeleton and tokens are still being prepared on their thread (`run`
        would wait for them)."""
        return isinstance(self._prepared, Future) and not self._prepared.done()

    def _ready(self) -> None:
        """The prepared skeleton and tokens (raises `prepare`'s error, e.g. a QuantizeError for
        a model the installed transformers cannot build)."""
        if self.skeleton is not None:
            return
        p = self._prepared.result() if isinstance(self._prepared, Future) else self._prepared
        self.skeleton, self.tokens, self.text, self.prefix = p.skeleton, p.tokens, p.text, p.prefix
        self.num_layers = len(self.skeleton.model.layers)
        self.inputs = layer_inputs(self.skeleton, self.tokens.shape[1], self.device, self.dtype)

    def _source_layer(self, L: int):
        return load_layer(self.skeleton, self.src, self.units, L, self.device, self.dtype)

    @torch.no_grad()
    def run(self, upto: int, log: Callable[[str], None] | None = None) -> None:
        """Check layers next .. min(upto, last decoder layer)."""
        self._ready()
        if self.h is None:
            u = self.units.get("model.embed_tokens.weight")
            if u is not None and u.scale is not None:  # an FP8 table: dequantized
                from quantize.source.weights import source_weight

                emb = source_weight(self.src, u, self.device)
            else:  # as stored (a scaled embedding multiplies in the table's dtype)
                emb = self.src.read("model.embed_tokens.weight", self.device)
            self.h = embed(self.skeleton, emb, self.tokens.to(self.device)).to(self.dtype)
        while self.next <= min(upto, self.num_layers - 1):
            L, t0 = self.next, time.perf_counter()
            h, topk = self.h, self.topk
            layer = self._source_layer(L)
            y_s, topk_s = run_layer(self.skeleton, layer, self.inputs, h, topk)
            quant = self.targets.get(L, [])
            y_r = None
            if quant:  # the source layer, its targets rounded to nearest in place, and its
                # FP8 tensors widened to BF16 as the output holds them (so RTN's error has the
                # same non-INT4 part as the output's)
                round_in_place(layer, L, quant, self.opts.group_size, self.opts.symmetric)
                for n in self.widened.get(L, []):
                    try:
                        v = layer_weight(layer, L, n)
                    except AttributeError:  # a tensor the layer class does not hold
                        continue
                    v.copy_(v.to(torch.bfloat16))
                y_r, _ = run_layer(self.skeleton, layer, self.inputs, h, topk)
            free_layer(layer)
            layer = load_layer(self.skeleton, self.dst, None, L, self.device, self.dtype)
            y_q, _ = run_layer(self.skeleton, layer, self.inputs, h, topk)
            free_layer(layer)
            err = _rel(y_q, y_s, h)
            entry = {"layer": L, "int4_linears": len(quant), "rel_error": err}
            if y_r is not None:
                rtn = _rel(y_r, y_s, h)
                entry["rtn_rel_error"] = rtn
                entry["ratio"] = err / rtn if rtn > 0 else (0.0 if err == 0 else None)
                entry["ok"] = math.isfinite(err) and err <= self.max_ratio * rtn + 1e-6
                if not math.isfinite(err):
                    entry["rel_error"] = None  # (JSON has no NaN / inf: the note says it)
                    entry["note"] = "non-finite output"
            entry["seconds"] = round(time.perf_counter() - t0, 3)
            self.layers.append(entry)
            if log:
                log(f"layer {L}: output error {err:.4g}"
                    + (f" ({entry['ratio']:.2f}x RTN's {entry['rtn_rel_error']:.4g})" if y_r is not None else ""))
            self.h, self.topk = y_s, topk_s
            self.next += 1

    def failed(self) -> list[dict]:
        return [e for e in self.layers if e.get("ok") is False]

    def report(self) -> dict:
        judged = [e for e in self.layers if "ratio" in e]
        return {"tokens": list(self.tokens.shape),
                "text": self.text or "seeded random token ids (the source has no tokenizer)",
                "prefix": list(self.prefix),
                "compute_dtype": str(self.dtype).replace("torch.", ""),
                "max_ratio": self.max_ratio, "ok": not self.failed(),
                "worst_ratio": max((e["ratio"] for e in judged if e["ratio"] is not None),
                                   default=None),
                "layers": self.layers}

    def problems(self) -> list[str]:
        def err(e: dict) -> str:
            if e["rel_error"] is None:
                return "non-finite output"
            ratio = "" if e["ratio"] is None else f"{e['ratio']:.1f}x "
            return f"error {e['rel_error']:.4g}, {ratio}round-to-nearest's {e['rtn_rel_error']:.4g}"

        return [f"model.layers.{e['layer']}: the output layer's {err(e)} on the same hidden "
                f"states (bound {self.max_ratio:g}x RTN's): the layer computes something else than "
                "its source (a wrong fold or a damaged tensor); reconvert (e.g. --method gptq)"
                for e in self.failed()]
