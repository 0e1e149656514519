"""quantize/overlap.py: a value built on a thread, and the page cache filled ahead of the reads
within a byte budget (on a real checkpoint; the reads themselves are Checkpoint.prefetch's)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from quantize.overlap import Bounded, HashAhead, Readahead, background, readahead_bytes
from quantize.source.checkpoint import open_checkpoint
from quantize.source.synth import tiny_config, write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = write_checkpoint(tmp_path_factory.mktemp("src"), tiny_config("glm_moe_dsa"), "fp8-block", seed=2)
    return open_checkpoint(d)


def test_background_returns_the_value_and_reraises_the_error_where_it_is_needed():
    names = []
    fut = background(lambda a, b: names.append(threading.current_thread().name) or a + b, 2, 3)
    assert fut.result(timeout=10) == 5
    assert names == ["quantize-background"]  # it ran on its own thread

    def boom() -> None:
        raise OSError("no such file")

    with pytest.raises(OSError, match="no such file"):
        background(boom).result(timeout=10)


def _recording(ckpt, monkeypatch) -> list[str]:
    """The names Readahead asks Checkpoint.prefetch for, in order (the reads still happen)."""
    asked: list[str] = []
    real = type(ckpt).prefetch

    def prefetch(self, names, *a, **kw):
        asked.extend(names)
        return real(self, names, *a, **kw)

    monkeypatch.setattr(type(ckpt), "prefetch", prefetch)
    return asked


def _settle(asked: list[str], n: int, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while len(asked) < n and time.monotonic() - t0 < timeout:
        time.sleep(0.01)
    time.sleep(0.1)  # (and no further: checked by the caller)


def test_readahead_stays_within_its_budget_beyond_what_was_consumed(ckpt, monkeypatch):
    asked = _recording(ckpt, monkeypatch)
    names = sorted(ckpt.tensors, key=lambda n: -ckpt.tensors[n].nbytes)[:12]
    size = [ckpt.tensors[n].nbytes for n in names]
    budget = size[0] + size[1] + size[2]  # three tensors ahead (the largest first)

    def within(taken: int) -> list[str]:  # a tensor is read while less than `budget` is ahead
        done, out = 0, []
        for n, b in zip(names, size):
            if done - taken >= budget:
                break
            out.append(n)
            done += b
        return out

    assert within(0) == names[:3] and len(within(size[0] + size[1])) > 3
    with Readahead(ckpt, names + ["no.such.tensor"], ahead=budget) as ra:
        _settle(asked, 3)
        assert asked == within(0)  # begins at once, stops at the budget
        ra.consumed(size[0] + size[1])
        _settle(asked, len(within(size[0] + size[1])))
        assert asked == within(size[0] + size[1])
        ra.consumed(sum(size))
        _settle(asked, len(names))
        assert asked == names  # (a name the checkpoint lacks is skipped)


def test_readahead_close_stops_a_waiting_thread_at_once(ckpt, monkeypatch):
    asked = _recording(ckpt, monkeypatch)
    names = list(ckpt.tensors)
    ra = Readahead(ckpt, names, ahead=1)  # one tensor, then it waits for the consumer
    _settle(asked, 1)
    t0 = time.monotonic()
    ra.close()
    assert time.monotonic() - t0 < 2 and len(asked) == 1
    assert not ra._thread.is_alive()


def test_readahead_bytes_is_bounded_by_the_limit_and_the_memory():
    got = readahead_bytes()
    assert 64 * 2**20 <= got <= 2 * 2**30
    assert readahead_bytes(limit=100 * 2**20) <= 100 * 2**20


def test_bounded_keeps_unfinished_work_within_its_byte_limit_and_reraises():
    from concurrent.futures import ThreadPoolExecutor

    gate = threading.Event()  # the worker stalls until released: a copy thread behind the solves
    lock = threading.Lock()
    running: list[int] = []  # bytes of submitted work not finished, as the worker sees it
    peak = [0]

    def work(n: int) -> int:
        gate.wait(10)
        with lock:
            running.remove(n)
        return n

    with ThreadPoolExecutor(1) as pool:
        b = Bounded(pool, limit=100)
        futs = []
        for i, n in enumerate([40, 40, 30, 70, 20, 150, 10]):
            if i == 2:
                threading.Timer(0.2, gate.set).start()  # release while the third submission waits
            with lock:
                running.append(n)
                peak[0] = max(peak[0], sum(running))
            futs.append(b.submit(work, n, n))
            assert b.pending_bytes <= max(100, n)  # one oversized submission alone may exceed it
        b.wait_all()
        assert b.pending_bytes == 0 and all(f.done() for f in futs)
        assert [f.result() for f in futs] == [40, 40, 30, 70, 20, 150, 10]
        assert b.waits >= 1  # the third (40 + 40 + 30 > 100) waited for the first
        assert peak[0] <= 100 + 150

        def boom() -> None:
            raise OSError("copy failed")

        b2 = Bounded(pool, limit=1)
        b2.submit(boom, 1)
        with pytest.raises(OSError, match="copy failed"):  # the next submission waits on it
            b2.submit(lambda: None, 1)


def _files(tmp_path, sizes: list[int], seed: int = 0) -> list:
    import random

    rng = random.Random(seed)
    paths = []
    for i, n in enumerate(sizes):
        p = tmp_path / f"f{i}.bin"
        p.write_bytes(rng.randbytes(n))
        paths.append(p)
    return paths


def _settle_read(h: HashAhead, want: int, timeout: float = 10.0) -> None:
    """Wait until `h` has read `want` bytes (or `timeout`), then a little more (to see that it
    reads no further: checked by the caller)."""
    t0 = time.monotonic()
    while h.read_bytes < want and time.monotonic() - t0 < timeout:
        time.sleep(0.01)
    time.sleep(0.1)


def test_hash_ahead_gives_each_files_sha256(tmp_path):
    import hashlib

    # pieces of 64 KiB: files of several pieces, one not a whole number of them, an empty one
    paths = _files(tmp_path, [5 * 2**16, 3 * 2**16 + 123, 0, 1000])
    paths.append(tmp_path / "missing.bin")
    with HashAhead(paths, ahead=2**16, chunk=2**16) as h:
        got = h.digests()
    for p in paths[:-1]:
        assert got[p] == hashlib.sha256(p.read_bytes()).hexdigest(), p.name
    assert isinstance(got[paths[-1]], OSError)  # said, and the files after it still hashed


def test_hash_ahead_reads_within_its_budget_beyond_what_was_consumed(tmp_path):
    piece = 2**16
    paths = _files(tmp_path, [4 * piece, 4 * piece], seed=1)

    with HashAhead(paths, ahead=3 * piece, chunk=piece) as h:
        _settle_read(h, 3 * piece)
        assert h.read_bytes == 3 * piece  # begins at once, stops at the budget
        h.consumed(4 * piece)  # the reader is into the second file
        _settle_read(h, 7 * piece)
        assert h.read_bytes == 7 * piece
        assert len(h.digests()) == 2 and h.read_bytes == 8 * piece  # the rest, once asked


def test_hash_ahead_closes_with_reads_pending(tmp_path):
    paths = _files(tmp_path, [8 * 2**16], seed=2)
    h = HashAhead(paths, ahead=2**16, chunk=2**16)
    t0 = time.monotonic()
    h.close()  # the reader waits on the budget: close ends it, no digest of a part-read file
    assert time.monotonic() - t0 < 5 and h.read_bytes <= 2 * 2**16 and h._digests == {}


def test_a_read_that_drops_its_pages_gives_the_same_bytes(ckpt):
    import torch

    names = sorted(ckpt.tensors)[:20]
    want = {n: ckpt.read(n).clone() for n in names}
    ckpt.drop_read = True
    try:
        for n in names:  # (posix_fadvise DONTNEED after each: a hint, never the bytes)
            got = ckpt.read(n)
            assert got.dtype == want[n].dtype and torch.equal(got.view(torch.uint8), want[n].view(torch.uint8))
    finally:
        ckpt.drop_read = False


def test_readahead_budget_is_bounded_by_the_memory():
    b = readahead_bytes(2**50)  # the memory's eighth, not the limit asked for
    assert 64 * 2**20 <= b < 2**50
    assert readahead_bytes(100 * 2**20) <= 100 * 2**20


def test_hash_ahead_can_finish_only_the_files_it_began(tmp_path):
    import hashlib

    piece = 2**16
    paths = _files(tmp_path, [3 * piece, 3 * piece, 3 * piece], seed=3)
    with HashAhead(paths, ahead=piece, chunk=piece) as h:
        t0 = time.monotonic()
        while h.read_bytes < piece and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        got = h.digests(started=True)  # the first file is being read: it alone is finished
    assert list(got) == [paths[0]] and got[paths[0]] == hashlib.sha256(paths[0].read_bytes()).hexdigest()


def test_hash_ahead_gives_an_unexpected_error_as_that_files_result(tmp_path):
    import hashlib

    paths = _files(tmp_path, [2**16], seed=4)
    h = HashAhead([paths[0], 1.5], ahead=2**20, chunk=2**16)  # open(1.5): a TypeError, not an OSError
    fut = background(h.digests)
    got = fut.result(timeout=10)  # returns (a reader that died would leave it waiting)
    assert got[paths[0]] == hashlib.sha256(paths[0].read_bytes()).hexdigest()
    assert isinstance(got[1.5], TypeError)  # the error is that file's result
    h.close()


def _opts_rtn():
    from quantize.options import ConvertOptions

    return ConvertOptions(method="rtn", max_shard_size=64 * 2**10)  # (several shards)


def test_rtn_reads_the_source_ahead_from_the_plan_on_before_its_checks(ckpt, monkeypatch, tmp_path):
    """RTN into a fresh folder starts its read-ahead before the checks (the check below waits
    for the reader's first tensor, and would time out with a reader started later); the reads
    are the plan's order, each tensor once; a check that refuses leaves no reader running."""
    from quantize import pipeline
    from quantize.errors import QuantizeError
    from quantize.plan import make_plan

    asked = _recording(ckpt, monkeypatch)
    real = pipeline._check_out_path

    def check_after_the_first_read(*a, **kw):
        _settle(asked, 1, timeout=20)
        assert asked, "no read ahead had begun when the output path was checked"
        return real(*a, **kw)

    monkeypatch.setattr(pipeline, "_check_out_path", check_after_the_first_read)
    plan = make_plan(ckpt, _opts_rtn(), 8)
    assert len(plan.shards) > 1
    res = pipeline.convert(ckpt.root, tmp_path / "out", _opts_rtn(), device="cpu")
    assert res.written == [s.file for s in plan.shards]
    assert asked == plan.read_order()

    asked.clear()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("the user's")
    with pytest.raises(QuantizeError, match="not empty"):
        pipeline.convert(ckpt.root, busy, _opts_rtn(), device="cpu")
    assert asked and asked == plan.read_order()[:len(asked)]
    assert not [t for t in threading.enumerate() if t.name == "quantize-readahead" and t.is_alive()]


def test_read_order_is_the_plans_and_leaves_out_the_kept_shards(ckpt):
    from quantize.plan import make_plan

    plan = make_plan(ckpt, _opts_rtn(), 8)
    first, *rest = plan.shards
    want = [n for s in rest for u in s.units for n in (u.source, u.scale) if n]
    assert plan.read_order({first.file}) == want
    assert plan.read_order() == [n for u in first.units for n in (u.source, u.scale) if n] + want
    assert set(plan.read_order()) <= set(ckpt.tensors)


def test_readers_stay_close_to_the_consumer_while_an_import_is_pending(tmp_path, ckpt, monkeypatch):
    """While the Future they yield to is pending, HashAhead and Readahead run at most
    QUIET_AHEAD beyond the consumer (the imports' small reads are not queued behind a full
    budget of ours); once it is done, their whole budget."""
    from quantize import overlap

    piece = 2**16
    monkeypatch.setattr(overlap, "QUIET_AHEAD", 2 * piece)
    paths = _files(tmp_path, [8 * piece], seed=3)
    importing: Future = Future()

    with HashAhead(paths, ahead=6 * piece, chunk=piece, yield_to=importing) as h:
        _settle_read(h, 2 * piece)
        assert h.read_bytes == 2 * piece  # the quiet budget, not the 6 pieces
        h.consumed(piece)
        _settle_read(h, 3 * piece)
        assert h.read_bytes == 3 * piece  # keeps the consumer's pace
        importing.set_result(None)  # the import is done: the whole budget again
        _settle_read(h, 7 * piece)
        assert h.read_bytes == 7 * piece

    asked = _recording(ckpt, monkeypatch)
    names = sorted(ckpt.tensors, key=lambda n: -ckpt.tensors[n].nbytes)[:6]
    monkeypatch.setattr(overlap, "QUIET_AHEAD", ckpt.tensors[names[0]].nbytes + 1)
    pending: Future = Future()
    with Readahead(ckpt, names, ahead=2**40, yield_to=pending):
        _settle(asked, 2)
        assert asked == names[:2]  # the first tensor, then one more within the quiet budget
        pending.set_result(None)
        _settle(asked, len(names))
        assert asked == names
