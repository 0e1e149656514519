"""The calibration loader: formats, deterministic sampling, and errors that name the file."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from quantize.calib.data import (
    DEFAULT_CALIB,
    EVAL_EVERY,
    HELDOUT_ENGLISH,
    SHIPPED_SETS,
    data_sha256,
    eval_reserved,
    join_documents,
    load_calibration,
    read_documents,
    text_prefix,
    tokenize_documents,
    tokenizer_prefix,
)
from quantize.errors import QuantizeError
from quantize.source.synth import write_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, 512)
    return AutoTokenizer.from_pretrained(str(d))


def test_small_set_checksum_matches_readme():
    small = SHIPPED_SETS["small"]
    readme = (small.parent / "README.md").read_text()
    want = re.search(r"([0-9a-f]{64})  default\.jsonl", readme).group(1)
    assert small.name == "default.jsonl" and hashlib.sha256(small.read_bytes()).hexdigest() == want
    docs = read_documents(small)
    assert any(isinstance(d, list) for d in docs) and any(isinstance(d, str) for d in docs)


# eval's out-of-domain text and bench_quality's others (heldout_english_2.md ...: not shipped,
# the benchmark's), every one in the folder
HELDOUT_TEXTS = (HELDOUT_ENGLISH,
                 *sorted((Path(__file__).resolve().parent.parent / "calib_data").glob("heldout_english_*.md")))


@pytest.mark.parametrize("path", HELDOUT_TEXTS, ids=lambda p: p.name)
def test_heldout_english_is_in_no_calibration_set(path):
    """eval's out-of-domain text (and the benchmark's others): CC0 as its header says, and
    no sentence of it in the small calibration set (which would make it in-domain; the large
    set: its own test) nor in another held-out text."""
    assert len(HELDOUT_TEXTS) == 5  # (the benchmark's four found beside eval's)
    text = path.read_text(encoding="utf-8")
    assert "CC0-1.0" in text.split("-->")[0] and len(text.split()) > 4000
    other = "".join(p.read_text(encoding="utf-8").split("-->", 1)[1]  # (the headers say the same)
                    for p in HELDOUT_TEXTS if p != path)
    calib = SHIPPED_SETS["small"].read_text(encoding="utf-8")
    sentences = [x.strip() for x in re.split(r"[.!?]\s", text) if len(x.strip()) > 40]
    assert len(sentences) > 150
    assert not [x for x in sentences if x in calib or x in other]


def test_default_sampling_is_deterministic(tok):
    a = load_calibration(None, tok, 4, 32, seed=0)
    b = load_calibration(None, tok, 4, 32, seed=0)
    c = load_calibration(None, tok, 4, 32, seed=1)
    assert a.tokens.shape == (4, 32) and a.tokens.dtype == torch.int64
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    assert not a.overlapping and a.chat_template == "checkpoint"


def test_the_shipped_sets_eval_documents_are_never_calibrated_on(tok, tmp_path):
    """Every EVAL_EVERY-th document of the shipped set is kept for eval: a calibration on the
    shipped set (by default or named by its path) reads exactly the others, a copy of the file
    under another name is an ordinary file (every document read). The windows are those of the
    whole stream tokenized, though only its beginning is (`_stream_prefix`)."""
    docs = read_documents(DEFAULT_CALIB)
    kept = [d for i, d in enumerate(docs) if not eval_reserved(i)]
    reserved = len(docs) - len(kept)
    assert reserved == len(docs) // EVAL_EVERY > 40
    ids, _ = join_documents(tokenize_documents(kept, tok)[0], 0, tok.eos_token_id)
    for path in (None, str(DEFAULT_CALIB)):
        cs = load_calibration(path, tok, 4, 32, seed=0)
        assert cs.eval_reserve == reserved and cs.documents == len(kept)
        assert cs.summary()["eval_reserve"] == reserved
        assert 4 * 32 <= cs.stream_tokens < len(ids) // 20  # the first batch of documents only
        assert torch.equal(cs.tokens, ids[: 4 * 32].view(4, 32))  # the whole stream's windows
    copy = tmp_path / "copy.jsonl.xz"
    copy.write_bytes(DEFAULT_CALIB.read_bytes())
    cs = load_calibration(copy, tok, 4, 32, seed=0)
    assert cs.eval_reserve == 0 and cs.documents == len(docs)


def test_jsonl_messages_use_the_chat_template(tok, tmp_path):
    p = tmp_path / "chat.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "hello there " * 20},
                                          {"role": "assistant", "content": "general kenobi " * 20}]})
                 + "\n" + json.dumps({"text": "plain record " * 30}) + "\n")
    cs = load_calibration(p, tok, 2, 16, seed=0)
    assert cs.documents == 2 and cs.chat_template == "checkpoint"
    user = tok.convert_tokens_to_ids("<|user|>")
    assert (cs.tokens == user).any()  # the template's role marker made it into the tokens


def _prefixed_tok(path: Path, prefix: tuple[str, ...], suffix: tuple[str, ...] = ()):
    from transformers import AutoTokenizer

    path.mkdir()
    write_tokenizer(path, 512, prefix, suffix)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("prefix,suffix", [((), ()), (("<|begin|>",), ()),
                                           (("<|begin|>", "<|system|>"), ("<|endoftext|>",)),
                                           ((), ("<|endoftext|>",))])
def test_windows_begin_with_the_tokenizers_prefix(tmp_path, prefix, suffix):
    """Each window is the tokens the tokenizer puts before a text, then the next seq_len - p
    tokens of the same stream the windows without it are cut from (a suffix is not a prefix);
    the summary names the prefix; a --seq-len the prefix fills is refused by name."""
    from tokenizers import Tokenizer

    t = _prefixed_tok(tmp_path / "tok", prefix, suffix)
    ids = [t.convert_tokens_to_ids(x) for x in prefix]
    assert tokenizer_prefix(t) == ids
    rust = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))  # the Rust library's view
    assert text_prefix(lambda x, sp: rust.encode(x, add_special_tokens=sp).ids) == ids
    n, S, p = 5, 24, len(ids)
    cs = load_calibration("shipped:small", t, n, S, seed=4)
    plain = load_calibration("shipped:small", t, n, S - p, seed=4, bos=False)  # the stream
    assert cs.tokens.shape == (n, S) and cs.summary()["prefix"] == list(prefix)
    assert torch.equal(cs.tokens[:, :p], torch.tensor(ids, dtype=torch.int64).expand(n, p))
    assert torch.equal(cs.tokens[:, p:], plain.tokens)
    off = load_calibration("shipped:small", t, n, S, seed=4, bos=False)
    assert off.summary()["prefix"] == []
    assert torch.equal(off.tokens.flatten()[: n * (S - p)], plain.tokens.flatten())
    if p:
        with pytest.raises(QuantizeError, match="no-calib-bos"):
            load_calibration("shipped:small", t, 2, p, seed=0)


def test_a_chat_templates_constant_start_is_the_prefix_when_the_tokenizer_adds_none(tmp_path):
    """GLM's tokenizer adds nothing before a text; its chat template writes `[gMASK]<sop>`
    before any message, as every request begins: those special tokens are the prefix. A start
    with plain text in it, a template that needs a message, or a tokenizer's own BOS (which
    wins) give no such prefix."""
    from transformers import AutoTokenizer

    def tok_with(name, **kw):
        (tmp_path / name).mkdir()
        write_tokenizer(tmp_path / name, 512, **kw)
        return AutoTokenizer.from_pretrained(str(tmp_path / name))

    glm = tok_with("glm", chat_start="<|begin|><|system|>")
    assert tokenizer_prefix(glm) == [0, 2]
    cs = load_calibration("shipped:small", glm, 2, 16, seed=0)
    assert cs.tokens[:, :2].tolist() == [[0, 2]] * 2 and cs.summary()["prefix"] == ["<|begin|>", "<|system|>"]
    assert tokenizer_prefix(tok_with("text", chat_start="Hello <|begin|>")) == []
    assert tokenizer_prefix(tok_with("needs", chat_start="{{ messages[0]['content'] | upper }}")) == []
    assert tokenizer_prefix(tok_with("bos", prefix=("<|begin|>",), chat_start="<|system|>")) == [0]


def test_plain_text_and_overlap(tok, tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    cs = load_calibration(p, tok, 50, 32, seed=3)
    assert cs.tokens.shape == (50, 32) and cs.overlapping  # fewer tokens than 50 x 32
    # reports (uploaded by push) name the data by file name and content hash, not local path
    assert cs.source == "a.txt" and cs.sha256 == hashlib.sha256(p.read_bytes()).hexdigest()
    assert str(tmp_path) not in json.dumps(cs.summary())


def test_folder_hash_is_its_contents_not_its_place(tmp_path):
    """A saved-dataset folder: one sha256 over its files' relative paths and hashes."""
    a, b = tmp_path / "x" / "ds", tmp_path / "y" / "ds"
    for d in (a, b):
        (d / "train").mkdir(parents=True)
        (d / "dataset_dict.json").write_text('{"splits": ["train"]}')
        (d / "train" / "data-00000-of-00001.arrow").write_bytes(b"rows")
    assert data_sha256(a) == data_sha256(b)
    (b / "train" / "data-00000-of-00001.arrow").write_bytes(b"other rows")
    assert data_sha256(a) != data_sha256(b)


@pytest.mark.parametrize("content, needle", [
    (b"", "no text"),
    (b"\xff\xfe not utf-8 \x80", "not UTF-8"),
    (b"too short", "tokens in all"),
])
def test_errors_name_the_file_and_the_fix(tok, tmp_path, content, needle):
    p = tmp_path / "bad.txt"
    p.write_bytes(content)
    with pytest.raises(QuantizeError) as e:
        load_calibration(p, tok, 4, 512, seed=0)
    msg = str(e.value)
    assert needle in msg and "bad.txt" in msg and "Fix:" in msg


def test_bad_jsonl_line_is_named(tok, tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(QuantizeError, match=r"x\.jsonl:2"):
        read_documents(p)
    p.write_text('{"body": "no text field"}\n')
    with pytest.raises(QuantizeError, match="rename the field"):
        read_documents(p)


def test_parquet_and_saved_dataset_folders(tmp_path):
    """Parquet (`text` or chat `messages`) and a save_to_disk folder (state.json + Arrow stream
    files, a Dataset or a DatasetDict's first split) give the same documents as the JSONL."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document {i}: " + "word " * (i + 3) for i in range(5)]
    chats = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
             for i in range(3)]
    pq.write_table(pa.table({"text": texts, "n": list(range(5))}), tmp_path / "t.parquet")
    pq.write_table(pa.table({"messages": chats}), tmp_path / "m.parquet")
    assert read_documents(tmp_path / "t.parquet") == texts
    assert read_documents(tmp_path / "m.parquet") == chats

    def save(folder, table, parts):  # the layout `datasets` save_to_disk writes
        folder.mkdir(parents=True)
        names = [f"data-{i:05d}-of-{parts:05d}.arrow" for i in range(parts)]
        step = -(-table.num_rows // parts)
        for i, n in enumerate(names):
            with pa.OSFile(str(folder / n), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
                w.write_table(table.slice(i * step, step))
        (folder / "state.json").write_text(json.dumps(
            {"_data_files": [{"filename": n} for n in names], "_split": None}))
        (folder / "dataset_info.json").write_text("{}")

    save(tmp_path / "ds", pa.table({"text": texts}), 2)
    assert read_documents(tmp_path / "ds") == texts
    save(tmp_path / "dd" / "train", pa.table({"messages": chats}), 1)
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    assert read_documents(tmp_path / "dd") == chats
    (tmp_path / "plain").mkdir()
    with pytest.raises(QuantizeError, match="state.json"):
        read_documents(tmp_path / "plain")
    (tmp_path / "ds" / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": "../t.parquet"}]}))
    with pytest.raises(QuantizeError, match="outside the folder"):
        read_documents(tmp_path / "ds")




def test_batched_tokenization_equals_one_call_per_document(tok):
    """`tokenize_documents` encodes all documents in one batched call: the ids must be those of
    encoding each rendered document on its own (the small set: prose, code, chats)."""
    from quantize.calib.data import _render, tokenize_documents

    docs = read_documents(SHIPPED_SETS["small"])
    ids, chats, templated = tokenize_documents(docs, tok)
    want = [tok(_render(d, tok)[0], add_special_tokens=False)["input_ids"] for d in docs]
    assert len(ids) == len(docs) and ids == want
    assert chats == templated == sum(isinstance(d, list) for d in docs) > 0


@pytest.mark.parametrize("suffix", [".xz", ".gz", ".bz2"])
def test_compressed_files_read_as_their_contents(tmp_path, suffix):
    """NAME.jsonl.xz / .gz / .bz2: the documents of NAME.jsonl; a damaged file is named."""
    import bz2
    import gzip
    import lzma

    compress = {".xz": lzma.compress, ".gz": gzip.compress, ".bz2": bz2.compress}[suffix]
    rows = [{"text": f"record {i}: " + "words " * (i + 2)} for i in range(4)]
    rows.append({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    plain = tmp_path / "c.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    packed = tmp_path / f"c.jsonl{suffix}"
    packed.write_bytes(compress(plain.read_bytes()))
    assert read_documents(packed) == read_documents(plain)
    txt = tmp_path / f"t.txt{suffix}"
    txt.write_bytes(compress(b"a whole text file, one document\n"))
    assert read_documents(txt) == ["a whole text file, one document\n"]
    (tmp_path / f"t.parquet{suffix}").write_bytes(compress(b"PAR1"))
    with pytest.raises(QuantizeError, match="decompress it and pass the .parquet"):
        read_documents(tmp_path / f"t.parquet{suffix}")
    packed.write_bytes(packed.read_bytes()[: len(packed.read_bytes()) // 2])
    with pytest.raises(QuantizeError, match=rf"c\.jsonl{re.escape(suffix)}.*not readable"):
        read_documents(packed)


def test_the_large_shipped_set(tok):
    """shipped:large: its checksum as the README says; default's records first, in order (so
    the documents eval keeps are the same in both sets); every record names a source and a
    licence; Chinese, chats, code; at least 5.5 M characters (1.65 M tokens with Gemma-3's
    tokenizer, README); a calibration on it keeps the same sixth for eval."""
    from quantize.calib.data import shipped_set

    large = shipped_set("shipped:large")
    assert large == SHIPPED_SETS["large"] == DEFAULT_CALIB and shipped_set("shipped:small") == SHIPPED_SETS["small"]
    readme = (DEFAULT_CALIB.parent / "README.md").read_text()
    want = re.search(r"([0-9a-f]{64})  large\.jsonl\.xz", readme).group(1)
    assert hashlib.sha256(large.read_bytes()).hexdigest() == want
    docs, small = read_documents(large), read_documents(SHIPPED_SETS["small"])
    assert docs[: len(small)] == small and len(docs) > 3 * len(small)
    import lzma

    rows = [json.loads(line) for line in lzma.decompress(large.read_bytes()).decode().splitlines()]
    assert all(re.search(r"\((PSF|BSD|GPL|CC0|Debian FAQ licence|poems)", r["source"]) for r in rows)
    text = "".join(d if isinstance(d, str) else "".join(m["content"] for m in d) for d in docs)
    assert len(text) > 6_300_000
    assert sum("\u4e00" <= ch <= "\u9fff" for ch in text) > 150_000  # Chinese characters
    assert sum(isinstance(d, list) for d in docs) > 150 and "def " in text
    cs = load_calibration("shipped:large", tok, 2, 32, seed=0)
    assert cs.source == "large.jsonl.xz" and cs.eval_reserve == len(docs) // EVAL_EVERY
    for path in HELDOUT_TEXTS:  # the out-of-domain texts stay out
        heldout = path.read_text(encoding="utf-8")
        sentences = [x.strip() for x in re.split(r"[.!?]\s", heldout) if len(x.strip()) > 40]
        assert not [x for x in sentences if x in text], path.name
    with pytest.raises(QuantizeError, match="shipped:large, shipped:small"):
        load_calibration("shipped:huge", tok, 2, 32, seed=0)
