"""A real wheel, installed outside the source tree, runs a calibrated convert on its own data."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_ships_the_default_calibration_set(tmp_path):
    """`pip wheel .` then an install into a plain folder: the package's files and the shipped
    calibration set (calib_data/default.jsonl, as quantize/_shipped/default.jsonl) are in it,
    and `python -m quantize convert --method gptq` without --calib runs from that install (not
    from this checkout) on the shipped text."""
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(dist)],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    (whl,) = dist.glob("glm_int4_quantize-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "quantize/_shipped/default.jsonl" in names and "quantize/cli/__init__.py" in names
    shipped = zipfile.ZipFile(whl).read("quantize/_shipped/default.jsonl")
    assert shipped == (ROOT / "calib_data" / "default.jsonl").read_bytes()
    # eval's out-of-domain text, the large set (--calib shipped:large) and its licence texts too
    for name in ("heldout_english.md", "large.jsonl.xz", "LICENSES/GPL-2.0.txt", "LICENSES/GPL-3.0.txt",
                 "LICENSES/BSD-3-Clause-SymPy.txt", "LICENSES/Debian-FAQ.txt"):
        assert zipfile.ZipFile(whl).read(f"quantize/_shipped/{name}") == (ROOT / "calib_data" / name).read_bytes()
    print(f"wheel {whl.name}: {whl.stat().st_size:,} bytes")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(whl)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr

    cfg = tiny_config("glm4_moe")
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-channel")
    write_tokenizer(src, cfg["vocab_size"])
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    probe = "import quantize.calib.data as c; print(c.__file__); print(c.DEFAULT_CALIB)"
    where = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                           text=True, check=True).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where  # the wheel, not the checkout
    r = subprocess.run([sys.executable, "-m", "quantize", "convert", str(src), str(tmp_path / "out"),
                        "--method", "gptq", "--num-samples", "4", "--seq-len", "32", "--device", "cpu",
                        "--tp", "1"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    card = (tmp_path / "out" / "README.md").read_text()
    assert "shipped with the tool" in card
