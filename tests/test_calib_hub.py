"""`--calib ORG/NAME[@REV][:SPLIT]`: calibration text from a Hub dataset, against the loopback Hub.

The dataset's split files are fetched into HF_HOME and read in path order; the calibration
tokens (and so the INT4 output) equal a run on a local file holding the same documents.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hubserver import Hub, HubState

from quantize.source.hub import is_dataset_spec, split_files
from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CLI = "from quantize.cli import app; app()"


def test_split_files_follow_the_hub_layouts():
    ultrachat = ["README.md", ".gitattributes", "data/train_sft-00000-of-00002.parquet",
                 "data/train_sft-00001-of-00002.parquet", "data/test_sft-00000-of-00001.parquet",
                 "data/train_gen-00000-of-00001.parquet"]
    assert split_files(ultrachat, "train_sft") == ultrachat[2:4]
    assert split_files(ultrachat, "test_sft") == [ultrachat[4]]
    assert split_files(ultrachat, "train") == []  # train_sft is not the train split
    assert split_files(ultrachat, None) == sorted(ultrachat[2:])  # no train split: every data file
    plain = ["train.jsonl", "validation.jsonl", "notes.md", "train/extra.txt", "x/.hidden.jsonl"]
    assert split_files(plain, None) == ["train.jsonl", "train/extra.txt"]
    assert split_files(plain, "validation") == ["validation.jsonl"]
    assert split_files(["docs/corpus-train.jsonl", "docs/corpus-test.jsonl"], None) == [
        "docs/corpus-train.jsonl"]


def test_dataset_spec_is_only_what_no_local_path_claims(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_dataset_spec("HuggingFaceH4/ultrachat_200k")
    assert is_dataset_spec("org/name@v1.0:train_sft")
    (tmp_path / "org").mkdir()
    assert not is_dataset_spec("org/name")  # a folder `org` here: a mistyped local path
    (tmp_path / "org" / "name").write_text("local text")
    assert not is_dataset_spec("org/name")
    for s in ("calib.jsonl", "./a/b", "/abs/x", "a/b/c", None):
        assert not is_dataset_spec(s)


def _docs(tag: str, n: int) -> list[dict]:
    words = ["model", "layer", "expert", "token", "weight", "scale", "group", "shard", "calibration", "routing"]
    return [{"text": f"{tag} document {i}: " + " ".join(words[(i + j) % len(words)] for j in range(60))}
            for i in range(n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibhub")
    cfg = tiny_config("glm4_moe")
    src = write_checkpoint(root / "GLM-tiny-FP8", cfg, "fp8-channel", seed=5)
    write_tokenizer(src, cfg["vocab_size"])
    ds = root / "ds"
    (ds / "data").mkdir(parents=True)
    train = _docs("train", 30)
    half = len(train) // 2  # two train files: read in path order
    for name, recs in (("data/train-00000-of-00002.jsonl", train[:half]),
                       ("data/train-00001-of-00002.jsonl", train[half:]),
                       ("data/test-00000-of-00001.jsonl", _docs("test", 30))):
        (ds / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    (ds / "README.md").write_text("---\nlicense: cc0-1.0\n---\n# a calibration set\n")
    local = root / "train.jsonl"  # the same train documents, one local file
    local.write_text("".join(json.dumps(r) + "\n" for r in train))
    state = HubState()
    hub = Hub(state)
    sha = state.add_repo("org/calib-set", ds, repo_type="dataset")
    yield {"hub": hub, "src": src, "local": local, "sha": sha, "root": root}
    hub.close()


def _convert(setup, home: Path, dst: Path, calib: str, *extra: str, offline: bool = False
             ) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=setup["hub"].url, HF_HOME=str(home), HF_HUB_DISABLE_XET="1",
               HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    args = ["convert", str(setup["src"]), str(dst), "--method", "gptq", "--num-samples", "4",
            "--seq-len", "64", "--device", "cpu", "--tp", "1", "--calib", calib, *extra]
    return subprocess.run([sys.executable, "-c", CLI, *args], env=env, cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_hub_dataset_calibrates_as_the_same_local_text(setup, tmp_path):
    home = tmp_path / "home"
    hub_out, local_out = tmp_path / "hub", tmp_path / "local"
    r = _convert(setup, home, hub_out, "org/calib-set")
    assert r.returncode == 0, r.stderr
    r = _convert(setup, home, local_out, str(setup["local"]))
    assert r.returncode == 0, r.stderr
    m_hub = json.loads((hub_out / "quantize-manifest.json").read_text())
    m_loc = json.loads((local_out / "quantize-manifest.json").read_text())
    # the same documents in the same order: the same calibration tokens, the same INT4 bytes
    assert m_hub["calibration"]["tokens_sha256"] == m_loc["calibration"]["tokens_sha256"]
    for shard in sorted(local_out.glob("*.safetensors")):
        assert (hub_out / shard.name).read_bytes() == shard.read_bytes(), shard.name
    assert m_hub["options"]["calib"] == "org/calib-set"  # the Hub id as given, no local path
    rep = json.loads((hub_out / "calibration-report.json").read_text())["calibration"]
    assert rep["source"] == f"org/calib-set@{setup['sha'][:12]}:train"
    assert rep["documents"] == 30 and len(rep["sha256"]) == 64
    # the card names the dataset with its owner (issue 25: it showed `calib-set@...:train`)
    assert f"org/calib-set@{setup['sha'][:12]}:train" in (hub_out / "README.md").read_text()
    assert str(home) not in (hub_out / "calibration-report.json").read_text()  # no cache path
    got = sorted(p.relative_to(home).as_posix() for p in home.rglob("*.jsonl") if p.is_file())
    assert got and all("/data/train-" in g for g in got)  # only the train split was fetched

    # offline, from the cache alone: the same data, the same tokens; no request reaches the Hub
    n0 = len(setup["hub"].state.requests)
    r = _convert(setup, home, tmp_path / "offline", "org/calib-set", offline=True)
    assert r.returncode == 0, r.stderr
    m_off = json.loads((tmp_path / "offline" / "quantize-manifest.json").read_text())
    assert m_off["calibration"]["tokens_sha256"] == m_hub["calibration"]["tokens_sha256"]
    assert len(setup["hub"].state.requests) == n0
    r = _convert(setup, tmp_path / "empty-home", tmp_path / "off2", "org/calib-set", offline=True)
    assert r.returncode == 2 and "HF_HUB_OFFLINE is set" in r.stderr, r.stderr

    # another split: other documents, other tokens
    r = _convert(setup, home, tmp_path / "test", f"org/calib-set@{setup['sha']}:test")
    assert r.returncode == 0, r.stderr
    m_test = json.loads((tmp_path / "test" / "quantize-manifest.json").read_text())
    assert m_test["calibration"]["tokens_sha256"] != m_hub["calibration"]["tokens_sha256"]


@pytest.mark.slow
def test_hub_dataset_errors_name_the_split_and_the_repo(setup, tmp_path):
    r = _convert(setup, tmp_path / "home", tmp_path / "o", "org/calib-set:validation")
    assert r.returncode == 2, r.stderr
    assert "org/calib-set:validation" in r.stderr and "'validation'" in r.stderr
    assert "data/test-00000-of-00001.jsonl" in r.stderr  # what the repo does hold
    assert not (tmp_path / "o").exists()  # refused before the output folder is touched
    r = _convert(setup, tmp_path / "home", tmp_path / "o2", "org/no-such-set")
    assert r.returncode == 2 and "org/no-such-set" in r.stderr and "HTTP 404" in r.stderr, r.stderr
    assert not (tmp_path / "o2").exists()
