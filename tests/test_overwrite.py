"""`convert --overwrite`: the old contents are moved aside and deleted while the conversion
runs (quantize/write/deleting.py); the finished folder is the one a fresh conversion writes."""

from __future__ import annotations

import collections
import shutil
import threading
from pathlib import Path

import pytest

import quantize.write.deleting
from quantize.errors import QuantizeError
from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.write.deleting import TRASH
from quantize.write.manifest import MANIFEST

RTN = ConvertOptions(method="rtn", max_shard_size=300_000)


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by relative path, the card and manifest left out (they name
    times and the command)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in ("README.md", MANIFEST)}


def _old_contents(out: Path, outside: Path) -> None:
    """A finished conversion's folder plus the user's own entries: a file, a folder tree and a
    link to a file outside (the link goes, its target stays)."""
    (out / "notes.txt").write_text("mine")
    (out / "sub" / "deeper").mkdir(parents=True)
    (out / "sub" / "deeper" / "x.bin").write_bytes(b"\x01" * 1000)
    outside.write_text("keep me")
    (out / "link").symlink_to(outside)


@pytest.fixture
def gated(monkeypatch):
    """The background deletion held until the test releases it (the real rmtree then runs)."""
    gate = threading.Event()
    rmtree = shutil.rmtree

    def held(path, *a, **kw):
        if threading.current_thread().name == "quantize-deleting":
            gate.wait(30)
        return rmtree(path, *a, **kw)

    monkeypatch.setattr(quantize.write.deleting.shutil, "rmtree", held)
    return gate


def test_overwrite_converts_while_the_old_contents_are_deleted(dsa_fp8, tmp_path, gated):
    fresh, out, outside = tmp_path / "fresh", tmp_path / "out", tmp_path / "outside.txt"
    convert(dsa_fp8, fresh, RTN, device="cpu")
    convert(dsa_fp8, out, ConvertOptions(method="rtn", max_shard_size=200_000), device="cpu")
    _old_contents(out, outside)
    old = {p.name for p in out.iterdir()}
    pending: list[set[str]] = []

    def first_unit(unit) -> None:
        if not pending:  # the stream has begun: the old entries sit in TRASH, not yet deleted
            pending.append({p.name.split("-", 2)[2] for p in (out / TRASH).iterdir()})

    release = threading.Timer(1.5, gated.set)  # (after the stream: the run must wait for it)
    release.start()
    convert(dsa_fp8, out, RTN, device="cpu", overwrite=True, on_unit=first_unit)
    assert not release.is_alive()
    assert pending and pending[0] == old, (pending, old)
    assert not (out / TRASH).exists()  # waited for before the folder was declared complete
    assert _files(out) == _files(fresh)  # nothing of before is left, nothing differs
    assert outside.read_text() == "keep me"


def test_a_killed_runs_trash_is_deleted_by_the_next_run(dsa_fp8, tmp_path):
    """TRASH left by a run killed while deleting is ours: the next run in the folder deletes it
    without --overwrite, whether it starts afresh or resumes; a file of that name that is not
    our folder is the user's content like any other."""
    fresh = tmp_path / "fresh"
    convert(dsa_fp8, fresh, RTN, device="cpu")
    out = tmp_path / "out"
    (out / TRASH / "123-0-sub").mkdir(parents=True)
    (out / TRASH / "123-0-sub" / "model-00001.safetensors").write_bytes(b"\x00" * 5000)
    convert(dsa_fp8, out, RTN, device="cpu")  # (not refused as a folder with contents)
    assert not (out / TRASH).exists() and _files(out) == _files(fresh)
    (out / TRASH).mkdir()
    (out / TRASH / "1-0-old.bin").write_bytes(b"\x02" * 100)
    convert(dsa_fp8, out, RTN, device="cpu")  # a complete folder run again: kept, TRASH gone
    assert not (out / TRASH).exists() and _files(out) == _files(fresh)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / TRASH).write_text("a file of the user's")
    with pytest.raises(QuantizeError, match="not empty"):
        convert(dsa_fp8, mine, RTN, device="cpu")
    convert(dsa_fp8, mine, RTN, device="cpu", overwrite=True)
    assert not (mine / TRASH).exists() and _files(mine) == _files(fresh)


def test_a_run_that_needs_the_old_contents_space_waits_for_their_deletion(dsa_fp8, tmp_path, gated,
                                                                          monkeypatch):
    """The disk check counts only the space free now: with too little while the old contents
    are still on the disk, the run waits for their deletion, checks again, then writes; with too
    little even then, it is refused as before."""
    out = tmp_path / "out"
    convert(dsa_fp8, out, RTN, device="cpu")
    Usage = collections.namedtuple("Usage", "total used free")
    room = {"after": 10**12}

    def usage(p) -> Usage:  # 1 byte free while TRASH holds the old shards
        free = 1 if (out / TRASH).exists() else room["after"]
        return Usage(10**12, 10**12 - free, free)

    monkeypatch.setattr("quantize.disk.shutil.disk_usage", usage)
    threading.Timer(0.3, gated.set).start()
    seen: list[bool] = []
    convert(dsa_fp8, out, RTN, device="cpu", overwrite=True,
            on_unit=lambda u: seen.append((out / TRASH).exists()))
    assert seen and not any(seen)  # nothing was written before the deletion had finished
    gated.clear()
    threading.Timer(0.3, gated.set).start()
    room["after"] = 1
    with pytest.raises(QuantizeError, match="not enough free disk space"):
        convert(dsa_fp8, out, RTN, device="cpu", overwrite=True)
    assert not (out / TRASH).exists()
