"""mk/pipeline.mk: `make -n all` prints the chain; a real `make all` (push in dry run) on a tiny
checkpoint runs it, and a second `make all` skips every finished step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def _wrapper(tmp_path: Path) -> Path:
    """What the main Makefile provides (PY, QUANTIZE), pointed at this checkout."""
    mk = tmp_path / "Makefile"
    mk.write_text(f"PY := {sys.executable}\n"
                  f"QUANTIZE := {sys.executable} -c 'from quantize.cli import app; app()'\n"
                  f"include {ROOT / 'mk' / 'pipeline.mk'}\n")
    return mk


def _make(mk: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run(["make", "--no-print-directory", "-f", str(mk), *args], cwd=ROOT, env=env,
                          check=False, capture_output=True, text=True, timeout=300)


def test_make_n_all_prints_the_chain(tmp_path):
    out = tmp_path / "GLM-5.2-INT4"
    r = _make(_wrapper(tmp_path), "-n", "all", "MODEL=zai-org/GLM-5.2-FP8", f"OUT={out}",
              "REPO=my-org/GLM-5.2-INT4", "GROUP_SIZE=64", "TP=4", "PRIVATE=1")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if "quantize.cli" in x]
    steps = [x.split("app()'")[1].split()[0] for x in lines]
    assert steps == ["plan", "convert", "verify", "eval", "push"]  # eval by default: the card's figures
    assert "convert zai-org/GLM-5.2-FP8 " + str(out) in lines[1] and "--group-size 64" in lines[1]
    assert "--tp 4" in lines[0] and "--strict" in lines[0]
    assert lines[4].endswith(f"push {out} my-org/GLM-5.2-INT4 --revision main --private")
    r = _make(_wrapper(tmp_path), "-n", "all", "MODEL=zai-org/GLM-5.2-FP8", f"OUT={out}",
              "REPO=my-org/GLM-5.2-INT4", "EVAL=0")
    assert [x.split("app()'")[1].split()[0] for x in r.stdout.splitlines() if "quantize.cli" in x] == \
        ["plan", "convert", "verify", "push"]
    assert not out.exists()  # -n ran nothing


def test_bare_make_prints_help():
    """`make` with no target is `make help`, not the pipeline's first target (which needs MODEL)."""
    # PIPELINE_PREREQ= : were the default goal a pipeline target again, fail at once on the
    # missing MODEL rather than first building a .venv in the checkout
    r = _make(ROOT / "Makefile", "PIPELINE_PREREQ=")
    assert r.returncode == 0, r.stderr
    assert "MODEL is required" not in r.stderr
    targets = [line.split()[0] for line in r.stdout.splitlines() if line and not line[0].isspace()]
    assert {"help", "install", "plan", "convert", "verify", "push", "all"} <= set(targets), r.stdout
    assert "variables: MODEL OUT METHOD GROUP_SIZE" in r.stdout


def test_make_requires_model_and_out(tmp_path):
    r = _make(_wrapper(tmp_path), "-n", "all", "REPO=a/b")
    assert r.returncode != 0 and "MODEL is required" in r.stderr


@pytest.mark.slow
def test_make_all_runs_then_skips_finished_steps(tmp_path):
    mk = _wrapper(tmp_path)
    src, out = tmp_path / "GLM-tiny-FP8", tmp_path / "GLM-tiny-INT4"
    # expert width 512: TP 2 (and the card's default, 8) satisfies the MoE kernels (plan runs
    # with --strict); the card must serve at the TP make was given
    write_checkpoint(src, tiny_config(moe_intermediate_size=512))
    args = ("all", f"MODEL={src}", f"OUT={out}", "REPO=my-org/GLM-tiny-INT4", "TP=2", "DRY_RUN=1", "EVAL=0",
            "MAX_SHARD_SIZE=1MB")
    r = _make(mk, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((out / "verify.json").read_text())["summary"]["ok"] is True
    assert json.loads((out / "quantize-manifest.json").read_text())["status"] == "complete"
    assert (tmp_path / "GLM-tiny-INT4.plan.json").is_file()
    assert "vllm serve my-org/GLM-tiny-INT4 --tensor-parallel-size 2" in r.stdout  # the card
    assert "model-00001-of-" in r.stdout  # the dry-run file list

    again = _make(mk, *args)
    assert again.returncode == 0, again.stderr
    ran = [x.split("app()'")[1].split()[0] for x in again.stdout.splitlines() if "app()'" in x]
    assert ran == ["push"]  # plan, convert and verify are up to date

    # a conversion that is not complete is resumed, whatever files are already there
    m = json.loads((out / "quantize-manifest.json").read_text())
    m["status"] = "in-progress"
    (out / "quantize-manifest.json").write_text(json.dumps(m))
    dry = _make(mk, "-n", *args)
    ran = [x.split("app()'")[1].split()[0] for x in dry.stdout.splitlines() if "app()'" in x]
    assert ran == ["convert", "verify", "push"]


def _ran(r: subprocess.CompletedProcess) -> list[str]:
    return [x.split("app()'")[1].split()[0] for x in r.stdout.splitlines() if "app()'" in x]


@pytest.mark.slow
def test_make_all_refuses_changed_convert_options(tmp_path):
    """A finished OUT is never reused under other options: with METHOD=gptq after an RTN run,
    make reruns convert, which refuses the RTN folder (and nothing is pushed); unchanged
    options still skip convert."""
    mk = _wrapper(tmp_path)
    src, out = tmp_path / "GLM-tiny-FP8", tmp_path / "GLM-tiny-INT4"
    cfg = tiny_config(moe_intermediate_size=128)
    write_checkpoint(src, cfg)
    write_tokenizer(src, cfg["vocab_size"])  # gptq checks its calibration inputs before the folder
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    args = ("all", f"MODEL={src}", f"OUT={out}", "REPO=my-org/GLM-tiny-INT4", "TP=2", "DRY_RUN=1", "EVAL=0",
            "MAX_SHARD_SIZE=1MB")
    r = _make(mk, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _ran(_make(mk, "-n", *args)) == ["push"]  # unchanged options: convert is up to date

    gptq = (*args, "METHOD=gptq", f"CALIB={calib}", "NUM_SAMPLES=2", "SEQ_LEN=16")
    assert _ran(_make(mk, "-n", *gptq)) == ["plan", "convert", "verify", "push"]
    r = _make(mk, *gptq)
    assert r.returncode != 0
    assert _ran(r) == ["plan", "convert"]  # refused: verify and push never ran
    assert "cannot resume" in r.stderr and "option method: was 'rtn', now 'gptq'" in r.stderr
    assert "--overwrite" in r.stderr
    assert json.loads((out / "quantize-manifest.json").read_text())["options"]["method"] == "rtn"
    again = _make(mk, *gptq)  # still refused on the next run, never skipped
    assert again.returncode != 0 and "option method: was 'rtn', now 'gptq'" in again.stderr

    back = _make(mk, *args)  # the original options: the finished RTN folder is accepted again
    assert back.returncode == 0, back.stdout + back.stderr
    assert _ran(back) == ["plan", "convert", "verify", "push"]  # convert rewrote the manifest
    assert _ran(_make(mk, *args)) == ["push"]


def test_make_n_all_with_eval(tmp_path):
    out = tmp_path / "GLM-5.2-INT4"
    r = _make(_wrapper(tmp_path), "-n", "all", "MODEL=zai-org/GLM-5.2-FP8", f"OUT={out}",
              "REPO=my-org/GLM-5.2-INT4", "EVAL=1", "EVAL_FLAGS=--num-samples 64", "DEVICE=cuda")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if "quantize.cli" in x]
    assert [x.split("app()'")[1].split()[0] for x in lines] == ["plan", "convert", "verify", "eval", "push"]
    assert f"eval zai-org/GLM-5.2-FP8 {out} " in lines[3]
    assert "--device cuda" in lines[3] and "--num-samples 64" in lines[3]


def test_make_passes_every_convert_option(tmp_path):
    """Every convert option has a make variable; set, it reaches the convert command (and the
    stamp, so changing it reruns convert), empty, the CLI's default applies."""
    out = tmp_path / "o"
    r = _make(_wrapper(tmp_path), "-n", "convert", "MODEL=zai-org/GLM-5.2-FP8", f"OUT={out}",
              "METHOD=gptq", "ASYMMETRIC=1", "SEED=7", "EXPERT_CALIBRATION=all",
              "MIN_EXPERT_TOKENS=4", "EXPERT_COVERAGE=64", "PERCDAMP=0.05", "MSE_CLIP=1", "SCALE_REFIT=2",
              "CHECKPOINT_INTERVAL=0",
              "MAX_GPU_MEMORY=75", "BASE_MODEL=zai-org/GLM-5.2-FP8", "CONFIG=run.toml")
    assert r.returncode == 0, r.stderr
    (cmd,) = [x for x in r.stdout.splitlines() if "app()' convert" in x]
    for flag in ("--method gptq", "--asymmetric", "--seed 7", "--expert-calibration all",
                 "--min-expert-tokens 4", "--expert-coverage 64", "--percdamp 0.05", "--mse-clip",
                 "--scale-refit 2",
                 "--checkpoint-interval 0", "--max-gpu-memory 75",
                 "--base-model zai-org/GLM-5.2-FP8", "--config run.toml"):
        assert flag in cmd, (flag, cmd)
    (stamp,) = [x for x in r.stdout.splitlines() if x.startswith("printf")]
    assert "--percdamp 0.05" in stamp and "--max-gpu-memory" not in stamp  # where it runs: not the output
    plain = _make(_wrapper(tmp_path), "-n", "convert", "MODEL=m", f"OUT={out}")
    (cmd,) = [x for x in plain.stdout.splitlines() if "app()' convert" in x]
    assert "--seed" not in cmd and "--asymmetric" not in cmd and "--percdamp" not in cmd


@pytest.mark.slow
def test_a_failing_verify_leaves_no_report_and_nothing_is_pushed(tmp_path):
    """verify failing its floor (MIN_SQNR=99: no INT4 tensor reaches it): make stops, removes
    the failing verify.json (so the next make runs verify again), never runs push, leaves no
    push stamp; the default floor then verifies and pushes (dry run)."""
    mk = _wrapper(tmp_path)
    src, out = tmp_path / "GLM-tiny-FP8", tmp_path / "GLM-tiny-INT4"
    write_checkpoint(src, tiny_config(moe_intermediate_size=512))
    args = ("all", f"MODEL={src}", f"OUT={out}", "REPO=my-org/GLM-tiny-INT4", "TP=2", "DRY_RUN=1", "EVAL=0")
    r = _make(mk, *args, "MIN_SQNR=99")
    assert r.returncode != 0 and _ran(r) == ["plan", "convert", "verify"], r.stdout + r.stderr
    assert not (out / "verify.json").exists()
    assert not list(out.glob(".pushed-*"))
    again = _make(mk, "-n", *args)
    assert _ran(again) == ["verify", "push"]  # verify runs again, convert is up to date
    ok = _make(mk, *args)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads((out / "verify.json").read_text())["summary"]["ok"] is True
