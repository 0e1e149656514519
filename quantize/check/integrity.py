"""verify's integrity checks: the manifest's files present, unchanged and alone, and the
reads that hash them.

Every file of the manifest is hashed, each read from the disk once (`Reads`): the small
files at once, the weight shards on two threads (`overlap.HashAhead`) in the order the tensor
checks read them, a bounded stretch ahead, so that the checks read the page cache and an
output larger than the memory is not read twice. A shard changed after conversion is
reported as changed (`changed`), also when the change breaks the checks that read it.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from quantize.errors import QuantizeError
from quantize.names import (
    CALIB_STATE,
    CALIB_TIMINGS,
    CARD,
    EVAL_JSON,
    PARTIAL,
    PICTURES,
    RUN_RECORD,
    VERIFY_JSON,
    WEIGHT_SUFFIXES,
)
from quantize.options import ConvertOptions
from quantize.overlap import STREAM_AHEAD, HashAhead, background, readahead_bytes
from quantize.plan import Plan, make_plan
from quantize.source.checkpoint import INDEX_NAME, Checkpoint, open_checkpoint
from quantize.source.weights import aux_files
from quantize.write.manifest import MANIFEST
from quantize.write.shards import sha256_file

__all__ = ["CHANGED", "OURS", "Reads", "changed", "files_problems", "options_of"]


@dataclass
class Reads:
    """verify's reads of the output, started before anything else (each file read from the
    disk once, the disk kept busy while this thread imports transformers and
    compressed-tensors), and the source opened and planned (None where that failed: said where
    the checks open it again):

        rest      the small files of the manifest hashed at once (a Future of `hash_files`)
        shards    the weight shards (`streamed`) hashed in the order of the tensor checks,
                  at most STREAM_AHEAD beyond them (or an eighth of the memory
                  available): the hashing works through the seconds of imports before the
                  first check, the checks then read the page cache, and an output larger
                  than the memory is not read twice

    The source is read ahead only once the checks begin (`_check_tensors_and_layers`): read
    from the start as well, its reads beside the hashing saturated the disk and the imports'
    own small reads waited behind them (verify 42.3 -> 52.7 s on the H200; BENCHMARKS.md).
    """

    rest: Future
    shards: HashAhead
    streamed: list[str]
    t0: float
    ahead: int  # the read-ahead budget (the source's too, once the checks begin)
    src: Checkpoint | None = None
    plan: Plan | None = None

    @classmethod
    def start(cls, src, dst: Path, manifest: dict) -> Reads:
        files = manifest["files"]
        whole = same_size(dst, files)
        streamed = streamed_shards(dst, whole)
        ahead = readahead_bytes(STREAM_AHEAD)
        reads = cls(background(hash_files, dst, [n for n in whole if n not in streamed]),
                    HashAhead([dst / n for n in streamed], ahead=ahead), streamed, time.perf_counter(),
                    ahead)
        try:
            reads.src = open_checkpoint(src)
            reads.plan = make_plan(reads.src, options_of(manifest))
        except (QuantizeError, OSError, ValueError, TypeError, KeyError):
            pass
        return reads

    def shard_digests(self, started: bool = False) -> dict[str, str]:
        """The shards' digests once all are hashed (one that could not be read: none);
        `started`: only those whose hashing had begun."""
        got = self.shards.digests(started)
        return {n: d for n, p in zip(self.streamed, self.shards.paths) if isinstance(d := got.get(p), str)}

    def close(self) -> None:
        self.shards.close()


def options_of(manifest: dict) -> ConvertOptions:
    return ConvertOptions.from_json(manifest["options"])


def same_size(dst: Path, files: dict) -> list[str]:
    """The manifest's files present at their recorded size (the others fail unread)."""
    return [n for n in files if (dst / n).is_file() and (dst / n).stat().st_size == files[n]["bytes"]]


def streamed_shards(dst: Path, names: list[str]) -> list[str]:
    """Of `names`, the weight shards the index maps tensors to, in file-name order (the
    order in which the tensor checks read them: the plan's)."""
    try:
        weight_map = json.loads((dst / INDEX_NAME).read_text()).get("weight_map", {})
        mapped = set(weight_map.values())
    except (OSError, ValueError, AttributeError, TypeError):
        return []  # (an unreadable index fails its own hash and the layout check)
    return sorted(n for n in names if n in mapped)


def changed(files: dict, digests: dict[str, str], names: list[str]) -> list[str]:
    """A problem for each of `names` whose sha256 is not the manifest's."""
    return [CHANGED.format(n) for n in names if digests.get(n) != files[n]["sha256"]]


CHANGED = ("{}: sha256 differs from the manifest (the file was changed after conversion; "
           "re-run convert with --overwrite)")


def hash_files(dst: Path, names: list[str]) -> dict[str, str]:
    """sha256 of each of `names`, several at once, largest first (hashlib releases the GIL:
    one thread hashing file after file waits on each cold read in turn)."""
    names = sorted(names, key=lambda n: -(dst / n).stat().st_size)
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda n: sha256_file(dst / n), names)))


def files_problems(src: Path, dst: Path, files: dict, digests: dict[str, str],
                   pending: set[str]) -> tuple[list[str], list[str]]:
    """The manifest's files present and unchanged (`digests`: `hash_files`'s; those in
    `pending` are hashed later and only their presence and size are checked here), no weight
    file it does not list, the source's files convert copies present; the user's other files
    noted: (problems, notes)."""
    problems, notes = [], []
    for name, rec in sorted(files.items()):
        if not (dst / name).is_file():
            problems.append(f"{name}: listed in the manifest but missing")
        elif name not in pending and digests.get(name) != rec["sha256"]:
            problems.append(CHANGED.format(name))
    extra = unlisted(dst, files)
    problems += [f"{n}: a weight file the manifest does not list (an engine may load it "
                 f"with the checkpoint); delete it, or reconvert with --overwrite"
                 for n in extra if n.endswith(WEIGHT_SUFFIXES)]
    problems += source_files_problems(src, dst, files)
    notes += [f"{n}: in the folder, not part of the conversion (push does not upload it)"
              for n in extra if not n.endswith((*WEIGHT_SUFFIXES, PARTIAL))
              and n not in OURS and not n.startswith(".")]
    return problems, notes


def unlisted(dst: Path, listed: dict) -> list[str]:
    """Files under `dst` (links included; links to folders not followed; the calibration's
    checkpoints aside) that are not among `listed`."""
    found = []
    for folder, dirs, files in os.walk(dst):
        rel = Path(folder).relative_to(dst)
        dirs[:] = sorted(d for d in dirs if (rel / d).as_posix() != CALIB_STATE)
        found += [(rel / f).as_posix() for f in sorted(files)]
    return [n for n in found if n not in listed]


def source_files_problems(src: Path, dst: Path, listed: dict) -> list[str]:
    """The source's non-weight files convert copies (tokenizer, generation config, chat
    template, ...): each in the output, in its manifest, byte for byte the source's."""
    if not src.is_dir():
        return []
    problems = []
    for p in aux_files(src):
        o = dst / p.name
        if not o.is_file() or p.name not in listed:
            where = "missing from the output" if not o.is_file() else "not in the manifest"
            problems.append(f"{p.name}: in the source, {where} (convert copies it; engines and "
                            "tokenizers read it); reconvert with --overwrite")
        elif o.stat().st_size != p.stat().st_size or sha256_file(o) != sha256_file(p):
            problems.append(f"{p.name}: differs from the source's; reconvert with --overwrite")
    return problems


OURS = {MANIFEST, CARD, VERIFY_JSON, EVAL_JSON, RUN_RECORD, CALIB_TIMINGS, *PICTURES}


# what verify, eval and convert write beside the manifest's files
OURS = {MANIFEST, CARD, VERIFY_JSON, EVAL_JSON, RUN_RECORD, CALIB_TIMINGS, *PICTURES}
