"""The documents stay short, linked, strict and runnable (issue 57).

- README.md is a front door (at most 260 lines) and BENCHMARKS.md a results page (at most
  320): the details live in docs/, the history of each figure under benchmarks/history/.
- Every relative link in README.md and docs/*.md names a file that exists, and a `#fragment`
  into a Markdown file names one of its headings (GitHub's anchors).
- Every JSON file under benchmarks/ is strict JSON: `NaN` / `Infinity` are refused (Python's
  json module reads them by default; other readers do not).
- The README's quick start runs as written on the demo checkpoint. Its fenced commands are
  taken from the section as they stand, with these substitutions and no others:

      ./GLM-5.2-FP8               -> the demo checkpoint (`python scripts/demo.py build DIR`,
                                     as `make demo` builds it: 4 layers + MTP, 16 experts)
      ./GLM-5.2-INT4              -> a fresh output folder
      --num-samples N             -> --num-samples 8   (the recipe's 512 x 2048 scaled down to
      --seq-len N                 -> --seq-len 64       8 x 64 tokens: seconds on a CPU)
      convert / verify / eval     -> + --device cpu    (make test has no GPU)
      eval without --num-samples  -> + --num-samples 2 --seq-len 64 --ood-samples 1
      torchrun --nproc-per-node 8 -> python -m torch.distributed.run --standalone
                                     --nproc-per-node 2 (gloo on the CPU; marked slow)

  and each must exit 0. The recipe itself is checked too: the quick start's convert is
  `--method gptq --num-samples 512 --seq-len 2048`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
LINKED = [README, *sorted((ROOT / "docs").glob("*.md"))]

SRC, DST = "./GLM-5.2-FP8", "./GLM-5.2-INT4"
SMALL = {"--num-samples": "8", "--seq-len": "64"}
ON_DEVICE = {"convert", "verify", "eval"}  # the commands with --device
EVAL_SMALL = ["--num-samples", "2", "--seq-len", "64", "--ood-samples", "1"]
RECIPE = ["--method", "gptq", "--num-samples", "512", "--seq-len", "2048"]


# --- length --------------------------------------------------------------------------------

@pytest.mark.parametrize(("doc", "most"), [(README, 260), (BENCHMARKS, 320)])
def test_front_pages_stay_short(doc, most):
    n = len(doc.read_text(encoding="utf-8").splitlines())
    assert n <= most, f"{doc.name} has {n} lines (at most {most}): move details to docs/ or history"


# --- links ---------------------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces -> '-';
    a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", md.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(md: Path) -> list[str]:
    text = _FENCE.sub("", md.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return _LINK.findall(text)


def test_the_docs_pages_exist():
    names = {p.name for p in LINKED[1:]}
    assert names >= {"recipes.md", "formats.md", "calibration.md", "resume.md", "multi-gpu.md",
                     "proofs.md", "development.md"}, names


@pytest.mark.parametrize("md", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file(md):
    bad = []
    for target in _links(md):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
            continue  # http(s):, mailto:: not ours to check offline
        path, _, frag = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(f"{target}: no such file {dest}")
        elif frag and dest.suffix == ".md" and frag not in _anchors(dest):
            bad.append(f"{target}: {dest.name} has no heading with the anchor #{frag}")
    assert not bad, f"{md.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_the_readme_links_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in _links(README)}
    missing = [p.name for p in LINKED[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


# --- strict JSON ---------------------------------------------------------------------------

def _refuse(name: str):
    raise ValueError(f"{name} is not JSON (write null where the value is undefined)")


def test_every_benchmark_json_is_strict():
    files = sorted((ROOT / "benchmarks").rglob("*.json"))
    assert files
    bad = []
    for f in files:
        try:
            json.loads(f.read_text(encoding="utf-8"), parse_constant=_refuse)
        except ValueError as e:
            bad.append(f"{f.relative_to(ROOT)}: {e}")
    assert not bad, "\n".join(bad)


# --- the quick start -----------------------------------------------------------------------

def _quick_start() -> list[list[str]]:
    """The fenced commands of the README's quick-start section, as argument lists."""
    text = README.read_text(encoding="utf-8")
    m = re.search(r"^## Quick start.*?$(.*?)(?=^## )", text, re.DOTALL | re.MULTILINE)
    assert m, "README.md has no '## Quick start' section"
    cmds = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", m.group(1), re.DOTALL | re.MULTILINE):
        for line in block.splitlines():
            args = shlex.split(line, comments=True)
            if args:
                assert args[0] in {"quantize", "torchrun"}, f"not a quantize command: {line}"
                cmds.append(args)
    return cmds


def _scaled(args: list[str], src: Path, dst: Path) -> list[str]:
    """One quick-start command with the module docstring's substitutions, nothing else."""
    out, it = [], iter(args)
    for a in it:
        key, eq, _ = a.partition("=")
        if key in SMALL:
            if not eq:
                next(it)  # the value after the flag
            out += [key, SMALL[key]]
        else:
            out.append({SRC: str(src), DST: str(dst)}.get(a, a))
    cmd = out[1] if out[0] == "quantize" else out[out.index("quantize") + 1]
    if cmd in ON_DEVICE:
        out += ["--device", "cpu"]
    if cmd == "eval" and "--num-samples" not in out:
        out += EVAL_SMALL
    if out[0] == "torchrun":
        assert out[1:3] == ["--nproc-per-node", "8"], out
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                "2", *out[3:]]
    return [sys.executable, "-m", "quantize", *out[1:]]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200",
            "HF_HUB_OFFLINE": "1", "QUANTIZE_DIST_TIMEOUT_MIN": "3"}


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, f"{shlex.join(cmd)}\nexit {r.returncode}\n{r.stderr[-4000:]}"


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("demo") / "GLM-tiny-FP8"
    _run([sys.executable, str(ROOT / "scripts" / "demo.py"), "build", str(src)])
    return src


def test_the_quick_start_is_the_recommended_recipe():
    cmds = _quick_start()
    one = [c for c in cmds if c[:2] == ["quantize", "convert"]]
    many = [c for c in cmds if c[0] == "torchrun"]
    assert len(one) == 1 and len(many) == 1, cmds
    for c in (one[0], many[0]):
        assert c[c.index("convert") + 1: c.index("convert") + 3] == [SRC, DST], c
        flags = c[c.index("convert") + 3:]
        assert all(f in flags for f in RECIPE) and " ".join(RECIPE) in " ".join(flags), c
    assert {c[1] for c in cmds if c[0] == "quantize"} >= {"plan", "convert", "verify"}, cmds


def test_the_quick_start_runs_on_the_demo_checkpoint(demo, tmp_path):
    """The one-GPU block, in order: plan, convert, verify, eval."""
    dst = tmp_path / "GLM-tiny-INT4"
    cmds = [c for c in _quick_start() if c[0] == "quantize"]
    for c in cmds:
        _run(_scaled(c, demo, dst))
    assert json.loads((dst / "verify.json").read_text())  # the verify of the quick start wrote it


@pytest.mark.slow
def test_the_quick_start_torchrun_command_runs_on_the_demo_checkpoint(demo, tmp_path):
    dst = tmp_path / "GLM-tiny-INT4-torchrun"
    (cmd,) = [c for c in _quick_start() if c[0] == "torchrun"]
    _run(_scaled(cmd, demo, dst))
    assert (dst / "model.safetensors.index.json").is_file()
