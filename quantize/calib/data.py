"""Calibration text -> a fixed (num_samples, seq_len) block of token ids.

Accepted `--calib` sources (the default is the shipped `calib_data/large.jsonl.xz`):

    *.jsonl / *.json   one JSON object per line: {"text": ...} or {"messages": [{role, content}]};
                       messages are rendered with the checkpoint's own chat template
    *.txt / *.md       plain UTF-8 text, the whole file one document
                       (each also compressed: NAME.jsonl.xz, .gz or .bz2)
    *.parquet          a `text` or `messages` column (needs pyarrow)
    a folder           a dataset saved with `datasets` `save_to_disk` (read with pyarrow)
    ORG/NAME[@REV][:SPLIT]  a dataset on the Hugging Face Hub (no local file of that name): the
                       split's .parquet / .jsonl / .txt files (default: train, else all),
                       fetched into the Hub cache at the revision's commit (`hub.resolve_dataset`)
    shipped:NAME       a set shipped with the tool: `shipped:large` (calib_data/large.jsonl.xz,
                       the default, ~1.8 M tokens: small's records, then FAQ dialogue in English
                       and Chinese, Python documentation, SymPy code, the Debian Administrator's
                       Handbook, Chinese technical prose and poems) or `shipped:small`
                       (calib_data/default.jsonl, ~0.27 M tokens, the default before large)

Sampling is deterministic for a given `seed`: the documents are shuffled with
`torch.Generator().manual_seed(seed)`, tokenized, joined with the EOS token into one
stream, and cut into consecutive windows. Each window begins with the tokens every request the
served model sees begins with (`tokenizer_prefix`: those the tokenizer itself puts before a
text, Gemma's and Llama's BOS; else the special tokens the chat template writes before any
message, GLM's `[gMASK]<sop>`; none when neither exists), followed by `seq_len` minus that many
tokens of the stream (`--no-calib-bos`: the stream alone, as before 2026-12-05). Only as much of the shuffled
stream is tokenized as the windows read (the same windows as tokenizing it all). When the stream holds fewer
than `num_samples * seq_len` tokens, the windows start at seeded random offsets instead and
overlap (recorded in `CalibrationSet.overlapping`); a stream shorter than one window is an error.
e.g. 1,000,000 tokens, 512 x 2048 requested: 488 full windows exist, so the 512 overlap.

The data is named in reports (calibration-report.json, which `push` uploads) by its file name and
sha256, never by its local path: the name says what it was, the hash pins the exact bytes.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import lzma
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from quantize.errors import Problem, QuantizeError
from quantize.write.shards import sha256_file

__all__ = ["DEFAULT_CALIB", "EVAL_EVERY", "HELDOUT_ENGLISH", "SHIPPED_SETS", "CalibrationSet", "ChatTemplateTimeout",
           "calib_path", "checkpoint_calibration", "data_sha256", "eval_reserved", "is_shipped", "join_documents",
           "load_calibration", "read_documents", "resolve_calib", "served_prefix", "shipped_set",
           "stream_order", "text_prefix", "tokenize_documents", "tokenizer_prefix", "window_starts"]

def _shipped(name: str) -> Path:
    """A shipped data file: inside the package in an installed wheel (quantize/_shipped/NAME,
    pyproject's package-data), calib_data/NAME in a checkout."""
    here = Path(__file__).resolve().parent.parent  # the package folder
    wheel = here / "_shipped" / name
    return wheel if wheel.is_file() else here.parent / "calib_data" / name


# `--calib shipped:NAME`: the sets shipped with the tool. large begins with small's records in
# small's order, so the documents eval keeps (below) are the same ones in both. large is the
# default: at the recommended 512 x 2048 it is read once (small four times over), and it had the
# lower KL on the validation texts of BENCHMARKS.md's "The default calibration set at 512 x 2048".
SHIPPED_SETS = {"large": _shipped("large.jsonl.xz"), "small": _shipped("default.jsonl")}
DEFAULT_CALIB = SHIPPED_SETS["large"]
_COMPRESSED = {".xz": lzma.decompress, ".gz": gzip.decompress, ".bz2": bz2.decompress}
# Every EVAL_EVERY-th document of the shipped set (index % EVAL_EVERY == EVAL_EVERY - 1) is kept
# for `eval`: a calibration on the shipped set never reads it, so eval's default figures stay
# held out at any --num-samples x --seq-len.
EVAL_EVERY = 6


def eval_reserved(i: int) -> bool:
    """Whether document i of the shipped set is kept for `eval` (never calibrated on)."""
    return i % EVAL_EVERY == EVAL_EVERY - 1


def is_shipped(path: Path) -> bool:
    """Whether `path` is one of the shipped sets (from the checkout or the wheel)."""
    try:
        return any(path.resolve() == p.resolve() for p in SHIPPED_SETS.values())
    except OSError:
        return False


def shipped_set(calib: str | Path | None) -> Path | None:
    """The file of `--calib shipped:NAME` (None: not of that form); an unknown NAME is an error
    that lists the names."""
    if not (isinstance(calib, str) and calib.startswith("shipped:")):
        return None
    name = calib.removeprefix("shipped:")
    if name not in SHIPPED_SETS:
        raise _error(calib, f"no shipped set named {name!r}", "one of "
                     + ", ".join(f"shipped:{n}" for n in SHIPPED_SETS), "pick one of those, or pass a file")
    return SHIPPED_SETS[name]


def calib_path(calib: str | Path | None) -> Path:
    """The local file or folder `--calib` (or eval's `--data`) names: a shipped set by its name,
    a path as given, the default set when None (a Hub dataset is `resolve_calib`'s)."""
    return shipped_set(calib) or (Path(calib) if calib is not None else DEFAULT_CALIB)


def _kind(p: Path) -> str:
    """The format suffix of a calibration file, under a compression suffix (a.jsonl.xz: .jsonl)."""
    return Path(p.stem).suffix if p.suffix in _COMPRESSED else p.suffix


# General English written for the project, in no calibration set: eval's out-of-domain text.
HELDOUT_ENGLISH = _shipped("heldout_english.md")


@dataclass(frozen=True)
class CalibrationSet:
    tokens: torch.Tensor  # int64 (num_samples, seq_len)
    source: str  # the file (or saved-dataset folder) name, no local path
    documents: int
    stream_tokens: int  # tokens of the joined stream read (all of it when the windows overlap)
    overlapping: bool  # fewer tokens than num_samples * seq_len: windows overlap
    chat_template: str  # "checkpoint" | "plain (the tokenizer has none)" | "unused"
    sha256: str | None = None  # of the data's bytes (`data_sha256`); None: tokens given directly
    eval_reserve: int = 0  # documents of the shipped set kept for eval, not read (EVAL_EVERY)
    prefix: tuple[str, ...] = ()  # the tokens each window begins with (text_prefix), as text

    def summary(self) -> dict:
        return {"source": self.source, "sha256": self.sha256, "documents": self.documents,
                "stream_tokens": self.stream_tokens, "num_samples": self.tokens.shape[0],
                "seq_len": self.tokens.shape[1], "overlapping": self.overlapping,
                "chat_template": self.chat_template, "eval_reserve": self.eval_reserve,
                "prefix": list(self.prefix)}


def data_sha256(path: Path) -> str:
    """sha256 of a calibration file; of a saved-dataset folder, over its files' relative paths
    and sha256s in sorted order."""
    if not path.is_dir():
        return sha256_file(path)
    return _files_sha256((f.relative_to(path).as_posix(), f)
                         for f in sorted(p for p in path.rglob("*") if p.is_file()))


def _files_sha256(files) -> str:
    """sha256 over (relative name, file) pairs in the given order: each name and its sha256."""
    h = hashlib.sha256()
    for rel, f in files:
        h.update(f"{rel}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


def _error(file: str, found: str, expected: str, fix: str) -> QuantizeError:
    return QuantizeError("unusable calibration data", [Problem(file, None, found, expected, fix)])


def _read_text(path: Path) -> str:
    try:
        if path.suffix in _COMPRESSED:
            try:
                data = _COMPRESSED[path.suffix](path.read_bytes())
            except Exception as e:  # noqa: BLE001 - each codec's own (LZMAError, BadGzipFile, EOFError)
                raise _error(str(path), f"not readable as {path.suffix} ({e})",
                             f"a complete {path.suffix} file", "compress it again, or pass it "
                             "uncompressed") from None
            return data.decode("utf-8")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _error(str(path), f"not UTF-8 (byte {e.start}: {e.reason})", "UTF-8 text",
                     "re-encode it, e.g. `iconv -f latin1 -t utf-8 IN > OUT`") from None


def _record(rec: object, where: str) -> str | list[dict]:
    if isinstance(rec, dict) and isinstance(rec.get("text"), str):
        return rec["text"]
    if isinstance(rec, dict) and isinstance(rec.get("messages"), list):
        for i, m in enumerate(rec["messages"]):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), (str, list))):
                raise _error(where, f"message {i} of `messages` is {str(m)[:60]!r}",
                             'chat messages as objects {"role": "user", "content": "..."}',
                             "write each message with a role and its content")
        return rec["messages"]
    raise _error(where, f"a record without `text` or `messages`: {str(rec)[:80]}",
                 'JSON objects with a "text" string or a "messages" list',
                 "rename the field holding the text to `text`")


def _pyarrow(p: Path, what: str):
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise _error(str(p), f"{what}, and `pyarrow` is not installed", "pyarrow to read it",
                     "pip install pyarrow, or export the text to JSONL") from None
    return pyarrow


def _saved_dataset_rows(p: Path) -> list[dict]:
    """Rows of a folder written by `datasets` `save_to_disk` (a Dataset, or the first split of
    a DatasetDict), read with pyarrow: `state.json` lists the Arrow stream files in order."""
    if (p / "dataset_dict.json").is_file():
        try:
            splits = json.loads((p / "dataset_dict.json").read_text())["splits"]
        except (ValueError, KeyError, TypeError):
            splits = []
        if not splits or not (p / str(splits[0])).is_dir():
            raise _error(str(p / "dataset_dict.json"), "no readable split", "a DatasetDict "
                         "saved with save_to_disk", "save one split, or export to JSONL")
        p = p / str(splits[0])
    try:
        files = [f["filename"] for f in json.loads((p / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise _error(str(p), "a folder without a datasets state.json", "a dataset saved with "
                     "`save_to_disk` (state.json + data-*.arrow)", "point --calib at a file, "
                     "or at the folder save_to_disk wrote") from None
    pa = _pyarrow(p, "a saved dataset")
    rows: list[dict] = []
    for name in files:
        f = p / name
        if Path(name).name != name or not f.is_file():
            raise _error(str(p / "state.json"), f"data file {name!r} missing or outside the folder",
                         "data files next to state.json", "save the dataset again")
        with pa.memory_map(str(f)) as src:
            rows += pa.ipc.open_stream(src).read_all().to_pylist()
    return rows


def read_documents(path: str | Path) -> list[str | list[dict]]:
    """The documents of a calibration source: strings, or chat message lists."""
    p = Path(path)
    if not p.exists():
        fix = (f"the shipped sets are in the package (quantize/_shipped/{p.name}): "
               "reinstall the package, or pass --calib" if p in SHIPPED_SETS.values()
               else "check the --calib path")
        raise _error(str(p), "no such file or folder", "a .jsonl, .txt, .parquet file or a "
                     "saved datasets folder", fix)
    _regular(p)
    if p.is_dir():
        docs = [_record(r, str(p)) for r in _saved_dataset_rows(p)]
    elif _kind(p) == ".parquet":
        if p.suffix in _COMPRESSED:
            raise _error(str(p), f"a parquet file inside {p.suffix}", "a .parquet file (parquet "
                         "compresses its own columns)", "decompress it and pass the .parquet")
        pq = _pyarrow(p, "a parquet file").parquet
        docs = [_record(r, str(p)) for r in pq.read_table(p).to_pylist()]
    elif _kind(p) in (".jsonl", ".json"):
        docs = []
        for i, line in enumerate(_read_text(p).splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise _error(f"{p}:{i}", f"invalid JSON ({e.msg})", "one JSON object per line",
                             "fix that line (JSONL, not a JSON array)") from None
            docs.append(_record(rec, f"{p}:{i}"))
    else:
        docs = [_read_text(p)]
    docs = [d for d in docs if (d.strip() if isinstance(d, str) else d)]
    if not docs:
        raise _error(str(p), "no text", "at least one non-empty document",
                     "point --calib at a file with text, or leave it out for the default set")
    return docs


def _regular(p: Path) -> None:
    """A calibration path must be a file or a folder (a device or a pipe, e.g. /dev/zero, would
    be read without end)."""
    if p.exists() and not p.is_dir() and not p.is_file():
        raise _error(str(p), "not a regular file or folder (a device or a pipe)",
                     "a .jsonl, .txt, .parquet file or a saved datasets folder",
                     "write the calibration text to a file and pass that")


# A chat template is code from the checkpoint: each rendering has this long (a real one takes
# milliseconds; nested loops in tokenizer_config.json would otherwise hang the run for good).
TEMPLATE_SECONDS = 10.0


class _TemplateTimeout(Exception):
    pass


class ChatTemplateTimeout(QuantizeError):
    """A chat template past its bound (`bounded_template`): the run stops, whatever it was for."""


def bounded_template(render: Callable[[], str], seconds: float | None = None) -> str:
    """`render()` (a jinja chat template, which compiles to Python) stopped once it has run
    `seconds` (None: TEMPLATE_SECONDS): a trace function on this thread checks the clock as the template's lines run
    and raises QuantizeError past the bound. The thread's previous trace function (a debugger,
    coverage) is restored afterwards."""
    import sys

    seconds = TEMPLATE_SECONDS if seconds is None else seconds
    deadline = time.monotonic() + seconds
    tick = [0]

    def trace(frame, event, arg):
        tick[0] += 1
        if tick[0] % 256 == 0 and time.monotonic() > deadline:
            raise _TemplateTimeout
        return trace

    before = sys.gettrace()
    sys.settrace(trace)
    try:
        return render()
    except _TemplateTimeout:
        raise ChatTemplateTimeout("the checkpoint's chat template does not finish", [Problem(
            "tokenizer_config.json / chat_template.jinja", None,
            f"still rendering after {seconds:g} s (a real template takes milliseconds)",
            "a chat template that renders a conversation in bounded time",
            "replace the template with the release's (a loop without end?), or pass plain-text "
            "records ({\"text\": ...})")]) from None
    finally:
        sys.settrace(before)


def _render(doc: str | list[dict], tokenizer) -> tuple[str, bool]:
    """(text, used the checkpoint's chat template)."""
    if isinstance(doc, str):
        return doc, False
    if getattr(tokenizer, "chat_template", None):
        try:
            return bounded_template(lambda: tokenizer.apply_chat_template(doc, tokenize=False)), True
        except QuantizeError:
            raise
        except Exception as e:  # noqa: BLE001 - the template's own error (jinja, its sandbox)
            raise QuantizeError("the checkpoint's chat template cannot render a calibration "
                                "record", [Problem(
                                    "tokenizer_config.json / chat_template.jinja", None,
                                    f"{type(e).__name__}: {e}"[:200],
                                    "a template that renders the records' messages",
                                    "check the records' roles against the template, or pass "
                                    "plain-text records ({\"text\": ...})")]) from None
    return "".join(f"{m['role']}: {m['content']}\n" for m in doc), False


def tokenize_documents(docs: list[str | list[dict]], tokenizer) -> tuple[list[list[int]], int, int]:
    """Each document's token ids (no special tokens), and (chats, templated) counts. One
    batched call: a fast (Rust) tokenizer encodes the batch on all cores, with the same ids
    as one call per document (no padding, no truncation)."""
    texts, chats, templated = [], 0, 0
    for doc in docs:
        text, used = _render(doc, tokenizer)
        chats += not isinstance(doc, str)
        templated += used
        texts.append(text)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return [list(x) for x in ids], chats, templated


def stream_order(documents: int, seed: int) -> list[int]:
    """The order of the documents in the joined stream for `seed`."""
    return torch.randperm(documents, generator=torch.Generator().manual_seed(seed)).tolist()


def join_documents(doc_ids: list[list[int]], seed: int, eos: int | None) -> tuple[torch.Tensor, tuple]:
    """The stream of `doc_ids` in `stream_order` for `seed`, each document followed by `eos`;
    and each document's span in it (indexed like `doc_ids`)."""
    order = stream_order(len(doc_ids), seed)
    stream: list[int] = []
    spans: list[tuple[int, int]] = [(0, 0)] * len(doc_ids)
    for i in order:
        begin = len(stream)
        stream += doc_ids[i]
        if eos is not None:
            stream.append(eos)
        spans[i] = (begin, len(stream))
    return torch.tensor(stream, dtype=torch.int64), tuple(spans)


_PROBE = "Calibration text."


def text_prefix(encode) -> list[int]:
    """The ids a tokenizer puts before a text by itself: `encode(text, special)` -> ids, with and
    without its special tokens; what the first has before the second's ids (Gemma's and Llama's
    BOS; [] for a tokenizer that adds nothing before, or only after, a text)."""
    plain, full = list(encode(_PROBE, False)), list(encode(_PROBE, True))
    for k in range(len(full) - len(plain) + 1):
        if full[k: k + len(plain)] == plain:
            return full[:k]
    return []


def tokenizer_prefix(tokenizer) -> list[int]:
    """The ids every request to the served model begins with, for a transformers tokenizer
    (`served_prefix`)."""
    special = getattr(tokenizer, "added_tokens_decoder", {})
    return served_prefix(lambda t, sp: tokenizer(t, add_special_tokens=sp)["input_ids"],
                         getattr(tokenizer, "chat_template", None),
                         {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)},
                         lambda i: getattr(special.get(i), "special", False))


def served_prefix(encode, chat_template, special_tokens: dict[str, str], is_special) -> list[int]:
    """The ids every request to the served model begins with: `text_prefix` (`encode(text,
    special)` -> ids; Gemma's and Llama's BOS); for a tokenizer that adds none, the special
    tokens the chat template renders before any message, when it renders only such tokens
    (`is_special(id)`; GLM's `[gMASK]<sop>`, which its chat template writes and its tokenizer
    does not add); else []. `special_tokens`: the template's names for them (bos_token, ...)."""
    ids = text_prefix(encode)
    start = None if ids else _template_start(chat_template, special_tokens)
    if not start:
        return ids
    ids = list(encode(start, False))
    return ids if all(is_special(i) for i in ids) else []


def _template_start(template, special_tokens: dict[str, str]) -> str | None:
    """What a chat template renders for no messages (transformers refuses an empty
    conversation, so jinja2 renders it as transformers sets it up: trimmed blocks, loop
    controls, the special tokens by name); None without a template or when it needs a message."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not isinstance(template, str):  # (none, or a dict of named templates)
        return None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    try:
        return bounded_template(lambda: env.from_string(template).render(
            messages=[], add_generation_prompt=False, tools=None, **special_tokens))
    except QuantizeError:
        raise
    except Exception:  # noqa: BLE001 - a template that needs a message (Gemma's): no constant start
        return None


def window_starts(stream_tokens: int, num_samples: int, seq_len: int, seed: int) -> tuple[list[int], bool]:
    """Where the calibration windows start in a stream of `stream_tokens` ids, and whether they
    overlap: consecutive windows from 0 when the stream holds them all, else seeded random
    starts (`seed + 1`)."""
    if stream_tokens >= num_samples * seq_len:
        return [i * seq_len for i in range(num_samples)], False
    g = torch.Generator().manual_seed(seed + 1)
    starts = torch.randint(0, stream_tokens - seq_len + 1, (num_samples,), generator=g)
    return starts.tolist(), True


def resolve_calib(calib: str | Path | None) -> tuple[str, list[Path], str]:
    """`--calib` -> (its name in reports, the local files to read, their sha256).

    None: the shipped default set. A local file or folder: itself, by name. ORG/NAME[@REV][:SPLIT]
    with no local file of that name: a Hub dataset, its split's files downloaded
    (`hub.resolve_dataset`); the sha256 is over their repo paths and contents."""
    from quantize.source.hub import is_dataset_spec, resolve_dataset

    if isinstance(calib, str) and is_dataset_spec(calib):
        name, files = resolve_dataset(calib)
        return name, [local for _, local in files], _files_sha256(files)
    p = calib_path(calib)
    _regular(p)
    return p.name, [p], (data_sha256(p) if p.exists() else "")


def _stream_prefix(docs: list, tokenizer, seed: int, need: int) -> tuple[torch.Tensor, int, int]:
    """`join_documents`' stream of `docs` for `seed`, tokenized in its order only until it holds
    `need` tokens (consecutive windows from 0 read no further; all of it when it holds fewer):
    the same ids as tokenizing every document, without the rest's time (the 1.8 M-token default
    set takes seconds to tokenize in all). With the (chats, templated) counts of what was read."""
    eos = tokenizer.eos_token_id
    order = stream_order(len(docs), seed)
    parts: list[list[int]] = []
    total = chats = templated = 0
    at, batch = 0, 16  # batches double: small requests read a few documents, large ones batch well
    while at < len(order) and total < need:
        take = order[at: at + batch]
        doc_ids, c, t = tokenize_documents([docs[i] for i in take], tokenizer)
        chats, templated, at, batch = chats + c, templated + t, at + len(take), batch * 2
        for x in doc_ids:
            parts.append(x + ([eos] if eos is not None else []))
            total += len(parts[-1])
    return torch.tensor([i for x in parts for i in x], dtype=torch.int64), chats, templated


def load_calibration(path: str | Path | None, tokenizer, num_samples: int, seq_len: int,
                     seed: int = 0, bos: bool = True) -> CalibrationSet:
    """`num_samples` windows of `seq_len` token ids from `path` (default set when None; a Hub
    dataset ORG/NAME[@REV][:SPLIT] too, see `resolve_calib`); with `bos`, each the tokenizer's
    `tokenizer_prefix` and then seq_len minus its length ids of the stream."""
    name, files, sha = resolve_calib(path)
    docs = [d for f in files for d in read_documents(f)]
    reserve = 0
    if len(files) == 1 and is_shipped(files[0]):  # its eval documents are not read
        kept = [d for i, d in enumerate(docs) if not eval_reserved(i)]
        reserve, docs = len(docs) - len(kept), kept
    prefix = tokenizer_prefix(tokenizer) if bos else []
    body = seq_len - len(prefix)  # stream tokens per window
    if body < 1:
        raise _error("--seq-len", str(seq_len), f"more than the {len(prefix)} tokens each window "
                     "begins with (the tokenizer's BOS)", "raise --seq-len, or pass --no-calib-bos")
    ids, chats, templated = _stream_prefix(docs, tokenizer, seed, num_samples * body)
    if len(ids) < body:
        after = f" after the {len(prefix)} BOS token(s) each window begins with" if prefix else ""
        raise _error(str(path if path is not None else DEFAULT_CALIB), f"{len(ids)} tokens in all",
                     f"at least {body} tokens (one window of --seq-len {seq_len}{after})",
                     "add text, or lower --seq-len")
    starts, overlapping = window_starts(len(ids), num_samples, body, seed)
    head = torch.tensor(prefix, dtype=torch.int64)
    tokens = torch.stack([torch.cat([head, ids[s: s + body]]) for s in starts])  # (num_samples, seq_len)
    template = "unused" if not chats else (
        "checkpoint" if templated == chats else "plain role: content (the tokenizer has none)")
    return CalibrationSet(tokens, name, len(docs), len(ids), overlapping, template, sha, reserve,
                          tuple(tokenizer.convert_ids_to_tokens(prefix)))


def checkpoint_calibration(root: Path, opts) -> CalibrationSet:
    """`load_calibration` of `opts.calib` (--num-samples x --seq-len, --seed) with the
    checkpoint's own tokenizer (`opts`: options.ConvertOptions)."""
    from transformers import AutoTokenizer

    # trust_remote_code=False: a tokenizer_config.json `auto_map` naming the checkpoint's own
    # code is refused (ValueError), never imported; unset, transformers would ask on stdin
    try:
        tok = AutoTokenizer.from_pretrained(str(root), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise QuantizeError("calibration needs the checkpoint's tokenizer", [Problem(
            str(root), None, f"no loadable tokenizer ({e.__class__.__name__})",
            "tokenizer.json / tokenizer_config.json next to config.json, with a tokenizer "
            "class of transformers (a tokenizer's own code is never run)",
            "copy the tokenizer files from the model release, or use --method rtn")]) from None
    return load_calibration(opts.calib, tok, opts.num_samples, opts.seq_len, opts.seed, opts.calib_bos)
