"""Layer-boundary checkpoints of the calibration, so that a resumed run continues from them.

After layer L's pass 2 everything the calibration carries forward fits in one folder: the
hidden states (layer L+1's inputs), the DSA top-k indices passed between layers, the report
entries and the AWQ scales so far. They live in the output folder but are no part of the
finished checkpoint (never in the manifest, so `verify` and `push` never see them):

    DST/calibration/state/layer-<L>/        the state after layer L: a resume starts at L+1
        hidden-000000.safetensors ...       chunk i: "hidden" (b, S, H) in the compute dtype
                                            (bf16 on CUDA, float32 on the CPU), "topk" if any
        awq-scales.safetensors              AWQ scales so far (AWQ methods)
        state.json                          fingerprint, layer, report entries, every file's
                                            bytes and sha256 (a truncated or altered file is
                                            found and the checkpoint ignored)

The calibrator saves the state after layer L only where a resume can start at L+1 (some
shard's first layer is L+1; with GLM-5.2's ~5 GB shards, about one layer each, nearly every
layer), and after its last layer. A checkpoint is written as `layer-<L>.partial/`, each file
fsynced, then renamed into place; a `.partial` folder left by a crash is deleted on the next
start. Size: the hidden states, so
GLM-5.2 at the defaults is 128 x 2048 tokens x 6144 x 2 bytes (bf16) = 3.2 GB per checkpoint,
a few seconds of writing against ~1 minute per layer. The last one (after the final layer, MTP
included) holds no hidden states: nothing is left to run, only the report and scales to write.

`prune(L)` deletes every checkpoint older than the newest one at or before layer L: the
caller passes the last layer a resume can still start after (the first layer of the first
shard the manifest has not recorded, minus one), so a deleted checkpoint can never be needed.
With one shard per layer or two (GLM-5.2 at 5 GB shards) that keeps at most two or three.
The fingerprint (options, source, tool and library versions, device type, calibration tokens)
must match exactly; a checkpoint of another run is ignored, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load, save

from quantize.shards import PARTIAL, fsync_dir, sha256_file, stall_point, write_failed

__all__ = ["CALIB_STATE", "Saved", "StateDir"]

CALIB_STATE = "calibration/state"
_NAME = re.compile(r"layer-(\d+)")
_META = "state.json"
_SCALES = "awq-scales.safetensors"


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
        t = load((self.path / _chunk_name(i)).read_bytes())
        return t["hidden"], t.get("topk")


def _chunk_name(i: int) -> str:
    return f"hidden-{i:06d}.safetensors"


def _write_bytes(path: Path, data: bytes) -> dict:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


class StateDir:
    """The checkpoints of one conversion's calibration: `DST/calibration/state`."""

    def __init__(self, root: Path, fingerprint: str) -> None:
        self.root, self.fingerprint = root, fingerprint
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
        """Write the state after `layer` atomically. `chunks`: (hidden, topk) pairs, iterated
        once (one chunk in memory at a time)."""
        final, tmp = self.path(layer), self.path(layer).with_name(f"layer-{layer}{PARTIAL}")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            files = {}
            for i, (h, topk) in enumerate(chunks):
                t = {"hidden": h.detach().cpu().contiguous()}
                if topk is not None:
                    t["topk"] = topk.detach().cpu().contiguous()
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
        have = self.layers()
        keep = max((c for c in have if c <= layer), default=None)
        for c in have:
            if keep is not None and c < keep:
                shutil.rmtree(self.path(c))

    def remove(self) -> None:
        """Delete every checkpoint (the conversion is complete)."""
        if self.root.is_dir():
            shutil.rmtree(self.root)
        if self.root.parent.is_dir() and not any(self.root.parent.iterdir()):
            self.root.parent.rmdir()  # `calibration/` held only the state (no AWQ scales)
