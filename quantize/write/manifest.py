"""`quantize-manifest.json`: what a conversion did, so it can resume and be verified.

    {"status": "in-progress" | "complete",
     "tool_version": "0.1.0",
     "options": {...ConvertOptions...},
     "plan_sha256": "...",                  # shard names and every planned tensor
     "source": {"name": ..., "repo_id": ..., "revision": ..., "index_sha256": ...,
                "files": {name: [bytes, mtime_ns]}},   (no local path: the folder is published)
     "sizes": {"source_bytes", "output_bytes", "output_file_bytes", "shards", "by_role"},
     "tp": 8,                               # convert --tp: the serving TP (not part of the
                                            # output's identity: a resume may change it)
     "calibration": {"tokens_sha256": "...", "device": "cuda" | "cpu",      # not for rtn
                     "compute_dtype": "bfloat16" | "float32"},
     "files": {name: {"bytes": n, "sha256": "..."}}}   # every finished output file

A folder whose manifest is not `complete` is not a finished checkpoint: `verify` and `push`
refuse it. Resuming with other options, a changed source, other calibration tokens (another
--calib file or tokenizer) or another compute device is refused with the difference: the kept
shards would otherwise mix two calibrations.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from quantize import SCHEMA_VERSION, __version__
from quantize.errors import Problem, QuantizeError
from quantize.names import MANIFEST
from quantize.options import recorded_option
from quantize.plan import Plan
from quantize.source.checkpoint import INDEX_NAME, Checkpoint
from quantize.write.shards import sha256_file, write_json_atomic

__all__ = ["CALIB_IDENTITY", "MANIFEST", "Manifest", "finished_manifest", "index_sha256",
           "manifest_status", "output_state", "read_manifest", "source_fingerprint"]


# The keys of "calibration" a resumed run must match (`Calibrator.identity`).
CALIB_IDENTITY = ("tokens_sha256", "device", "compute_dtype", "processes")


def index_sha256(root: Path) -> str | None:
    """The sha256 of a checkpoint folder's weight index (None: an unsharded one)."""
    index = root / INDEX_NAME
    return hashlib.sha256(index.read_bytes()).hexdigest() if index.is_file() else None


def source_fingerprint(ckpt: Checkpoint, base_model: str | None = None) -> dict:
    """The source's identity without a local path (`hub.source_identity`: repo id and commit
    when known, else the folder's name) and what a resume compares: the index's sha256 and
    every file's size and mtime."""
    from quantize.source.hub import source_identity

    root = ckpt.root
    index_sha = index_sha256(root)
    files = {}
    for f in ckpt.files + ["config.json"]:
        st = (root / f).stat()
        files[f] = [st.st_size, st.st_mtime_ns]
    return {**source_identity(root, base_model), "index_sha256": index_sha, "files": files}


def plan_sizes(plan: Plan) -> dict:
    """The plan's size figures for the model card (so the card needs no access to the source)."""
    by_role = sorted(plan.bytes_by("role").items(), key=lambda kv: -kv[1][0])
    return {"source_bytes": plan.source_bytes, "output_bytes": plan.output_bytes,
            "output_file_bytes": plan.output_file_bytes, "shards": len(plan.shards),
            "by_role": [[r, s, o] for r, (s, o) in by_role]}


def source_changes(recorded: dict, ckpt: Checkpoint) -> list[str]:
    """What differs between a recorded source fingerprint and the source as it is now."""
    fp = source_fingerprint(ckpt)
    diffs = []
    if recorded.get("index_sha256") != fp["index_sha256"]:
        diffs.append("source index changed")
    for f, stat in fp["files"].items():
        if recorded.get("files", {}).get(f) != stat:
            diffs.append(f"source file {f} changed (size/mtime)")
    return diffs


def calibration_changes(recorded: dict | None, now: dict | None) -> list[str]:
    """What differs between the recorded calibration and this run's (None: not calibrated)."""
    if now is None:  # rtn now: the method option differs if the earlier run calibrated
        return []
    if not isinstance(recorded, dict):
        return [("calibration: the earlier run recorded none (rtn, or an older version of this "
                 "tool), so nothing says its finished shards used these calibration tokens")]
    diffs = []
    if recorded.get("tokens_sha256") != now["tokens_sha256"]:
        diffs.append("calibration tokens differ (the --calib file, --seed, --num-samples/--seq-len "
                     "or the tokenizer changed)")
    for k, what in (("device", "calibration device"), ("compute_dtype", "calibration compute dtype"),
                    ("processes", "calibration processes (torchrun ranks)")):
        if recorded.get(k) != now.get(k):
            diffs.append(f"{what}: was {recorded.get(k) or 1}, now {now.get(k) or 1}")
    return diffs


def plan_digest(plan: Plan) -> str:
    h = hashlib.sha256()
    for s in plan.shards:
        h.update(s.file.encode())
        for t in s.tensors:
            h.update(f"{t.name}|{t.dtype}|{t.shape}".encode())
    h.update(json.dumps(list(plan.ignore)).encode())
    return h.hexdigest()


def finished_manifest(out_dir: Path, refusing: str = "",
                      fix: str = "finish it with `quantize convert SRC DST --resume`") -> dict:
    """The manifest of a complete conversion in `out_dir`; anything else (no manifest, one
    still in progress) raises "not a finished conversion" + `refusing`, with `fix`."""
    manifest = read_manifest(out_dir) if out_dir.is_dir() else None
    if manifest is None or manifest.get("status") != "complete":
        state = "no manifest" if manifest is None else f"manifest status {manifest.get('status')!r}"
        raise QuantizeError("not a finished conversion" + refusing, [Problem(
            str(out_dir / MANIFEST), None, state, "a complete conversion made by `quantize convert`",
            fix)])
    return manifest


def read_manifest(out_dir: Path) -> dict | None:
    p = out_dir / MANIFEST
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
        why = None if (isinstance(data, dict) and isinstance(data.get("status"), str)
                       and isinstance(data.get("files"), dict)
                       and isinstance(data.get("options"), dict)) else "not this tool's layout"
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        why = str(e)
    if why is not None:
        raise QuantizeError("the output's manifest is unreadable", [Problem(
            str(p), None, why, "the JSON this tool writes",
            "pass --overwrite to start the conversion over (or delete the output folder)")])
    return data


def manifest_status(out_dir: Path) -> str | None:
    """The status of `out_dir`'s manifest (None: no readable manifest)."""
    try:
        m = read_manifest(out_dir) if out_dir.is_dir() else None
    except QuantizeError:
        return None
    return None if m is None else m.get("status")


def output_state(out_dir: Path, before: str | None = "complete") -> str:
    """One sentence on what a failed `convert` left in `out_dir`, for the error message.
    `before`: the manifest's status when the run began (`manifest_status`): a conversion this
    run completed before failing is not called an earlier one."""
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return f"nothing was written to {out_dir}"
    try:
        m = read_manifest(out_dir)
    except QuantizeError:
        m = None
    if m is None:
        return f"{out_dir} was left as it was"
    if m.get("status") == "complete" and before == "complete":
        return f"{out_dir} still holds the earlier, complete conversion"
    if m.get("status") == "complete":
        return (f"{out_dir} holds this run's complete conversion ({MANIFEST}), but a step after "
                "it failed: fix the cause and rerun the same command (finished shards are kept)")
    return (f"{out_dir} holds an unfinished conversion ({MANIFEST} says in-progress; verify and "
            "push refuse it): rerun the same command to resume, or add --overwrite if the "
            "source or the options changed")


class Manifest:
    """The in-progress manifest of one conversion; every update is an atomic rewrite."""

    def __init__(self, out_dir: Path, data: dict):
        self.path = out_dir / MANIFEST
        self.data = data

    @classmethod
    def start(cls, out_dir: Path, ckpt: Checkpoint, plan: Plan, extra: dict | None = None,
              base_model: str | None = None) -> Manifest:
        data = {
            "schema_version": SCHEMA_VERSION,
            "status": "in-progress",
            "tool_version": __version__,
            "options": plan.options.to_json(),
            "plan_sha256": plan_digest(plan),
            "source": source_fingerprint(ckpt, base_model),
            "sizes": plan_sizes(plan),
            "files": {},
            **(extra or {}),
        }
        m = cls(out_dir, data)
        m.save()
        return m

    @classmethod
    def resume(cls, out_dir: Path, ckpt: Checkpoint, plan: Plan, previous: dict,
               calibration: dict | None = None) -> Manifest:
        """Continue `previous` if it was made by the same options from the same source, and
        (calibrated methods) from the same calibration tokens on the same kind of device."""
        diffs = []
        opts, before = plan.options.to_json(), previous.get("options", {})
        for k in [*opts, *(k for k in before if k not in opts)]:  # (one left out reads as its value)
            old, v = recorded_option(before, k), recorded_option(opts, k)
            if old != v:
                diffs.append(f"option {k}: was {old!r}, now {v!r}")
        if previous.get("tool_version") != __version__:  # same layout, maybe other arithmetic
            diffs.append(f"tool version: was {previous.get('tool_version')!r}, now {__version__!r}")
        diffs += source_changes(previous.get("source", {}), ckpt)
        diffs += calibration_changes(previous.get("calibration"), calibration)
        if not diffs and previous.get("plan_sha256") != plan_digest(plan):
            diffs.append("the planned output differs (tool version or layout changed)")
        if diffs:
            raise QuantizeError("cannot resume: this output was made differently", [Problem(
                str(out_dir / MANIFEST), None, d, "the same options, source and calibration",
                "rerun with the original options, calibration data and --device, or pass "
                "--overwrite to start over") for d in diffs])
        m = cls(out_dir, previous)
        m.data["status"] = "in-progress"
        m.save()
        return m

    def identity(self) -> dict:
        """What a resume must match (`resume` checks it): options, plan, tool version, source
        (its index and files; the path may move), calibration tokens and device."""
        d = self.data
        calib = d.get("calibration")
        return {"options": d["options"], "plan_sha256": d["plan_sha256"],
                "tool_version": d["tool_version"],
                "source": {k: d["source"].get(k) for k in ("index_sha256", "files")},
                "calibration": None if calib is None else {k: calib.get(k) for k in CALIB_IDENTITY}}

    def done(self, name: str) -> dict | None:
        return self.data["files"].get(name)

    def holds(self, name: str) -> bool:
        """Whether `name` is recorded as finished and its bytes on disk still match the record
        (a resumed run re-hashes what it keeps: a shard changed since is rewritten)."""
        rec = self.done(name)
        p = self.path.parent / name
        return (rec is not None and p.is_file() and p.stat().st_size == rec["bytes"]
                and sha256_file(p) == rec["sha256"])

    def record(self, name: str, nbytes: int, sha256: str) -> None:
        self.data["files"][name] = {"bytes": nbytes, "sha256": sha256}
        self.save()

    def finish(self, ckpt: Checkpoint, **extra) -> None:
        """Mark the conversion complete, unless the source changed while it ran (a download
        still finishing, a copy over it): then nothing vouches that the shards agree."""
        diffs = source_changes(self.data["source"], ckpt)
        if diffs:
            raise QuantizeError("the source changed during the conversion", [Problem(
                ckpt.name, None, d, "the source left alone while converting",
                "let the download or copy finish, then rerun with --overwrite") for d in diffs])
        self.data.update(extra)
        self.data["status"] = "complete"
        self.save()

    def save(self) -> None:
        write_json_atomic(self.path, self.data)
