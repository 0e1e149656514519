"""Nothing `push` uploads holds a local path of the machine that converted (issue 12, item 5).

A user converts from a local copy (as `hf download --local-dir` leaves it) with their own
calibration file, verifies, evaluates and prepares the push, all through the CLI as a
subprocess; every uploaded file (the card, the manifest with its recorded command, verify.json,
the calibration report, config and shards) and eval.json is then searched for the temporary
folder's path. The source is named by `--base-model` and the commit `hf download` recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from quantize.publish.push import prepare_push
from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer

ROOT = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def quantize(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The CLI as its console script runs it (argv[0] `quantize`: the command is recorded)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    code = "import sys; sys.argv[0] = 'quantize'; from quantize.cli import app; app()"
    r = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, check=False,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.mark.slow
def test_uploaded_files_hold_no_local_path(tmp_path):
    cfg = tiny_config("glm4_moe")
    src = write_checkpoint(tmp_path / "models" / "GLM-tiny-FP8", cfg, "fp8-channel")
    write_tokenizer(src, cfg["vocab_size"])
    (src / "README.md").write_text("---\nlicense: mit\n---\n# GLM-tiny\n")
    meta = src / ".cache" / "huggingface" / "download"  # what `hf download --local-dir` leaves
    meta.mkdir(parents=True)
    (meta / "config.json.metadata").write_text(f"{COMMIT}\n\"etag\"\n1760000000.0\n")
    calib = tmp_path / "data" / "my-calib.jsonl"
    calib.parent.mkdir()
    calib.write_text("".join(json.dumps({"text": f"Document {i}: " + "the quick brown fox " * 40})
                             + "\n" for i in range(40)))
    dst = tmp_path / "out" / "GLM-tiny-INT4"
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()

    quantize("convert", str(src), str(dst), "--method", "gptq", "--num-samples", "8",
             "--seq-len", "64", f"--calib={calib}", "--base-model", "zai-org/GLM-4.6-FP8",
             "--device", "cpu", "--tp", "1", cwd=elsewhere)
    quantize("verify", str(src), str(dst), cwd=elsewhere)
    quantize("eval", str(src), str(dst), "--data", str(calib), "--num-samples", "2",
             "--seq-len", "64", "--device", "cpu", cwd=elsewhere)

    plan = prepare_push(dst, "me/GLM-tiny-INT4")
    names = [f.name for f in plan.files]
    assert {"README.md", "verify.json", "quantize-manifest.json", "config.json"} <= set(names)
    assert "calibration-report.json" in names
    leaks = {str(tmp_path), str(tmp_path.resolve())}
    for name in [*names, "eval.json"]:
        data = (dst / name).read_bytes()
        for leak in leaks:
            assert leak.encode() not in data, f"{name} holds the local path {leak}"

    m = json.loads((dst / "quantize-manifest.json").read_text())
    assert m["source"]["name"] == m["source"]["repo_id"] == "zai-org/GLM-4.6-FP8"
    assert m["source"]["revision"] == COMMIT and m["source"]["license"] == "mit"
    assert m["command"].startswith("quantize convert zai-org/GLM-4.6-FP8 GLM-tiny-INT4 ")
    assert "--calib=my-calib.jsonl" in m["command"]
    # every flag with its value (issue 25: the values lost their flags)
    assert m["command"].endswith("--method gptq --num-samples 8 --seq-len 64 --calib=my-calib.jsonl "
                                 "--base-model zai-org/GLM-4.6-FP8 --device cpu --tp 1"), m["command"]
    card = ModelCard.load(dst / "README.md")
    assert card.data.base_model == "zai-org/GLM-4.6-FP8" and card.data.license == "mit"
    assert json.loads((dst / "verify.json").read_text())["src"] == "zai-org/GLM-4.6-FP8"
    assert json.loads((dst / "eval.json").read_text())["options"]["data"] == "my-calib.jsonl"


def test_base_model_must_be_a_repo_id(tmp_path):
    cfg = tiny_config("glm4_moe")
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-channel")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "quantize", "convert", str(src), str(tmp_path / "o"),
                        "--base-model", "not a repo"], env=env, capture_output=True, text=True, check=False,
                       timeout=300)
    assert r.returncode != 0
    assert "--base-model" in r.stderr and "ORG/NAME" in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("typed", ["{d}/", "{d}//", "{p}/./GLM-INT4", "{p}//GLM-INT4/", "{p}/x/../GLM-INT4"])
def test_recorded_command_names_a_new_dst_however_typed(tmp_path, typed):
    """DST does not exist yet when the command is recorded; typed with a trailing `/`, `//`,
    `/./` or `..` it is still the output folder and is recorded by its name alone (on
    1d01519 the manifest and the pushed card held the local path)."""
    from quantize.cli.run_record import public_command

    src = write_checkpoint(tmp_path / "GLM-tiny-FP8", tiny_config("glm4_moe"), "fp8-channel")
    dst = tmp_path / "GLM-INT4"
    word = typed.format(d=dst, p=tmp_path)
    for s in (str(src), f"{src}/"):
        cmd = public_command(["convert", s, word, "--method", "rtn"], s, Path(word), None)
        assert str(tmp_path) not in cmd, cmd
        assert cmd == "quantize convert GLM-tiny-FP8 GLM-INT4 --method rtn", cmd
