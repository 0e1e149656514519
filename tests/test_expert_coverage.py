"""--expert-coverage N: a routed expert with fewer than N routed tokens has its statistics topped
up to N with the tokens its router logit ranks highest among those not routed to it
(capture.MLPStats.nearest / top_up). Float64 references from the router's own logits, one
process and two gloo ranks, and the whole conversion on a fixture with an expert the router
never picks (CPU, offline)."""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile

import pytest
import torch

from quantize.calib.capture import MLPStats, moe_forward
from quantize.calib.decoder import build_skeleton, load_layer
from quantize.calib.distributed import Dist
from quantize.check.verify import verify
from quantize.names import CALIB_REPORT, MANIFEST
from quantize.options import MAX_EXPERT_COVERAGE, ConvertOptions, recorded_option
from quantize.pipeline import convert
from quantize.plan import make_plan
from quantize.source.checkpoint import open_checkpoint
from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)
CALIB = {"num_samples": 8, "seq_len": 64}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    cfg = tiny_config("glm_moe_dsa")
    d = write_checkpoint(tmp_path_factory.mktemp("src"), cfg, "fp8-block", seed=5)
    write_tokenizer(d, cfg["vocab_size"])
    return d


def _layer(src):
    ck = open_checkpoint(src)
    units = {u.source: u for u in make_plan(ck, ConvertOptions()).units}
    return ck, load_layer(build_skeleton(ck.config), ck, units, 1, torch.device("cpu"), torch.float32)


def _chunks(H: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 16, H, generator=gen), torch.randn(1, 24, H, generator=gen),
            torch.randn(1, 20, H, generator=gen)]


def _reference(layer, chunks, N: int, weighted: bool):
    """Per expert, float64: its routed rows and, when fewer than N, the N - n other tokens with
    the highest router logits for it; the gate/up and down Hessians 2 XᵀX / n over both (rows
    scaled by the routing weight, an added row by its expert's mean one, when `weighted`)."""
    mlp = layer.mlp
    E = mlp.experts.num_experts
    X = torch.cat([c.reshape(-1, c.shape[-1]) for c in chunks]).double()
    logits, topw, topk = mlp.gate(X.float())
    ref = {}
    for e in range(E):
        pick = topk == e
        routed = pick.any(-1)
        w = (topw * pick).sum(-1).double()
        order = torch.argsort(logits[:, e].double().masked_fill(routed, float("-inf")), descending=True)
        n = int(routed.sum())
        extra = order[:max(0, N - n)]
        rows, ws = X[routed], w[routed]
        if weighted:
            rows = rows * ws[:, None]
        mean = float(ws.mean().detach()) if n and weighted else 1.0
        allx = torch.cat([rows, X[extra] * mean])
        W = mlp.experts.gate_up_proj[e].double()
        gate, up = (torch.cat([X[routed], X[extra]]) @ W.T).chunk(2, dim=-1)
        inter = mlp.experts.act_fn(gate) * up
        if weighted:
            inter = inter * torch.cat([ws, torch.full((len(extra),), mean, dtype=torch.float64)])[:, None]
        m = allx.shape[0]
        ref[e] = (n, len(extra), 2 * allx.T @ allx / m, 2 * inter.T @ inter / m, set(extra.tolist()))
    return ref


@pytest.mark.parametrize("store,weighted", [(True, False), (False, False), (True, True)],
                         ids=["kept-inputs", "running-sums", "routed-weighted"])
def test_experts_are_topped_up_with_the_tokens_the_router_ranks_highest(src, store, weighted):
    """Over three chunks of different sizes (the best candidates merged across them), every
    expert routed fewer than N tokens gets exactly N - n added, the ones its router logit ranks
    highest among the tokens not routed to it; its gate/up and down Hessians are 2 XᵀX / n
    over routed and added rows (float64 reference); an expert routed N or more is untouched."""
    ck, layer = _layer(src)
    H, E = ck.config["hidden_size"], ck.config["n_routed_experts"]
    chunks = _chunks(H, seed=11 if weighted else 7)
    N = 20
    stats = MLPStats("moe", hessians=True, samples=False, all_experts=False, num_experts=E,
                     store_tokens=store, router_weighted=weighted, cover=N)
    with torch.no_grad():
        for x in chunks:
            moe_forward(layer.mlp, x, stats)
        stats.top_up(layer.mlp.experts)
    ref = _reference(layer, chunks, N, weighted)
    topped = untouched = 0
    for e in range(E):
        n, m, Hin, Hdn, _ = ref[e]
        assert stats.expert_tokens[e] == n and stats.added[e] == m, e
        topped += m > 0
        untouched += m == 0
        got_in, got_dn = stats.expert_H_in(e).double(), stats.expert_H_down(e).double()
        assert torch.allclose(got_in, Hin, rtol=1e-5, atol=1e-5 * Hin.abs().max().item()), e
        assert torch.allclose(got_dn, Hdn, rtol=1e-4, atol=1e-4 * Hdn.abs().max().item()), e
    assert topped >= 2 and untouched >= 1  # both cases exercised: the check is not vacuous


def test_no_coverage_is_the_routed_tokens_alone(src):
    """cover 0 (the option off) keeps nothing and adds nothing: the Hessians are those of
    the routed tokens, bit for bit those of a run without the option."""
    ck, layer = _layer(src)
    H, E = ck.config["hidden_size"], ck.config["n_routed_experts"]
    chunks = _chunks(H, seed=3)
    a, b = (MLPStats("moe", hessians=True, samples=False, all_experts=False, num_experts=E,
                     cover=c) for c in (0, 64))
    with torch.no_grad():
        for x in chunks:
            moe_forward(layer.mlp, x, a)
            moe_forward(layer.mlp, x, b)
        a.top_up(layer.mlp.experts)
    assert a.candidates is None and a.added == [0] * E and b.candidates is not None
    ref = _reference(layer, chunks, 0, False)
    for e in range(E):
        Hk = a.expert_H_in(e)
        assert (Hk is None) == (ref[e][0] == 0)
        if Hk is not None:
            assert torch.allclose(Hk.double(), ref[e][2], rtol=1e-5, atol=1e-5 * ref[e][2].abs().max().item())


def _rank(rank: int, world: int, store_path: str, src: str, N: int, out: str) -> None:
    """One gloo rank: its share of the chunks through the MoE layer, counts summed, topped up,
    every expert's Hessians summed over the ranks (as the GPTQ batches reduce them)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    d = Dist(rank, world, torch.device("cpu"))
    ck, layer = _layer(src)
    H, E = ck.config["hidden_size"], ck.config["n_routed_experts"]
    chunks = _chunks(H, seed=7)
    stats = MLPStats("moe", hessians=True, samples=False, all_experts=False, num_experts=E, cover=N)
    with torch.no_grad():
        for c, x in enumerate(chunks):
            if c % world == rank:
                moe_forward(layer.mlp, x, stats)
        stats.all_reduce(d, torch.device("cpu"))
        stats.top_up(layer.mlp.experts, d)
        K = H
        Hin = torch.zeros(E, K, K)
        stats.experts_H_in(list(range(E)), Hin)
        I = ck.config["moe_intermediate_size"]
        Hdn = torch.zeros(E, I, I)
        for e in range(E):
            Hd = stats.expert_H_down(e)  # (None: this rank's tokens gave it none)
            if Hd is not None:
                Hdn[e] = Hd
    d.all_reduce(Hin)
    d.all_reduce(Hdn)
    if rank == 0:
        torch.save({"added": stats.added, "tokens": stats.expert_tokens, "Hin": Hin, "Hdn": Hdn}, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_top_up_as_one_process(src):
    """Under torchrun each rank sees its own tokens: the N - n added tokens are chosen over
    every rank's candidates (the global ranking), and the Hessians summed over the ranks
    equal one process's on all the tokens. (N = 30: rank 1's 24 tokens are fewer, so its
    candidates are padded to the width every rank gathers.)"""
    N = 30
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        procs = [ctx.Process(target=_rank, args=(r, 2, os.path.join(tmp, "store"), str(src), N, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        got = torch.load(out)
    ck, layer = _layer(src)
    ref = _reference(layer, _chunks(ck.config["hidden_size"], seed=7), N, False)
    assert got["tokens"] == [ref[e][0] for e in ref]
    assert got["added"] == [ref[e][1] for e in ref] and sum(got["added"]) > 0
    for e, (_, _, Hin, Hdn, _) in ref.items():
        assert torch.allclose(got["Hin"][e].double(), Hin, rtol=1e-5, atol=1e-5 * Hin.abs().max().item()), e
        assert torch.allclose(got["Hdn"][e].double(), Hdn, rtol=1e-4, atol=1e-4 * Hdn.abs().max().item()), e


def _starved(tmp_path):
    cfg = tiny_config("glm_moe_dsa")
    write_checkpoint(tmp_path, cfg, "fp8-block")
    write_tokenizer(tmp_path, cfg["vocab_size"])
    from safetensors.torch import load_file, save_file

    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    f = tmp_path / index[name]
    t = load_file(f)
    t[name] = t[name].clone()
    t[name][7] = -100.0  # sigmoid scores are in (0, 1): expert 7 never makes the top-k
    save_file(t, f, metadata={"format": "pt"})
    return cfg


def test_an_expert_the_router_never_picks_is_covered_end_to_end(tmp_path):
    """An expert no token is routed to: without the option, all-token statistics (fallback);
    with --expert-coverage N, N added tokens instead, reported per layer (`topped_up`), its
    integers differ from the fallback's, the option recorded in the manifest (left out at 0,
    which reads back as 0) and named in the card, and the output verifies."""
    src = tmp_path / "src"
    cfg = _starved(src)
    outs = {}
    for N in (0, 48):
        outs[N] = out = tmp_path / f"cover{N}"
        convert(src, out, ConvertOptions(method="gptq", expert_coverage=N, **CALIB), device="cpu")
    reps = {N: json.loads((o / CALIB_REPORT).read_text()) for N, o in outs.items()}
    lay = {N: next(x for x in r["layers"] if x["layer"] == 1) for N, r in reps.items()}
    assert lay[0]["expert_tokens"][7] == 0 and {f["expert"] for f in lay[0]["fallback"]} >= {7}
    assert "topped_up" not in lay[0]
    top = {t["expert"]: t for t in lay[48]["topped_up"]}
    assert top[7] == {"expert": 7, "tokens": 0, "added": 48}
    assert all(t["tokens"] + t["added"] == 48 for t in top.values())
    assert all(lay[48]["expert_tokens"][e] >= 48 for e in range(cfg["n_routed_experts"]) if e not in top)
    assert 7 not in {f["expert"] for f in lay[48]["fallback"]}
    assert reps[48]["expert_coverage"] == 48
    man = {N: json.loads((o / MANIFEST).read_text())["options"] for N, o in outs.items()}
    assert "expert_coverage" not in man[0] and recorded_option(man[0], "expert_coverage") == 0
    assert man[48]["expert_coverage"] == 48
    from safetensors.torch import load_file

    def tensor(out, name):
        for f in sorted(out.glob("*.safetensors")):
            t = load_file(f)
            if name in t:
                return t[name]
        raise KeyError(name)
    w = "model.layers.1.mlp.experts.7.down_proj.weight_packed"
    assert not torch.equal(tensor(outs[0], w), tensor(outs[48], w))
    card = (outs[48] / "README.md").read_text()
    assert "| expert coverage | each expert's statistics over at least 48 tokens: " in card
    assert "layer 1 expert 7 (0 + 48)" in card
    assert "expert coverage" not in (outs[0] / "README.md").read_text()
    checked = verify(src, outs[48], write=False)
    assert checked.ok, checked.problems


def test_coverage_bounds():
    for bad in (-1, MAX_EXPERT_COVERAGE + 1):
        with pytest.raises(ValueError, match="--expert-coverage must be 0 .off. to 1024 tokens"):
            ConvertOptions(method="gptq", expert_coverage=bad)
    assert ConvertOptions(method="gptq", expert_coverage=1024).expert_coverage == 1024
    for kw in ({"method": "awq"}, {"method": "rtn"},
               {"method": "gptq", "expert_calibration": "all"}):
        with pytest.raises(ValueError, match="--expert-coverage tops up the routed experts' GPTQ"):
            ConvertOptions(expert_coverage=64, **kw)
    assert ConvertOptions(method="awq+gptq", expert_calibration="routed-weighted",
                          expert_coverage=64).expert_coverage == 64


def test_an_expert_still_short_after_the_top_up_falls_back_and_says_both_counts(tmp_path):
    """--expert-coverage below --min-expert-tokens: an expert topped up to N < the minimum
    still takes the all-token fallback, and its reason gives routed and added tokens."""
    src = tmp_path / "src"
    _starved(src)
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(method="gptq", expert_coverage=32, min_expert_tokens=100,
                                     num_samples=2, seq_len=64), device="cpu")
    lay = next(x for x in json.loads((out / CALIB_REPORT).read_text())["layers"] if x["layer"] == 1)
    fb = {f["expert"]: f["reason"] for f in lay["fallback"]}
    assert fb[7] == "0 routed tokens + 32 added < --min-expert-tokens 100: all-token statistics"
    assert {t["expert"] for t in lay["topped_up"]} >= {7}
