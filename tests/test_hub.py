"""Hub sources (`quantize plan/inspect/convert org/name`) against the loopback Hub.

plan/inspect must read only config.json and the shards' headers (range requests); convert
downloads a snapshot into HF_HOME and the card names the repo and its exact commit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hubserver import Hub, HubState

from quantize.source.synth import tiny_config, write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CLI = "from quantize.cli import app; app()"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    src = tmp_path_factory.mktemp("hubsrc") / "GLM-tiny-FP8"
    write_checkpoint(src, tiny_config())
    state = HubState()
    h = Hub(state)
    h.sha = state.add_repo("zai-org/GLM-tiny-FP8", src)
    h.src = src
    yield h
    h.close()


def _run(hub: Hub, home: Path, *args: str, cwd: Path = ROOT, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_HUB_DISABLE_XET="1",
               HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return subprocess.run([sys.executable, "-c", CLI, *args], env=env, cwd=cwd, check=False,
                          capture_output=True, text=True, timeout=120)


def test_plan_and_inspect_read_headers_only(hub, tmp_path):
    n0 = len(hub.state.requests)
    remote = _run(hub, tmp_path / "home", "plan", "zai-org/GLM-tiny-FP8", "--json", "--tp", "2")
    assert remote.returncode == 0, remote.stderr
    local = _run(hub, tmp_path / "home", "plan", str(hub.src), "--json", "--tp", "2")
    assert json.loads(remote.stdout) == json.loads(local.stdout)  # same plan, byte for byte
    shard_gets = [r for r in hub.state.requests[n0:]
                  if r[0] == "GET" and r[1].endswith(".safetensors")]
    # every shard read is a bounded range from 0, well short of the file: headers only
    import re

    assert shard_gets
    for _, path, rng in shard_gets:
        m = re.fullmatch(r"bytes=0-(\d+)", rng or "")
        size = (hub.src / path.rsplit("/", 1)[-1]).stat().st_size
        assert m and int(m.group(1)) + 1 < size, (path, rng, size)

    ins = _run(hub, tmp_path / "home", "inspect", "zai-org/GLM-tiny-FP8", "--json")
    assert ins.returncode == 0, ins.stderr
    assert json.loads(ins.stdout)["format"] == "fp8-block"


@pytest.mark.slow
def test_convert_downloads_and_card_names_base_model(hub, tmp_path):
    home, out = tmp_path / "home", tmp_path / "out"
    r = _run(hub, home, "convert", "zai-org/GLM-tiny-FP8", str(out), "--revision", hub.sha)
    assert r.returncode == 0, r.stderr
    snap = home / "hub" / "models--zai-org--GLM-tiny-FP8" / "snapshots" / hub.sha
    assert (snap / "config.json").is_file()
    assert (snap / "config.json").is_symlink()  # the standard cache: `hf download` reuses it
    manifest = json.loads((out / "quantize-manifest.json").read_text())
    src = manifest["source"]  # the snapshot's repo and commit, not its local path
    assert (src["name"], src["repo_id"], src["revision"]) == ("zai-org/GLM-tiny-FP8",) * 2 + (hub.sha,)
    assert str(home) not in json.dumps(manifest)
    card = (out / "README.md").read_text()
    from huggingface_hub import ModelCard

    meta = ModelCard(card).data.to_dict()  # as the Hub reads the front matter
    assert meta["base_model"] == "zai-org/GLM-tiny-FP8" and meta["base_model_relation"] == "quantized"
    assert f"at revision `{hub.sha}`" in card
    assert (out / "generation_config.json").is_file()  # non-weight files came along
    v = _run(hub, home, "verify", "zai-org/GLM-tiny-FP8", str(out))  # main resolves to hub.sha
    assert v.returncode == 0, v.stderr
    # the same conversion from the local folder the Hub repo was seeded from: every weight
    # shard, the index and config.json byte for byte
    local = tmp_path / "local"
    r = _run(hub, home, "convert", str(hub.src), str(local))
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert names and names == sorted(p.name for p in local.glob("*.safetensors"))
    for n in [*names, "model.safetensors.index.json", "config.json"]:
        assert (out / n).read_bytes() == (local / n).read_bytes(), n


def test_missing_repo_and_local_revision_are_clear_errors(hub, tmp_path):
    r = _run(hub, tmp_path / "home", "plan", "zai-org/No-Such-Model")
    assert r.returncode == 2 and "HTTP 404" in r.stderr and "check the repo id" in r.stderr
    r = _run(hub, tmp_path / "home", "plan", str(hub.src), "--revision", "main")
    assert r.returncode == 2 and "--revision only applies to Hub sources" in r.stderr


@pytest.mark.slow
def test_mistyped_local_path_is_not_sent_to_the_hub(hub, tmp_path):
    """`demo/GLM-tiny-FP9` beside a `demo/` folder is a typo of a local path: said at once,
    with the closest folder, and not one request reaches the Hub (it used to spend 34 s on 6
    requests and then blame HF_HUB_OFFLINE, which was not set). Paths written as paths are
    never repo ids; a real repo id that cannot be fetched offline names the variable only
    when it is set."""
    (tmp_path / "demo" / "GLM-tiny-FP8").mkdir(parents=True)
    before = len(hub.state.requests)
    for args in (["inspect", "demo/GLM-tiny-FP9"], ["plan", "demo/GLM-tiny-FP9"],
                 ["convert", "demo/GLM-tiny-FP9", "out", "--device", "cpu"]):
        r = _run(hub, tmp_path / "home", *args, cwd=tmp_path)
        assert r.returncode == 2, r.stderr
        assert "no such folder (demo/ exists)" in r.stderr and "did you mean demo/GLM-tiny-FP8" in r.stderr
    for path in ("./nope/model", "/nonexistent-root/model", "nope/model/"):
        r = _run(hub, tmp_path / "home", "inspect", path, cwd=tmp_path)
        assert r.returncode == 2 and "no such folder" in r.stderr, r.stderr
    assert len(hub.state.requests) == before  # nothing went to the Hub
    assert not (tmp_path / "out").exists()
    r = _run(hub, tmp_path / "home", "inspect", "zai-org/GLM-tiny-FP8", cwd=tmp_path, HF_HUB_OFFLINE="1")
    assert r.returncode == 2 and "HF_HUB_OFFLINE is set" in r.stderr and "unset HF_HUB_OFFLINE" in r.stderr
    r = _run(hub, tmp_path / "home", "inspect", "zai-org/GLM-tiny-FP8", cwd=tmp_path)
    assert r.returncode == 0, r.stderr  # the same id online: a repo id, read from the Hub
