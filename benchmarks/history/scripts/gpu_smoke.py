"""GPU smoke of the whole CLI: the demo checkpoint converted, verified and evaluated on a GPU.

    python3 benchmarks/history/scripts/gpu_smoke.py --out benchmarks/h200_gpu_smoke.json [--device cuda]

Builds the demo's tiny GLM-5-architecture block-FP8 checkpoint (`scripts/demo.py build`: random
weights, real tokenizer, MTP layer), then for each method runs `quantize convert` on DEVICE,
`quantize verify` of the output on DEVICE and on the CPU, and `quantize eval` on DEVICE, each as
its own process with `--json`, and writes every command, its exit status, wall seconds and JSON
summary to OUT. Exits 1 when any step fails. With `--device cpu` it runs anywhere (how the
script itself is tested); its figures are only a smoke on random weights: whether each step
runs and passes, and the perplexity ratio and KL eval reports.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _run(cmd: list[str], log: Path) -> dict:
    t = time.perf_counter()
    p = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
    dt = time.perf_counter() - t
    log.write_text(f"$ {' '.join(cmd)}\n{p.stderr}\n--- stdout\n{p.stdout}")
    try:
        summary = json.loads(p.stdout) if p.stdout.strip() else None
    except json.JSONDecodeError:
        summary = None
    print(f"rc {p.returncode} in {dt:.1f} s: {' '.join(cmd[2:5])}", file=sys.stderr, flush=True)
    return {"command": " ".join(["quantize", *cmd[3:]]), "rc": p.returncode,
            "seconds": round(dt, 2), "json": summary,
            "stderr_tail": p.stderr[-2000:] if p.returncode else None}


def _sections(dst: Path, device: str) -> dict:
    """The rounding phase's split in calibration/timings.json: every MoE layer has one, with
    GPU seconds where the run used CUDA (events), host seconds everywhere."""
    layers = json.loads((dst / "calibration" / "timings.json").read_text())["layers"]
    split = {lay["layer"]: lay["rounding_sections_s"] for lay in layers if "rounding_sections_s" in lay}
    ok = bool(split) and all(v["host"] and "gpu_error" not in v
                             and (bool(v["gpu"]) == device.startswith("cuda")) for v in split.values())
    return {"command": "calibration/timings.json rounding_sections_s", "rc": 0 if ok else 1,
            "seconds": 0.0, "json": split, "stderr_tail": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--methods", default="gptq,awq+gptq")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--num-samples", type=int, default=16)
    a = ap.parse_args()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "GLM-tiny-FP8"
    subprocess.run([sys.executable, "scripts/demo.py", "build", str(src)], cwd=ROOT, check=True)
    q = [sys.executable, "-m", "quantize"]
    runs = {}
    for method in a.methods.split(","):
        dst = work / f"out-{method.replace('+', '-')}"
        tag = method.replace("+", "-")
        shutil.rmtree(dst, ignore_errors=True)  # a fresh conversion each run, not a resume
        steps = [
            ("convert", q + ["convert", str(src), str(dst), "--method", method, "--device",
                             a.device, "--json"]
             + ([] if method == "rtn" else ["--num-samples", str(a.num_samples), "--seq-len", "256"])),
            ("verify", q + ["verify", str(src), str(dst), "--device", a.device, "--json"]),
            ("eval", q + ["eval", str(src), str(dst), "--device", a.device, "--num-samples", "8",
                          "--seq-len", "256", "--json"]),
        ]
        if a.device != "cpu":  # the GPU's output verified by the CPU path too
            steps.insert(2, ("verify_cpu", q + ["verify", str(src), str(dst), "--device", "cpu",
                                                "--json"]))
        runs[method] = {}
        for name, cmd in steps:
            runs[method][name] = _run(cmd, work / f"{tag}-{name}.log")
            if runs[method][name]["rc"] and name == "convert":
                break
            if name == "convert":
                runs[method]["timings"] = _sections(dst, a.device)
    ok = all(s["rc"] == 0 for r in runs.values() for s in r.values())
    gpu = None
    if a.device.startswith("cuda"):
        import torch
        gpu = torch.cuda.get_device_name(0)
    out = {"command": "python3 benchmarks/history/scripts/gpu_smoke.py " + " ".join(sys.argv[1:]),
           "machine": {"python": platform.python_version(), "platform": platform.platform(),
                       "gpu": gpu},
           "source": "scripts/demo.py build (random weights)", "device": a.device,
           "all_passed": ok, "runs": runs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}: {'all passed' if ok else 'FAILED'}", file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
