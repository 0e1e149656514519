"""Layer-boundary checkpoints of the calibration, so that a resumed run continues from them.

After layer L's pass 2 everything the calibration carries forward fits in one folder: the
hidden states (layer L+1's inputs), the DSA top-k indices passed between layers, the report
entries and the AWQ scales so far. They live in the output folder but are no part of the
finished checkpoint (never in the manifest, so `verify` and `push` never see them):

    DST/calibration/state/layer-<L>/        the state after layer L: a resume starts at L+1
        hidden-000000.safetensors ...       chunk i: "hidden" (b, S, H) in the compute dtype
                                            (bf16 on CUDA, float32 on the CPU), "topk" if any
                                            (a broadcast view, the every-key top-k, as the
                                            one row it repeats and "topk@shape")
        awq-scales.safetensors              AWQ scales so far (AWQ methods)
        state.json                          fingerprint, layer, report entries, every file's
                                            bytes and sha256 (a truncated or altered file is
                                            found and the checkpoint ignored)

The calibrator saves the state after layer L only where a resume can start at L+1 (some
shard's first layer is L+1; with GLM-5.2's ~5 GB shards, about one layer each, nearly every
layer), at most once every `interval` seconds (`--checkpoint-interval`, default 300), and
always after its last layer. A checkpoint is written as `layer-<L>.partial/`, each file
fsynced, then renamed into place; a `.partial` folder left by a crash is deleted on the next
start. Size: the hidden states, so GLM-5.2 at 128 x 2048 tokens is 128 x 2048 x 6144 x 2 bytes
(bf16) = 3.2 GB per checkpoint, 12.9 GB at 512 x 2048. The last one (after the final layer,
MTP included) holds no hidden states: nothing is left to run, only the report and scales.

`Checkpointer` takes the writing off the calibration's critical path: the hidden states are
copied to host memory on a copy thread (through pinned chunks and their own CUDA stream, so the
next layer's kernels keep running), then serialized, hashed, fsynced and renamed on the same
thread. At most one checkpoint is in flight; while one is still being written, a layer that
could be checkpointed is skipped (with `interval` 0, the test setting, it waits instead). The
calibration calls `wait_copied()` before it replaces the hidden states on the device, so at
most one extra copy of them is ever held there, briefly. A run that dies before a checkpoint
is renamed into place resumes from the previous one: the same bytes, some layers run again.

`prune(L)` deletes every checkpoint older than the newest one at or before layer L: the
caller passes the last layer a resume can still start after (the first layer of the first
shard the manifest has not recorded, minus one), so a deleted checkpoint can never be needed.
With one shard per layer or two (GLM-5.2 at 5 GB shards) that keeps at most two or three
(disk.MAX_CHECKPOINTS: the newest one a resume may need, a newer finished one, and one being
written). Where the disk has room for fewer (disk.check_disk), `Checkpointer(at_once=...)`
skips a save while two are still needed, or, with room for one, lets each replace the last
once the writer is past its layer.
The fingerprint (options, source, tool and library versions, device type, calibration tokens)
must match exactly; a checkpoint of another run is ignored, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load, save

from quantize.disk import MAX_CHECKPOINTS, checkpoint_bytes
from quantize.names import CALIB_STATE, PARTIAL
from quantize.write.shards import fsync_dir, sha256_file, stall_point, write_failed

__all__ = ["CALIB_STATE", "Checkpointer", "Saved", "StateDir", "checkpoint_bytes", "moved", "stored"]


_NAME = re.compile(r"layer-(\d+)")
_META = "state.json"
_SCALES = "awq-scales.safetensors"
_SHAPE = "@shape"  # beside a tensor saved from a broadcast view: the shape it expands to


@dataclass
class Saved:
    """One checkpoint as read back (its files already checked against state.json)."""

    path: Path
    layer: int  # the state after this layer
    entries: list[dict]  # the report's per-layer entries so far
    mtp_skip: dict[int, str]  # MTP layers rounded to nearest, and why
    awq_scales: dict[str, torch.Tensor]
    chunks: int  # hidden-state chunks (0: the last checkpoint, nothing left to run)

    def chunk(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Chunk i's hidden states (b, S, H) and top-k indices, on the host."""
        t = self.parts(i)
        return t["hidden"], t.get("topk")

    def parts(self, i: int) -> dict[str, torch.Tensor]:
        """Chunk i's file: "hidden", and where saved "topk", --gptaq's "fp" and "fp_topk" (a
        tensor saved from a broadcast view comes back as that view of its one stored copy)."""
        t = load((self.path / _chunk_name(i)).read_bytes())
        for k in [k for k in t if k.endswith(_SHAPE)]:
            shape = t.pop(k).tolist()
            t[k[:-len(_SHAPE)]] = t[k[:-len(_SHAPE)]].expand(shape)
        return t


def stored(t: torch.Tensor) -> torch.Tensor:
    """The values a broadcast view repeats: `t` with each dimension of stride 0 (and size > 1)
    cut to size 1, so that `stored(t).expand(t.shape)` is `t`; `t` itself when it repeats
    nothing. (The every-key DSA top-k, (b, S, S) of one row: GLM-5.2 at 512 x 2048, 4.3 GB
    as a whole tensor, 4 KB stored.)"""
    cut = tuple(slice(0, 1) if st == 0 and n > 1 else slice(None)
                for st, n in zip(t.stride(), t.shape))
    return t[cut] if any(c.stop == 1 for c in cut) else t


def moved(t: torch.Tensor, to) -> torch.Tensor:
    """`t` on `to` (a device, or the host through `staging.to_host`), a broadcast view as a
    view of its stored values moved (`stored`), not a whole copy."""
    from quantize.source.staging import to_host

    s = stored(t)
    s = to_host(s) if to == "host" else s.to(to)
    return s if s.shape == t.shape else s.expand(t.shape)


def _chunk_name(i: int) -> str:
    return f"hidden-{i:06d}.safetensors"


def _write_bytes(path: Path, data: bytes) -> dict:
    from quantize.write.shards import open_fresh

    with open_fresh(path) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


class StateDir:
    """The checkpoints of one conversion's calibration: `DST/calibration/state`."""

    def __init__(self, root: Path, fingerprint: str) -> None:
        self.root, self.fingerprint = root, fingerprint
        self._lock = threading.Lock()  # prune runs on the writer's and the saver's threads
        if root.is_dir():
            for p in root.glob(f"*{PARTIAL}"):  # a crash mid-write (the folder lock says so)
                shutil.rmtree(p)

    def path(self, layer: int) -> Path:
        return self.root / f"layer-{layer}"

    def layers(self) -> list[int]:
        """The layers with a checkpoint, ascending."""
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir()
                      if (m := _NAME.fullmatch(p.name)) and p.is_dir())

    def save(self, layer: int, chunks, entries: list[dict], mtp_skip: dict[int, str],
             awq_scales: dict[str, torch.Tensor]) -> None:
        """Write the state after `layer` atomically. `chunks`: (hidden, topk) pairs, or with
        --gptaq (hidden, topk, fp, fp_topk), iterated once (one chunk in memory at a time)."""
        final, tmp = self.path(layer), self.path(layer).with_name(f"layer-{layer}{PARTIAL}")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            files = {}
            for i, parts in enumerate(chunks):
                t = {}
                for k, v in zip(("hidden", "topk", "fp", "fp_topk"), parts):
                    if v is None:
                        continue
                    one = stored(v)
                    t[k] = one.detach().cpu().contiguous()
                    if one.shape != v.shape:  # a broadcast view: its one copy and its shape
                        t[k + _SHAPE] = torch.tensor(v.shape, dtype=torch.int64)
                files[_chunk_name(i)] = _write_bytes(tmp / _chunk_name(i), save(t))
            if awq_scales:
                files[_SCALES] = _write_bytes(tmp / _SCALES, save(awq_scales))
            meta = {"fingerprint": self.fingerprint, "layer": layer, "chunks": sum(
                    n.startswith("hidden-") for n in files), "files": files, "entries": entries,
                    "mtp_skip": {str(k): v for k, v in mtp_skip.items()}}
            _write_bytes(tmp / _META, (json.dumps(meta, indent=1) + "\n").encode())
            fsync_dir(tmp)
            stall_point("state")  # test hook (shards.py): written, not yet renamed into place
            if final.exists():  # an older run's checkpoint of the same layer (not used)
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.root)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise write_failed(final, e) from None

    def problem(self, layer: int) -> str | None:
        """Why the checkpoint after `layer` cannot be used (None: it can)."""
        d = self.path(layer)
        try:
            meta = json.loads((d / _META).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            return f"{_META} unreadable ({type(e).__name__})"
        if not isinstance(meta, dict) or meta.get("layer") != layer or \
                not isinstance(meta.get("files"), dict):
            return f"{_META} is not this tool's layout"
        if meta.get("fingerprint") != self.fingerprint:
            return "written by a run with other options, source, versions or device"
        for name, rec in meta["files"].items():
            p = d / name
            if not p.is_file() or p.stat().st_size != rec["bytes"]:
                return f"{name} has {p.stat().st_size if p.is_file() else 'no'} bytes, " \
                       f"{_META} says {rec['bytes']}"
            if sha256_file(p) != rec["sha256"]:
                return f"{name}: sha256 differs from {_META}"
        return None

    def read(self, layer: int) -> Saved:
        """The checkpoint after `layer`; call `problem(layer)` first."""
        d = self.path(layer)
        meta = json.loads((d / _META).read_text())
        scales = load((d / _SCALES).read_bytes()) if _SCALES in meta["files"] else {}
        return Saved(d, layer, meta["entries"], {int(k): v for k, v in meta["mtp_skip"].items()},
                     scales, meta["chunks"])

    def prune(self, layer: int) -> None:
        """Delete every checkpoint older than the newest one at or before `layer`."""
        with self._lock:
            have = self.layers()
            keep = max((c for c in have if c <= layer), default=None)
            for c in have:
                if keep is not None and c < keep:
                    shutil.rmtree(self.path(c))

    def drop_all(self) -> None:
        """Delete every checkpoint (room for the next where the disk holds only one)."""
        with self._lock:
            for c in self.layers():
                shutil.rmtree(self.path(c))

    def remove(self, siblings: bool = False) -> None:
        """Delete every checkpoint (the conversion is complete); `siblings`: the folder above
        too, with the other ranks' (torchrun: `.../state/rank-R-of-W/`)."""
        root = self.root.parent if siblings else self.root
        if root.is_dir():
            shutil.rmtree(root)
        if root.parent.is_dir() and not any(root.parent.iterdir()):
            root.parent.rmdir()  # `calibration/` held only the state


class Checkpointer:
    """Saves checkpoints into a `StateDir` on a background thread (module docstring).

        saver = Checkpointer(state, interval=300, keep_after=lambda: last_layer_a_resume_needs)
        if saver.due():
            saver.save(L, hidden_chunks, topks, entries, mtp_skip, awq_scales)
        ...
        saver.wait_copied()   # before the hidden states on the device are replaced
        saver.wait()          # before the state folder is removed; raises a failed save's error
    """

    def __init__(self, state: StateDir, interval: float, keep_after: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic, at_once: int = MAX_CHECKPOINTS) -> None:
        """`at_once`: the checkpoints the disk has room for (disk.check_disk). Below
        MAX_CHECKPOINTS a save is skipped while that many are still needed; with room for one
        (one process only), each save waits on its thread, its copy in host memory, until the
        writer is past its layer, then replaces the last."""
        self.state, self.interval, self.keep_after, self.clock = state, interval, keep_after, clock
        self.at_once = at_once
        self._last = clock()  # the first checkpoint comes `interval` seconds into the run
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._abandon = threading.Event()  # the run stops: a save waiting for room gives up
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def due(self) -> bool:
        """Whether a layer that can be checkpointed now should be: `interval` seconds have
        passed since the last one began and none is still being written (interval 0: always)."""
        if not self._room():
            return False
        if self.interval <= 0:
            return True
        return not self.busy and self.clock() - self._last >= self.interval

    def _room(self) -> bool:
        """Whether the disk has room for one more checkpoint beside those a resume still needs
        (the newest at or before `keep_after()` and any after it); with room for one at all,
        always (it replaces the last)."""
        if self.at_once >= MAX_CHECKPOINTS or self.at_once <= 1:
            return True
        have = self.state.layers()
        keep = max((c for c in have if c <= self.keep_after()), default=None)
        return sum(keep is None or c >= keep for c in have) < self.at_once

    def save(self, layer: int, chunks: list[torch.Tensor], topk: list[torch.Tensor | None],
             entries: list[dict], mtp_skip: dict[int, str], awq_scales: dict[str, torch.Tensor],
             background: bool = True, fp: list[torch.Tensor] | None = None,
             fp_topk: list[torch.Tensor | None] | None = None) -> None:
        """Checkpoint the state after `layer`. `chunks` / `topk`: the hidden states and DSA
        top-k per chunk, on the device or the host, never modified in place afterwards (the
        caller replaces them); `fp` / `fp_topk` the unrounded model's (--gptaq) alike; the
        other arguments are copied here. `background=False` writes before returning (hidden
        states spilled to files that the next layer overwrites)."""
        self.wait()
        self._last = self.clock()
        args = (layer, list(chunks), list(topk), json.loads(json.dumps(entries)), dict(mtp_skip),
                dict(awq_scales), None if fp is None else list(fp),
                None if fp_topk is None else list(fp_topk))
        if not background:
            self._write(*args, wait_for_writer=False)
            return
        self._copied.clear()
        self._thread = threading.Thread(target=self._run, args=args, name="quantize-checkpoint",
                                        daemon=True)
        self._thread.start()

    def abandon(self) -> None:
        """The run stops: a save still waiting for the writer (room for one) is dropped."""
        self._abandon.set()

    def wait_copied(self) -> None:
        """Until the checkpoint in flight holds its own host copy of the hidden states."""
        self._copied.wait()

    def wait(self) -> None:
        """Until no checkpoint is in flight; re-raises the error of one that failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def _run(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the calibration's thread by wait()
            self._error = e
        finally:
            self._copied.set()

    def _write(self, layer: int, chunks: list[torch.Tensor], topk: list[torch.Tensor | None],
               entries: list[dict], mtp_skip: dict[int, str], awq_scales: dict[str, torch.Tensor],
               fp: list[torch.Tensor] | None = None, fp_topk: list[torch.Tensor | None] | None = None,
               wait_for_writer: bool = True) -> None:
        """`wait_for_writer`: on the checkpoint's own thread (room for one: it may wait for the
        writer there); False on the layer thread, which the writer waits for."""
        host = [moved(h, "host") for h in chunks]  # (b, S, H) each, through pinned chunks
        top = [None if k is None else moved(k, "host") for k in topk]
        host_fp = [None] * len(host) if fp is None else [moved(h, "host") for h in fp]
        top_fp = [None] * len(host) if fp_topk is None else \
            [None if k is None else moved(k, "host") for k in fp_topk]
        del chunks, topk, fp, fp_topk  # the device copies may go now
        self._copied.set()
        self.state.prune(self.keep_after())  # room first: an older checkpoint no resume needs
        if self.at_once == 1 and host:  # room for one: it replaces the last once a resume
            # would start from it (the writer is past its layer), not before (a crash in
            # between would find none usable); a crash while it is written restarts at layer 0.
            # (The last checkpoint holds no hidden states: a few KB beside the one kept.)
            while wait_for_writer and self.keep_after() < layer:
                if self._abandon.wait(0.05):
                    return
            self.state.drop_all()
        self.state.save(layer, zip(host, top, host_fp, top_fp), entries, mtp_skip, awq_scales)
        del host, host_fp
        self.state.prune(self.keep_after())
