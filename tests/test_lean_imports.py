"""An RTN conversion and `verify --no-layer-check` never import transformers or
compressed-tensors (whose import reads and compiles transformers: seconds on a warm cache,
13-25 s on a GPU node while the stream keeps the disk busy, BENCHMARKS.md): config.json's
quantization_config is written and compared as compressed-tensors' schema without them
(tests/test_schemes.py proves compressed-tensors reads it as its own). Whole CLI processes,
their imports listed by Python itself (-X importtime)."""

import os
import subprocess
import sys

from quantize.source.synth import tiny_config, write_checkpoint

HEAVY = ("transformers", "compressed_tensors", "accelerate")


def _imported(args: list[str], tmp_path) -> set[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "quantize", *args], check=False,
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    names = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines()
             if line.startswith("import time:")}
    assert "quantize.pipeline" in names or "quantize.check.verify" in names  # (the listing works)
    return {n.split(".")[0] for n in names}


def test_rtn_convert_and_verify_without_layers_import_neither_library(tmp_path):
    src = write_checkpoint(tmp_path / "src", tiny_config("glm_moe_dsa"), "fp8-block", seed=3)
    out = tmp_path / "out"
    top = _imported(["convert", str(src), str(out), "--method", "rtn", "--device", "cpu"], tmp_path)
    assert not top & set(HEAVY), sorted(top & set(HEAVY))
    assert (out / "config.json").exists()
    top = _imported(["verify", str(src), str(out), "--device", "cpu", "--no-layer-check"], tmp_path)
    assert not top & set(HEAVY), sorted(top & set(HEAVY))
    # and with the layer check, verify imports transformers (its classes run the layers)
    top = _imported(["verify", str(src), str(out), "--device", "cpu"], tmp_path)
    assert "transformers" in top
