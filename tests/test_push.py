"""`quantize push` end to end against the loopback Hub in hubserver.py.

The real huggingface_hub client runs unmodified in a subprocess pointed at the server by
HF_ENDPOINT (with HF_HUB_DISABLE_XET=1: the loopback Hub speaks Git LFS, not Xet). Checked: the
refusals, the dry-run listing, the bytes that arrive, resuming after a killed upload, pushing to
a branch, and that the token never shows in output, debug logs or uploaded files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hubserver import Hub, HubState

from quantize.check.verify import VERIFY_JSON, verify
from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.publish.plots import PICTURES
from quantize.publish.push import prepare_push
from quantize.source.synth import tiny_config, write_checkpoint
from quantize.write.manifest import MANIFEST

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_loopbackTESTtoken0123456789abcdef"
CLI = "from quantize.cli import app; app()"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny FP8 source converted into several shards and verified."""
    d = tmp_path_factory.mktemp("push")
    src, dst = d / "src", d / "out"
    write_checkpoint(src, tiny_config())
    convert(src, dst, ConvertOptions(max_shard_size=1_000_000), device="cpu")
    assert verify(src, dst).ok
    return src, dst


def _env(hub: Hub, home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HOME=str(home), HF_HUB_DISABLE_XET="1",
               HF_HUB_VERBOSITY="debug", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    return env


def _push(hub: Hub, home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI, "push", *args], env=_env(hub, home), cwd=ROOT,
                          check=False,
                          capture_output=True, text=True, timeout=120)


def _expected_files(dst: Path) -> set[str]:
    manifest = json.loads((dst / MANIFEST).read_text())
    pictures = {n for n in PICTURES if (dst / n).is_file()}  # verify's, with matplotlib
    return set(manifest["files"]) | {"README.md", VERIFY_JSON, MANIFEST} | pictures


def _copy(dst, to):
    """The output folder's top-level files copied byte for byte into a new folder `to`."""
    to.mkdir()
    for p in dst.iterdir():
        (to / p.name).write_bytes(p.read_bytes())
    return to


def test_refuses_unfinished_and_unverified(converted, tmp_path):
    _, dst = converted
    bad = _copy(dst, tmp_path / "out")
    os.utime(bad / VERIFY_JSON)  # copied after the manifest: a current report

    prepare_push(bad, "org/ok", write_card=False)  # the copy is publishable

    with pytest.raises(Exception, match="not a Hub repo id"):
        prepare_push(bad, "no-slash", write_card=False)

    report = json.loads((bad / VERIFY_JSON).read_text())
    report["summary"]["ok"] = False
    (bad / VERIFY_JSON).write_text(json.dumps(report))
    with pytest.raises(Exception, match="verify failed"):
        prepare_push(bad, "org/x", write_card=False)
    assert prepare_push(bad, "org/x", skip_verify_check=True, write_card=False).files

    (bad / VERIFY_JSON).unlink()
    with pytest.raises(Exception, match="not verified"):
        prepare_push(bad, "org/x", write_card=False)

    m = json.loads((bad / MANIFEST).read_text())
    m["status"] = "in-progress"
    (bad / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(Exception, match="not a finished conversion"):  # no override for this
        prepare_push(bad, "org/x", skip_verify_check=True, write_card=False)


def test_refuses_a_report_without_the_layer_check_and_a_failed_eval(converted, tmp_path):
    """A verify.json from before the layer check, or one run with --no-layer-check, is no proof
    of function; an eval.json whose verdict failed says the output is broken: both refused."""
    _, dst = converted
    bad = _copy(dst, tmp_path / "out")
    report = json.loads((bad / VERIFY_JSON).read_text())
    assert report["summary"]["layer_check"]["ok"] is True
    for lc in (None, {"skipped": "--no-layer-check"}, {**report["summary"]["layer_check"], "ok": False}):
        (bad / VERIFY_JSON).write_text(json.dumps({**report, "summary": {**report["summary"],
                                                                          "layer_check": lc}}))
        with pytest.raises(Exception, match="no layer check"):
            prepare_push(bad, "org/x", write_card=False)
    (bad / VERIFY_JSON).write_text(json.dumps(report))
    prepare_push(bad, "org/x", write_card=False)
    (bad / "eval.json").write_text(json.dumps({"summary": {}, "verdict": {
        "ok": False, "failed": ["held-out perplexity ratio 1.2e+04 > --max-ppl-ratio 2"]}}))
    with pytest.raises(Exception, match="eval found the output broken") as e:
        prepare_push(bad, "org/x", write_card=False)
    assert "1.2e+04" in str(e.value) and "eval.json" in str(e.value)
    # a hand-edited eval.json without a verdict (or with one that says nothing) is no proof
    # either (on 1d01519 push accepted it)
    for edited in ({"summary": {"ppl_ratio": 1.0}}, {"summary": {}, "verdict": {"failed": []}},
                   {"summary": {}, "verdict": "pass"}):
        (bad / "eval.json").write_text(json.dumps(edited))
        with pytest.raises(Exception, match="eval.json has no verdict"):
            prepare_push(bad, "org/x", write_card=False)


def test_stale_verify_is_refused(converted, tmp_path):
    _, dst = converted
    bad = _copy(dst, tmp_path / "out")
    old = time.time() - 100
    os.utime(bad / VERIFY_JSON, (old, old))  # verify ran before the (re)conversion
    with pytest.raises(Exception, match="older than the conversion"):
        prepare_push(bad, "org/x", write_card=False)


def test_dry_run_lists_exact_files_and_card(converted, tmp_path):
    _, dst = converted
    (dst / "scratch.partial").write_bytes(b"half-written")  # must not be uploaded
    before = (dst / "README.md").read_text()
    hub = Hub(HubState(token=TOKEN))
    try:
        r = _push(hub, tmp_path / "home", str(dst), "org/GLM-tiny-INT4", "--dry-run")
        assert r.returncode == 0, r.stderr
        assert hub.state.requests == []  # a dry run touches no network
    finally:
        hub.close()
        (dst / "scratch.partial").unlink()
    listed = {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].replace(",", "").isdigit():
            listed[parts[1]] = int(parts[0].replace(",", ""))
    assert set(listed) == _expected_files(dst)
    for name, n in listed.items():
        if name != "README.md":  # the card is listed as it would be rewritten
            assert (dst / name).stat().st_size == n, name
    assert "vllm serve org/GLM-tiny-INT4" in r.stdout
    assert (dst / "README.md").read_text() == before  # dry run writes nothing
    assert TOKEN not in r.stdout + r.stderr


def test_push_end_to_end_then_resume_after_kill(converted, tmp_path):
    _, dst = converted
    home = tmp_path / "home"
    state = HubState(token=TOKEN, stall_after=1)
    hub = Hub(state)
    try:
        # 1. interrupted: the server completes one LFS upload, holds the next; we kill the client
        proc = subprocess.Popen([sys.executable, "-c", CLI, "push", str(dst), "org/GLM-tiny-INT4",
                                 "--private"], env=_env(hub, home), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        assert state.stalled.wait(60), "the client never reached the second upload"
        proc.kill()
        out1, err1 = proc.communicate(timeout=30)
        first = list(state.uploads)
        assert len(first) == 1 and state.repos["org/GLM-tiny-INT4"].commits == []
        assert state.repos["org/GLM-tiny-INT4"].private

        # 2. the same command again: only the missing objects are sent, then one commit
        state.stall_after = None
        state.release.set()
        r = _push(hub, home, str(dst), "org/GLM-tiny-INT4", "--private")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().endswith(state.repos["org/GLM-tiny-INT4"].heads["main"])
    finally:
        hub.close()

    shards = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(shards) >= 3
    assert len(state.uploads) == len(shards) and len(set(state.uploads)) == len(shards)
    assert state.uploads[0] == first[0]  # resumed: the finished object was not sent again

    remote = state.files("org/GLM-tiny-INT4")
    assert set(remote) == _expected_files(dst)
    for name, data in remote.items():
        assert data == (dst / name).read_bytes(), f"{name} arrived with different bytes"
    assert "vllm serve org/GLM-tiny-INT4" in remote["README.md"].decode()

    # the token was used (every write carried it) and never shown or uploaded
    assert f"Bearer {TOKEN}" in state.auth_seen
    logs = out1 + err1 + r.stdout + r.stderr
    assert TOKEN not in logs
    assert all(TOKEN.encode() not in data for data in remote.values())


@pytest.mark.slow
def test_push_to_branch_and_nothing_to_do_twice(converted, tmp_path):
    _, dst = converted
    home = tmp_path / "home"
    state = HubState(token=TOKEN)
    hub = Hub(state)
    try:
        r = _push(hub, home, str(dst), "org/tiny", "--revision", "int4-g32")
        assert r.returncode == 0, r.stderr
        r2 = _push(hub, home, str(dst), "org/tiny", "--revision", "int4-g32")
        assert r2.returncode == 0, r2.stderr
        bad = _push(hub, home, str(dst), "org/other")
        hub.state.token = "hf_someOTHERtoken0000000000"  # the server now rejects ours
        denied = _push(hub, home, str(dst), "org/denied")
    finally:
        hub.close()
    repo = state.repos["org/tiny"]
    assert set(repo.branches["int4-g32"]) == _expected_files(dst)
    assert repo.branches["main"] == {}
    assert len(repo.commits) == 1  # the second push found every file unchanged
    assert len(state.uploads) == len(list(dst.glob("*.safetensors")))  # and uploaded nothing
    assert bad.returncode == 0  # a second repo reuses the stored LFS objects
    assert denied.returncode == 2 and "upload to org/denied failed" in denied.stderr
    for p in (r, r2, bad, denied):
        assert TOKEN not in p.stdout + p.stderr


def test_a_flipped_bit_or_a_borrowed_verify_report_is_refused(converted, tmp_path):
    """push re-hashes every file against the manifest (a bit flipped after verify passed is
    caught, size and time unchanged), and verify.json must name this folder's manifest."""
    _, dst = converted
    bad = _copy(dst, tmp_path / "out")
    os.utime(bad / VERIFY_JSON)
    prepare_push(bad, "org/ok", write_card=False)

    shard = min(bad.glob("*.safetensors"))
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor's data
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(Exception, match="does not match its manifest") as e:
        prepare_push(bad, "org/x", write_card=False)
    assert shard.name in str(e.value) and "sha256 differs" in str(e.value)
    with pytest.raises(Exception, match="does not match its manifest"):  # no override for this
        prepare_push(bad, "org/x", skip_verify_check=True, write_card=False)
    shard.write_bytes((dst / shard.name).read_bytes())

    report = json.loads((bad / VERIFY_JSON).read_text())
    report["manifest_sha256"] = "0" * 64  # a passing report of some other conversion
    (bad / VERIFY_JSON).write_text(json.dumps(report))
    with pytest.raises(Exception, match="not a report of this conversion"):
        prepare_push(bad, "org/x", write_card=False)


def test_push_with_token_option_and_commit_message(converted, tmp_path):
    """`--token` instead of HF_TOKEN (the server sees it on every write; it is printed nowhere,
    also not when the server refuses it) and `--commit-message` as the commit's title."""
    _, dst = converted
    home = tmp_path / "home"
    other = "hf_optionGIVENtoken9876543210fedcba"
    state = HubState(token=other)
    hub = Hub(state)
    try:
        env = {**_env(hub, home)}
        env.pop("HF_TOKEN")
        run = lambda *a: subprocess.run([sys.executable, "-c", CLI, "push", *a], env=env, cwd=ROOT,
                                        check=False, capture_output=True, text=True, timeout=120)
        r = run(str(dst), "org/tok", "--token", other, "--commit-message", "INT4 g32, RTN")
        wrong = run(str(dst), "org/tok2", "--token", TOKEN)  # a token the server refuses
    finally:
        hub.close()
    assert r.returncode == 0, r.stderr
    assert f"Bearer {other}" in state.auth_seen
    assert state.repos["org/tok"].commits[-1]["summary"] == "INT4 g32, RTN"
    assert set(state.repos["org/tok"].branches["main"]) == _expected_files(dst)
    assert wrong.returncode == 2 and "upload to org/tok2 failed" in wrong.stderr
    for p in (r, wrong):
        assert other not in p.stdout + p.stderr and TOKEN not in p.stdout + p.stderr


def test_bare_name_create_pr_and_json(converted, tmp_path):
    """A bare repo name goes into the token user's namespace (whoami, as the hf CLI does);
    `--create-pr` leaves main as it was and puts the files on refs/pr/1; `--json` prints the
    pushed files and the URL as strict JSON with its schema version."""
    _, dst = converted
    state = HubState(token=TOKEN)
    hub = Hub(state)
    try:
        first = _push(hub, tmp_path / "home", str(dst), "GLM-tiny-INT4", "--json")
        before = dict(state.repos["tester/GLM-tiny-INT4"].branches["main"])
        pr = _push(hub, tmp_path / "home", str(dst), "tester/GLM-tiny-INT4", "--create-pr",
                   "--commit-message", "review me", "--base-model", "zai-org/GLM-5.2-FP8")  # a new card
    finally:
        hub.close()
    assert first.returncode == 0, first.stderr
    rep = json.loads(first.stdout)
    assert rep["schema_version"] == 1 and rep["repo_id"] == "tester/GLM-tiny-INT4"
    assert {f["name"] for f in rep["files"]} == _expected_files(dst)
    assert rep["url"].startswith(hub.url) and rep["total_bytes"] == sum(f["bytes"] for f in rep["files"])
    repo = state.repos["tester/GLM-tiny-INT4"]
    assert set(repo.branches["main"]) == _expected_files(dst)
    assert pr.returncode == 0, pr.stderr
    assert pr.stdout.strip().endswith("/tester/GLM-tiny-INT4/discussions/1")
    assert repo.branches["main"] == before and "refs/pr/1" in repo.branches
    assert repo.commits[-1]["summary"] == "review me" and repo.commits[-1]["revision"] == "refs/pr/1"


def test_bare_name_offline_and_a_lowered_verify_floor_are_refused(converted, tmp_path):
    src, dst = converted
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", CLI, "push", str(dst), "GLM-tiny-INT4", "--dry-run"],
                       env=env, cwd=ROOT, check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "HF_HUB_OFFLINE" in r.stderr and "my-org/GLM-tiny-INT4" in r.stderr
    # a full repo id under HF_HUB_OFFLINE: said as offline mode, not as a token problem
    r = subprocess.run([sys.executable, "-c", CLI, "push", str(dst), "org/GLM-tiny-INT4"],
                       env={**env, "COLUMNS": "300"}, cwd=ROOT, check=False, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "HF_HUB_OFFLINE is set" in r.stderr and "HF_TOKEN" not in r.stderr, r.stderr
    low = tmp_path / "low"
    low.mkdir()
    for p in dst.iterdir():
        (low / p.name).write_bytes(p.read_bytes())
    assert verify(src, low, min_sqnr_db=3.0).ok  # passes a weaker check than push asks for
    with pytest.raises(Exception, match="lower SQNR floor"):
        prepare_push(low, "org/x", write_card=False)
    assert verify(src, low).ok  # the default floor again: publishable
    assert prepare_push(low, "org/x", write_card=False).files


def test_push_from_a_read_only_folder_is_one_line(converted, tmp_path):
    """A verified output on a read-only mount: push (which refreshes the card) fails in one
    line naming the file and the fix, no OSError traceback (on 1d01519 a traceback)."""
    import shutil

    probe = subprocess.run(["unshare", "--mount", "--map-root-user", "true"], capture_output=True,
                           check=False) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("this machine gives no mount namespace to remount read-only in")
    _, dst = converted
    ro = _copy(dst, tmp_path / "ro")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "300",
           "HF_HUB_OFFLINE": "0"}
    script = (f'mount --bind "{ro}" "{ro}" && mount -o remount,bind,ro "{ro}" && '
              f'exec "{sys.executable}" -c "{CLI}" push "{ro}" org/x')
    r = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c", script], env=env,
                       capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "README.md" in r.stderr and "could not write" in r.stderr, r.stderr
