"""cProfile of the calibrated layer pipeline on one device (as run on the H200, 2026-12-01).

    OUT=bench_out PYTHONPATH=. python3 benchmarks/history/scripts/profile_h200_calib.py

Builds (once) a 2-layer GLM-5.2-shaped block-FP8 checkpoint with 64 experts in /tmp/profA,
times the read-ahead of the MoE layer's expert weights (threads x depth), then runs the
Calibrator (rtn, gptq routed, gptq all-expert) on 64 x 2048 random tokens under cProfile
(Python 3.12's cProfile sees every thread), writing OUT/cprof_<run>.txt and OUT/prof2.json.
SMALL=1 runs tiny shapes (checks the script on a CPU; figures meaningless).
"""
import cProfile
import io
import json
import os
import pstats
import time
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "/tmp/out")); OUT.mkdir(exist_ok=True, parents=True)
SMALL = bool(os.environ.get("SMALL"))
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
import quantize.calib.loop as Cm
from quantize.calib.data import CalibrationSet
from quantize.calib.decoder import ReadAhead
from quantize.options import ConvertOptions
from quantize.plan import make_plan
from quantize.source.checkpoint import open_checkpoint
from quantize.source.synth import GLM52_CONFIG, tiny_config, write_checkpoint

cfg = {**tiny_config("glm_moe_dsa"), **(GLM52_CONFIG if not SMALL else {})}
cfg.update(num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=0, vocab_size=4096,
           n_routed_experts=64 if not SMALL else 8, max_position_embeddings=4096)
src = Path("/tmp/profA")
if not (src / "config.json").exists():
    write_checkpoint(src, cfg, "fp8-block", shard_bytes=4 * 10**9)
os.sync()
ck = open_checkpoint(src)
res = {}
opts = ConvertOptions(group_size=32)
units = {u.source: u for u in make_plan(ck, opts).units}
names = [n for n, u in units.items() if u.action == "quantize"]
W = Cm.LayerWeights(ck, units, dev)
def sync():
    if dev.type == "cuda": torch.cuda.synchronize()
for depth, workers in ((32, 4), (32, 8), (8, 2)):
    sync(); t = time.perf_counter()
    R = ReadAhead(W.__getitem__, names, depth=depth, workers=workers)
    for n in names: R[n]
    R.close(); sync()
    res[f"readahead_d{depth}_w{workers}_s"] = round(time.perf_counter() - t, 3)
sync(); t = time.perf_counter()
for n in names: W[n]
sync(); res["seq_getitem_s"] = round(time.perf_counter() - t, 3)
print(json.dumps(res), flush=True)
S_, L_ = (64, 2048) if not SMALL else (4, 64)
tokens = torch.randint(0, 4096, (S_, L_), generator=torch.Generator().manual_seed(0))
calib = CalibrationSet(tokens, "random", S_, tokens.numel(), False, "unused")
for run, kw in (("rtn", {"method": "rtn"}), ("gptq", {"method": "gptq"}), ("gptq-all", {"method": "gptq", "expert_calibration": "all"})):
    o = ConvertOptions(group_size=32, num_samples=S_, seq_len=L_, **kw)
    plan = make_plan(ck, o)
    c = Cm.Calibrator(ck, plan, o, dev, log=lambda m: print(m, flush=True), calib=calib)
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    for u in plan.units:
        c.result(u)
    pr.disable()
    res[run] = {"total": round(time.perf_counter() - t, 2), "layer1": c.layers[-1].get("timing_s")}
    sio = io.StringIO()
    ps = pstats.Stats(pr, stream=sio); ps.sort_stats("tottime").print_stats(22)
    ps.sort_stats("cumtime").print_stats("quantize/", 30)
    (OUT / f"cprof_{run}.txt").write_text(sio.getvalue())
    print(run, json.dumps(res[run]), flush=True)
    print(sio.getvalue()[:3500], flush=True)
    del c
(OUT / "prof2.json").write_text(json.dumps(res, indent=2))
