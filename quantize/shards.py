"""Write the output folder: streamed safetensors shards, index, config, copied files.

Every file appears under its final name only when complete: it is written to
`<name>.partial`, fsynced, then renamed, and the folder is fsynced. A crash leaves at most a
`.partial` file, which a resumed run discards. A shard is streamed tensor by tensor after its
header (known from the plan), so memory holds one tensor, never a shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from quantize.checkpoint import TORCH_TO_ST
from quantize.errors import Problem, QuantizeError
from quantize.plan import OutTensor, shard_header

__all__ = ["ShardWriter", "copy_file_atomic", "fsync_dir", "sha256_file", "write_json_atomic"]

PARTIAL = ".partial"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_full(path: Path, e: OSError) -> QuantizeError:
    return QuantizeError("the disk filled up while writing", [Problem(
        str(path), None, f"{e.strerror} (errno {e.errno})", "room for the output",
        "free space (`quantize plan` prints the output size), then rerun the same command "
        "with --resume: finished shards are kept")])


def write_json_atomic(path: Path, obj: object) -> None:
    data = (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()
    tmp = path.with_name(path.name + PARTIAL)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _disk_full(path, e) if e.errno == 28 else e
    fsync_dir(path.parent)


def copy_file_atomic(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + PARTIAL)
    try:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _disk_full(dst, e) if e.errno == 28 else e


def sha256_file(path: Path, chunk: int = 2**24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


class ShardWriter:
    """Stream one planned shard: header first, then each tensor in plan order.

    with ShardWriter(out_dir / shard.file, shard.tensors) as w:
        for t in tensors: w.write(t)
    digest = w.sha256
    """

    def __init__(self, path: Path, planned: list[OutTensor]):
        self.path = path
        self.tmp = path.with_name(path.name + PARTIAL)
        self.planned = planned
        self.next = 0
        self.hash = hashlib.sha256()
        self.sha256: str | None = None
        self.nbytes = 0

    def __enter__(self) -> ShardWriter:
        self.f = open(self.tmp, "wb")
        self._put(shard_header(self.planned))
        return self

    def _put(self, data) -> None:
        try:
            self.f.write(data)
        except OSError as e:
            raise _disk_full(self.path, e) if e.errno == 28 else e
        self.hash.update(data)
        self.nbytes += len(data)

    def write(self, tensor: torch.Tensor) -> None:
        want = self.planned[self.next]
        got = (TORCH_TO_ST.get(tensor.dtype), tuple(tensor.shape))
        if got != (want.dtype, want.shape):
            raise RuntimeError(f"internal: {want.name} computed as {got}, planned "
                               f"{(want.dtype, want.shape)}")
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        self._put(memoryview(t.view(torch.uint8).numpy()))
        self.next += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                if self.next != len(self.planned):
                    raise RuntimeError(f"internal: {self.path.name} got {self.next} of "
                                       f"{len(self.planned)} tensors")
                try:
                    self.f.flush()
                    os.fsync(self.f.fileno())
                except OSError as e:
                    raise _disk_full(self.path, e) if e.errno == 28 else e
        finally:
            self.f.close()
        if exc_type is not None:
            self.tmp.unlink(missing_ok=True)
            return
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        self.sha256 = self.hash.hexdigest()
