"""Build calib_data/large.jsonl.xz: a calibration set of ~1.5 M tokens for the 512 x 2048 recipe
(the shipped default holds ~0.27 M, so that recipe reads it four times over).

    mkdir -p /tmp/deb && (cd /tmp/deb && apt-get download python3.11-doc=3.11.2-6+deb12u8 \\
        python3-sympy=1.11.1-1 debian-faq=11.1 debian-faq-zh-cn=11.1 \\
        debian-reference-zh-cn=2.100 fortunes-zh=2.98 debian-handbook=11.20220922)  # Debian 12
    OMP_NUM_THREADS=1 python3.11 scripts/build_calib_large.py --debs /tmp/deb

Every record of calib_data/default.jsonl first, in its order, then (each record names its source
and licence; calib_data/README.md lists them, calib_data/LICENSES/ holds the notices):

    dialogue  the Python FAQ (PSF-2.0), the Debian FAQ in English and in Simplified Chinese
              (verbatim / modified-copies permission notice): each question a user turn, its
              answer the assistant's, three exchanges per conversation (chat `messages`)
    docs      the Python tutorial, HOWTOs and library chapters (PSF-2.0): technical English prose
    code      SymPy 1.11.1 modules on number theory, combinatorics, polynomials, series (BSD-3-Clause):
              Python code with mathematical docstrings
    prose     the Debian Administrator's Handbook in English (GPL-2.0-or-later or CC-BY-SA-3.0):
              a book of modern English prose on running systems
    zh        the Debian Reference in Simplified Chinese (GPL-2.0-or-later): technical Chinese
              prose; Tang and Song poems from fortunes-zh (the poems are public domain; the
              collection GPL-3.0-or-later)

The .deb files are checked against the sha256s below before anything is read. The output is
byte-identical for the same inputs (xz preset 9, no timestamps).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import lzma
import re
import subprocess
import sys
import tarfile
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "calib_data"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_calib_data import RECORD_CHARS, _chunks

DEBS = {  # file -> sha256 (Debian 12 bookworm, main)
    "python3.11-doc_3.11.2-6+deb12u8_all.deb":
        "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b",
    "python3-sympy_1.11.1-1_all.deb":
        "b437232be31819aafd267ddf2132c16293ef75e02fd58b4ad31eee3ef1d5b49e",
    "debian-faq_11.1_all.deb":
        "427426e0cfa6888622fc1d72631071cb4b5a1f86ccde722e7820bcef284de5d0",
    "debian-faq-zh-cn_11.1_all.deb":
        "3545356b1aa04d87e91dd15e8406210cf5b4f476662e597897bcb42234591758",
    "debian-reference-zh-cn_2.100_all.deb":
        "6d2d8d9a646397e28b04cdff23d2e4374101ebf9be348e35961af62c8a2d0977",
    "fortunes-zh_2.98_all.deb":
        "211c5ddee59d0ae74ce01cbfd02f7c8714740bae1835d5661eb2254edd739105",
    "debian-handbook_11.20220922_all.deb":
        "3d5dbeac1f1afc9c094eab9d0f701f6ecff99c4927d5a4794cf6c85678134faa",
}
PYDOC = "usr/share/doc/python3.11/html/_sources/"
DOC_DIRS = ("tutorial", "howto")
LIBRARY = ("math", "cmath", "decimal", "fractions", "statistics", "random", "itertools", "functools",
           "collections", "datetime", "re", "string", "json", "pathlib", "os.path", "subprocess",
           "asyncio-task", "unittest", "argparse", "logging", "typing", "dataclasses", "enum",
           "sqlite3", "csv", "heapq", "bisect", "contextlib", "threading", "socket")
SYMPY = "usr/lib/python3/dist-packages/sympy/"
SYMPY_DIRS = ("ntheory", "combinatorics", "polys", "series", "concrete", "discrete")
SYMPY_RECORDS = 180  # ~1.1 MB of code: the first records of the files in sorted order (360, the
# first build's, lowered the KL on every other genre's text less than half of them did)
HANDBOOK = "usr/share/doc/debian-handbook/html/en-US/"
FAQ_TURNS = 3  # question / answer exchanges per conversation
POEMS_PER_RECORD = 12


def deb_files(deb: Path) -> dict[str, bytes]:
    """Member path (no leading ./) -> bytes of a .deb's data archive (ar + tar.xz)."""
    out = subprocess.run(["ar", "p", str(deb), "data.tar.xz"], check=True, capture_output=True).stdout
    files = {}
    with tarfile.open(fileobj=io.BytesIO(out), mode="r:xz") as tar:
        for m in tar.getmembers():
            if m.isfile():
                files[m.name.removeprefix("./")] = tar.extractfile(m).read()
    return files


_CJK = re.compile(r"[\u3000-\u303f\u3400-\u9fff\uff00-\uffef]")


def reflow(text: str) -> str:
    """Undo the hard line wrap of Debian's text renderings: the lines of one paragraph (same
    indent, not a table, list item or code) joined, without a space between Chinese characters."""
    out: list[str] = []
    for line in text.splitlines():
        s = line.strip()
        prev = out[-1] if out else ""
        joinable = (s and prev.strip() and not s.startswith(("|", "+", "*", "-", "$", "#", "o "))
                    and not prev.strip().startswith(("|", "+", "$", "#"))
                    and len(line) - len(line.lstrip()) == len(prev) - len(prev.lstrip())
                    and not re.match(r"^\d+(\.\d+)*\.\s", s))
        if joinable:
            sep = "" if (_CJK.match(s[0]) or _CJK.match(prev.rstrip()[-1])) else " "
            out[-1] = prev.rstrip() + sep + s
        else:
            out.append(line.rstrip())
    return "\n".join(out) + "\n"


def rst_sections(text: str) -> list[tuple[str, str]]:
    """(title, body) of each titled section of a reST file (a title: a line underlined by a
    line of one punctuation character at least as long)."""
    lines = text.splitlines()
    heads = [i for i in range(len(lines) - 1)
             if lines[i].strip() and re.fullmatch(r"([-=~^\"'*+#])\1{2,}", lines[i + 1].strip())
             and len(lines[i + 1].strip()) >= len(lines[i].strip())]
    out = []
    for k, i in enumerate(heads):
        end = heads[k + 1] if k + 1 < len(heads) else len(lines)
        body = [ln for ln in lines[i + 2:end] if not re.match(r"^\s*\.\. (_|index::|only::|contents::|highlight)", ln)]
        body_text = "\n".join(body).strip()
        out.append((lines[i].strip(), body_text))
    return out


def conversations(pairs: list[tuple[str, str]], source: str) -> list[dict]:
    """Q&A pairs -> chat records of FAQ_TURNS exchanges each."""
    pairs = [(q, a) for q, a in pairs if len(a) > 80]
    recs = []
    for k in range(0, len(pairs), FAQ_TURNS):
        msgs = []
        for q, a in pairs[k:k + FAQ_TURNS]:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        recs.append({"messages": msgs, "source": source})
    return recs


def python_faq(files: dict[str, bytes]) -> list[dict]:
    recs = []
    for path in sorted(p for p in files if p.startswith(PYDOC + "faq/") and not p.endswith("index.rst.txt")):
        pairs = [(t, b) for t, b in rst_sections(files[path].decode()) if t.endswith("?")]
        recs += conversations(pairs, f"cpython/Doc/{path.removeprefix(PYDOC).removesuffix('.txt')} (PSF-2.0)")
    return recs


def python_docs(files: dict[str, bytes]) -> list[dict]:
    paths = [p for p in sorted(files) if any(p.startswith(PYDOC + d + "/") for d in DOC_DIRS)
             and not p.endswith("index.rst.txt")]
    paths += [PYDOC + f"library/{m}.rst.txt" for m in LIBRARY]
    recs = []
    for path in paths:
        text = files[path].decode()
        text = "\n".join(ln for ln in text.splitlines()
                         if not re.match(r"^\s*\.\. (_|index::|only::|contents::|highlight|sectionauthor)", ln))
        src = f"cpython/Doc/{path.removeprefix(PYDOC).removesuffix('.txt')} (PSF-2.0)"
        recs += [{"text": part, "source": src} for part in _chunks(text)]
    return recs


def debian_faq(files: dict[str, bytes], lang: str) -> list[dict]:
    """The Debian FAQ's plain-text rendering: numbered questions ("1.4. ...?") and their
    indented answers."""
    name = next(p for p in files if p.endswith(f"debian-faq.{lang}.txt.gz"))
    text = reflow(gzip.decompress(files[name]).decode())
    pairs, q, body = [], None, []
    for line in text.splitlines():
        m = re.match(r"^\d+\.\d+\.\s+(.*)$", line)
        if m:
            if q is not None:
                pairs.append((q, "\n".join(body).strip()))
            q, body = m.group(1).strip(), []
        elif re.match(r"^(Chapter \d+|第 ?\d+ ?章)", line):
            if q is not None:
                pairs.append((q, "\n".join(body).strip()))
            q, body = None, []
        elif q is not None:
            body.append(line.removeprefix("    "))
    if q is not None:
        pairs.append((q, "\n".join(body).strip()))
    lic = "Debian FAQ licence: verbatim and modified copies permitted"
    return conversations(pairs, f"debian-faq ({lang}) {name.split('/')[-1]} ({lic})")


def debian_reference(files: dict[str, bytes]) -> list[dict]:
    name = next(p for p in files if p.endswith("debian-reference.zh-cn.txt.gz"))
    text = reflow(gzip.decompress(files[name]).decode())
    return [{"text": part, "source": "debian-reference (zh-cn) 2.100 (GPL-2.0-or-later)"}
            for part in _chunks(text)]


def poems(files: dict[str, bytes]) -> list[dict]:
    recs = []
    for book in ("tang300", "song100"):
        text = re.sub(r"\x1b\[[0-9;]*m", "", files[f"usr/share/games/fortunes/{book}"].decode())
        items = [p.strip() for p in text.split("\n%\n") if p.strip()]
        for k in range(0, len(items), POEMS_PER_RECORD):
            recs.append({"text": "\n\n".join(items[k:k + POEMS_PER_RECORD]) + "\n",
                         "source": f"fortunes-zh 2.98 {book} (poems in the public domain; "
                                   f"collection GPL-3.0-or-later)"})
    return recs


class _HandbookText(HTMLParser):
    """The text of one page of the Debian Administrator's Handbook (DocBook XHTML): a line per
    paragraph, heading, list item or table row; program listings kept as they are."""

    BLOCKS = frozenset({"div", "p", "h1", "h2", "h3", "h4", "h5", "li", "tr", "dt", "dd", "pre", "br", "table"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.pre = 0

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in self.BLOCKS:
            self.out.append("\n")
        self.pre += tag == "pre"

    def handle_endtag(self, tag: str) -> None:
        self.pre -= tag == "pre"
        if tag in self.BLOCKS:
            self.out.append("\n")

    def handle_data(self, data: str) -> None:
        self.out.append(data if self.pre else re.sub(r"\s+", " ", data))

    def text(self) -> str:
        lines = [ln.rstrip() if self.pre else ln.strip() for ln in "".join(self.out).split("\n")]
        return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def handbook(files: dict[str, bytes]) -> list[dict]:
    """The English Debian Administrator's Handbook, page by page in the book's order (the
    index's links), between the top and the bottom navigation bars."""
    index = files[HANDBOOK + "index.html"].decode()
    order = list(dict.fromkeys(re.findall(r'href="([a-z][-a-z.]*\.html)"', index)))
    recs = []
    for page in order:
        html = files.get(HANDBOOK + page)
        if html is None or page == "index.html":
            continue
        body = html.decode()
        body = body[body.index("</ul>") + 5: body.rindex('<ul class="docnav">')]
        parser = _HandbookText()
        parser.feed(body)
        text = parser.text()
        src = f"debian-handbook 11.20220922 en-US/{page} (GPL-2.0-or-later or CC-BY-SA-3.0)"
        recs += [{"text": part, "source": src} for part in _chunks(text) if len(part) > RECORD_CHARS // 8]
    return recs


def sympy_code(files: dict[str, bytes]) -> list[dict]:
    paths = sorted(p for p in files if p.endswith(".py") and "/tests/" not in p and "/benchmarks/" not in p
                   and any(p.startswith(SYMPY + d + "/") for d in SYMPY_DIRS))
    recs: list[dict] = []
    per_file = [(p, _chunks(files[p].decode())[:2]) for p in paths]
    for p, parts in per_file:
        recs += [{"text": part, "source": f"sympy 1.11.1 {p.removeprefix('usr/lib/python3/dist-packages/')} "
                                          f"(BSD-3-Clause)"} for part in parts if len(part) > RECORD_CHARS // 4]
    return recs[:SYMPY_RECORDS]


def build(debs: Path) -> list[dict]:
    files: dict[str, bytes] = {}
    for name, want in DEBS.items():
        data = (debs / name).read_bytes()
        got = hashlib.sha256(data).hexdigest()
        if got != want:
            raise SystemExit(f"{name}: sha256 {got}, expected {want}")
        files.update(deb_files(debs / name))
    records = [json.loads(line) for line in (ROOT / "default.jsonl").read_text(encoding="utf-8").splitlines()]
    parts = {
        "python-faq": python_faq(files),
        "debian-faq-en": debian_faq(files, "en"),
        "debian-faq-zh": debian_faq(files, "zh-cn"),
        "python-docs": python_docs(files),
        "sympy-code": sympy_code(files),
        "handbook-en": handbook(files),
        "debian-reference-zh": debian_reference(files),
        "poems-zh": poems(files),
    }
    # interleaved, so that every sixth record (eval's share) and any prefix mix the genres
    longest = max(len(v) for v in parts.values())
    for k in range(longest):
        for name, recs in parts.items():
            if k < len(recs):
                records.append({**recs[k], "part": name})
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--debs", type=Path, required=True, help="folder holding the .deb files")
    ap.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer.json to count tokens with")
    a = ap.parse_args()
    records = build(a.debs)
    data = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records).encode()
    out = ROOT / "large.jsonl.xz"
    out.write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
    counts: dict[str, list[int]] = {}
    tok = None
    if a.tokenizer is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(a.tokenizer))
    for r in records:
        text = r.get("text") or "\n".join(m["content"] for m in r["messages"])
        c = counts.setdefault(r.get("part", "default.jsonl"), [0, 0, 0])
        c[0] += 1
        c[1] += len(text)
        if tok is not None:
            c[2] += len(tok.encode(text, add_special_tokens=False).ids)
    for k, (n, chars, toks) in counts.items():
        print(f"{k:22s} {n:5d} records {chars:9,d} chars {toks:9,d} tokens")
    print(f"{len(records)} records, {len(data):,} bytes, {out.stat().st_size:,} compressed; "
          f"sha256 {hashlib.sha256(out.read_bytes()).hexdigest()}  {out.name}")


if __name__ == "__main__":
    main()
