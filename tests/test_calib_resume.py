"""Calibrated runs resume from layer-boundary checkpoints (quantize/calib/state.py), byte for byte.

Tiny glm_moe_dsa (3 decoder layers + MTP; layer 2 shares layer 1's DSA top-k, so a resume at
layer 2 needs the top-k from the checkpoint), awq+gptq, 200 KB shards: ~20 shards, a new layer
starting in several of them, so checkpoints after layers 0, 1, 2 and the last one (MTP) are
written. The per-layer wall-clock times in calibration-report.json are the only bytes that
differ between two runs, so every run here reads a clock that stands still
(`quantize.calib.layer.time`), in process and in the CLI subprocesses alike: then the whole
folder, report and manifest included, must be identical.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantize.calib.data import checkpoint_calibration
from quantize.calib.state import CALIB_STATE, StateDir
from quantize.errors import QuantizeError
from quantize.options import ConvertOptions
from quantize.pipeline import convert as _convert
from quantize.plan import make_plan
from quantize.source.checkpoint import open_checkpoint
from quantize.source.layout import layer_of
from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer
from quantize.write.manifest import MANIFEST
from quantize.write.shards import STALL_ENV

ROOT = Path(__file__).resolve().parents[1]
CALIB = {"num_samples": 8, "seq_len": 64}
OPTS = ConvertOptions(method="awq+gptq", max_shard_size=200_000, **CALIB)
STILL_CLOCK = types.SimpleNamespace(perf_counter=lambda: 0.0)
LAYER0 = r"^\d\d:\d\d:\d\d\.\d{3} layer 0:"  # the CLI's log lines carry a time stamp


def convert(*args, **kw):
    """`pipeline.convert` checkpointing after every layer a resume can start after (the
    default interval of minutes would give a tiny run none but the last)."""
    return _convert(*args, checkpoint_interval=0, **kw)


class Stop(Exception):
    """Raised from `on_unit`: the run dies in the middle of a shard."""


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    cfg = tiny_config("glm_moe_dsa")
    cfg["index_topk_freq"] = 2  # indexer types full, full, shared
    d = write_checkpoint(tmp_path_factory.mktemp("src"), cfg, "fp8-block", seed=1)
    write_tokenizer(d, cfg["vocab_size"])
    return d


@pytest.fixture(autouse=True)
def still_clock(monkeypatch):
    monkeypatch.setattr("quantize.calib.layer.time", STILL_CLOCK)


@pytest.fixture(scope="module")
def reference(src, tmp_path_factory) -> Path:
    """An uninterrupted run (in process), with the clock standing still."""
    out = tmp_path_factory.mktemp("ref") / "out"
    mp = pytest.MonkeyPatch()
    mp.setattr("quantize.calib.layer.time", STILL_CLOCK)
    try:
        convert(src, out, OPTS, device="cpu")
    finally:
        mp.undo()
    assert not (out / CALIB_STATE).exists()
    return out


def folder_bytes(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def assert_same_files(out: Path, reference: Path) -> dict[str, bytes]:
    """Every file of `reference` in `out` with the same bytes, and no other; the files."""
    got, want = folder_bytes(out), folder_bytes(reference)
    assert sorted(got) == sorted(want)
    for name in want:  # every file, the report and the manifest included
        assert got[name] == want[name], f"{name} differs from the uninterrupted run"
    return want


def assert_identical(out: Path, reference: Path) -> None:
    want = assert_same_files(out, reference)
    assert "calibration-report.json" in want and "calibration/awq-scales.safetensors" in want
    assert not (out / CALIB_STATE).exists() and not list(out.rglob("*.partial"))


def die_in_layer(src: Path, out: Path, opts: ConvertOptions, layer: int, **kw) -> None:
    """A run that dies at the second shard starting inside `layer` (the first one recorded)."""
    plan = make_plan(open_checkpoint(src), opts)
    starts = [s.units[0] for s in plan.shards if layer_of(s.units[0].source) == layer]
    with pytest.raises(Stop):
        convert(src, out, opts, device="cpu", on_unit=stop_at(lambda u: u == starts[1]), **kw)


def stop_at(pred):
    def on_unit(unit) -> None:
        if pred(unit):
            raise Stop(unit.source)
    return on_unit


def computed_layers(log: list[str]) -> list[int]:
    return [int(m.group(1)) for line in log if (m := re.match(r"layer (\d+)", line))]


def test_interrupted_run_resumes_from_a_checkpoint(src, reference, tmp_path):
    out = tmp_path / "out"
    die_in_layer(src, out, OPTS, 2)  # at the second shard inside layer 2, the first recorded
    # a resume starts at layer 2 (after layer 1); layer 2 is done too (and layer 3 may be:
    # the layer thread runs one layer ahead of the writer); 0 can go
    layers = StateDir(out / CALIB_STATE, "").layers()
    assert layers in ([1, 2], [1, 2, 3]), layers
    log: list[str] = []
    res = convert(src, out, OPTS, device="cpu", resume=True, log=log.append)
    assert f"resuming calibration at layer 2 from {out / CALIB_STATE}/layer-1" in log, log
    assert computed_layers(log) == [2, 3], log  # layers 0 and 1 were not run again
    assert res.skipped and res.written
    assert_identical(out, reference)
    assert res.calibration == json.loads((reference / "calibration-report.json").read_text())

    # the finished folder run again: every file kept, no layer run, the report unchanged
    log.clear()
    res = convert(src, out, OPTS, device="cpu", log=log.append)
    assert res.written == [] and computed_layers(log) == [], log
    assert_identical(out, reference)


def test_a_damaged_checkpoint_is_ignored_and_the_layers_recomputed(src, reference, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(Stop):
        convert(src, out, OPTS, device="cpu", on_unit=stop_at(lambda u: layer_of(u.source) == 3))
    state = StateDir(out / CALIB_STATE, "")
    assert state.layers() == [2, 3]  # older ones deleted: every shard up to layer 3 recorded
    victim = out / CALIB_STATE / "layer-2" / "hidden-000000.safetensors"
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size // 2)  # a torn write
    log: list[str] = []
    convert(src, out, OPTS, device="cpu", resume=True, log=log.append)
    assert (f"ignoring calibration checkpoint {out / CALIB_STATE}/layer-2: hidden-000000.safetensors "
            f"has {size // 2} bytes, state.json says {size}") in log, log
    assert "no usable calibration checkpoint before layer 3: computing from layer 0" in log, log
    assert computed_layers(log) == [0, 1, 2, 3], log
    assert_identical(out, reference)


def test_a_checkpoint_of_another_run_is_not_used(tmp_path):
    h = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    k = torch.randint(0, 4, (2, 4, 3), dtype=torch.int32)
    StateDir(tmp_path, "run-a").save(5, [(h, k), (h, None)], [{"layer": 5}], {1: "why"},
                                     {"s": torch.ones(3)})
    assert StateDir(tmp_path, "run-a").problem(5) is None
    saved = StateDir(tmp_path, "run-a").read(5)
    assert (saved.chunks, saved.entries, saved.mtp_skip) == (2, [{"layer": 5}], {1: "why"})
    assert torch.equal(saved.awq_scales["s"], torch.ones(3))
    (h0, k0), (_, k1) = saved.chunk(0), saved.chunk(1)
    assert torch.equal(h0, h) and h0.dtype == torch.bfloat16 and torch.equal(k0, k) and k1 is None
    assert "other options" in StateDir(tmp_path, "run-b").problem(5)
    for L in (7, 9):
        StateDir(tmp_path, "run-a").save(L, [(h, None)], [], {}, {})
    s = StateDir(tmp_path, "run-a")
    s.prune(8)  # a resume may still start after layer 7 (or later): 5 can go
    assert s.layers() == [7, 9]
    s.prune(6)  # nothing at or before 6 is older than the newest at or before 6: keep all
    assert s.layers() == [7, 9]


def write_docs(path: Path, seed: int) -> None:
    """40 JSONL documents of 40 random words: calibration text that differs with the seed."""
    rng = random.Random(seed)
    words = [f"{a}{b}" for a in "bcdfghklmnprstvz" for b in ("ao", "ei", "ou", "ia", "ue")]
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(40))})
                            + "\n" for _ in range(40)))


def test_other_calibration_tokens_or_device_are_not_resumed(src, tmp_path):
    """Killed after some shards, then the same command with the --calib file edited: refused,
    naming the difference (the kept shards would mix two calibrations); so is a manifest that
    says the earlier run calibrated on a GPU. The original file resumes."""
    calib, out = tmp_path / "calib.jsonl", tmp_path / "out"
    write_docs(calib, seed=0)
    opts = ConvertOptions(method="gptq", calib=str(calib), max_shard_size=200_000, **CALIB)
    with pytest.raises(Stop):
        convert(src, out, opts, device="cpu", on_unit=stop_at(lambda u: layer_of(u.source) == 2))
    text = (out / MANIFEST).read_text()
    recorded = json.loads(text)
    assert recorded["files"] and recorded["status"] == "in-progress"

    original = calib.read_bytes()
    write_docs(calib, seed=1)  # same path, same options, other text
    with pytest.raises(QuantizeError, match="cannot resume") as e:
        convert(src, out, opts, device="cpu", resume=True)
    assert "calibration tokens differ (the --calib file, --seed, --num-samples/--seq-len or the " \
           "tokenizer changed)" in str(e.value)
    assert (out / MANIFEST).read_text() == text  # refused before anything was written
    assert recorded["calibration"]["device"] == "cpu"
    assert recorded["calibration"]["compute_dtype"] == "float32"

    calib.write_bytes(original)
    on_gpu = {**recorded, "calibration": {**recorded["calibration"], "device": "cuda",
                                          "compute_dtype": "bfloat16"}}
    (out / MANIFEST).write_text(json.dumps(on_gpu))
    with pytest.raises(QuantizeError, match="cannot resume") as e:
        convert(src, out, opts, device="cpu", resume=True)
    assert "calibration device: was cuda, now cpu" in str(e.value)
    assert "calibration compute dtype: was bfloat16, now float32" in str(e.value)

    (out / MANIFEST).write_text(text)
    res = convert(src, out, opts, device="cpu", resume=True)
    assert res.skipped and res.written
    assert json.loads((out / MANIFEST).read_text())["calibration"] == recorded["calibration"]


def test_a_run_under_the_previous_group_32_defaults_resumes_with_their_flags(tmp_path):
    """Group 32's GPTQ defaults changed (options.SMALL_GROUP_DEFAULTS). A run begun under the
    previous ones (clip weighted, error power 3, GPTAQ 0.375; its manifest without
    mse_weight_power, as those versions wrote it) is refused under today's defaults, naming
    all three, before anything is written; with those three values given it resumes, and the
    folder is the one an uninterrupted run with them writes."""
    cfg = tiny_config("glm_moe_dsa")
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-block", seed=5)
    write_tokenizer(src, cfg["vocab_size"])
    previous = dict(method="gptq", max_shard_size=200_000, targets=frozenset({"routed", "shared"}),
                    mse_norm=3, mse_weight_power=1.0, gptaq=0.375, **CALIB)
    out, whole = tmp_path / "out", tmp_path / "whole"
    convert(src, whole, ConvertOptions(**previous), device="cpu")
    with pytest.raises(Stop):
        convert(src, out, ConvertOptions(**previous), device="cpu",
                on_unit=stop_at(lambda u: layer_of(u.source) == 2))
    text = (out / MANIFEST).read_text()
    assert "mse_weight_power" not in json.loads(text)["options"]  # (as the previous versions)
    today = ConvertOptions(**{**previous, "mse_norm": None, "mse_weight_power": None, "gptaq": None})
    with pytest.raises(QuantizeError, match="cannot resume") as e:
        convert(src, out, today, device="cpu", resume=True)
    for why in ("option mse_norm: was 3, now 2", "option mse_weight_power: was 1.0, now 0.0",
                "option gptaq: was 0.375, now 0.5"):
        assert why in str(e.value), str(e.value)
    assert (out / MANIFEST).read_text() == text
    res = convert(src, out, ConvertOptions(**previous), device="cpu", resume=True)
    assert res.skipped and res.written
    shards = sorted(p.name for p in whole.glob("*.safetensors"))
    assert shards == sorted(p.name for p in out.glob("*.safetensors"))
    assert all((whole / n).read_bytes() == (out / n).read_bytes() for n in shards)


def test_a_run_whose_routed_experts_had_group_32s_unweighted_clip_resumes_with_their_flags(tmp_path):
    """Routed experts got their own clip settings (3, weighted, at every group size). A group-32
    run begun when group 32's unweighted clip of power 2 applied to them too (its manifest with
    mse_norm 2 and mse_weight_power 0 and no routed keys, as those versions wrote it) is refused
    under today's defaults, naming both routed options, before anything is written; with
    --mse-norm-routed 2 --mse-weight-power-routed 0 it resumes into the folder an uninterrupted
    run writes."""
    cfg = tiny_config("glm_moe_dsa")
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-block", seed=6)
    write_tokenizer(src, cfg["vocab_size"])
    base = dict(method="gptq", max_shard_size=200_000, **CALIB)
    previous = ConvertOptions(**base, mse_norm=2, mse_weight_power=0.0)  # (then every target's)
    assert {"mse_norm_routed", "mse_weight_power_routed"}.isdisjoint(previous.to_json())
    out, whole = tmp_path / "out", tmp_path / "whole"
    convert(src, whole, previous, device="cpu")
    with pytest.raises(Stop):
        convert(src, out, previous, device="cpu", on_unit=stop_at(lambda u: layer_of(u.source) == 2))
    text = (out / MANIFEST).read_text()
    with pytest.raises(QuantizeError, match="cannot resume") as e:
        convert(src, out, ConvertOptions(**base), device="cpu", resume=True)
    for why in ("option mse_norm_routed: was 2, now 3", "option mse_weight_power_routed: was 0.0, now 1.0"):
        assert why in str(e.value), str(e.value)
    assert "option mse_norm:" not in str(e.value)  # (dense and shared: the same defaults)
    assert (out / MANIFEST).read_text() == text
    res = convert(src, out, ConvertOptions(**base, mse_norm_routed=2, mse_weight_power_routed=0.0),
                  device="cpu", resume=True)
    assert res.skipped and res.written
    shards = sorted(p.name for p in whole.glob("*.safetensors"))
    assert shards == sorted(p.name for p in out.glob("*.safetensors"))
    assert all((whole / n).read_bytes() == (out / n).read_bytes() for n in shards)


def test_resume_refused_after_the_seed_the_tokenizer_or_config_changed(tmp_path):
    """An interrupted calibrated run, then the same command after one change each: another
    --seed (an option: named), an edited tokenizer (other token ids: the calibration tokens
    differ), a touched config.json (a source file: named). Each is refused before anything is
    written; the unchanged command resumes."""
    import shutil

    cfg = tiny_config("glm_moe_dsa")
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-block", seed=3)
    write_tokenizer(src, cfg["vocab_size"])
    out = tmp_path / "out"
    opts = ConvertOptions(method="gptq", max_shard_size=200_000, **CALIB)
    with pytest.raises(Stop):
        convert(src, out, opts, device="cpu", on_unit=stop_at(lambda u: layer_of(u.source) == 2))
    text = (out / MANIFEST).read_text()

    def refused(o, why):
        with pytest.raises(QuantizeError, match="cannot resume") as e:
            convert(src, out, o, device="cpu", resume=True)
        assert why in str(e.value), str(e.value)
        assert (out / MANIFEST).read_text() == text

    refused(ConvertOptions(method="gptq", max_shard_size=200_000, seed=1, **CALIB),
            "option seed: was 0, now 1")
    # an option the manifest leaves out at a value (options.OMITTED_AT: mse_weight_power 1, the
    # activation-weighted clip) is compared as that value, both ways; group 32's default is 0
    weighted = ConvertOptions(method="gptq", max_shard_size=200_000, mse_weight_power=1.0, **CALIB)
    assert "mse_weight_power" not in weighted.to_json() and opts.to_json()["mse_weight_power"] == 0
    refused(weighted, "option mse_weight_power: was 0.0, now 1.0")
    recorded = json.loads(text)
    older = {k: v for k, v in recorded["options"].items() if k != "mse_weight_power"}
    (out / MANIFEST).write_text(json.dumps({**recorded, "options": older}))  # as at 1, or before it
    text = (out / MANIFEST).read_text()
    refused(opts, "option mse_weight_power: was 1.0, now 0.0")
    (out / MANIFEST).write_text(json.dumps(recorded))
    text = (out / MANIFEST).read_text()
    tok = src / "tokenizer.json"
    original = tok.read_bytes()
    shutil.copy(tok, tmp_path / "tok.bak")
    t = json.loads(original)
    vocab = t["model"]["vocab"]  # swap the ids of two tokens the calibration reads: same size
    used = checkpoint_calibration(src, opts).tokens.flatten().tolist()
    a, b = [tk for tk, i in vocab.items() if i in {max(used), min(u for u in used if u > 4)}]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tok.write_text(json.dumps(t))
    refused(opts, "calibration tokens differ")
    tok.write_bytes(original)
    os.utime(tok, ns=(tok.stat().st_atime_ns, tok.stat().st_mtime_ns))
    cfg_file = src / "config.json"
    st = cfg_file.stat()
    os.utime(cfg_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    refused(opts, "source file config.json changed (size/mtime)")
    os.utime(cfg_file, ns=(st.st_atime_ns, st.st_mtime_ns))
    res = convert(src, out, opts, device="cpu", resume=True)
    assert res.skipped and res.written


# --- killed from outside (see tests/test_resume.py for the stall hook) -----------------------


def run_cli(src: Path, out: Path, stall: str | None = None, sig=signal.SIGKILL) -> tuple[int, str]:
    """`quantize convert` in a subprocess with a clock standing still in quantize.calib.layer;
    with `stall`, sent `sig` (SIGKILL) when it reaches that point. Returns (exit status, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "300"}
    env.pop(STALL_ENV, None)
    code = ("import signal, types, quantize.calib.layer as c; "
            "signal.signal(signal.SIGINT, signal.default_int_handler); "
            "c.time = types.SimpleNamespace(perf_counter=lambda: 0.0); "
            "from quantize.cli import app; app()")
    cmd = [sys.executable, "-c", code, "convert", str(src), str(out), "--max-shard-size", "200KB",
           "--device", "cpu", "--tp", "1", "--method", "awq+gptq", "--num-samples", "8",
           "--seq-len", "64", "--checkpoint-interval", "0"]
    if stall is None:
        r = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=120)
        return r.returncode, r.stderr
    env[STALL_ENV] = stall
    log = out.with_name(out.name + ".stderr")
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=f)
    deadline = time.monotonic() + 120
    try:
        while "QUANTIZE_TEST_STALLED" not in log.read_text():
            assert p.poll() is None, f"exited {p.returncode} before {stall}: {log.read_text()}"
            assert time.monotonic() < deadline, f"never reached {stall}"
            time.sleep(0.05)
    finally:
        os.kill(p.pid, sig)
        rc = p.wait(timeout=30)
    return rc, log.read_text()


@pytest.mark.slow
def test_killed_while_checkpointing_then_resumed_is_byte_identical(src, tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    rc, err = run_cli(src, ref)
    assert rc == 0, err
    assert re.search(LAYER0, err, re.MULTILINE), err  # the per-layer log, as matched below
    assert not (ref / CALIB_STATE).exists()

    # 1. killed while writing its 3rd checkpoint (after layer 2): layer-2.partial on disk,
    # layer-1 kept (what a resume needs; layer-0 may be pruned meanwhile: the writer goes on)
    rc, _ = run_cli(src, out, stall="state:3")
    assert rc == -signal.SIGKILL
    names = sorted(p.name for p in (out / CALIB_STATE).iterdir())
    assert names in (["layer-0", "layer-1", "layer-2.partial"], ["layer-1", "layer-2.partial"]), names
    # 2. the same command again, killed after its 3rd shard is renamed into place
    rc, err = run_cli(src, out, stall="shard:3")
    assert re.search(r"resuming calibration at layer [12] from", err), err
    assert not (out / CALIB_STATE / "layer-2.partial").exists()
    # 3. once more, to the end
    rc, err = run_cli(src, out)
    assert rc == 0, err
    assert re.search(r"resuming calibration at layer [1-9]", err), err
    assert re.search(LAYER0, err, re.MULTILINE) is None, err  # ran only in the first run
    assert_same_files(out, ref)
    assert not (out / CALIB_STATE).exists()


def test_checkpointer_policy_and_background_bytes(tmp_path):
    """`Checkpointer`: due only `interval` seconds after the last save began and never while one
    is still being written; its background save writes the same bytes as `StateDir.save`; a
    failed background save is raised by the next `wait()`."""
    from quantize.calib.state import Checkpointer

    now = [100.0]
    h = [torch.randn(2, 4, 8, dtype=torch.bfloat16) for _ in range(2)]
    k = [torch.randint(0, 4, (2, 4, 3)), None]
    entries, scales = [{"layer": 3, "x": [1, 2]}], {"s": torch.rand(5)}
    saver = Checkpointer(StateDir(tmp_path / "bg", "fp"), 60, lambda: 3, clock=lambda: now[0])
    assert not saver.due()
    now[0] += 59.9
    assert not saver.due()
    now[0] += 0.2
    assert saver.due()
    saver.save(3, h, k, entries, {}, scales)
    entries[0]["x"].append(3)  # the caller's report grows on: the checkpoint keeps its copy
    assert not saver.due()  # the clock restarted at this save
    saver.wait()
    StateDir(tmp_path / "fg", "fp").save(3, zip(h, k), [{"layer": 3, "x": [1, 2]}], {}, scales)
    assert folder_bytes(tmp_path / "bg") == folder_bytes(tmp_path / "fg")
    assert StateDir(tmp_path / "bg", "fp").problem(3) is None

    assert Checkpointer(StateDir(tmp_path / "x", "fp"), 0, lambda: 0).due()  # 0: every time
    (tmp_path / "file").write_text("not a folder")
    bad = Checkpointer(StateDir(tmp_path / "file" / "state", "fp"), 0, lambda: 0)
    bad.save(1, h, k, [], {}, {})
    with pytest.raises(QuantizeError, match="could not write"):
        bad.wait()
    bad.wait()  # raised once


def test_checkpoints_fit_the_disk(src, reference, tmp_path, monkeypatch):
    """`disk_needed` gives a checkpoint's bytes exactly (hidden states + DSA top-k, as written).
    convert refuses to start only when the disk lacks the shards + one checkpoint; with room for
    fewer than 3 it keeps that many at once (room for one: each replaces the last once the writer
    is past its layer), and an interrupted run still resumes from one, byte for byte."""
    import collections

    from safetensors.torch import load_file

    from quantize.disk import disk_needed

    out = tmp_path / "out"
    with pytest.raises(Stop):
        convert(src, out, OPTS, device="cpu", on_unit=stop_at(lambda u: layer_of(u.source) == 3))
    plan = make_plan(open_checkpoint(src), OPTS)
    need = disk_needed(plan, "cpu")
    d = out / CALIB_STATE / "layer-2"
    one = sum(t.nbytes for f in d.glob("hidden-*.safetensors") for t in load_file(f).values())
    shards = sum(s.file_bytes for s in plan.shards)
    assert one == need["checkpoint"] > 0
    assert need["total"] == shards + 3 * one
    assert disk_needed(plan, "cuda")["checkpoint"] < one  # bf16 hidden states

    Usage = collections.namedtuple("Usage", "total used free")

    def disk(free: int) -> None:
        monkeypatch.setattr("quantize.disk.shutil.disk_usage", lambda p: Usage(10**12, 10**12 - free, free))

    disk(shards + one - 1)
    fresh = tmp_path / "fresh"
    with pytest.raises(QuantizeError, match="not enough free disk space") as e:
        convert(src, fresh, OPTS, device="cpu")
    assert "1 calibration checkpoint(s)" in str(e.value) and "--checkpoint-interval inf" in str(e.value)
    assert not list(fresh.iterdir())  # refused before anything was written

    on_disk: list[int] = []  # checkpoints holding hidden states on disk as each save lands
    save = StateDir.save  # (the last one holds none: a few KB, it may sit beside them)

    def counted(self, layer, *a, **kw):
        save(self, layer, *a, **kw)
        on_disk.append(sum(any(self.path(c).glob("hidden-*")) for c in self.layers()))

    monkeypatch.setattr(StateDir, "save", counted)
    for room in (1, 2):
        disk(shards + room * one + one // 2)
        on_disk.clear()
        out, log = tmp_path / f"room-{room}", []
        with pytest.raises(Stop):
            convert(src, out, OPTS, device="cpu", log=log.append,
                    on_unit=stop_at(lambda u: layer_of(u.source) == 3))
        assert any(f"room for {room} calibration checkpoint(s)" in line for line in log), log
        assert on_disk and max(on_disk) <= room, on_disk
        state = StateDir(out / CALIB_STATE, "")
        assert 1 <= sum(any(state.path(c).glob("hidden-*")) for c in state.layers()) <= room
        log.clear()
        convert(src, out, OPTS, device="cpu", log=log.append)
        assert any(line.startswith("resuming calibration at layer") for line in log), log
        assert_identical(out, reference)


@pytest.mark.slow
def test_ctrl_c_during_a_calibrated_run_stops_it_and_the_folder_resumes(src, tmp_path):
    """SIGINT while the writer waits for the layer thread: exit 130 at once (the layer in progress
    is not waited for), a resumable folder, and the resumed run equals an uninterrupted one."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    rc, err = run_cli(src, ref)
    assert rc == 0, err
    rc, err = run_cli(src, out, stall="unit:40", sig=signal.SIGINT)
    assert rc == 130 and "Traceback" not in err, err
    assert "interrupted:" in err and "rerun the same command to resume" in err, err
    rc, err = run_cli(src, out)
    assert rc == 0, err
    assert_same_files(out, ref)


def test_a_gptaq_run_resumes_with_both_streams(src, tmp_path):
    """--gptaq (and --sequential-mlp) with dense and shared-expert targets: each checkpoint holds the unrounded
    model's hidden states and DSA top-k beside the rounded ones ("fp", "fp_topk"), twice the
    bytes the disk check reserves; a run that dies in layer 2 resumes after layer 1 and its
    folder is byte-identical to an uninterrupted run's."""
    from quantize.disk import disk_needed

    opts = ConvertOptions(method="awq+gptq", max_shard_size=200_000,
                          targets=frozenset({"routed", "shared", "dense"}), **CALIB)
    assert opts.gptaq == 0.5 and opts.sequential_mlp  # (group 32's defaults: both resumed alike)
    plan = make_plan(open_checkpoint(src), opts)
    plain = make_plan(open_checkpoint(src), ConvertOptions(**{**opts.__dict__, "gptaq": 0.0}))
    assert plan.gptaq_active and not plain.gptaq_active
    assert disk_needed(plan, "cpu")["checkpoint"] == 2 * disk_needed(plain, "cpu")["checkpoint"]
    ref = tmp_path / "ref"
    convert(src, ref, opts, device="cpu")
    out = tmp_path / "out"
    die_in_layer(src, out, opts, 2)
    state = StateDir(out / CALIB_STATE, "")
    assert 1 in state.layers()
    saved = state.read(1)
    parts = saved.parts(0)
    assert {"hidden", "topk", "fp", "fp_topk"} <= set(parts)
    assert parts["fp"].shape == parts["hidden"].shape and not torch.equal(parts["fp"], parts["hidden"])
    log: list[str] = []
    convert(src, out, opts, device="cpu", resume=True, log=log.append)
    assert f"resuming calibration at layer 2 from {out / CALIB_STATE}/layer-1" in log, log
    assert computed_layers(log) == [2, 3], log
    assert_identical(out, ref)


@pytest.fixture(scope="module")
def every_key_src(tmp_path_factory) -> Path:
    """Tiny glm_moe_dsa whose DSA top-k holds every key of the 64-token samples (index_topk 64,
    as GLM-5.2's 2048 at 2,048-token samples); layer 2 shares layer 1's top-k."""
    cfg = tiny_config("glm_moe_dsa", index_topk_freq=2)
    cfg["index_topk"] = 64
    d = write_checkpoint(tmp_path_factory.mktemp("src-every-key"), cfg, "fp8-block", seed=5)
    write_tokenizer(d, cfg["vocab_size"])
    return d


def test_an_every_key_top_k_is_checkpointed_as_one_row_and_resumed(every_key_src, tmp_path):
    """Where the top-k holds every key the calibration carries it as a broadcast view of one
    row; a checkpoint writes that row and its shape (not (b, S, S) indices), the disk check
    counts no top-k bytes, and the resumed run's folder is byte-identical to an uninterrupted
    one's."""
    from quantize.disk import disk_needed

    src = every_key_src
    opts = ConvertOptions(method="gptq", max_shard_size=200_000, **CALIB)
    plan = make_plan(open_checkpoint(src), opts)
    assert plan.index_topk == 64
    n, S, H = CALIB["num_samples"], CALIB["seq_len"], plan.hidden_size
    assert disk_needed(plan, "cpu")["checkpoint"] == n * S * H * 4  # float32 hidden states only
    ref = tmp_path / "ref"
    convert(src, ref, opts, device="cpu")
    out = tmp_path / "out"
    die_in_layer(src, out, opts, 2)
    saved = StateDir(out / CALIB_STATE, "").read(1)
    raw = load_file(saved.path / "hidden-000000.safetensors")
    b = raw["hidden"].shape[0]
    assert raw["topk"].shape == (1, 1, S) and raw["topk@shape"].tolist() == [b, S, S]
    k = saved.parts(0)["topk"]
    assert k.shape == (b, S, S) and k.stride()[:2] == (0, 0)
    assert torch.equal(k, torch.arange(S, dtype=k.dtype).expand(b, S, S))
    hidden_file = (saved.path / "hidden-000000.safetensors").stat().st_size
    assert hidden_file < raw["hidden"].nbytes + 4096  # no (b, S, S) indices beside it
    log: list[str] = []
    convert(src, out, opts, device="cpu", resume=True, log=log.append)
    assert f"resuming calibration at layer 2 from {out / CALIB_STATE}/layer-1" in log, log
    assert computed_layers(log) == [2, 3], log
    assert_same_files(out, ref)


def test_checkpoints_stop_where_the_top_k_outgrows_the_disk_check(every_key_src, tmp_path,
                                                                  monkeypatch):
    """With the every-key shortcut switched off (as run_layer's proof does when it fails) the
    top-k is carried whole, more than the disk check counted: no checkpoint with hidden states
    is written, the log says so once, and the output is the same."""
    src = every_key_src
    opts = ConvertOptions(method="gptq", max_shard_size=200_000, **CALIB)
    ref = tmp_path / "ref"
    convert(src, ref, opts, device="cpu")
    monkeypatch.setattr("quantize.calib.decoder.EVERY_KEY", [False])
    out = tmp_path / "out"
    log: list[str] = []
    die_in_layer(src, out, opts, 3, log=log.append)
    assert StateDir(out / CALIB_STATE, "").layers() in ([], [3]), log  # 3: the last, no hidden
    warned = [line for line in log if "no calibration checkpoints from layer 0 on" in line]
    assert len(warned) == 1 and "the disk check counted" in warned[0], log
    log.clear()
    convert(src, out, opts, device="cpu", resume=True, log=log.append)
    assert computed_layers(log)[0] == 0, log
    assert_same_files(out, ref)
