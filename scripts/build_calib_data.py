"""Build calib_data/default.jsonl: the default calibration set (prose, code, dialogue).

    OMP_NUM_THREADS=1 python scripts/build_calib_data.py   # rewrites calib_data/default.jsonl

Sources, all redistributable (calib_data/README.md lists them with licenses and the checksum):

    prose     calib_data/src/prose.md           written for this project, CC0
    dialogue  calib_data/src/dialogues.jsonl    written for this project, CC0 (chat `messages`)
    docs      CPython 3.11 `pydoc_data/topics.py` (the language reference as text), PSF-2.0
    code      CPython 3.11 pure-Python stdlib modules listed in CODE_MODULES, PSF-2.0

Long texts are cut into records of about RECORD_CHARS characters on line boundaries, so that
the sampler, which shuffles records, mixes genres instead of reading one long file.
The output is byte-identical for the same Python version (`sys.version_info[:2]` is checked).
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "calib_data"
RECORD_CHARS = 6000
PYTHON = (3, 11)
CODE_RECORDS_PER_MODULE = 3  # keeps code near a third of the set
CODE_MODULES = (
    "argparse.py", "bisect.py", "calendar.py", "colorsys.py", "csv.py", "dataclasses.py",
    "difflib.py", "enum.py", "fractions.py", "functools.py", "heapq.py", "ipaddress.py",
    "json/decoder.py", "json/encoder.py", "pathlib.py", "pprint.py", "queue.py", "random.py",
    "shlex.py", "statistics.py", "string.py", "textwrap.py", "tokenize.py", "uuid.py",
)


def _chunks(text: str, size: int = RECORD_CHARS) -> list[str]:
    out, cur, n = [], [], 0
    for line in text.splitlines(keepends=True):
        if n + len(line) > size and cur:
            out.append("".join(cur))
            cur, n = [], 0
        cur.append(line)
        n += len(line)
    if "".join(cur).strip():
        out.append("".join(cur))
    return out


def build() -> list[dict]:
    if sys.version_info[:2] != PYTHON:
        raise SystemExit(f"run with Python {PYTHON[0]}.{PYTHON[1]}: the stdlib text is version-specific")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    records: list[dict] = []
    for para in (ROOT / "src" / "prose.md").read_text(encoding="utf-8").split("\n\n"):
        if para.strip():
            records.append({"text": para.strip() + "\n", "source": "prose.md (CC0)"})
    for line in (ROOT / "src" / "dialogues.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            records.append({"messages": json.loads(line)["messages"], "source": "dialogues.jsonl (CC0)"})
    tree = ast.parse((stdlib / "pydoc_data" / "topics.py").read_text(encoding="utf-8"))
    topics = ast.literal_eval(tree.body[0].value)  # the file is one `topics = {...}` literal
    for topic in sorted(topics):
        for part in _chunks(topics[topic]):
            records.append({"text": part, "source": f"cpython/Lib/pydoc_data/topics.py:{topic} (PSF-2.0)"})
    for mod in CODE_MODULES:
        for part in _chunks((stdlib / mod).read_text(encoding="utf-8"))[:CODE_RECORDS_PER_MODULE]:
            records.append({"text": part, "source": f"cpython/Lib/{mod} (PSF-2.0)"})
    return records


def main() -> None:
    records = build()
    out = ROOT / "default.jsonl"
    data = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records)
    out.write_text(data, encoding="utf-8")
    kinds: dict[str, int] = {}
    for r in records:
        k = r["source"].split(" ")[0].split(":")[0].rsplit("/", 1)[0]
        kinds[k] = kinds.get(k, 0) + len(r.get("text") or json.dumps(r["messages"]))
    print(f"{out}: {len(records)} records, {len(data.encode())} bytes, "
          f"sha256 {hashlib.sha256(data.encode()).hexdigest()}")
    for k, v in sorted(kinds.items()):
        print(f"  {k}: {v} chars")


if __name__ == "__main__":
    main()
