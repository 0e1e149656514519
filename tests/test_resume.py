"""Crash safety (issue 5): kill the converter from outside, resume, get the same bytes.

The converter runs as a real subprocess through the CLI. `QUANTIZE_TEST_STALL_AT=EVENT:N`
(quantize/write/shards.py) makes it announce and sleep at an exact point, where the test SIGKILLs
it: no sleeps-and-hope, no races. Also here: resume refuses other options or a changed
source, verify never passes an unfinished folder and names any changed byte, and the output
folder rules (not inside the source, not a non-empty stranger's folder).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantize.check.verify import verify
from quantize.cli import app
from quantize.errors import QuantizeError
from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.write.manifest import MANIFEST
from quantize.write.shards import STALL_ENV, sha256_file

ROOT = Path(__file__).resolve().parents[1]
SHARD = "200KB"  # ~20 output shards from the tiny checkpoint
OPTS = ConvertOptions(max_shard_size=200_000)
runner = CliRunner()


def cli_args(src: Path, out: Path, *extra: str) -> list[str]:
    return ["convert", str(src), str(out), "--max-shard-size", SHARD, "--device", "cpu",
            "--tp", "1", *extra]


def run_cli(*args: str, stall: str | None = None, timeout: float = 60, sig=signal.SIGKILL,
            meanwhile=None) -> subprocess.CompletedProcess | tuple[int, str]:
    """Run `quantize ARGS` in a subprocess. With `stall`, wait until it reaches that point, call
    `meanwhile()`, send it `sig` (SIGKILL: no cleanup runs); return (exit status, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "300"}
    env.pop(STALL_ENV, None)
    # Ctrl-C as in a terminal, even when the test runner itself was started with SIGINT ignored
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from quantize.cli import app; app()")
    cmd = [sys.executable, "-c", code, *args]
    if stall is None:
        return subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=timeout)
    env[STALL_ENV] = stall
    log = Path(args[2]).with_name(Path(args[2]).name + ".stderr")
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=f)
    deadline = time.monotonic() + timeout
    try:
        while "QUANTIZE_TEST_STALLED" not in log.read_text():
            assert p.poll() is None, f"exited {p.returncode} before {stall}: {log.read_text()}"
            assert time.monotonic() < deadline, f"never reached {stall}"
            time.sleep(0.05)
        if meanwhile is not None:
            meanwhile()
    finally:
        os.kill(p.pid, sig)  # from outside
        rc = p.wait(timeout=30)
    text = log.read_text()
    log.unlink()
    return rc, text


def folder_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def assert_not_a_result(out: Path) -> None:
    """An interrupted folder: manifest in-progress, no index/config, verify refuses it."""
    m = json.loads((out / MANIFEST).read_text())
    assert m["status"] == "in-progress"
    assert not (out / "model.safetensors.index.json").exists()
    assert not (out / "config.json").exists()
    for name, rec in m["files"].items():  # what the manifest records is really there, intact
        assert sha256_file(out / name) == rec["sha256"], name
    r = runner.invoke(app, ["verify", "unused-src", str(out)])
    assert r.exit_code == 2 and "not a finished conversion" in r.output
    assert "in-progress" in r.output


def assert_half_written(out: Path, reference: Path) -> None:
    """Exactly one `.partial` shard, holding more than its header and less than the whole."""
    (partial,) = out.glob("*.partial")
    whole = (reference / partial.name.removesuffix(".partial")).stat().st_size
    header = 8 + int.from_bytes(partial.read_bytes()[:8], "little")
    assert header < partial.stat().st_size < whole


@pytest.fixture(scope="module")
def reference(dsa_fp8, tmp_path_factory) -> Path:
    """An uninterrupted conversion, through the same CLI subprocess."""
    out = tmp_path_factory.mktemp("ref") / "out"
    r = run_cli(*cli_args(dsa_fp8, out))
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.slow
def test_killed_four_times_then_resumed_is_byte_identical(dsa_fp8, reference, tmp_path):
    out = tmp_path / "out"
    n_shards = len(list(reference.glob("*.safetensors")))
    assert n_shards >= 10

    # 1. killed while the first multi-unit shard is half written (its first unit flushed)
    run_cli(*cli_args(dsa_fp8, out), stall="unit:1")
    assert_half_written(out, reference)
    assert_not_a_result(out)

    # 2. `--resume`, killed in the middle of a later shard (50th unit event of this run)
    _, err = run_cli(*cli_args(dsa_fp8, out, "--resume"), stall="unit:50")
    assert "resuming" in err
    assert_half_written(out, reference)
    assert_not_a_result(out)
    recorded = json.loads((out / MANIFEST).read_text())["files"]
    assert 0 < len(recorded) < n_shards

    # 3. the same command again (no --resume): detects the manifest, says so, continues; killed
    #    after its 2nd shard was renamed into place but before the manifest recorded it
    _, err = run_cli(*cli_args(dsa_fp8, out), stall="shard:2")
    assert f"found an interrupted conversion in {out} ({len(recorded)} of {n_shards} shards done): resuming" in err
    on_disk = {p.name for p in out.glob("*.safetensors")}
    recorded2 = set(json.loads((out / MANIFEST).read_text())["files"])
    assert len(on_disk - recorded2) == 1  # a complete shard the manifest does not vouch for
    assert_not_a_result(out)

    # 4. killed after every shard, before index / config / completed manifest
    run_cli(*cli_args(dsa_fp8, out), stall="finish:1")
    assert len(json.loads((out / MANIFEST).read_text())["files"]) == n_shards
    assert_not_a_result(out)

    # 5. finish; it keeps what the manifest vouches for and rewrites nothing else
    r = run_cli(*cli_args(dsa_fp8, out))
    assert r.returncode == 0, r.stderr
    assert f"0 shard(s) written, {n_shards} kept" in r.stderr
    assert not list(out.glob("*.partial"))
    got, want = folder_bytes(out), folder_bytes(reference)
    assert sorted(got) == sorted(want)
    for name in want:  # every file, the manifest included, byte for byte
        assert got[name] == want[name], f"{name} differs from the uninterrupted run"
    assert verify(dsa_fp8, out, write=False).ok


def test_ctrl_c_removes_the_half_written_shard_and_says_how_to_resume(dsa_fp8, tmp_path):
    out = tmp_path / "out"
    rc, err = run_cli(*cli_args(dsa_fp8, out), stall="unit:30", sig=signal.SIGINT)
    assert rc == 130 and "Traceback" not in err
    assert "interrupted:" in err and "rerun the same command to resume" in err
    assert not list(out.glob("*.partial"))
    assert_not_a_result(out)


def test_a_second_run_into_the_same_folder_is_refused_while_the_first_runs(dsa_fp8, tmp_path):
    out = tmp_path / "out"

    def second_run() -> None:
        partial = sorted(out.glob("*.partial"))
        for extra in ([], ["--resume"], ["--overwrite"]):
            r = runner.invoke(app, cli_args(dsa_fp8, out, *extra))
            assert r.exit_code == 2, r.output
            assert "another conversion is writing to this folder" in r.output
        assert sorted(out.glob("*.partial")) == partial  # the running one's file left alone

    run_cli(*cli_args(dsa_fp8, out), stall="unit:3", meanwhile=second_run)
    r = runner.invoke(app, cli_args(dsa_fp8, out))  # the lock died with the process
    assert r.exit_code == 0, r.output


def test_a_changed_kept_shard_is_rewritten_on_resume(dsa_fp8, reference, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    victim = sorted(out.glob("*.safetensors"))[3]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # same size, one bit pattern changed
    victim.write_bytes(bytes(data))
    res = convert(dsa_fp8, out, OPTS, device="cpu", resume=True)
    assert res.written == [victim.name]
    assert victim.read_bytes() == (reference / victim.name).read_bytes()


def test_resume_refuses_other_options_and_says_which(dsa_fp8, tmp_path):
    out = tmp_path / "out"
    run_cli(*cli_args(dsa_fp8, out), stall="shard:2")
    before = folder_bytes(out)
    for extra, says in ((["--asymmetric"], "option symmetric: was True, now False"),
                        (["--group-size", "32", "--targets", "routed,shared"],
                         "option targets: was ['routed'], now ['routed', 'shared']")):
        r = runner.invoke(app, cli_args(dsa_fp8, out, "--resume", *extra))
        assert r.exit_code == 2, r.output
        assert "cannot resume: this output was made differently" in r.output and says in r.output
        assert "holds an unfinished conversion" in r.output  # what was left, and what to do
    original = (out / MANIFEST).read_bytes()
    m = json.loads(original)
    (out / MANIFEST).write_text(json.dumps({**m, "tool_version": "0.0.1"}))
    r = runner.invoke(app, cli_args(dsa_fp8, out))  # shards of another version are not mixed in
    assert r.exit_code == 2 and "tool version: was '0.0.1', now " in r.output
    (out / MANIFEST).write_bytes(original)
    r = runner.invoke(app, ["convert", str(dsa_fp8), str(out), "--device", "cpu"])  # 5GB shards
    assert r.exit_code == 2 and "option max_shard_size: was 200000, now 5000000000" in r.output
    assert folder_bytes(out) == before  # a refused resume touches nothing
    r = runner.invoke(app, cli_args(dsa_fp8, out))  # the original options still resume it
    assert r.exit_code == 0, r.output


def test_resume_refuses_a_changed_source(dsa_fp8, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(dsa_fp8, src)
    run_cli(*cli_args(src, out), stall="shard:1")
    shard = min(src.glob("*.safetensors"))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    r = runner.invoke(app, cli_args(src, out, "--resume"))
    assert r.exit_code == 2 and f"source file {shard.name} changed (size/mtime)" in r.output
    idx = src / "model.safetensors.index.json"
    idx.write_text(idx.read_text() + "\n")
    r = runner.invoke(app, cli_args(src, out))
    assert r.exit_code == 2 and "source index changed" in r.output
    r = runner.invoke(app, cli_args(src, out, "--overwrite"))  # the way out the message names
    assert r.exit_code == 0, r.output
    assert json.loads((out / MANIFEST).read_text())["status"] == "complete"


def test_a_source_changed_during_the_run_is_never_marked_complete(dsa_fp8, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(dsa_fp8, src)
    shard = max(src.glob("*.safetensors"))

    def touch_once(unit) -> None:  # e.g. `hf download` still rewriting a shard
        if not touch_once.done:
            os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
            touch_once.done = True
    touch_once.done = False

    with pytest.raises(QuantizeError, match="the source changed during the conversion") as e:
        convert(src, out, OPTS, device="cpu", on_unit=touch_once)
    assert f"source file {shard.name} changed (size/mtime)" in str(e.value)
    assert json.loads((out / MANIFEST).read_text())["status"] == "in-progress"


def test_resume_and_overwrite_together_are_refused(dsa_fp8, tmp_path):
    r = runner.invoke(app, cli_args(dsa_fp8, tmp_path / "o", "--resume", "--overwrite"))
    assert r.exit_code == 2 and "contradict" in r.output
    assert not (tmp_path / "o").exists()


# --- integrity ---------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["shard", "model.safetensors.index.json", "config.json",
                                   "generation_config.json"])
def test_verify_names_any_changed_byte(dsa_fp8, reference, tmp_path, which):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    name = sorted(out.glob("*.safetensors"))[5].name if which == "shard" else which
    p = out / name
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one byte, size unchanged
    p.write_bytes(bytes(data))
    r = runner.invoke(app, ["verify", str(dsa_fp8), str(out)])
    assert r.exit_code == 1, r.output
    assert f"{name}: sha256 differs from the manifest" in r.output


def test_verify_hashes_the_output_in_the_order_its_checks_read_it(dsa_fp8, reference):
    """What lets verify read the output once: its hashing reads the shards in the order of the
    tensor checks (the plan's), and each shard holds its tensors in that order."""
    from quantize.check.integrity import options_of, same_size, streamed_shards
    from quantize.plan import make_plan
    from quantize.source.checkpoint import open_checkpoint, read_tensor_table
    from quantize.write.manifest import finished_manifest

    manifest = finished_manifest(reference)
    plan = make_plan(open_checkpoint(dsa_fp8), options_of(manifest))
    assert len(plan.shards) > 3
    assert streamed_shards(reference, same_size(reference, manifest["files"])) == [s.file for s in plan.shards]
    tensors = read_tensor_table(reference)[0]
    for shard in plan.shards:
        begins = [tensors[t.name].begin for t in shard.tensors]
        assert {tensors[t.name].file for t in shard.tensors} == {shard.file}
        assert begins == sorted(begins), shard.file


@pytest.mark.parametrize("ahead", ["default", "one byte"])
def test_verify_names_a_changed_shard_its_checks_cannot_read(dsa_fp8, reference, tmp_path,
                                                             monkeypatch, ahead):
    """A shard's bytes are hashed beside the tensor checks that read them (not before): a
    change that breaks the reading itself (a header that no longer parses) is still reported
    as the changed file, not as a crash; also when the hashing had not reached that shard
    (one byte ahead: the shard the error names is hashed then)."""
    if ahead == "one byte":
        from quantize.check import integrity

        monkeypatch.setattr(integrity, "readahead_bytes", lambda limit: 1)
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    p = sorted(out.glob("*.safetensors"))[3]
    data = bytearray(p.read_bytes())
    n = int.from_bytes(data[:8], "little")
    data[8 + n // 2: 8 + n // 2 + 4] = b"\xff\xff\xff\xff"  # no longer UTF-8 JSON
    p.write_bytes(bytes(data))
    r = runner.invoke(app, ["verify", str(dsa_fp8), str(out)])
    assert r.exit_code == 1, r.output
    assert f"{p.name}: sha256 differs from the manifest" in r.output
    assert "Traceback" not in r.output


def test_verify_names_a_missing_file_and_refuses_a_folder_without_manifest(dsa_fp8, reference,
                                                                           tmp_path):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    victim = min(out.glob("*.safetensors"))
    victim.unlink()
    r = runner.invoke(app, ["verify", str(dsa_fp8), str(out)])
    assert r.exit_code == 1 and f"{victim.name}: listed in the manifest but missing" in r.output
    (out / MANIFEST).unlink()
    r = runner.invoke(app, ["verify", str(dsa_fp8), str(out)])
    assert r.exit_code == 2 and "no manifest" in r.output


def test_verify_names_weight_files_the_manifest_does_not_list(dsa_fp8, reference, tmp_path):
    """A stray shard (an engine globbing *.safetensors would load it) or any other weight file
    fails verify by name; files written after conversion (card, reports) and other
    unlisted non-weight files do not (the latter are said as notes)."""
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    shards = sorted(out.glob("*.safetensors"))
    n = len(shards)
    stray = [f"model-{n + 1:05d}-of-{n:05d}.safetensors", "pytorch_model.bin", "consolidated.pt",
             "model-q4.gguf", "calibration/extra.safetensors"]
    for name in stray:
        (out / name).parent.mkdir(exist_ok=True)
        shutil.copyfile(shards[0], out / name)
    (out / "linked.safetensors").symlink_to(shards[1])
    (out / "NOTES.md").write_text("unlisted, not a weight file: fine\n")
    (out / "eval.json").write_text("{}\n")
    r = runner.invoke(app, ["verify", str(dsa_fp8), str(out)])
    assert r.exit_code == 1, r.output
    for name in [*stray, "linked.safetensors"]:
        assert f"{name}: a weight file the manifest does not list" in r.output, (name, r.output)
    assert "delete it, or reconvert with --overwrite" in r.output
    # a file of the user's is said as a note (issue 25), never a problem; our reports are ours
    assert "note: NOTES.md: in the folder, not part of the conversion" in r.output
    assert "problem: NOTES.md" not in r.output
    assert "eval.json" not in r.output and "README.md" not in r.output
    for name in [*stray, "linked.safetensors"]:
        (out / name).unlink()
    r = runner.invoke(app, ["verify", str(dsa_fp8), str(out)])
    assert r.exit_code == 0, r.output
    assert (out / "README.md").is_file() and (out / "verify.json").is_file()


def test_output_inside_or_equal_to_source_is_refused(dsa_fp8, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(dsa_fp8, src)
    before = sorted(p.name for p in src.rglob("*"))
    link = tmp_path / "alias"
    link.symlink_to(src)
    for out, says in ((src, "is the source"), (link, "is the source"), (src / "int4", "is inside"),
                      (link / "x", "is inside"),
                      (tmp_path, "contains the source")):
        r = runner.invoke(app, cli_args(src, out))
        assert r.exit_code == 2 and f"the output folder {says}" in r.output, (out, r.output)
    assert sorted(p.name for p in src.rglob("*")) == before  # nothing written into the source


def test_non_empty_output_without_manifest_is_refused(dsa_fp8, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("mine")
    for extra in ([], ["--resume"]):
        r = runner.invoke(app, cli_args(dsa_fp8, out, *extra))
        assert r.exit_code == 2 and "the output folder is not empty" in r.output
        assert "--overwrite" in r.output
        assert [p.name for p in out.iterdir()] == ["precious.txt"]
    r = runner.invoke(app, cli_args(dsa_fp8, out, "--overwrite"))
    assert r.exit_code == 0, r.output
    assert not (out / "precious.txt").exists()


def test_killed_before_the_first_manifest_is_not_a_stranger(dsa_fp8, tmp_path):
    """Only `.partial` leftovers (a kill during the very first write) do not block a rerun."""
    out = tmp_path / "out"
    out.mkdir()
    (out / f"{MANIFEST}.partial").write_text("{")
    res = convert(dsa_fp8, out, OPTS, device="cpu")
    assert not list(out.glob("*.partial")) and res.skipped == []


def test_verify_in_process_refuses_in_progress(dsa_fp8, tmp_path):
    out = tmp_path / "out"
    run_cli(*cli_args(dsa_fp8, out), stall="unit:3")
    with pytest.raises(QuantizeError, match="not a finished conversion"):
        verify(dsa_fp8, out)


def test_partial_files_that_are_not_ours_are_never_deleted(dsa_fp8, tmp_path):
    """`thesis.partial` (a file) or `data.partial` (a folder) of the user's: a folder holding one
    is not empty (refused, untouched); beside a finished conversion run again, it stays."""
    for name, make in (("thesis.partial", lambda p: p.write_text("chapter 1")),
                       ("data.partial", lambda p: (p.mkdir(), (p / "x").write_text("1")))):
        out = tmp_path / name.split(".")[0] / "out"
        out.mkdir(parents=True)
        make(out / name)
        r = runner.invoke(app, cli_args(dsa_fp8, out))
        assert r.exit_code == 2 and "the output folder is not empty" in r.output, r.output
        assert name in r.output and sorted(p.name for p in out.iterdir()) == [name]
        (out / name).rename(out.parent / name)  # out of the way: convert, then put it back
        assert runner.invoke(app, cli_args(dsa_fp8, out)).exit_code == 0
        (out.parent / name).rename(out / name)
        r = runner.invoke(app, cli_args(dsa_fp8, out))  # the finished conversion, run again
        assert r.exit_code == 0, r.output
        assert (out / name).exists()
        if name == "thesis.partial":
            assert (out / name).read_text() == "chapter 1"


def test_no_write_follows_a_link_planted_in_the_output(dsa_fp8, reference, tmp_path):
    """Links planted at the names convert (on resume), verify and the card write through
    (`NAME.partial`, verify.json, README.md.partial) point outside the folder: every write
    makes its file fresh in the folder, and the files they point to keep their bytes (on
    1d01519 `open(..., "wb")` followed them)."""
    from quantize.publish.readme import write_readme

    out = tmp_path / "out"
    shutil.copytree(reference, out)
    victim = sorted(out.glob("*.safetensors"))[3]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # the resume rewrites this shard
    victim.write_bytes(bytes(data))
    precious = {}
    names = [f"{victim.name}.partial", f"{MANIFEST}.partial", "config.json.partial",
             "model.safetensors.index.json.partial", "verify.json", "verify.json.partial",
             "README.md.partial"]
    for i, name in enumerate(names):
        target = tmp_path / f"precious-{i}"
        target.write_text(f"the user's file {i}")
        precious[target] = target.read_bytes()
        if (out / name).exists() or (out / name).is_symlink():
            (out / name).unlink()
        (out / name).symlink_to(target)
    res = convert(dsa_fp8, out, OPTS, device="cpu", resume=True)
    assert res.written == [victim.name]
    assert victim.read_bytes() == (reference / victim.name).read_bytes()
    (out / "verify.json.partial").symlink_to(tmp_path / "precious-5")  # (the resume removed it)
    assert verify(dsa_fp8, out).ok
    write_readme(out)
    for target, before in precious.items():
        assert target.read_bytes() == before, f"{target.name} was written through a link"
    assert (out / "verify.json").is_file() and not (out / "verify.json").is_symlink()
    assert json.loads((out / "verify.json").read_text())["summary"]["ok"] is True
    assert not [p.name for p in out.iterdir() if p.is_symlink()]


def _unshare_ok() -> bool:
    """Whether this machine lets a process bind-mount in a mount namespace of its own."""
    if shutil.which("unshare") is None:
        return False
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "a").mkdir()
        (Path(d) / "b").mkdir()
        r = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c",
                            f'mount --bind "{d}/a" "{d}/b"'], capture_output=True, check=False)
    return r.returncode == 0


@pytest.mark.skipif(not _unshare_ok(), reason="this machine gives no mount namespace to bind-mount in")
def test_output_through_a_second_mount_of_the_source_is_refused(dsa_fp8, tmp_path):
    """One folder seen through two mounts (a bind mount, as cluster scratch and container mounts
    are) is one folder: DST a second view of the source's parent folder is refused with
    --overwrite (on 1d01519 it deleted the source and a file beside it), a folder inside a
    second view of the source too. Decided by device and inode, not path strings."""
    models = tmp_path / "models"
    src = models / "GLM-FP8"
    shutil.copytree(dsa_fp8, src)
    (models / "notes.txt").write_text("a neighbour")
    view = tmp_path / "view"
    view.mkdir()
    before = sorted(str(p.relative_to(models)) for p in models.rglob("*"))
    code = ("import sys; from quantize.cli import app; sys.argv[0] = 'quantize'; app()")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "300"}
    for bound, out, says in ((models, view, "contains the source"),
                             (src, view / "int4", "is inside the source"),
                             (src, view, "is the source")):
        script = (f'mount --bind "{bound}" "{view}" && exec "{sys.executable}" -c "{code}" '
                  f'convert "{src}" "{out}" --overwrite --device cpu --tp 1')
        r = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c", script], env=env,
                           capture_output=True, text=True, check=False, timeout=120)
        assert r.returncode == 2 and f"the output folder {says}" in r.stderr, (bound, out, r.stderr)
        assert sorted(str(p.relative_to(models)) for p in models.rglob("*")) == before


def test_verify_fails_when_a_conversion_rewrites_the_folder_under_it(dsa_fp8, reference, tmp_path):
    """`convert --overwrite` into the folder while verify runs: verify fails and writes no
    report, so no verify.json of the old bytes names the new manifest and push refuses the
    folder until verify runs again (on 1d01519 the report named the manifest as verify ended)."""
    from quantize.publish.push import prepare_push

    out = tmp_path / "out"
    shutil.copytree(reference, out)
    (out / "verify.json").unlink(missing_ok=True)
    done = []

    def rewrite(unit) -> None:
        if not done:
            done.append(convert(dsa_fp8, out, ConvertOptions(max_shard_size=200_000, group_size=32),
                                device="cpu", overwrite=True))

    with pytest.raises(QuantizeError) as e:
        verify(dsa_fp8, out, on_unit=rewrite)
    assert done and not (out / "verify.json").exists(), e.value
    with pytest.raises(QuantizeError, match="verify"):
        prepare_push(out, "me/x")
    assert verify(dsa_fp8, out).ok  # run again: the new conversion, verified
    m = hashlib.sha256((out / MANIFEST).read_bytes()).hexdigest()
    assert json.loads((out / "verify.json").read_text())["manifest_sha256"] == m


def test_json_stdout_holds_an_object_however_the_run_ends(dsa_fp8, tmp_path):
    """With --json, stdout is one JSON object (valid UTF-8) for a click-level error, a name with
    bytes that are not UTF-8, and Ctrl-C mid-conversion (on 1d01519: empty, or not JSON)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "300"}
    env.pop(STALL_ENV, None)

    def obj(raw: bytes) -> dict:
        d = json.loads(raw.decode("utf-8"))  # strict: valid UTF-8, one JSON value
        assert d["schema_version"] == 1 and d["error"], d
        return d

    cases = [([str(dsa_fp8), str(tmp_path / "a"), "--bogus"], "No such option"),
             ([str(dsa_fp8), str(tmp_path / "b"), "--tp", "0"], "--tp")]
    for args, says in cases:
        r = subprocess.run([sys.executable, "-m", "quantize", "convert", "--json", *args], env=env,
                           capture_output=True, check=False, timeout=120)
        assert r.returncode == 2 and says in obj(r.stdout)["error"], r.stdout
    bad = os.fsencode(str(tmp_path)) + b"/\xffout"
    os.makedirs(bad)
    open(bad + b"/x", "w").close()
    r = subprocess.run([sys.executable, "-m", "quantize", "convert", "--json", os.fsencode(str(dsa_fp8)), bad],
                       env=env, capture_output=True, check=False, timeout=120)
    assert r.returncode == 2 and "UTF-8" in obj(r.stdout)["error"], r.stdout

    out = tmp_path / "out"
    env[STALL_ENV] = "unit:5"
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "sys.argv[0] = 'quantize'; from quantize.cli import main; main()")
    log, stdout = tmp_path / "err.txt", tmp_path / "out.json"
    with open(log, "w") as e, open(stdout, "wb") as o:
        p = subprocess.Popen([sys.executable, "-c", code, *cli_args(dsa_fp8, out), "--json"], env=env,
                             stdout=o, stderr=e)
    deadline = time.monotonic() + 60
    while "QUANTIZE_TEST_STALLED" not in log.read_text():
        assert p.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGINT)
    assert p.wait(timeout=60) == 130
    assert "interrupted" in obj(stdout.read_bytes())["error"]


def test_verify_against_another_source_says_so(dsa_fp8, reference, tmp_path):
    """verify with the wrong SRC (another checkpoint) says SRC is not the converted one and how
    to find the right one, not that the files are "not in the manifest, reconvert"."""
    from quantize.source.synth import tiny_config, write_checkpoint

    other = write_checkpoint(tmp_path / "other", tiny_config("glm4_moe"), "fp8-channel")
    r = runner.invoke(app, ["verify", str(other), str(reference)], env={"COLUMNS": "300"})
    assert r.exit_code == 2, r.output
    assert "SRC is not the checkpoint this output was converted from" in r.output
    assert "reconvert" not in r.output
