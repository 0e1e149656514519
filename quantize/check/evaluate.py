"""Quality of an INT4 output against its source on held-out text, streamed layer by layer.

    tokens = held-out windows (num_samples, S) of the --data text, the source's tokenizer
    h_s = embed_s[tokens], h_q = embed_q[tokens]              (b, S, H) chunks, two streams
    for L in 0 .. num_hidden_layers - 1:
        h_s = source layer L (h_s)     transformers' decoder layer filled from SRC (FP8 dequantized)
        h_q = quantized layer L (h_q)  the same class filled purely from DST (INT4 unpacked and
                                       dequantized as the engines do; AWQ-folded norms / routers
                                       as written), each layer loaded, run and freed in turn
        rel_error[L] = ||h_q - h_s|| / ||h_s||   over every token: where the error accumulates
    logits = lm_head(norm(h)) on both, LOGIT_TOKENS tokens at a time:
        ppl = exp(mean NLL of the next token), KL(source || quantized) per token, top-1 agreement

Memory: one decoder layer (of one model) at a time, the two hidden-state streams (moved to host
memory or disk by `HiddenStates` when they would take half the free memory), and both heads during the
logits pass. GLM-5.2 worked number: a layer's BF16 weights ~20 GB, 16 x 2048 tokens x 6144 x
2 B = 0.4 GB per stream, lm_head 154,880 x 6144 x 2 B = 1.9 GB per model. The MTP layer is not
evaluated (it predicts the token after next, for speculative decoding; transformers drops it).

Held-out windows (`select_windows`): the text is read with calib_data's loader and split into
documents. When DST was calibrated on the same file (manifest options `calib`, `num_samples`,
`seq_len`, `seed`), the calibration's own stream is rebuilt and every document a calibration
window touched is dropped; eval shuffles the rest (--seed) and cuts consecutive, non-overlapping
windows, each beginning with the tokens every served request begins with
(`calib.data.tokenizer_prefix`: the BOS of Gemma or Llama, GLM's `[gMASK]<sop>`; `--no-bos`:
the text alone), whose targets
are not scored (a BOS is never a target; the first text token, predicted from it, is). If
nothing of a full window is left (e.g. the shipped 900 kB set under the default
128 x 2048 calibration, which covers nearly all of it), eval uses the whole file and eval.json
says `"disjoint": false, "overlap_avoidable": false`: pass --data with other text.

Writes DST/eval.json (`summary` is what the model card shows); like verify.json it is a
report about the checkpoint, not among the manifest's checksummed files.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from quantize import SCHEMA_VERSION, __version__
from quantize.calib.data import (
    EVAL_EVERY,
    HELDOUT_ENGLISH,
    calib_path,
    data_sha256,
    eval_reserved,
    is_shipped,
    join_documents,
    read_documents,
    tokenize_documents,
    tokenizer_prefix,
    window_starts,
)
from quantize.calib.decoder import (
    HiddenStates,
    build_skeleton,
    chunk_tokens,
    embed,
    free_layer,
    layer_inputs,
    load_layer,
    run_layer,
)
from quantize.check.int4view import Int4View, open_output
from quantize.errors import Problem, QuantizeError
from quantize.names import CALIB_REPORT, EVAL_JSON, LAYERS_PICTURE, MANIFEST
from quantize.options import ConvertOptions
from quantize.plan import Unit, make_plan
from quantize.source.checkpoint import Checkpoint, open_checkpoint
from quantize.source.hub import source_identity
from quantize.write.manifest import finished_manifest

__all__ = ["EVAL_JSON", "EvalOptions", "EvalSet", "Evaluator", "Int4View", "TokenScores",
           "evaluate", "open_output", "score_logits", "select_windows", "verdict"]

LOGIT_TOKENS = 1024  # tokens per logits piece: 1024 x 154,880 x 4 B = 0.6 GB per (T, V) float32


@dataclass(frozen=True)
class EvalOptions:
    data: str | None = None  # None: the default calibration set's reserve (data.DEFAULT_CALIB)
    # 16 x 2048 = 32k scored tokens: the ppl ratio settles to ~0.1% (enough to rank methods)
    # in minutes on a GPU; raise it for a publication-grade figure.
    num_samples: int = 16
    seq_len: int = 2048  # capped to the model's max_position_embeddings (the log says so)
    seed: int = 0  # shuffles the held-out documents before the windows are cut
    dtype: str = "auto"  # auto: bfloat16 on a GPU (what the engines run), float32 on the CPU
    # Out-of-domain text scored beside `data`, so overfitting to the calibration text shows
    # before publishing: None = the shipped general-English text (in no calibration set),
    # "none" = skip. Up to `ood_samples` windows of seq_len (the text is ~6k tokens).
    ood: str | None = None
    ood_samples: int = 4
    # The verdict (`verdict`): the output is broken, exit 1 and push refuses it, when on either
    # text the perplexity more than doubles or the mean KL(source || quantized) exceeds 1 nat
    # per token. Honest INT4 sits far below both (Gemma-3-270M g128: RTN +39 % / ratio 1.39 in
    # domain, GPTQ +7 %); a wrong AWQ fold gave a ratio of ~10,000.
    max_ppl_ratio: float = 2.0
    max_kl: float = 1.0
    # Windows begin with the tokens every served request begins with (its BOS, data.tokenizer_prefix):
    # Gemma-3-270M scored without its BOS has 2.5-3x its own perplexity (BENCHMARKS.md).
    bos: bool = True

    def __post_init__(self) -> None:
        if not (self.max_ppl_ratio > 0 and math.isfinite(self.max_ppl_ratio)):
            raise ValueError(f"--max-ppl-ratio must be a finite positive number, got {self.max_ppl_ratio}")
        if not (self.max_kl > 0 and math.isfinite(self.max_kl)):
            raise ValueError(f"--max-kl must be a finite positive number, got {self.max_kl}")
        if self.num_samples < 1 or self.seq_len < 2:
            raise ValueError("--num-samples must be >= 1 and --seq-len >= 2 (a next token to score)")
        if self.ood_samples < 1:
            raise ValueError("--ood-samples must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"--dtype must be auto, float32 or bfloat16, got {self.dtype!r}")


# ---------------------------------------------------------------------------------------------
# DST as plain float weights


# ---------------------------------------------------------------------------------------------
# Held-out windows


@dataclass(frozen=True)
class EvalSet:
    tokens: torch.Tensor  # int64 (num_samples, seq_len)
    source: str
    documents: int  # in the file
    held_out: int  # documents the windows were cut from
    stream_tokens: int  # tokens of those documents joined
    calibration: str  # how the calibration data relates to these windows (one sentence)
    disjoint: bool  # no document under a calibration window is in an eval window
    overlap_avoidable: bool | None  # None when disjoint
    prefix: int = 0  # tokens each window begins with (the tokenizer's BOS), not scored as targets

    def summary(self) -> dict:
        p = Path(self.source)  # its name and hash, not this machine's path (the card quotes it)
        return {"source": p.name, "sha256": data_sha256(p) if p.exists() else None,
                "documents": self.documents, "held_out_documents": self.held_out,
                "stream_tokens": self.stream_tokens, "num_samples": self.tokens.shape[0],
                "seq_len": self.tokens.shape[1], "calibration": self.calibration,
                "disjoint": self.disjoint, "overlap_avoidable": self.overlap_avoidable,
                "prefix_tokens": self.prefix}


class CalibWindows(NamedTuple):
    """The calibration windows of a conversion on the same file (its manifest options)."""

    num_samples: int
    seq_len: int
    seed: int
    prefix: int = 0  # tokens each window began with (calib_bos), not from the stream


def calibration_documents(doc_ids: list[list[int]], eos: int | None, calib: CalibWindows) -> set[int]:
    """The documents (indices into doc_ids) a calibration window touched: the calibration's own
    stream rebuilt (calib_data.join_documents / window_starts with its seed)."""
    ids, spans = join_documents(doc_ids, calib.seed, eos)
    body = calib.seq_len - calib.prefix  # stream tokens per window
    if len(ids) < body or body < 1:
        return set(range(len(doc_ids)))  # calibration refuses this; count everything as seen
    starts, _ = window_starts(len(ids), calib.num_samples, body, calib.seed)
    cover = torch.zeros(len(ids) + 1, dtype=torch.int64)  # +1 at each start, -1 at each end
    for s in starts:
        cover[s] += 1
        cover[s + body] -= 1
    seen = torch.cat([torch.zeros(1, dtype=torch.int64), (cover.cumsum(0)[:-1] > 0).long().cumsum(0)])
    return {i for i, (a, b) in enumerate(spans) if seen[b] - seen[a] > 0}  # covered tokens in [a, b)


def select_windows(doc_ids: list[list[int]], eos: int | None, num_samples: int, seq_len: int,
                   seed: int, calib: CalibWindows | None, source: str = "",
                   relation: str = "", allowed: set[int] | None = None,
                   prefix: list[int] | None = None) -> EvalSet:
    """Up to `num_samples` windows of `seq_len` ids from the documents no calibration window
    touched (all documents when `calib` is None), shuffled by `seed`: each `prefix` (the
    tokenizer's BOS) and then the next seq_len minus its length ids of their stream.
    `allowed`: only these documents (the shipped set's eval reserve)."""
    seen = calibration_documents(doc_ids, eos, calib) if calib is not None else set()
    pool = sorted(allowed) if allowed is not None else range(len(doc_ids))
    held = [i for i in pool if i not in seen]
    held_tokens = sum(len(doc_ids[i]) + (eos is not None) for i in held)
    disjoint, avoidable = True, None
    if calib is None:
        note = relation or "no calibration data on this file"
    elif held_tokens >= seq_len:
        note = (f"{len(seen)} of {len(doc_ids)} documents were under calibration windows "
                f"({calib.num_samples} x {calib.seq_len}, seed {calib.seed}) and are held out")
    else:
        held, disjoint, avoidable = list(pool), False, False
        note = (f"calibration ({calib.num_samples} x {calib.seq_len}, seed {calib.seed}) touched "
                f"{len(seen)} of {len(doc_ids)} documents, leaving fewer than --seq-len {seq_len} "
                "tokens: the windows overlap the calibration text (pass --data with other text)")
    ids, _ = join_documents([doc_ids[i] for i in held], seed, eos)
    head = torch.tensor(prefix or [], dtype=torch.int64)
    body = seq_len - len(head)
    n = min(num_samples, len(ids) // body) if body > 0 else 0
    if n == 0:
        raise QuantizeError("too little eval text", [Problem(
            source, None, f"{len(ids)} tokens", f"at least --seq-len {seq_len}"
            + (f" less the {len(head)} BOS token(s) each window begins with" if len(head) else ""),
            "pass --data with more text, or raise --seq-len (or lower it)")])
    body_ids = ids[: n * body].view(n, body)  # consecutive, non-overlapping
    tokens = torch.cat([head.expand(n, -1), body_ids], 1).contiguous()  # (n, S)
    return EvalSet(tokens, source, len(doc_ids), len(held), len(ids), note, disjoint, avoidable,
                   len(head))


def ood_windows(path: Path, tok, num_samples: int, seq_len: int,
                prefix: list[int] | None = None) -> torch.Tensor:
    """Up to `num_samples` windows of the out-of-domain text (any format --data reads; its
    documents in file order), each `prefix` and then the next seq_len minus its length ids;
    when it holds fewer, one window of all of them after the prefix."""
    doc_ids, _, _ = tokenize_documents(read_documents(path), tok)
    ids = [i for d in doc_ids for i in d]
    if len(ids) < 2:
        raise QuantizeError("too little out-of-domain text", [Problem(
            str(path), None, f"{len(ids)} tokens", "at least 2", "pass --ood with more text, or --ood none")])
    head = list(prefix or [])
    length = min(max(seq_len - len(head), 1), len(ids))  # text tokens per window
    n = min(num_samples, len(ids) // length)
    return torch.tensor([head + ids[i * length: (i + 1) * length] for i in range(n)],
                        dtype=torch.int64)  # (n, len(head) + length)


# ---------------------------------------------------------------------------------------------
# Scores


class TokenScores(NamedTuple):
    """Sums over scored tokens (position t predicts token t + 1)."""

    tokens: int
    nll_source: float
    nll_quantized: float
    kl: float  # sum of KL(p_source || p_quantized)
    top1_agree: int  # argmax equal

    def __add__(self, o: TokenScores) -> TokenScores:  # type: ignore[override]
        return TokenScores(*(a + b for a, b in zip(self, o)))


def score_logits(logits_s: torch.Tensor, logits_q: torch.Tensor, targets: torch.Tensor) -> TokenScores:
    """Scores of (T, V) logits of both models against (T,) next-token ids."""
    ls = torch.log_softmax(logits_s.float(), dim=-1)  # (T, V)
    lq = torch.log_softmax(logits_q.float(), dim=-1)
    t = targets.to(ls.device).unsqueeze(1)  # (T, 1)
    kl = (ls.exp() * (ls - lq)).sum(dim=-1).clamp(min=0)  # (T,); >= 0 up to rounding
    return TokenScores(targets.numel(), -float(ls.gather(1, t).double().sum()),
                       -float(lq.gather(1, t).double().sum()), float(kl.double().sum()),
                       int((ls.argmax(-1) == lq.argmax(-1)).sum()))


def verdict(summary: dict, ood: dict | None, max_ppl_ratio: float, max_kl: float) -> dict:
    """Whether the output is broken by EvalOptions' rule; every broken figure, one line each."""
    failed = []
    for name, d in (("held-out", summary), ("out-of-domain", ood)):
        if d is None:
            continue
        r, kl = d["ppl_ratio"], d["kl_mean"]
        if not (math.isfinite(r) and r <= max_ppl_ratio):
            failed.append(f"{name} perplexity ratio {r:.4g} > --max-ppl-ratio {max_ppl_ratio:g}")
        if not (math.isfinite(kl) and kl <= max_kl):
            failed.append(f"{name} mean KL {kl:.4g} nats > --max-kl {max_kl:g}")
    return {"ok": not failed, "max_ppl_ratio": max_ppl_ratio, "max_kl": max_kl, "failed": failed}


def summarize(s: TokenScores) -> dict:
    ppl_s, ppl_q = math.exp(s.nll_source / s.tokens), math.exp(s.nll_quantized / s.tokens)
    return {"ppl_source": ppl_s, "ppl_quantized": ppl_q, "ppl_ratio": ppl_q / ppl_s,
            "kl_mean": s.kl / s.tokens, "top1_agreement": s.top1_agree / s.tokens, "tokens": s.tokens}


# ---------------------------------------------------------------------------------------------
# The two streams


SIDES = ("source", "quantized")


@dataclass
class _Stream:
    """One token set through both models: its windows, layer inputs (positions for its window
    length), samples per chunk, and per side the hidden-state chunks and routing state."""

    tokens: torch.Tensor  # int64 (n, S)
    inputs: object
    b: int
    hidden: dict[str, HiddenStates] = field(default_factory=dict)
    topk: dict[str, list[torch.Tensor | None]] = field(default_factory=dict)


class Evaluator:
    """The source and quantized models side by side over `tokens`, one layer at a time; the
    token sets in `extra` (e.g. out-of-domain text) ride along in the same pass, so every layer
    of both checkpoints is read once. The per-layer error is the main set's."""

    def __init__(self, src: Checkpoint, units: dict[str, Unit], dst: Int4View, tokens: torch.Tensor,
                 device: torch.device, dtype: torch.dtype,
                 log: Callable[[str], None] | None = None,
                 extra: dict[str, torch.Tensor] | None = None, prefix: int = 0) -> None:
        self.src, self.units, self.dst = src, units, dst
        # every window's first `prefix` tokens are the tokenizer's BOS: no target among them is
        # scored, and the per-layer error leaves their hidden states out (a BOS's are the same in
        # every window, and a sink's can be orders of magnitude larger than the text's)
        self.prefix = prefix
        self.device, self.dtype = device, dtype
        self.log = log or (lambda msg: None)
        self.skeleton = build_skeleton(src.config)  # DST has the same config (checked by evaluate)
        self.num_layers = len(self.skeleton.model.layers)
        self.streams = {name: _Stream(t, layer_inputs(self.skeleton, t.shape[1], device, dtype),
                                      max(1, chunk_tokens(device) // t.shape[1]))  # samples per chunk
                        for name, t in {"": tokens, **(extra or {})}.items()}
        self.hidden = self.streams[""].hidden  # the main set's (logits, the per-layer error)
        self.layers: list[dict] = []

    def read(self, side: str, name: str) -> torch.Tensor:
        """A non-layer tensor of one side (embedding, final norm, lm_head) on the device."""
        if side == "quantized":
            return self.dst.read(name, self.device)
        u = self.units.get(name)
        if u is not None and u.scale is not None:
            from quantize.source.weights import source_weight

            return source_weight(self.src, u, self.device)
        return self.src.read(name, self.device)

    def embed(self) -> None:
        H = self.src.config["hidden_size"]
        nbytes = sum(st.tokens.numel() for st in self.streams.values()) * H * torch.finfo(self.dtype).bits // 8
        where = HiddenStates.placement(2 * nbytes, self.device)  # both sides
        for side in SIDES:
            emb = self.read(side, "model.embed_tokens.weight")  # (V, H)
            for st in self.streams.values():
                chunks = [embed(self.skeleton, emb, st.tokens[i: i + st.b].to(self.device)).to(self.dtype)
                          for i in range(0, st.tokens.shape[0], st.b)]  # (b, S, H) each
                st.hidden[side] = HiddenStates(chunks, self.device, where)
                st.topk[side] = [None] * len(chunks)
                del chunks
            del emb

    @torch.no_grad()
    def run_layer(self, L: int) -> dict:
        """Layer L on both streams; the quantized stream's error against the source's."""
        t0 = time.perf_counter()
        for side in SIDES:
            ckpt, units = (self.src, self.units) if side == "source" else (self.dst, None)
            layer = load_layer(self.skeleton, ckpt, units, L, self.device, self.dtype)
            for st in self.streams.values():
                hs, topk = st.hidden[side], st.topk[side]
                for i in range(len(hs)):
                    h, topk[i] = run_layer(self.skeleton, layer, st.inputs, hs.on_device(i), topk[i])
                    hs.put(i, h)
            free_layer(layer)
        err = ref = 0.0
        p = self.prefix if self.prefix < self.streams[""].tokens.shape[1] else 0
        for i in range(len(self.hidden["source"])):
            hs = self.hidden["source"].on_device(i)[:, p:].double()
            hq = self.hidden["quantized"].on_device(i)[:, p:].double()
            err += float((hq - hs).pow(2).sum())
            ref += float(hs.pow(2).sum())
        prefix = f"model.layers.{L}."
        entry = {"layer": L, "int4_linears": sum(n.startswith(prefix) for n in self.dst.packed),
                 "rel_error": math.sqrt(err / max(ref, 1e-300)),
                 "seconds": round(time.perf_counter() - t0, 3)}
        self.layers.append(entry)
        return entry

    def head(self, side: str) -> tuple[torch.nn.Module, torch.Tensor]:
        """The final norm (a filled copy of the skeleton's) and the lm_head weight of one side."""
        norm = copy.deepcopy(self.skeleton.model.norm).to(self.dtype)
        norm.to_empty(device=self.device)
        with torch.no_grad():
            for key, t in norm.state_dict().items():
                t.copy_(self.read(side, f"model.norm.{key}"))
        ckpt = self.src if side == "source" else self.dst
        name = "lm_head.weight" if "lm_head.weight" in ckpt.tensors else "model.embed_tokens.weight"
        return norm.eval(), self.read(side, name).to(self.dtype)  # tied embeddings: the table

    def logits(self, side: str, i: int, head: tuple | None = None) -> torch.Tensor:
        """Chunk i's logits of one side, (b, S, V) float32 (tests compare them with transformers)."""
        norm, W = head or self.head(side)
        with torch.no_grad():
            return F.linear(norm(self.hidden[side].on_device(i)), W).float()

    @torch.no_grad()
    def score(self, name: str = "", heads: dict | None = None) -> TokenScores:
        """Token set `name`'s scores ("" the main one), after the last layer."""
        heads = heads or {side: self.head(side) for side in SIDES}
        st = self.streams[name]
        total = TokenScores(0, 0.0, 0.0, 0.0, 0)
        first = max(self.prefix, 1)  # the first target scored: the first token after the prefix
        for i in range(len(st.hidden["source"])):
            targets = st.tokens[i * st.b: (i + 1) * st.b, first:].reshape(-1)  # (b * (S-first),)
            x = {}
            for side in SIDES:
                norm, _ = heads[side]
                h = norm(st.hidden[side].on_device(i))[:, first - 1:-1]  # (b, S-first, H): the last has no target
                x[side] = h.reshape(-1, h.shape[-1])
            for a in range(0, targets.numel(), LOGIT_TOKENS):
                piece = slice(a, a + LOGIT_TOKENS)
                total = total + score_logits(F.linear(x["source"][piece], heads["source"][1]),
                                             F.linear(x["quantized"][piece], heads["quantized"][1]),
                                             targets[piece])
        return total

    def run(self) -> dict[str, TokenScores]:
        """Every layer, then each token set's scores by name ("" the main one)."""
        self.embed()
        for L in range(self.num_layers):
            e = self.run_layer(L)
            self.log(f"layer {L}/{self.num_layers - 1}: {e['int4_linears']} INT4 Linears, hidden-state "
                     f"relative error {e['rel_error']:.4f}, {e['seconds']} s")
        heads = {side: self.head(side) for side in SIDES}
        return {name: self.score(name, heads) for name in self.streams}


# ---------------------------------------------------------------------------------------------
# The command


def _same_model(src: Checkpoint, dst: Int4View) -> None:
    skip = {"quantization_config", "torch_dtype"}
    a = {k: v for k, v in src.config.items() if k not in skip}
    b = {k: v for k, v in dst.config.items() if k not in skip}
    diffs = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if diffs:
        raise QuantizeError("DST was not converted from SRC", [Problem(
            str(Path(dst.name) / "config.json"), None, f"{k} = {b.get(k)!r}",
            f"{a.get(k)!r} as in {src.name}/config.json", "pass the source DST was converted from")
            for k in diffs])


def _tokenizer(src: Checkpoint, dst: Path):
    from transformers import AutoTokenizer

    for root in (str(src.root), str(dst)):  # convert copies the source's tokenizer into DST
        try:
            # trust_remote_code=False: a tokenizer_config.json `auto_map` naming the checkpoint's
            # own tokenization_*.py is refused (ValueError), never imported. Left unset,
            # transformers asks "run the custom code? [y/N]" on stdin and runs it on y.
            return AutoTokenizer.from_pretrained(root, trust_remote_code=False)
        except (OSError, ValueError):
            continue
    raise QuantizeError("eval needs the checkpoint's tokenizer", [Problem(
        str(src.root), None, f"no loadable tokenizer here nor in {dst}",
        "tokenizer.json / tokenizer_config.json next to config.json, with a tokenizer class of "
        "transformers (a tokenizer's own code is never run)",
        "copy the tokenizer files from the model release into SRC")])


def _calib_windows(manifest_opts: ConvertOptions, data: Path, calib_sha256: str | None = None,
                   prefix: int = 0) -> tuple[CalibWindows | None, str]:
    """The conversion's calibration windows when they were cut from `data`, and a sentence.
    The same file: the same sha256 as the calibration report records (`calib_sha256`), else
    (reports without one) the same path or name."""
    if manifest_opts.method == "rtn":
        return None, "none: the conversion used round-to-nearest (no calibration data)"
    calib = calib_path(manifest_opts.calib or None)
    if calib_sha256 is not None and data.exists():
        same = data_sha256(data) == calib_sha256
    else:
        same = calib.resolve() == data.resolve() if calib.exists() else calib.name == data.name
    if not same:
        return None, f"another file ({calib.name}): disjoint by file"
    o = manifest_opts
    return CalibWindows(o.num_samples, o.seq_len, o.seed, prefix), ""


def _windows(src_ckpt, dst: Path, opts: EvalOptions, conv: ConvertOptions, calib_rep: dict | None,
             log: Callable[[str], None]):
    """The held-out windows eval scores: (seq_len, the --data file, its EvalSet, the extra
    token sets scored in the same pass ({"ood": ...} unless --ood none), the --ood file)."""
    seq_len = opts.seq_len
    limit = src_ckpt.config.get("max_position_embeddings")
    if limit and seq_len > limit:
        log(f"note: --seq-len {seq_len} is beyond max_position_embeddings {limit} of config.json: "
            f"using {limit}")
        seq_len = int(limit)
    tok = _tokenizer(src_ckpt, dst)
    head = tokenizer_prefix(tok)
    prefix = head if opts.bos else []
    data = calib_path(opts.data or None)
    docs = read_documents(data)
    calib_summary = (calib_rep or {}).get("calibration") or {}
    calib_prefix = calib_summary.get("prefix")  # as the calibration recorded it, else rebuilt
    calib, relation = _calib_windows(conv, data, calib_summary.get("sha256"), len(calib_prefix)
                                     if calib_prefix is not None else len(head) if conv.calib_bos else 0)
    allowed = None
    if is_shipped(data):  # the shipped set: its documents kept for eval (data.EVAL_EVERY)
        allowed = {i for i in range(len(docs)) if eval_reserved(i)}
        if calib is not None and calib_summary.get("eval_reserve"):  # never read by the
            calib, relation = None, (f"held out: a calibration on the shipped set never reads "
                                     f"these documents (every {EVAL_EVERY}th)")  # calibration
    if allowed is not None and calib is None:  # only the reserve is read: only it is tokenized
        ids = iter(tokenize_documents([docs[i] for i in sorted(allowed)], tok)[0])
        doc_ids = [next(ids) if i in allowed else [] for i in range(len(docs))]
    else:
        doc_ids = tokenize_documents(docs, tok)[0]
    es = select_windows(doc_ids, tok.eos_token_id, opts.num_samples, seq_len, opts.seed, calib,
                        str(data), relation, allowed, prefix)
    log(f"eval data: {es.tokens.shape[0]} x {es.tokens.shape[1]} tokens from {data}; calibration: "
        f"{es.calibration}")
    if not es.disjoint:
        log("warning: the eval windows overlap the calibration text; the figures flatter the "
            "calibrated method (pass --data with held-out text)")

    extra, ood_path = {}, None
    if (opts.ood or "").lower() != "none":
        ood_path = Path(opts.ood) if opts.ood else HELDOUT_ENGLISH
        if not ood_path.is_file():
            raise QuantizeError("out-of-domain text not found", [Problem(
                str(ood_path), None, "no such file", "a text file", "pass --ood FILE, or --ood none")])
        extra["ood"] = ood_windows(ood_path, tok, opts.ood_samples, seq_len, prefix)
        log(f"out-of-domain data: {extra['ood'].shape[0]} x {extra['ood'].shape[1]} tokens from "
            f"{ood_path.name} (scored in the same pass)")
    return seq_len, data, es, extra, ood_path


def evaluate(src: str | Path, dst: str | Path, opts: EvalOptions = EvalOptions(),
             device: str = "auto", log: Callable[[str], None] | None = None,
             write: bool = True) -> dict:
    """Compare DST with SRC on held-out text; write DST/eval.json (and refresh the card)."""
    from quantize.source.weights import resolve_device

    dst = Path(dst)
    log = log or (lambda msg: None)
    manifest = finished_manifest(dst)
    conv = ConvertOptions.from_json(manifest["options"])
    src_ckpt = open_checkpoint(src)
    units = {u.source: u for u in make_plan(src_ckpt, conv).units}
    view = open_output(dst)
    _same_model(src_ckpt, view)
    dev = resolve_device(device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        opts.dtype, torch.bfloat16 if dev.type == "cuda" else torch.float32)

    calib_rep = json.loads((dst / CALIB_REPORT).read_text()) if (dst / CALIB_REPORT).is_file() else None
    seq_len, data, es, extra, ood_path = _windows(src_ckpt, dst, opts, conv, calib_rep, log)
    t0 = time.perf_counter()
    ev = Evaluator(src_ckpt, units, view, es.tokens, dev, dtype, log, extra=extra, prefix=es.prefix)
    scores = ev.run()
    summary = summarize(scores[""])
    relation = ("no calibration (rtn)" if conv.method == "rtn" else
                "disjoint from the calibration text" if es.disjoint else "overlaps the calibration text")
    summary["data"] = f"{Path(es.source).name}, {es.tokens.shape[0]} x {es.tokens.shape[1]} tokens, {relation}"
    ood = None
    if ood_path is not None:
        n, S = extra["ood"].shape
        ood = {**summarize(scores["ood"]), "data": f"{ood_path.name}, {n} x {S} tokens"
               + (", in no calibration set" if ood_path == HELDOUT_ENGLISH else "")}
        summary.update({"ood_ppl_ratio": ood["ppl_ratio"], "ood_kl_mean": ood["kl_mean"],
                        "ood_top1_agreement": ood["top1_agreement"], "ood_data": ood["data"]})
    report = {
        "schema_version": SCHEMA_VERSION,
        "summary": summary,
        "verdict": verdict(summary, ood, opts.max_ppl_ratio, opts.max_kl),
        "layers": ev.layers,
        "data": es.summary(),
        "out_of_domain": ood,
        "options": {"num_samples": opts.num_samples, "seq_len": seq_len, "seed": opts.seed,
                    "bos": opts.bos,
                    "data": Path(data).name, "ood": ood_path and ood_path.name},  # names, not paths: the card quotes this report
        "method": conv.method,
        "source": source_identity(src)["name"] if Path(src).exists() else str(src),
        "device": str(dev),
        "compute_dtype": str(dtype).replace("torch.", ""),
        "mtp": "not evaluated (transformers drops the MTP layer; it is used for speculative decoding)",
        "seconds": round(time.perf_counter() - t0, 1),
        "tool_version": __version__,
    }
    if write:
        _write_report(dst, report, calib_rep)
    return report


def _write_report(dst: Path, report: dict, calib_rep: dict | None) -> None:
    """DST/eval.json, its picture, and the card refreshed."""
    from quantize.publish import plots
    from quantize.publish.readme import refresh_readme  # local: readme -> verify -> pipeline
    from quantize.write.shards import sha256_file, write_json_atomic

    # a report about the checkpoint, not part of it (not among the manifest's files): it
    # names the manifest it measured and its picture's sha256, so push can tell this
    # conversion's report from a stale or copied one
    report["manifest_sha256"] = sha256_file(dst / MANIFEST)
    if plots.errors_by_layer(report, calib_rep, dst / LAYERS_PICTURE) is not None:
        report["pictures"] = {LAYERS_PICTURE: sha256_file(dst / LAYERS_PICTURE)}
    write_json_atomic(dst / EVAL_JSON, report)
    refresh_readme(dst)
