"""The Triton kernel tests' runner: a test script in a fresh Python, compiled on a GPU, else
under Triton's interpreter (TRITON_INTERPRET=1, which must be set before triton is imported,
hence the subprocess). Tests import it as `from triton_script import ...` (tests/ is on the
path, as for hubserver.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest


def needs_triton(instead: str):
    """Skip the module where triton is not installed (CPU builds of torch, CI); `instead`: the
    path those machines run."""
    return pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                              reason=f"triton not installed (CPU torch): {instead}")


def run_script(script: str, timeout: int) -> str:
    """`script` run by `python -c` (the interpreter where no GPU is); its stdout. The test fails
    with the tail of its stderr when it exits non-zero."""
    env = dict(os.environ)
    import torch

    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       check=False, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout
