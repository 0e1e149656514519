"""Write the output folder: streamed safetensors shards, index, config, copied files.

Every file appears under its final name only when complete: it is written to
`<name>.partial`, fsynced, then renamed, and the folder is fsynced. A crash leaves at most a
`.partial` file, which a resumed run discards. A shard is streamed tensor by tensor after its
header (known from the plan), so memory holds one tensor, never a shard. While a conversion
writes, it holds a flock on the output folder, so a second run into the same folder is refused.
A failed write (disk full, read-only, permissions) becomes a QuantizeError naming the file.

Test hook (off unless the variable is set; never set it in production):
`QUANTIZE_TEST_STALL_AT=EVENT:N` makes the process print `QUANTIZE_TEST_STALLED EVENT N` to
stderr and sleep forever at the N-th (1-based) EVENT of this process, so a test can SIGKILL it
at an exact point, always on the main thread. EVENT is `unit` (a unit's tensors written into a
`.partial` shard and flushed, more units of that shard to come: the shard is half written),
`shard` (a shard renamed into place, before the manifest records it), `finish` (every shard
done, before the index, config and completed manifest are written) or `state` (a calibration
checkpoint's files written into `layer-<L>.partial/`, not yet renamed; quantize/calib/state.py).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from quantize.errors import Problem, QuantizeError
from quantize.names import partial_name
from quantize.plan import OutTensor, shard_header
from quantize.source.checkpoint import st_dtype

if TYPE_CHECKING:  # (torch is imported where tensors are written: the file helpers here
    import torch  # serve the header-only commands too)

__all__ = [
    "ShardWriter", "copy_file_atomic", "folder_lock", "fsync_dir", "open_fresh", "read_own_json",
    "sha256_file", "stall_point", "write_bytes_atomic", "write_failed", "write_json_atomic",
]

STALL_ENV = "QUANTIZE_TEST_STALL_AT"
_stall_counts: dict[str, int] = {}


def stall_point(event: str, partial: BinaryIO | None = None) -> None:
    """The test hook described in the module docstring; a no-op unless STALL_ENV is set.
    `partial`: the open `.partial` file, flushed first so the half-written bytes are on disk."""
    want = os.environ.get(STALL_ENV)
    if not want:
        return
    _stall_counts[event] = n = _stall_counts.get(event, 0) + 1
    if want == f"{event}:{n}":
        if partial is not None:
            partial.flush()
        print(f"QUANTIZE_TEST_STALLED {event} {n}", file=sys.stderr, flush=True)
        while True:
            time.sleep(60)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_failed(path: Path, e: OSError) -> QuantizeError:
    """A failed write as a message: the disk filling up, or anything else the OS refused."""
    if e.errno == errno.ENOSPC:
        return QuantizeError("the disk filled up while writing", [Problem(
            str(path), None, f"{e.strerror} (errno {e.errno})", "room for the output",
            "free space (`quantize plan` prints the output size), then rerun the same command "
            "with --resume: finished shards are kept")])
    return QuantizeError("could not write the output", [Problem(
        str(path), None, f"{e.strerror or e} (errno {e.errno})", "a writable output folder",
        "fix the folder's permissions or pick another one, then rerun the same command")])


@contextmanager
def folder_lock(path: Path) -> Iterator[None]:
    """Create `path` if needed and hold an exclusive flock on the folder itself (no lock file is
    left behind; the kernel drops the lock when the process dies, even by SIGKILL)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise write_failed(path, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise QuantizeError("another conversion is writing to this folder", [Problem(
            str(path), None, "locked by a running `quantize convert`",
            "one conversion per output folder at a time",
            "wait for the other run to finish (or stop it), then rerun this command to resume")]
        ) from None
    try:
        yield
    finally:
        os.close(fd)


def _discard(tmp: Path) -> None:
    """Remove a temporary file after a failed write; a second failure must not hide the first."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


def open_fresh(path: Path):
    """`path` opened for writing as a new file of its folder: whatever is there under that name
    (a file, or a link to anywhere) is removed first, and the file is created exclusively
    without following a link (O_EXCL | O_NOFOLLOW), so a write never lands outside the folder
    through a link planted at a temporary or report name."""
    try:
        if path.is_symlink() or path.is_file():
            path.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    return os.fdopen(fd, "wb")


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """`data` to `path` through `path.partial` (created fresh: `open_fresh`), fsynced and
    renamed over `path` (a link at `path` is replaced, not followed)."""
    tmp = path.with_name(partial_name(path.name))
    try:
        with open_fresh(tmp) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)  # the new name survives a crash only once its folder is synced
    except OSError as e:
        _discard(tmp)
        raise write_failed(path, e) from None


def finite(obj: object) -> object:
    """`obj` with every non-finite float (inf, nan) as None: JSON has no such numbers (Python
    would write `Infinity`, which strict parsers refuse)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def json_text(obj: object, indent: int | None = 2) -> str:
    """Strict JSON (no NaN / Infinity): non-finite numbers as null."""
    return json.dumps(finite(obj), indent=indent, sort_keys=False, allow_nan=False)


def read_own_json(path: Path, max_bytes: int = 64 << 20) -> dict | None:
    """A JSON report this tool wrote into an output folder, or None where there is none to use:
    absent, a link (never followed), not a regular file (a FIFO would block the read), over
    `max_bytes` (our reports are kilobytes; a link to /dev/zero is no report), unreadable, or
    not a JSON object (a stale or foreign file)."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > max_bytes:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json_atomic(path: Path, obj: object) -> None:
    write_bytes_atomic(path, (json_text(obj) + "\n").encode())


def copy_file_atomic(src: Path, dst: Path) -> None:
    tmp = dst.with_name(partial_name(dst.name))
    try:
        with open(src, "rb") as r, open_fresh(tmp) as f:  # (a link at tmp: removed, not followed)
            shutil.copyfileobj(r, f, 1 << 24)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
        fsync_dir(dst.parent)
    except OSError as e:
        _discard(tmp)
        raise write_failed(dst, e) from None


def sha256_file(path: Path, chunk: int = 2**24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


# Start the disk writes of every WRITEBACK_BYTES written instead of leaving them all to the
# shard's final fsync: Linux only begins writeback of dirty pages past a share of RAM (10 % by
# default), so a 5 GB shard on a large host would otherwise reach the disk only at the end,
# with the conversion waiting for it. sync_file_range(SYNC_FILE_RANGE_WRITE) queues the range
# and returns; the fsync at the end still makes the shard durable.
WRITEBACK_BYTES = 64 * 2**20
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sfr = _sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to begin writing [offset, offset + nbytes) of `fd` to disk (a hint: on
    other systems, or if the call fails, the final fsync does it all)."""
    if _sfr is not None:
        _sfr(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class ShardWriter:
    """Stream one planned shard: header first, then each tensor in plan order.

    with ShardWriter(out_dir / shard.file, shard.tensors) as w:
        for t in tensors: w.write(t)
    digest = w.sha256
    """

    def __init__(self, path: Path, planned: list[OutTensor]):
        self.path = path
        self.tmp = path.with_name(partial_name(path.name))
        self.planned = planned
        self.next = 0
        self.hash = hashlib.sha256()
        self.sha256: str | None = None
        self.nbytes = 0
        self.flushed = 0  # bytes handed to the kernel's writeback so far
        self._hash_pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> ShardWriter:
        try:
            self.f = open_fresh(self.tmp)
        except OSError as e:
            raise write_failed(self.path, e) from None
        try:
            self._put(shard_header(self.planned))
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _put(self, data) -> None:
        # A large chunk is hashed on a second thread while this one writes it (both release
        # the GIL), so the hash does not add to the writer's time. Both finish before
        # returning: the caller may reuse the buffer.
        hashing = self._hasher().submit(self.hash.update, data) if len(data) >= 2**20 else None
        try:
            self.f.write(data)
        except OSError as e:
            if hashing is not None:
                hashing.result()
            raise write_failed(self.path, e) from None
        if hashing is None:
            self.hash.update(data)
        else:
            hashing.result()
        self.nbytes += len(data)
        if self.nbytes - self.flushed >= WRITEBACK_BYTES:
            start_writeback(self.f.fileno(), self.flushed, self.nbytes - self.flushed)
            self.flushed = self.nbytes

    def _hasher(self) -> ThreadPoolExecutor:
        if self._hash_pool is None:
            self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="quantize-sha256")
        return self._hash_pool

    def write(self, tensor: torch.Tensor) -> None:
        want = self.planned[self.next]
        got = (st_dtype(tensor.dtype), tuple(tensor.shape))
        if got != (want.dtype, want.shape):
            raise RuntimeError(f"internal: {want.name} computed as {got}, planned "
                               f"{(want.dtype, want.shape)}")
        if tensor.is_cuda and tensor.numel():  # through pinned chunks (quantize/source/staging.py)
            from quantize.source.staging import device_chunks

            for chunk in device_chunks(tensor):
                self._put(memoryview(chunk.numpy()))
        else:
            import torch

            t = tensor.detach().to("cpu").contiguous().reshape(-1)
            self._put(memoryview(t.view(torch.uint8).numpy()))
        self.next += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._hash_pool is not None:
            self._hash_pool.shutdown()
        if exc_type is not None:
            try:
                self.f.close()  # may fail again (e.g. disk still full); the original error wins
            except OSError:
                pass
            _discard(self.tmp)
            return
        try:
            if self.next != len(self.planned):
                raise RuntimeError(f"internal: {self.path.name} got {self.next} of "
                                   f"{len(self.planned)} tensors")
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
        except BaseException as e:
            try:
                self.f.close()
            except OSError:
                pass
            _discard(self.tmp)
            if isinstance(e, OSError):
                raise write_failed(self.path, e) from None
            raise
        try:
            os.replace(self.tmp, self.path)
            fsync_dir(self.path.parent)
        except OSError as e:
            _discard(self.tmp)
            raise write_failed(self.path, e) from None
        self.sha256 = self.hash.hexdigest()
        stall_point("shard")
