"""verify's cost with the layer check, on the GLM-5.2-shaped slice (one H200), whole processes.

    mkdir .old && git archive 59b908c quantize calib_data | tar -x -C .old      # the verify before the layer check
    python3 benchmarks/history/scripts/bench_verify.py --out benchmarks/h200_verify_layercheck.json --old .old

Builds the slice `scripts/bench_pipeline.py` builds (glm_moe_dsa, hidden 6144, layer 0 dense,
layer 1 MoE with 256 experts, MTP, block FP8, 21.1 GB), converts it (RTN; GPTQ and AWQ+GPTQ at
N x 2048 tokens, their calibration reports kept: the fold found, the RTN check's figures and its
phase time), then times `quantize verify` of each output as a whole process with the page cache
dropped before each: today's (layer check on), `--no-layer-check`, and the code in --old.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(cmd: list[str], env: dict | None = None, cwd: Path = ROOT) -> dict:
    cold = drop_caches()
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, check=False)
    out = {"rc": p.returncode, "seconds": round(time.perf_counter() - t0, 2), "cold_cache": cold}
    try:
        out["json"] = json.loads(p.stdout)
    except json.JSONDecodeError:
        out["tail"] = (p.stdout + p.stderr)[-800:]
    print(" ".join(cmd[2:4]), cmd[-1] if cmd[-1].startswith("--") else "", out["rc"], out["seconds"],
          flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--old", type=Path, default=None, help="a folder holding the old quantize/")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench-verify"))
    ap.add_argument("--methods", default="rtn,gptq,awq+gptq")
    ap.add_argument("--num-samples", type=int, default=64)
    a = ap.parse_args()
    from quantize.source.synth import GLM52_CONFIG, tiny_config, write_checkpoint, write_tokenizer

    cfg = {**tiny_config("glm_moe_dsa"), **GLM52_CONFIG}
    cfg.update(num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=1,
               vocab_size=32768, max_position_embeddings=4096)
    src = a.workdir / "glm52-2layer-mtp-fp8"
    res: dict = {"command": " ".join(sys.argv), "runs": {}}
    if not (src / "config.json").exists():
        t0 = time.perf_counter()
        write_checkpoint(src, cfg, "fp8-block", shard_bytes=4 * 10**9, device="cuda")
        write_tokenizer(src, cfg["vocab_size"])
        res["build_s"] = round(time.perf_counter() - t0, 1)
    res["source_bytes"] = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    q = [sys.executable, "-m", "quantize"]
    for method in a.methods.split(","):
        dst = a.workdir / f"out-{method.replace('+', '-')}"
        r: dict = {}
        r["convert"] = timed(q + ["convert", str(src), str(dst), "--overwrite", "--method", method,
                                  "--tp", "1", "--checkpoint-interval", "inf",
                                  "--num-samples", str(a.num_samples), "--seq-len", "2048",
                                  "--json"] if method != "rtn" else
                             q + ["convert", str(src), str(dst), "--overwrite", "--tp", "1", "--json"])
        rep = dst / "calibration-report.json"
        if rep.exists():
            r["calibration"] = [{k: lay.get(k) for k in ("layer", "check", "output_rel_error")}
                                | {"norm_fold": (lay.get("awq") or {}).get("norm_fold")}
                                for lay in json.loads(rep.read_text())["layers"]]
            tim = json.loads((dst / "calibration" / "timings.json").read_text())["layers"]
            r["timing_s"] = [{"layer": t["layer"], **(t.get("timing_s") or {})} for t in tim]
        r["verify"] = timed(q + ["verify", str(src), str(dst), "--json"])
        r["verify_no_layer_check"] = timed(q + ["verify", str(src), str(dst), "--json",
                                                "--no-layer-check"])
        if a.old is not None:
            # (`python -m` puts the working folder first on sys.path: run it from there)
            path = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p and
                    Path(p).resolve() != ROOT]
            env = {**os.environ, "PYTHONPATH": ":".join([str(a.old.resolve()), *path])}
            r["verify_before"] = timed(q + ["verify", str(src), str(dst), "--json"], env,
                                       cwd=a.old.resolve())
        res["runs"][method] = r
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
