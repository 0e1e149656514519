"""Work that overlaps the stream instead of waiting for it.

    fut = background(prepare, src)                a value built on a daemon thread (e.g. a slow
                                                  import: transformers): .result() where it is
                                                  needed re-raises its error
    with Readahead(ckpt, names) as ra:            the tensors' bytes read into the page cache
        ...; ra.consumed(nbytes)                  in the order given, at most `ahead` bytes
                                                  beyond what the reader has taken
    with HashAhead(paths) as h:                   files hashed (sha256) in the order given, at
        ...; h.consumed(nbytes)                   most `ahead` bytes beyond what the reader has
    h.digests()                                   taken: its reads then come from the page cache
                                                  (each file read from the disk once)
    Readahead(..., yield_to=fut)                  (and HashAhead) at most QUIET_AHEAD beyond
                                                  the reader while `fut` (an import) is pending
    copies = Bounded(pool, limit)                 work handed to an executor, at most `limit`
    fut = copies.submit(fn, nbytes, *args)        bytes of it unfinished: submit waits for the
                                                  oldest first (what it holds stays bounded)

A cold read of one tensor at a time waits for the disk per tensor (~0.8 GB/s measured on an
H200 node whose disk reads 1.9 GB/s); a thread reading ahead in long sequential chunks keeps
the disk busy while the stream computes and writes (BENCHMARKS.md, "RTN and verify against
the disk"). No torch here: header-only commands import this module too.
"""

from __future__ import annotations

import collections
import hashlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

__all__ = ["STREAM_AHEAD", "Bounded", "HashAhead", "Readahead", "background", "readahead_bytes"]


def background(fn: Callable, *args) -> Future:
    """fn(*args) on a daemon thread; its Future."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - raised by .result() on the caller's thread
            fut.set_exception(e)

    threading.Thread(target=run, daemon=True, name="quantize-background").start()
    return fut


class Bounded:
    """An executor's work with at most `limit` bytes of it unfinished. Each submission names
    the bytes it holds until done (e.g. GPU tensors a copy thread moves to the host);
    `submit` first waits for the oldest submissions while the new one would take the
    unfinished total past `limit` (one submission alone may exceed it)."""

    def __init__(self, pool: Executor, limit: int) -> None:
        self.pool, self.limit = pool, limit
        self._pending: collections.deque[tuple[Future, int]] = collections.deque()
        self.pending_bytes = 0
        self.waits = 0  # submissions that had to wait for older ones

    def _pop(self) -> None:
        fut, n = self._pending.popleft()
        self.pending_bytes -= n
        fut.result()  # (re-raises the work's error)

    def wait_all(self) -> None:
        """Until every submission has finished; forgets them (and what their results hold)."""
        while self._pending:
            self._pop()

    def submit(self, fn: Callable, nbytes: int, *args) -> Future:
        while self._pending and self._pending[0][0].done():
            self._pop()
        if self._pending and self.pending_bytes + nbytes > self.limit:
            self.waits += 1
            while self._pending and self.pending_bytes + nbytes > self.limit:
                self._pop()
        fut = self.pool.submit(fn, *args)
        self._pending.append((fut, nbytes))
        self.pending_bytes += nbytes
        return fut


STREAM_AHEAD = 16 * 2**30  # a stream's read-ahead (convert's, verify's): at most this, or an
# eighth of the memory available; its start-up (imports, checks) reads that far into the source


def readahead_bytes(limit: int = 2 * 2**30) -> int:
    """How far ahead to read: `limit`, or an eighth of the memory available when that is less
    (pages read too far ahead would be evicted before their use and read twice). Available:
    the host's, or what this process's memory cgroup has left below its limit when that is
    less (the page cache counts against the cgroup)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if (room := _cgroup_room()) is not None:
        avail = room if avail is None else min(avail, room)
    return limit if avail is None else max(64 * 2**20, min(limit, avail // 8))


def _cgroup_room() -> int | None:
    """Bytes below this process's memory cgroup's limit (cgroup v2 memory.max, v1
    memory.limit_in_bytes) not taken by its memory other than the page cache; None without a
    limit."""
    try:
        with open("/proc/self/cgroup") as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in entries:
        if controllers == "":  # v2
            base, limit_f, use_f, stat_key = f"/sys/fs/cgroup{path}", "memory.max", "memory.current", "file"
        elif "memory" in controllers.split(","):  # v1
            base, limit_f, use_f, stat_key = (f"/sys/fs/cgroup/memory{path}", "memory.limit_in_bytes",
                                              "memory.usage_in_bytes", "cache")
        else:
            continue
        try:
            with open(f"{base}/{limit_f}") as f:
                text = f.read().strip()
            if text == "max" or int(text) >= 2**60:
                continue
            with open(f"{base}/{use_f}") as f:
                used = int(f.read())
            cache = 0
            with open(f"{base}/memory.stat") as f:
                for line in f:
                    k, _, v = line.partition(" ")
                    if k == stat_key:
                        cache = int(v)
            return max(0, int(text) - used + cache)
        except (OSError, ValueError):
            continue
    return None


QUIET_AHEAD = 64 * 2**20  # how far a reader runs ahead while it yields to an import


class _Ahead:
    """A reader that stays at most `ahead` bytes beyond the bytes its consumer reported
    (`consumed`): `_wait(done)` blocks while `done` bytes read are that far ahead and says
    whether to go on (False once `close` asked it to stop)."""

    def __init__(self, ahead: int | None) -> None:
        self.ahead = readahead_bytes() if ahead is None else ahead
        self._cv = threading.Condition()
        self._taken = 0
        self._stop = False
        self._gate: Future | None = None  # while pending: stay at most QUIET_AHEAD ahead

    def consumed(self, nbytes: int) -> None:
        with self._cv:
            self._taken += nbytes
            self._cv.notify()

    def yield_to(self, work: Future) -> None:
        """While `work` (an import on another thread: its small reads of the Python packages
        wait behind each long read of ours on a saturated disk) is pending, read at most
        QUIET_AHEAD beyond the consumer instead of `ahead`: the disk then serves the
        consumer's pace, not a full queue (verify's layer check loaded in 6.1-7.0 s instead of
        8.8-9.3 s beside its tensor checks on a 2-core machine: BENCHMARKS.md, "verify lets
        the imports through")."""
        if work.done():
            return
        with self._cv:
            self._gate = work
        work.add_done_callback(lambda _: self.consumed(0))  # (wakes a reader held back)

    def _limit(self) -> int:
        gate = self._gate
        return min(self.ahead, QUIET_AHEAD) if gate is not None and not gate.done() else self.ahead

    def _wait(self, done: int) -> bool:
        with self._cv:
            self._cv.wait_for(lambda: self._stop or done - self._taken < self._limit())
            return not self._stop

    def _signal_stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Readahead(_Ahead):
    """Reads the named tensors of `ckpt` (a source_checkpoint.Checkpoint) into the OS page
    cache on a daemon thread, in the order given, staying at most `ahead` bytes beyond the
    bytes the consumer reported (`consumed`). Read errors are left to the real reads; `close`
    (or leaving the `with`) stops it within one chunk."""

    def __init__(self, ckpt, names: list[str], ahead: int | None = None,
                 yield_to: Future | None = None) -> None:
        super().__init__(ahead)
        if yield_to is not None:
            self.yield_to(yield_to)
        self.ckpt, self.names = ckpt, [n for n in names if n in ckpt.tensors]
        self._thread = threading.Thread(target=self._run, daemon=True, name="quantize-readahead")
        self._thread.start()

    def _run(self) -> None:
        done = 0
        for name in self.names:
            if not self._wait(done):
                return
            self.ckpt.prefetch([name], stop=lambda: self._stop)
            done += self.ckpt.tensors[name].nbytes

    def close(self) -> None:
        self._signal_stop()
        self._thread.join()


class HashAhead(_Ahead):
    """The sha256 of each of `paths`, hashed in the order given on two daemon threads (one
    reads `chunk`-sized pieces, one hashes them: a thread doing both leaves the disk idle while
    it hashes), the reads staying at most `ahead` bytes beyond the bytes the consumer reported
    (`consumed`): a consumer reading the same files in the same order then reads them from the
    page cache, and each file comes from the disk once however little of it the cache holds.
    `digests()` waits for all: {path: hexdigest, or the error that stopped its read};
    `digests(started=True)` only for the files whose reading has begun (at most the budget
    beyond the consumer). `close` (or leaving the `with`) stops it within one chunk."""

    def __init__(self, paths: list, ahead: int | None = None, chunk: int = 16 * 2**20,
                 yield_to: Future | None = None) -> None:
        super().__init__(ahead)
        if yield_to is not None:
            self.yield_to(yield_to)
        self.paths, self.chunk = list(paths), chunk
        self.read_bytes = 0  # read so far (the last file's hashing may still be under way)
        self._no_more = False  # set: no file is opened after the one being read
        self._pieces: queue.Queue = queue.Queue(maxsize=4)  # read, not yet hashed
        self._digests: dict = {}
        self._done = threading.Event()
        for fn, name in ((self._read, "quantize-hash-read"), (self._hash, "quantize-hash")):
            threading.Thread(target=fn, daemon=True, name=name).start()

    def _read(self) -> None:
        try:
            for path in self.paths:
                if self._no_more:
                    break
                try:
                    with open(path, "rb", buffering=0) as f:
                        while True:
                            if not self._wait(self.read_bytes):  # (no digest for a file left part-read)
                                return
                            piece = f.read(self.chunk)
                            if not piece:
                                break
                            self.read_bytes += len(piece)
                            self._pieces.put((path, piece))
                except Exception as e:  # noqa: BLE001 - the file's result: its digest or the error
                    self._pieces.put((path, e))
                self._pieces.put((path, None))  # the file's end
        finally:  # the end, however the reading ended (else `digests` and `close` would wait)
            self._pieces.put(None)

    def _hash(self) -> None:
        try:
            h, failed = hashlib.sha256(), None
            while (item := self._pieces.get()) is not None:
                path, piece = item
                if piece is None:
                    self._digests[path] = failed or h.hexdigest()
                    h, failed = hashlib.sha256(), None
                elif isinstance(piece, Exception):
                    failed = piece
                elif failed is None:
                    h.update(piece)  # (releases the GIL)
        finally:
            self._done.set()

    def digests(self, started: bool = False) -> dict:
        """{path: sha256 hexdigest, or the error that stopped the read}, once all are done
        (reads past the budget go on regardless: the consumer is finished with them);
        `started`: only the files whose reading had begun (no later file is read)."""
        self._no_more = self._no_more or started
        self.consumed(float("inf"))
        self._done.wait()
        return dict(self._digests)

    def close(self) -> None:
        self._signal_stop()
        self._done.wait()  # (the hashing thread empties the queue the reader may wait on)
