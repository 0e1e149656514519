"""`torchrun --nproc-per-node 2 -m quantize convert ...` on the CPU (gloo), against one process.

RTN runs on rank 0 alone: the output must be byte-identical. GPTQ splits the calibration samples
and the routed experts across the two ranks (quantize/calib/distributed.py); the Hessians are the same
sums taken in another order, so the first calibrated layer (whose inputs are the same in both
runs: layer 0 is a dense layer without INT4 targets) must agree in nearly every integer, the
routed-token counts exactly, and every layer's output error must be within 10 % of the
one-process run's (later layers see hidden states that differ by that rounding, so some tokens
change experts there). The output must pass `verify`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantize.calib.distributed import Dist, owned
from quantize.calib.loop import Calibrator
from quantize.errors import QuantizeError
from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.plan import make_plan
from quantize.rounding.int4 import unpack_int4
from quantize.source.checkpoint import open_checkpoint
from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CALIB = ["--num-samples", "8", "--seq-len", "64"]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    cfg = tiny_config("glm_moe_dsa")
    d = write_checkpoint(tmp_path_factory.mktemp("src"), cfg, "fp8-block", seed=3)
    write_tokenizer(d, cfg["vocab_size"])
    return d


def torchrun(src: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "300",
           "HF_HUB_OFFLINE": "1", "QUANTIZE_DIST_TIMEOUT_MIN": "3"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "quantize", "convert", str(src), str(out), "--device", "cpu", "--tp", "1",
           "--max-shard-size", "1MB", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children first."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parent[int(stat.parent.name)] = int(fields[1])
    out, todo = [], [pid]
    while todo:
        cur = todo.pop()
        kids = [c for c, pp in parent.items() if pp == cur]
        out += kids
        todo += kids
    return out


def folder_bytes(d: Path) -> dict[str, bytes]:
    """Every file of an output folder but the CLI's run record (quantize-run.toml: the options
    as typed, the one-process reference here runs through the API)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != "quantize-run.toml"}


def codes(out: Path, prefix: str) -> torch.Tensor:
    """Every INT4 code of the tensors under `prefix`, in name order, as one int8 vector."""
    ts = {}
    for f in sorted(out.glob("*.safetensors")):
        ts.update(load_file(f))
    return torch.cat([unpack_int4(ts[n], int(ts[n.replace("weight_packed", "weight_shape")][1])).reshape(-1)
                      for n in sorted(ts) if n.startswith(prefix) and n.endswith("weight_packed")])


@pytest.mark.slow
def test_rtn_under_torchrun_is_byte_identical(src, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    convert(src, one, ConvertOptions(max_shard_size=10**6), device="cpu", tp=1)
    r = torchrun(src, two)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("done in") == 1  # rank 0 reports, rank 1 stays quiet
    assert "2 processes (torchrun)" in r.stderr  # the log says how many run
    got, want = folder_bytes(two), folder_bytes(one)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"{name} differs from the one-process run"


@pytest.mark.slow
def test_gptq_under_torchrun_matches_one_process(src, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    opts = ConvertOptions(method="gptq", num_samples=8, seq_len=64, max_shard_size=10**6)
    convert(src, one, opts, device="cpu", tp=1)
    r = torchrun(src, two, "--method", "gptq", *CALIB)
    assert r.returncode == 0, r.stderr[-3000:]
    v = subprocess.run([sys.executable, "-m", "quantize", "verify", str(src), str(two)],
                       env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
                       capture_output=True, text=True, check=False)
    assert v.returncode == 0, v.stdout[-2000:] + v.stderr[-2000:]

    a, b = codes(one, "model.layers.1."), codes(two, "model.layers.1.")
    same = (a == b).float().mean().item()
    assert a.numel() > 10_000 and same >= 0.99, f"layer 1: {same:.4%} of the integers agree"
    rep1 = json.loads((one / "calibration-report.json").read_text())
    rep2 = json.loads((two / "calibration-report.json").read_text())
    by = {lay["layer"]: lay for lay in rep1["layers"]}
    assert rep2["layers"][1]["expert_tokens"] == by[1]["expert_tokens"]  # every rank's tokens
    assert rep2["layers"][1]["tokens"] == by[1]["tokens"] == 8 * 64
    # the per-layer errors are taken over the same samples at both world sizes (one process's
    # first chunk, each rank's share of it summed; issue 25): on the first calibrated layer
    # (same inputs) they agree to 0.2 % (0.005 % here; 1.7 % when each rank measured its own
    # first chunk), later ones differ by what the ~1 % of other integers changed upstream
    first = min(lay["layer"] for lay in rep2["layers"] if lay.get("output_rel_error") is not None)
    for lay in rep2["layers"]:
        if lay.get("output_rel_error") is not None:
            e1, e2 = by[lay["layer"]]["output_rel_error"], lay["output_rel_error"]
            bound = 0.002 if lay["layer"] == first else 0.03
            assert abs(e2 - e1) <= bound * e1, (lay["layer"], e1, e2)
    manifest = json.loads((two / "quantize-manifest.json").read_text())
    assert manifest["calibration"]["processes"] == 2

    # a one-process run may not resume a two-process folder: other sums, other integers
    (two / "quantize-manifest.json").write_text(json.dumps({**manifest, "status": "in-progress"}))
    with pytest.raises(QuantizeError, match=r"calibration processes \(torchrun ranks\): was 2, now 1"):
        convert(src, two, opts, device="cpu", tp=1, resume=True)


@pytest.mark.slow
def test_gptaq_under_torchrun_sums_its_statistics_over_the_ranks(src, tmp_path):
    """--gptaq (default 0.5 at group 32) with shared-expert targets under torchrun: every rank carries
    both streams of its own samples and the D terms are summed over the ranks, so the report's
    |D| / |H| per layer is the one-process run's (0 on the first calibrated layer, whose two
    streams are the same tokens; within 3 % after it, where the ranks' other integers move the
    streams a little); the output verifies. With --sequential-mlp the shared experts' second
    pass is summed over the ranks alike: the same token count, and its within-layer D term
    within 3 % of one process's on the first calibrated layer (20 % after it)."""
    from quantize.check.verify import verify

    one, two = tmp_path / "one", tmp_path / "two"
    opts = ConvertOptions(method="gptq", num_samples=8, seq_len=64, max_shard_size=10**6,
                          targets=frozenset({"routed", "shared"}), sequential_mlp=True)
    convert(src, one, opts, device="cpu", tp=1)
    r = torchrun(src, two, "--method", "gptq", "--targets", "routed,shared", "--sequential-mlp", *CALIB)
    assert r.returncode == 0, r.stderr[-3000:]
    assert verify(src, two).ok
    g1, g2 = ({lay["layer"]: lay["gptaq"] for lay in json.loads((o / "calibration-report.json").read_text())["layers"]
               if "gptaq" in lay} for o in (one, two))
    assert sorted(g1) == sorted(g2) and len(g1) >= 2
    first = min(g1)
    for L in g1:
        assert g2[L]["tokens"] == g1[L]["tokens"] in (8 * 64, 8 * 63)  # (the MTP layer: S - 1)
        if L == first:
            assert g1[L]["D_in_rel"] == g2[L]["D_in_rel"] == 0
        else:
            assert g1[L]["D_in_rel"] > 0
            assert abs(g2[L]["D_in_rel"] - g1[L]["D_in_rel"]) <= 0.03 * g1[L]["D_in_rel"], (L, g1[L], g2[L])
    s1, s2 = ({lay["layer"]: lay["sequential_mlp"] for lay in json.loads((o / "calibration-report.json").read_text())["layers"]
               if "sequential_mlp" in lay} for o in (one, two))
    assert sorted(s1) == sorted(s2) == sorted(g1)
    for L in s1:
        assert s1[L]["tokens"] == s2[L]["tokens"] == g1[L]["tokens"]
        assert s1[L]["D_within_rel"] > 0
        # (a difference of two streams through the layer's own rounded gate/up: on the first
        # calibrated layer, whose inputs are the same tokens in both runs, within 3 %; after it
        # the inputs differ by the earlier layers' integers (measured: 3.8 % on layer 2, 10 % on
        # the MTP layer, on one CPU), so 20 %, still far from one rank's share alone)
        tol = 0.03 if L == first else 0.20
        assert abs(s2[L]["D_within_rel"] - s1[L]["D_within_rel"]) <= tol * s1[L]["D_within_rel"], (L, s1[L], s2[L])


def test_ranks_split_samples_and_experts_and_refuse_awq(src):
    d = [Dist(r, 3, torch.device("cpu")) for r in range(3)]
    assert [x.samples(8) for x in d] == [slice(0, 2), slice(2, 5), slice(5, 8)]
    assert [owned(e, 8, 3) for e in range(8)] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert [owned(e, 256, 8) for e in (0, 31, 32, 255)] == [0, 0, 1, 7]
    ck = open_checkpoint(src)
    for opts, msg in ((ConvertOptions(method="awq+gptq", num_samples=8, seq_len=64), "AWQ runs in one process"),
                      (ConvertOptions(method="gptq", num_samples=2, seq_len=64), "--num-samples 3")):
        with pytest.raises(QuantizeError, match=msg):
            Calibrator(ck, make_plan(ck, opts), opts, torch.device("cpu"), dist=d[0])


@pytest.mark.slow
def test_a_killed_torchrun_run_resumes_from_every_ranks_checkpoint(src, tmp_path):
    """Two ranks, a checkpoint after every layer (each rank its own samples' hidden states),
    the whole group SIGKILLed after rank 0's 14th shard (of 20): the same command resumes from a layer
    both ranks have, and the finished folder equals an uninterrupted two-rank run's."""
    import signal
    import time

    from quantize.write.shards import STALL_ENV

    args = ("--method", "gptq", *CALIB, "--max-shard-size", "200KB", "--checkpoint-interval", "0")
    ref, out = tmp_path / "ref", tmp_path / "out"
    r = torchrun(src, ref, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (ref / "calibration" / "state").exists()

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "QUANTIZE_DIST_TIMEOUT_MIN": "3", STALL_ENV: "shard:14"}
    log = tmp_path / "killed.stderr"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "quantize", "convert", str(src), str(out), "--device", "cpu", "--tp", "1", *args]
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=f, start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while "QUANTIZE_TEST_STALLED" not in log.read_text():
            assert p.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "never reached the stall point"
            time.sleep(0.1)
    finally:
        for pid in [p.pid, *descendants(p.pid)]:  # torchrun and both ranks (own sessions)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        p.wait(timeout=30)
        time.sleep(0.5)  # the ranks' deaths (and their folder lock) reach the kernel
    state = out / "calibration" / "state"
    ranks = sorted(d.name for d in state.iterdir())
    assert ranks == ["rank-0-of-2", "rank-1-of-2"], ranks

    r = torchrun(src, out, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming calibration at layer" in r.stderr and "other ranks' checkpoints" in r.stderr, \
        r.stderr[-3000:]
    assert not state.exists()
    manifest = json.loads((ref / "quantize-manifest.json").read_text())
    for name in manifest["files"]:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert (out / "quantize-manifest.json").read_bytes() == (ref / "quantize-manifest.json").read_bytes()
