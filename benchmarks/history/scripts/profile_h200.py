"""Profile of the GPU paths on one device, as run on the H200 on 2026-12-01 (JSON and tables).

    OUT=bench_out PYTHONPATH=. python3 benchmarks/history/scripts/profile_h200.py ABCD

Parts (letters of the first argument):
    A  read paths for 192 GLM-5.2-shaped FP8 expert tensors (2.4 GB, page cache warm):
       Checkpoint.read on 1/4/8 threads, read + dequantize on the GPU, pinned staging
    B  GPTQ on 32 GLM-5.2 gate/up experts: routed vs shared Hessian, factorization variants,
       the lazy-batch updates, and a torch.profiler table of one routed solve
    C  the streaming conversion's stages (read / compute / write / shard close), in process
    D  Calibrator runs (gptq routed, gptq all, rtn) on a 64-expert GLM-5.2-shaped layer
Writes OUT/prof.json (and OUT/prof_gptq_routed.txt). DEV=cpu SMALL=1 runs tiny shapes on
the CPU to check the script itself (figures meaningless).
"""
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "/tmp/out"))
res = {}
def sync(): torch.cuda.synchronize()
def T(f, *a, **k):
    sync(); t = time.perf_counter(); r = f(*a, **k); sync(); return time.perf_counter() - t, r
dev = torch.device(os.environ.get("DEV", "cuda"))
SMALL = bool(os.environ.get("SMALL"))
if dev.type == "cpu":
    torch.cuda.synchronize = lambda *a: None
    torch.cuda.init = lambda: None
t0 = time.perf_counter(); torch.cuda.init(); torch.zeros(1, device=dev); res["cuda_init_s"] = time.perf_counter() - t0
print("cuda init", res["cuda_init_s"], flush=True)

part = sys.argv[1] if len(sys.argv) > 1 else "ABC"
from quantize.options import ConvertOptions
from quantize.pipeline import source_weight
from quantize.plan import make_plan
from quantize.source.checkpoint import open_checkpoint
from quantize.source.synth import GLM52_CONFIG, tiny_config, write_checkpoint

if "A" in part:
    cfg = {**tiny_config("glm_moe_dsa"), **(GLM52_CONFIG if not SMALL else {})}
    cfg.update(num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=0, vocab_size=4096,
               n_routed_experts=64 if not SMALL else 4, max_position_embeddings=4096)
    src = Path("/tmp/profA")
    t = time.perf_counter(); write_checkpoint(src, cfg, "fp8-block", shard_bytes=4 * 10**9)
    res["A_write_s"] = time.perf_counter() - t
    ck = open_checkpoint(src)
    plan = make_plan(ck, ConvertOptions())
    units = [u for u in plan.units if u.action == "quantize"]
    nbytes = sum(ck.tensors[u.source].nbytes for u in units)
    res["A_bytes"] = nbytes
    def rate(dt): return round(nbytes / dt / 1e9, 2)
    names = [u.source for u in units]
    t = time.perf_counter()
    for n in names: ck.read(n)
    res["A1_read_seq_GBps"] = rate(time.perf_counter() - t)
    for w in (4, 8):
        with ThreadPoolExecutor(w) as ex:
            t = time.perf_counter(); list(ex.map(ck.read, names)); res[f"A2_read_{w}thr_GBps"] = rate(time.perf_counter() - t)
    dt, _ = T(lambda: [source_weight(ck, u, dev) for u in units]); res["A3_srcweight_seq_GBps"] = rate(dt)
    for w in (4, 8):
        with ThreadPoolExecutor(w) as ex:
            dt, _ = T(lambda: list(ex.map(lambda u: source_weight(ck, u, dev), units))); res[f"A3_srcweight_{w}thr_GBps"] = rate(dt)
    dt, _ = T(lambda: [bool(torch.isfinite(source_weight(ck, u, dev)).all()) for u in units]); res["A5_loadlayer_like_seq_GBps"] = rate(dt)
    # pinned staging: preadv into a per-thread pinned buffer, async H2D on a per-thread stream
    local = threading.local()
    def pinned_read(u):
        info = ck.tensors[u.source]
        if not hasattr(local, "buf") or local.buf.numel() < info.nbytes:
            local.buf = torch.empty(info.nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
            local.stream = torch.cuda.Stream() if dev.type == 'cuda' else None
        mv = memoryview(local.buf.numpy())[: info.nbytes]
        with open(ck.root / info.file, "rb", buffering=0) as f:
            os.preadv(f.fileno(), [mv], info.begin)
        with (torch.cuda.stream(local.stream) if dev.type == 'cuda' else __import__('contextlib').nullcontext()):
            g = local.buf[: info.nbytes].to(dev, non_blocking=True)
            local.stream and local.stream.synchronize()
        return g
    for w in (1, 4, 8):
        with ThreadPoolExecutor(w) as ex:
            dt, _ = T(lambda: list(ex.map(pinned_read, units))); res[f"A4_pinned_{w}thr_GBps"] = rate(dt)
    # plain file read of whole shards (page cache)
    t = time.perf_counter()
    for f in ck.files:
        with open(src / f, "rb") as fh:
            while fh.read(2**24): pass
    tot = sum((src / f).stat().st_size for f in ck.files)
    res["A6_file_read_GBps"] = round(tot / (time.perf_counter() - t) / 1e9, 2)
    print(json.dumps(res), flush=True)

if "B" in part:
    from torch.profiler import ProfilerActivity, profile

    from quantize.rounding import gptq as G
    torch.manual_seed(0)
    B, I, Hd = (32, 2048, 6144) if not SMALL else (2, 64, 256)
    W = torch.randn(B, 2 * I, Hd, device=dev)
    X = torch.randn(B, 4096 if not SMALL else 512, Hd, device=dev, dtype=torch.bfloat16)
    Hs, _ = G.accumulate_hessian(torch.zeros(B, Hd, Hd, device=dev), X, 0)
    del X
    cfg = G.GPTQConfig()
    G.gptq_quantize(W[:2], Hs[:2], cfg); sync()
    dt, _ = T(G.gptq_quantize, W, Hs, cfg); res["B_routed32_gateup_s"] = round(dt, 3)
    dt, _ = T(G.gptq_quantize, W.reshape(-1, Hd), Hs[0], cfg); res["B_shared32_gateup_s"] = round(dt, 3)
    perm = torch.argsort(torch.diagonal(Hs, dim1=-2, dim2=-1), dim=-1, descending=True, stable=True)
    dt, _ = T(G._inverse_cholesky, Hs, perm, 0.01, True); res["B_invchol_flipped32_s"] = round(dt, 3)
    dt, _ = T(G._inverse_cholesky, Hs, perm, 0.01, False); res["B_invchol_plain32_s"] = round(dt, 3)
    A = Hs.clone() + torch.eye(Hd, device=dev) * 1e-2
    dt, _ = T(lambda: torch.linalg.cholesky_ex(A)); res["B_chol_batched32_s"] = round(dt, 3)
    dt, _ = T(lambda: [torch.linalg.cholesky_ex(A[j]) for j in range(B)]); res["B_chol_loop32_s"] = round(dt, 3)
    Lc = torch.linalg.cholesky_ex(A[0])[0]; eye = torch.eye(Hd, device=dev)
    dt, _ = T(lambda: [torch.linalg.solve_triangular(Lc, eye, upper=False) for j in range(B)]); res["B_trsm_loop32_s"] = round(dt, 3)
    dt, _ = T(lambda: [torch.linalg.inv_ex(Lc) for j in range(B)]); res["B_inv_loop32_s"] = round(dt, 3)
    dt, _ = T(lambda: [torch.cholesky_inverse(Lc) for j in range(B)]); res["B_cholinv_loop32_s"] = round(dt, 3)
    torch.backends.cuda.matmul.allow_tf32 = False
    Err = torch.randn(B, 2 * I, 128, device=dev)
    dt, _ = T(lambda: [W[..., i2:].sub_(Err @ Hs[:, 0:128, i2:]) for i2 in range(128, Hd, 128) if True]); res["B_updates_fp32_s"] = round(dt, 3)
    del A
    print(json.dumps(res), flush=True)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        G.gptq_quantize(W, Hs, cfg); sync()
    tab = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    (OUT / "prof_gptq_routed.txt").write_text(tab); print(tab[:6000], flush=True)
    del W, Hs, Err
    torch.cuda.empty_cache()

if "C" in part:
    import quantize.pipeline as P
    sys.path.insert(0, "scripts")
    from bench_stream import _config
    src = Path("/tmp/profC"); 
    write_checkpoint(src, _config(8, 2048, 64, 1024) if not SMALL else _config(2, 256, 4, 128), "fp8-block", seed=8, shard_bytes=512 * 2**20)
    stats = {}
    lock = threading.Lock()
    def wrap(name, f):
        def g(*a, **k):
            t = time.perf_counter(); r = f(*a, **k); dt = time.perf_counter() - t
            with lock: stats[name] = stats.get(name, 0) + dt
            return r
        return g
    P.read_unit = wrap("read_unit", P.read_unit)
    P.compute_unit = wrap("compute_unit", P.compute_unit)
    P._write_all = wrap("write_all", P._write_all)
    P._check_scales = wrap("check_scales", P._check_scales)
    P.make_plan = wrap("make_plan", P.make_plan)
    P.open_checkpoint = wrap("open_checkpoint", P.open_checkpoint)
    import quantize.write.shards as S
    S.ShardWriter.__exit__ = wrap("shard_close", S.ShardWriter.__exit__)
    torch.set_num_threads(16)
    t = time.perf_counter(); P.convert(src, Path("/tmp/profC_out"), ConvertOptions(), device=dev.type)
    stats["total"] = time.perf_counter() - t
    res["C_stream_stages_s"] = {k: round(v, 3) for k, v in stats.items()}
    res["C_src_bytes"] = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    print(json.dumps(res["C_stream_stages_s"]), flush=True)
(OUT / "prof.json").write_text(json.dumps(res, indent=2))
print(json.dumps(res, indent=2))

if "D" in part:
    import quantize.calib.loop as Cm
    import quantize.pipeline as P
    from quantize.calib.data import CalibrationSet
    src = Path("/tmp/profA")
    ck = open_checkpoint(src)
    V = ck.config["vocab_size"]
    S_, L_ = (64, 2048) if not SMALL else (4, 64)
    tokens = torch.randint(0, V, (S_, L_), generator=torch.Generator().manual_seed(0))
    calib = CalibrationSet(tokens, "random", S_, tokens.numel(), False, "unused")
    for run, kw in (("gptq", {"method": "gptq", "expert_calibration": "routed"}),
                    ("gptq-all", {"method": "gptq", "expert_calibration": "all"}), ("rtn", {"method": "rtn"})):
        stats = {}
        lock = threading.Lock()
        def wrap(name, f, stats=stats, lock=lock):
            def g(*a, **kws):
                if dev.type == "cuda": torch.cuda.synchronize()
                t = time.perf_counter(); r = f(*a, **kws)
                if dev.type == "cuda": torch.cuda.synchronize()
                dt = time.perf_counter() - t
                with lock: stats[name] = stats.get(name, 0) + dt
                return r
            return g
        orig = (Cm.load_layer, Cm.gptq_quantize, Cm.accumulate_hessian)
        Cm.load_layer = wrap("load_layer", Cm.load_layer)
        Cm.gptq_quantize = wrap("gptq_quantize", Cm.gptq_quantize)
        opts = ConvertOptions(group_size=32, num_samples=S_, seq_len=L_, **kw)
        plan = make_plan(ck, opts)
        if dev.type == "cuda": torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        c = Cm.Calibrator(ck, plan, opts, dev, log=lambda m, run=run: print(f"  [{run}] {m}", flush=True), calib=calib)
        for u in plan.units:
            c.result(u)
        tot = time.perf_counter() - t
        rep = c.report()
        lay = [{k: v for k, v in l.items() if k not in ("expert_tokens", "modified_bf16", "fallback")} for l in rep["layers"]]
        res[f"D_{run}"] = {"total": round(tot, 2), "wrapped": {k: round(v, 2) for k, v in stats.items()}, "layers": lay,
                           "peak": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0}
        print(json.dumps(res[f"D_{run}"]), flush=True)
        Cm.load_layer, Cm.gptq_quantize, Cm.accumulate_hessian = orig
        del c
        if dev.type == "cuda": torch.cuda.empty_cache()
    (OUT / "prof.json").write_text(json.dumps(res, indent=2))
