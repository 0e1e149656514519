"""SGLang 0.5.23 serving our INT4 experts: does its Triton W4A16 MoE path compute what our
convert writes, and how fast is it beside the FP8 experts we convert from (issue 56, parts 2-3).

One GLM-5.2-shaped MoE layer on one GPU: E = 256 routed experts, top-8, hidden H = 6144,
expert width I = 2048, bf16 activations.

1. Source: random experts in GLM-5.2-FP8's layout, e4m3 weights with one float32
   `weight_scale_inv` per 128x128 block (scale = block amax / 448), made on the device.
2. Ours: every expert's gate / up / down through the conversion's own functions,
   `quantize.source.fp8.dequant_block` -> `quantize.rounding.int4.quantize_rtn` ->
   `int4_outputs` (what `pipeline.compute_unit` runs for an RTN unit), named as on disk:
   `model.layers.3.mlp.experts.{e}.{gate,up,down}_proj.{weight_packed,weight_scale,weight_shape}`.
   The first `--shard-experts` experts travel through a safetensors shard written by our
   `ShardWriter` and read back with `safetensors.safe_open` (bytes compared), so SGLang loads
   our bytes.
3. SGLang's own classes: `FusedMoE` built with `CompressedTensorsConfig.from_config` of the
   `quantization_config` our `write.qconfig` writes, under `--moe-runner-backend triton`, which
   picks `CompressedTensorsWNA16TritonMoE`: its `create_weights`, `FusedMoE.weight_loader` once
   per file tensor (names mapped by `make_expert_params_mapping`, as the model loaders do), its
   `process_weights_after_loading` (the repack for the Triton kernel) and its `apply`.
4. Checks per group size (32, 128); any failure makes the exit status 1:
   - exact: the loaded parameters equal the file tensors, w13 = [gate; up] transposed; and the
     repacked uint8 weights, read with `fused_moe_kernel_gptq_awq`'s own index arithmetic
     (`triton_w4a16_weight`), equal our `dequantize` bit for bit;
   - numeric: the layer output against our reference (our `dequantize`, the same routing, float64
     on the device) at every M timed: per-token relative error ||y - y_ref|| / ||y_ref|| at most
     TOL_INT4 (its reason beside it). Printed beside it: the bf16 rounding of the reference
     alone, and the distance to the FP8 source (the quantization error a wrong kernel hides in);
   - the FP8 path (below) against the float64 reference of the FP8 source, TOL_FP8.
5. Timing, kernel level: SGLang's Triton runner (`MoeRunner(TRITON).run`: moe-align, the two
   fused-MoE GEMMs, SiLU-and-mul, top-k sum) at M = 1, 8, 16, 32, 64 (decode) and 4096 (prefill)
   tokens, INT4 W4A16 g32 / g128 against FP8 block [128, 128] (`fused_moe_kernel` with
   use_fp8_w8a8, activations quantized per token in groups of 128 as SGLang does, the quant info
   `Fp8MoEMethod.get_triton_quant_info` builds). CUDA events around each call, median and min
   of `--iters` (a fifth of them at M > 1024) after `--warmup` calls, eager and as a replayed
   CUDA graph (decode serves from graphs).
   Beside each: the bandwidth floor, bytes of expert weights the call must read (distinct
   experts routed x bytes per expert) / device copy bandwidth measured in the same run.
   SGLang's tuned-config lookup (`get_moe_configs`) is asked for each shape; the file it looks
   for and the config used are recorded (0.5.23 ships none for these shapes on H100 or H200, so
   both schemes run its default config). `--tp N` times one tensor-parallel rank's shard
   instead (expert width I / N, all 256 experts; GLM-5.2 served at TP 8: I = 256).

SGLang's CUDA pieces on a machine without `sglang-kernel` (its CUDA wheel pins torch 2.14.1):
moe-align above 64 routed pairs calls `sgl_kernel.moe_align_block_size` (AOT) and the top-k sum
above 32 tokens `sgl_kernel.moe_sum_reduce`. The `sgl_kernel` stand-in here serves the first
with SGLang's JIT build of the same kernel (`sglang/kernels/ops/moe/moe_align.py`, tvm-ffi +
nvcc), checked against `moe_align_block_size_torch` (plain torch; used only if the JIT build
fails), and the second with SGLang's own `moe_sum_reduce_triton` (its ROCm path). SiLU-and-mul
and the FP8 activation quantization are SGLang JIT builds too; a failed build falls back to
plain torch / SGLang's Triton version. The JSON names what ran.

Import-only stubs (never called on this path; recorded with every name touched): see
`IMPORT_ONLY`. Run on the GPU machine, with the wheels SGLang's import chain needs in .whl
(CPython 3.12; torch, triton and transformers are the machine's own; 45 MB):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
        sglang==0.5.23 compressed-tensors==0.18.0 pydantic==2.14.4 pydantic-core==2.50.5 \
        annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 loguru==0.7.3 \
        msgspec==0.19.0 orjson==3.13.0 pybase64==1.5.1 dill==0.4.1 openai==2.8.0 jiter==0.19.0 \
        distro==1.9.0 sniffio==1.3.1 apache-tvm-ffi==0.1.11

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    python3 scripts/bench_sglang_moe.py --out $OUT/bench_sglang_moe.json
    python3 scripts/bench_sglang_moe.py --device cpu --tiny --out /tmp/b.json   # CPU check

`--device cpu` runs everything at a tiny shape, SGLang's Triton kernels under Triton's
interpreter (TRITON_INTERPRET=1, set right where it departs from a GPU: `interpreter_like_gpu`),
its custom ops registered for the CPU too; timings are meaningless there.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import platform
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

LAYER = 3  # the layer index in the tensor names (any MoE layer of GLM-5.2)
PREFIX = f"model.layers.{LAYER}.mlp.experts"
FP8_BLOCK = (128, 128)
E4M3_MAX = 448.0

# Per-token relative error ||y - y_ref|| / ||y_ref|| allowed between SGLang's INT4 layer and our
# float64 reference. The weights are exact (checked bit for bit); what remains is bf16 rounding
# the kernel path applies four times in sequence: the gate/up GEMM output, silu(g) * u, the
# routed-weighted down output, the top-k sum. Each is at most u = 2^-8 (0.39 %) relative per
# element, about u / sqrt(3) = 0.23 % rms; in sequence ~0.4-0.6 % per token (the CPU check
# measured 0.6 % at most; the JSON shows the bf16 rounding of the reference alone beside it).
# 2 % = 5 u leaves room for the worst token and stays far below a wrong kernel or layout: the
# INT4 rounding itself moves the output ~15 % from the FP8 source (`int4_vs_fp8_source`), a
# swapped gate/up, nibble order or group index by O(100 %).
TOL_INT4 = 0.02
# FP8: the activations are quantized to e4m3 per 128-group on both GEMMs (u = 2^-4, ~3.6 % rms
# each), so ~5 % per token is expected (the CPU check: 5.9 % at most); 15 % still fails any
# layout or scale error.
TOL_FP8 = 0.15

# The write-up's figures (INT4 against FP8 on SGLang's Triton MoE path): decode speed gain at
# 1 / 8 / 16 / 32 / 64 concurrent requests, prefill slower by 15 %.
WRITEUP_DECODE_GAIN = {1: 0.55, 8: 0.21, 16: 0.21, 32: 0.27, 64: 0.16}
WRITEUP_PREFILL_SLOWER = 0.15


class MoEShape(NamedTuple):
    E: int  # routed experts
    H: int  # hidden size (K of gate/up, N of down)
    I: int  # expert intermediate width (N of gate/up, K of down)
    top_k: int


GLM52 = MoEShape(E=256, H=6144, I=2048, top_k=8)
TINY = MoEShape(E=16, H=256, I=128, top_k=4)  # FP8 blocks and group 128 still divide it


# --------------------------------------------------------------------------------------------
# Import-only stubs and the sgl_kernel stand-in. Installed before SGLang is imported, each only
# when the real package is missing. A stubbed name is a class that raises when instantiated or
# called: import-only, and any use shows in the traceback and in the JSON's `stubs.touched`.


class Stub(NamedTuple):
    top: str  # top-level package served (with every submodule) when not installed
    why: str


IMPORT_ONLY = (
    Stub("starlette", "sglang.srt.utils.common imports starlette.routing.Mount (HTTP routes)"),
    Stub("zmq", "sglang.srt.utils.network and managers: the scheduler's ZMQ sockets"),
    Stub("IPython", "sglang.utils: notebook display helpers"),
    Stub("gguf", "sglang.srt.layers.quantization.gguf: GGUF checkpoints"),
    Stub("partial_json_parser", "sglang.srt.function_call: tool-call parsing"),
    Stub("torchvision", "SGLang's multimodal configs and transformers' image processors; the "
                        "GPU image has it, PyPI has no CPU build for the CPU check's torch"),
)
STUB_TOUCHED: set[str] = set()


class _ImportOnlyMeta(type):
    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return cls  # e.g. an enum member read at import time (Allow.ALL)

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__qualname__} is an import-only stub (scripts/bench_sglang_moe.py)")


def _import_only(qualname: str) -> type:
    STUB_TOUCHED.add(qualname)
    return _ImportOnlyMeta(qualname, (Exception,), {"__qualname__": qualname})


class _StubModule(types.ModuleType):
    __version__ = "0.0.0"  # transformers reads a version of every package it finds

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = _import_only(f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `top` and `top.anything` as _StubModule for each top-level name given."""

    def __init__(self, tops: set[str]):
        self.tops = tops

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.tops:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


class Kernels:
    """What serves the CUDA steps SGLang takes from `sgl_kernel` or builds with nvcc (filled in
    by `choose_kernels`; the sgl_kernel stand-in reads `align` at every call)."""

    align: Callable | None = None


def moe_align_block_size_torch(topk_ids: torch.Tensor, num_experts: int, block_size: int,
                               sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                               num_tokens_post_pad: torch.Tensor,
                               cumsum_buffer: torch.Tensor | None = None,
                               pad_sorted_token_ids: bool = False,
                               ignore_invalid_expert: bool = False) -> None:
    """`sgl_kernel.moe_align_block_size` in plain torch, without a host sync (CUDA-graph safe).

    SGLang's "+1 offset" convention: `num_experts` = E + 1 buckets, routed id e goes to bucket
    e + 1 (an EP-filtered -1 to bucket 0). Each bucket's (token, slot) pairs, flattened index
    t * top_k + slot, are laid out in bucket order, each bucket padded to a multiple of
    block_size with the value numel; expert_ids[b] = bucket - 1 of block b (-1 past the end);
    num_tokens_post_pad[0] = the padded total. Within a bucket the pairs keep their flat order
    (the CUDA kernel's order there depends on its atomics; fused_moe reads a block as a set).
    e.g. ids [[2, 3], [1, 2]], block 2, E = 4: buckets 2: {2}, 3: {0, 3}, 4: {1} ->
    sorted [2, 4, 0, 3, 1, 4], expert_ids [1, 2, 3], total 6.
    """
    if ignore_invalid_expert:
        raise NotImplementedError("ignore_invalid_expert: not needed by the TP=1 path timed here")
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    bucket = flat + 1  # (numel,) in [0, num_experts)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_size - 1) // block_size * block_size
    ends = torch.cumsum(padded, 0)  # (num_experts,) padded end of each bucket
    order = torch.sort(bucket, stable=True).indices  # flat pair indices, bucket by bucket
    sorted_bucket = bucket[order]
    first = torch.cumsum(counts, 0) - counts  # where each bucket starts in `order`
    rank = torch.arange(numel, device=dev) - first[sorted_bucket]
    dest = (ends - padded)[sorted_bucket] + rank
    sorted_token_ids.fill_(numel)
    sorted_token_ids.scatter_(0, dest, order.to(sorted_token_ids.dtype))
    block_start = torch.arange(expert_ids.numel(), device=dev) * block_size
    block_bucket = torch.searchsorted(ends, block_start, right=True)  # num_experts: past the end
    expert_ids.copy_(torch.where(block_bucket < num_experts, block_bucket - 1, -1))
    num_tokens_post_pad[:1].copy_(ends[-1:])
    if cumsum_buffer is not None:  # the CUDA kernel leaves the bucket offsets here
        cumsum_buffer[:1].zero_()
        cumsum_buffer[1:num_experts + 1].copy_(ends)


def _sgl_kernel_align(*args, **kwargs):
    return Kernels.align(*args, **kwargs)


def _sgl_kernel_moe_sum_reduce(input, output, routed_scaling_factor):
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import moe_sum_reduce_triton

    return moe_sum_reduce_triton(input, output, routed_scaling_factor)


class _SglKernelStandIn(_StubModule):
    """`sgl_kernel` (the CUDA sglang-kernel wheel, absent): the two calls on our path served
    (`moe_align_block_size`, `moe_sum_reduce`), every other name import-only."""


class _SglKernelFinder(_StubFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "sgl_kernel.scalar_type":  # absent, so SGLang takes its own mock types
            return None
        return super().find_spec(name, path, target)

    def create_module(self, spec):
        if spec.name != "sgl_kernel":
            return super().create_module(spec)
        m = _SglKernelStandIn("sgl_kernel")
        m.__path__ = []
        m.moe_align_block_size = _sgl_kernel_align
        m.moe_sum_reduce = _sgl_kernel_moe_sum_reduce
        return m


def install_stubs() -> dict:
    """The import-only stubs for packages not installed here, and the sgl_kernel stand-in."""
    missing = {s.top for s in IMPORT_ONLY if importlib.util.find_spec(s.top) is None}
    if missing:
        sys.meta_path.insert(0, _StubFinder(missing))
    stand_in = importlib.util.find_spec("sgl_kernel") is None
    if stand_in:
        sys.meta_path.insert(0, _SglKernelFinder({"sgl_kernel"}))
    return {"stubbed": {s.top: s.why for s in IMPORT_ONLY if s.top in missing},
            "real": sorted(s.top for s in IMPORT_ONLY if s.top not in missing),
            "sgl_kernel": "stand-in (moe_align_block_size, moe_sum_reduce served; rest import-only)"
                          if stand_in else "installed"}


# --------------------------------------------------------------------------------------------
# Weights: the FP8 source, our INT4 tensors, the shard round trip.


class FP8Experts(NamedTuple):
    """All experts in SGLang's Fp8MoEMethod layout (w13 = gate rows, then up rows)."""

    w13: torch.Tensor  # e4m3 (E, 2I, H)
    w13_scale_inv: torch.Tensor  # f32 (E, 2I/128, H/128)
    w2: torch.Tensor  # e4m3 (E, H, I)
    w2_scale_inv: torch.Tensor  # f32 (E, H/128, I/128)

    def source(self, e: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's (fp8 weight, scale_inv) as the checkpoint stores gate / up / down."""
        half, sb = self.w13.shape[1] // 2, self.w13_scale_inv.shape[1] // 2
        match proj:
            case "gate_proj":
                return self.w13[e, :half], self.w13_scale_inv[e, :sb]
            case "up_proj":
                return self.w13[e, half:], self.w13_scale_inv[e, sb:]
            case "down_proj":
                return self.w2[e], self.w2_scale_inv[e]
        raise ValueError(proj)

    def dequantized(self, e: int) -> tuple[torch.Tensor, ...]:
        """Expert e's (gate, up, down) as float64, for the reference."""
        from quantize.source.fp8 import dequant_block

        return tuple(dequant_block(*self.source(e, p), FP8_BLOCK).double() for p in PROJS)


def fp8_block_quantize(W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float (N, K) -> e4m3 (N, K) and f32 scale_inv (N/128, K/128), scale = block amax / 448."""
    N, K = W.shape
    bn, bk = FP8_BLOCK
    Wb = W.float().reshape(N // bn, bn, K // bk, bk)  # (N/128, 128, K/128, 128)
    amax = Wb.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # (N/128, K/128)
    scale_inv = amax / E4M3_MAX
    q = (Wb / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(N, K), scale_inv


def make_fp8_experts(shape: MoEShape, device: torch.device, seed: int) -> FP8Experts:
    """Random N(0, 1/K) experts quantized to FP8 blocks, one expert at a time on the device."""
    E, H, I = shape.E, shape.H, shape.I
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.empty(E, 2 * I, H, dtype=torch.float8_e4m3fn, device=device)
    s13 = torch.empty(E, 2 * I // FP8_BLOCK[0], H // FP8_BLOCK[1], device=device)
    w2 = torch.empty(E, H, I, dtype=torch.float8_e4m3fn, device=device)
    s2 = torch.empty(E, H // FP8_BLOCK[0], I // FP8_BLOCK[1], device=device)
    for e in range(E):
        w13[e], s13[e] = fp8_block_quantize(torch.randn(2 * I, H, generator=g, device=device) / H ** 0.5)
        w2[e], s2[e] = fp8_block_quantize(torch.randn(H, I, generator=g, device=device) / I ** 0.5)
    return FP8Experts(w13, s13, w2, s2)


PROJS = ("gate_proj", "up_proj", "down_proj")
SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")  # int4_outputs' order, symmetric


def convert_experts(src: FP8Experts, group_size: int) -> dict[str, torch.Tensor]:
    """{file name: tensor} of every expert's INT4 outputs, by our conversion's own functions."""
    from quantize.rounding.int4 import int4_outputs, quantize_rtn
    from quantize.source.fp8 import dequant_block

    out = {}
    for e in range(src.w13.shape[0]):
        for proj in PROJS:
            W = dequant_block(*src.source(e, proj), FP8_BLOCK)  # (N, K) float32
            for suffix, t in zip(SUFFIXES, int4_outputs(quantize_rtn(W, group_size))):
                out[f"{PREFIX}.{e}.{proj}.{suffix}"] = t
    return out


def shard_round_trip(ckpt: dict[str, torch.Tensor], names: list[str], folder: Path) -> dict:
    """Write `names` with our ShardWriter, read them back with safetensors, compare, and put
    the read-back tensors into `ckpt` (so they are what SGLang loads)."""
    from safetensors import safe_open

    from quantize.plan import OutTensor
    from quantize.source.checkpoint import st_dtype
    from quantize.write.shards import ShardWriter

    path = folder / "model-00001-of-00001.safetensors"
    planned = [OutTensor(n, st_dtype(ckpt[n].dtype), tuple(ckpt[n].shape)) for n in names]
    with ShardWriter(path, planned) as w:
        for n in names:
            w.write(ckpt[n])
    unequal = []
    device = next(iter(ckpt.values())).device
    with safe_open(str(path), framework="pt", device=str(device) if device.type == "cuda" else "cpu") as f:
        for n in names:
            t = f.get_tensor(n)
            ref = ckpt[n]
            if t.dtype != ref.dtype or t.shape != ref.shape or not torch.equal(t, ref.to(t.device)):
                unequal.append(n)
            ckpt[n] = t
    nbytes = path.stat().st_size
    path.unlink()
    return {"tensors": len(names), "file_bytes": nbytes, "sha256": w.sha256,
            "unequal": unequal, "equal": not unequal}


# --------------------------------------------------------------------------------------------
# References (plain torch; tests/test_bench_sglang_moe.py runs them on the CPU).


def int4_weight(ckpt: dict[str, torch.Tensor], e: int, proj: str, dtype: torch.dtype) -> torch.Tensor:
    """One expert's (N, K) weight as our `dequantize` gives it, from its file tensors."""
    from quantize.rounding.int4 import Int4Weight, dequantize, unpack_int4

    packed = ckpt[f"{PREFIX}.{e}.{proj}.weight_packed"]
    scale = ckpt[f"{PREFIX}.{e}.{proj}.weight_scale"]
    K = packed.shape[1] * 8
    return dequantize(Int4Weight(unpack_int4(packed, K), scale, None), dtype)


def moe_reference(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """y[t] = sum_k w[t, k] * down(silu(gate x_t) * up x_t) over the routed experts, in `dtype`;
    `expert(e)` gives (gate (I, H), up (I, H), down (H, I)) in `dtype`."""
    T, H = x.shape
    y = torch.zeros(T, H, dtype=dtype, device=x.device)
    xf = x.to(dtype)
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        Wg, Wu, Wd = expert(e)
        xe = xf[tok]  # (n_e, H)
        h = F.silu(xe @ Wg.T) * (xe @ Wu.T)  # (n_e, I)
        y.index_add_(0, tok, (h @ Wd.T) * topk_weights[tok, slot, None].to(dtype))
    return y


def rel_errors(y: torch.Tensor, ref: torch.Tensor) -> dict:
    """Per-token ||y_t - ref_t|| / ||ref_t||: max and mean; and over the whole output."""
    d = (y.double() - ref.double())
    r = ref.double()
    per_token = d.norm(dim=1) / r.norm(dim=1).clamp(min=1e-300)
    return {"max_rel": float(per_token.max()), "mean_rel": float(per_token.mean()),
            "frob_rel": float(d.norm() / r.norm().clamp(min=1e-300))}


def triton_w4a16_weight(b_u8: torch.Tensor, b_scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """The (N, K) bf16 weight `fused_moe_kernel_gptq_awq` multiplies by, from one expert's
    repacked (N, K/2) uint8 and (N, K/g) scale, with the kernel's own index arithmetic:
    b = (B[n, k // 2] >> (k % 2) * 4) & 0xF;  w = bf16((b - 8) * f32(scale[n, k // g]))."""
    K2 = b_u8.shape[1]
    k = torch.arange(2 * K2, device=b_u8.device)
    nibble = (b_u8[:, k // 2].to(torch.int32) >> ((k % 2) * 4)) & 0xF  # (N, K)
    return ((nibble - 8).float() * b_scale.float()[:, k // group_size]).to(torch.bfloat16)


def loaded_equal_file(layer, ckpt: dict[str, torch.Tensor], E: int) -> list[str]:
    """Parameters as FusedMoE.weight_loader left them vs the file tensors (before the repack):
    w13_* [e] = cat(gate, up).T, w2_* [e] = down.T. The names that differ."""
    bad = []
    for e in range(E):
        def f(proj, s, e=e):
            return ckpt[f"{PREFIX}.{e}.{proj}.{s}"]
        for s in ("weight_packed", "weight_scale"):
            w13 = torch.cat([f("gate_proj", s), f("up_proj", s)]).t().to(getattr(layer, f"w13_{s}").device)
            if not torch.equal(getattr(layer, f"w13_{s}")[e], w13):
                bad.append(f"w13_{s}[{e}]")
            if not torch.equal(getattr(layer, f"w2_{s}")[e], f("down_proj", s).t().to(w13.device)):
                bad.append(f"w2_{s}[{e}]")
    return bad


def repacked_equal_ours(layer, ckpt: dict[str, torch.Tensor], E: int, I: int,
                        group_size: int) -> list[str]:
    """The repacked weights read as the Triton kernel reads them vs our dequantize, exactly."""
    bad = []
    for e in range(E):
        w13 = triton_w4a16_weight(layer.w13_weight_packed[e], layer.w13_weight_scale[e], group_size)
        w2 = triton_w4a16_weight(layer.w2_weight_packed[e], layer.w2_weight_scale[e], group_size)
        ours = {"gate_proj": w13[:I], "up_proj": w13[I:], "down_proj": w2}
        for proj, got in ours.items():
            if not torch.equal(got, int4_weight(ckpt, e, proj, torch.bfloat16).to(got.device)):
                bad.append(f"{e}.{proj}")
    return bad


def align_semantics_differ(a: tuple, b: tuple, numel: int, block_size: int) -> str | None:
    """Where two moe-align results (sorted_token_ids, expert_ids, num_tokens_post_pad) differ
    in what fused_moe reads: the total, the expert of each block below it, and each block's set
    of pair indices. None when they agree."""
    sa, ea, na = a
    sb, eb, nb = b
    total = int(na[0])
    if total != int(nb[0]):
        return f"num_tokens_post_pad {total} != {int(nb[0])}"
    nblocks = total // block_size
    if not torch.equal(ea[:nblocks].long(), eb[:nblocks].long()):
        return "expert_ids differ below the padded total"
    blk = torch.arange(total, device=sa.device) // block_size  # each slot's block
    ka = torch.sort(blk * (numel + 1) + sa[:total].long()).values
    kb = torch.sort(blk * (numel + 1) + sb[:total].to(sa.device).long()).values
    if not torch.equal(ka, kb):
        return "a block holds different (token, slot) pairs"
    return None


def align_buffers(topk_ids: torch.Tensor, E: int, block_size: int) -> tuple:
    """(sorted_token_ids, expert_ids, num_tokens_post_pad, cumsum_buffer) as SGLang's
    moe_align_block_size allocates them for E routed experts (its sizes, padded to 4)."""
    numel = topk_ids.numel()
    if numel < E + 1:
        max_padded = numel * block_size
    else:
        max_padded = numel + (E + 1) * (block_size - 1)
    max_padded = (max_padded + 3) // 4 * 4
    dev = topk_ids.device
    return (torch.empty(max_padded, dtype=torch.int32, device=dev),
            torch.empty(-(-max_padded // block_size), dtype=torch.int32, device=dev),
            torch.empty(1, dtype=torch.int32, device=dev),
            torch.empty(E + 2, dtype=torch.int32, device=dev))


def weight_bytes(shape: MoEShape, scheme: str) -> int:
    """Bytes one expert's weights and scales take in the kernel's layout."""
    H, I = shape.H, shape.I
    if scheme == "fp8_block":
        bn, bk = FP8_BLOCK
        return 3 * H * I + 4 * (2 * I // bn * (H // bk) + H // bn * (I // bk))
    g = int(scheme.removeprefix("int4_g"))
    return 3 * H * I // 2 + 2 * (2 * I * (H // g) + H * (I // g))


# --------------------------------------------------------------------------------------------
# SGLang: its context, its layer, its kernels.


def module(name: str) -> types.ModuleType:
    """The module itself (SGLang's packages rebind some submodule names to functions, e.g.
    triton_utils.moe_align_block_size, so `import a.b as m` can hand back the function)."""
    return importlib.import_module(name)


def sglang_context(device: torch.device) -> None:
    """World of one, the published server args (TP = EP = 1, --moe-runner-backend triton), the
    MoE flags: what SGLang's own layer tests set up (sglang/test/layer_ut_utils.py)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29641")
    ps = module("sglang.srt.distributed.parallel_state")
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    on_cpu = {"device": "cpu"} if device.type == "cpu" else {}
    publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1,
                       moe_runner_backend="triton", **on_cpu),
            role="test", ranks=SpawnRanks(world_rank=0))
    if ps._WORLD is not None:
        get_parallel().override_permanently(world_group=ps._WORLD)
    ps.initialize_model_parallel(backend="gloo")
    initialize_moe_config()


def our_quantization_config(group_size: int) -> dict:
    """config.json's quantization_config as our convert writes it for an RTN run."""
    from quantize.options import ConvertOptions
    from quantize.source.checkpoint import SourceFormat
    from quantize.write.qconfig import quantization_config

    plan = types.SimpleNamespace(options=ConvertOptions(method="rtn", group_size=group_size),
                                 fp8_targets=(), source_format=SourceFormat.FP8_BLOCK,
                                 block_size=FP8_BLOCK,
                                 ignore=["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                         "re:.*mlp\\.gate$"])
    return quantization_config(plan)


class Int4Layer(NamedTuple):
    layer: torch.nn.Module  # SGLang's FusedMoE
    scheme: str  # the scheme class SGLang chose
    loaded_unequal: list[str]
    repacked_unequal: list[str]
    load_s: float


def build_int4_layer(shape: MoEShape, group_size: int, ckpt: dict[str, torch.Tensor],
                     device: torch.device) -> Int4Layer:
    """SGLang's FusedMoE for our config, loaded tensor by tensor from `ckpt`, repacked."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    t0 = time.perf_counter()
    qc = CompressedTensorsConfig.from_config(our_quantization_config(group_size))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as SGLang's model loader builds a bf16 model
    try:
        with torch.device(device):
            layer = FusedMoE(num_experts=shape.E, hidden_size=shape.H, intermediate_size=shape.I,
                             layer_id=LAYER, top_k=shape.top_k, params_dtype=torch.bfloat16,
                             quant_config=qc, prefix=PREFIX, inplace=False)
    finally:
        torch.set_default_dtype(default)
    params = dict(layer.named_parameters())
    for p in params.values():  # sentinel: a parameter the loader never writes shows
        p.data.fill_(-7 if not p.is_floating_point() else float("nan"))
    mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", shape.E)
    for name, t in ckpt.items():
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name not in name:
                continue
            full = name.replace(weight_name, param_name)  # ...mlp.experts.w13_weight_packed
            param = params[full.removeprefix(PREFIX + ".")]
            param.weight_loader(param, t, full, shard_id=shard_id, expert_id=expert_id)
            break
        else:
            raise RuntimeError(f"{name}: no FusedMoE parameter maps it")
    loaded = loaded_equal_file(layer, ckpt, shape.E)
    layer.quant_method.process_weights_after_loading(layer)
    repacked = repacked_equal_ours(layer, ckpt, shape.E, shape.I, group_size)
    return Int4Layer(layer, type(layer.scheme).__name__, loaded, repacked, time.perf_counter() - t0)


def dispatch(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    logits = torch.empty(0, device=x.device)  # the Triton path never reads them
    return StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                  topk_output=StandardTopKOutput(topk_weights, topk_ids, logits))


def int4_call(layer, d) -> Callable[[], torch.Tensor]:
    """The layer's compute after routing: CompressedTensorsFusedMoEMethod.apply (the scheme's
    apply_weights: its Triton quant info into its MoeRunner)."""
    return lambda: layer.quant_method.apply(layer, d).hidden_states


def fp8_call(runner, src: FP8Experts, d) -> Callable[[], torch.Tensor]:
    """SGLang's Triton runner on FP8 block experts, with the quant info Fp8MoEMethod builds for a
    block-quantized layer (sglang/srt/layers/quantization/fp8.py get_triton_quant_info)."""
    from sglang.srt.layers.moe.moe_runner.triton import TritonMoeQuantInfo

    def call():
        info = TritonMoeQuantInfo(w13_weight=src.w13, w2_weight=src.w2, use_fp8_w8a8=True,
                                  w13_scale=src.w13_scale_inv, w2_scale=src.w2_scale_inv,
                                  a13_scale=None, a2_scale=None, block_shape=list(FP8_BLOCK))
        return runner.run(d, info).hidden_states
    return call


def cpu_custom_ops() -> None:
    """SGLang registers its custom ops (the fused-experts entry points) for the CUDA dispatch key
    only; the CPU check registers the same Python functions for the CPU key too, and names the
    device for the config lookup."""
    import inspect

    from sglang.srt.utils.common import sglang_lib

    fm = module("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe")

    for name in ("outplace_fused_experts", "inplace_fused_experts"):
        sglang_lib.impl(name, inspect.unwrap(getattr(fm, name)), "CPU")
    # and its tuned-config lookup names the device: none on a CPU
    cfg = module("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config")
    cfg.get_device_name = lambda device_id=0: "cpu"


def interpreter_like_gpu() -> None:
    """Triton's interpreter (3.9), which runs SGLang's kernels in the CPU check, departs from a GPU
    in two ways that bias the numbers: it multiplies bf16 dot operands as their uint16 bit
    patterns, and it truncates float downcasts (f32 -> bf16, -> e4m3) where the GPU rounds to
    nearest even. Both are set right here: the operands widened to f32 (the products a bf16 MMA
    accumulates in f32), the downcasts done by torch's own conversions."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype != tl.bfloat16:
            return h
        return interpreter.TensorHandle(
            (h.data.astype(np.uint32) << np.uint32(16)).view(np.float32), tl.float32)

    def create_dot_f32(self, a, b, d, *args):
        return create_dot(self, widen(a), widen(b), d, *args)
    interpreter.InterpreterBuilder.create_dot = create_dot_f32

    convert = interpreter._convert_float
    as_torch = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}
    to_torch = {tl.bfloat16: (torch.bfloat16, torch.int16, np.uint16),
                tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8, np.uint8)}

    def convert_rne(input, input_dtype, output_dtype, rounding_mode):
        if (input_dtype not in as_torch or output_dtype not in to_torch
                or rounding_mode not in (None, interpreter._ir.ROUNDING_MODE.RTNE)):
            return convert(input, input_dtype, output_dtype, rounding_mode)
        src = torch.from_numpy(np.ascontiguousarray(input))
        if input_dtype == tl.bfloat16:
            src = src.view(torch.int16).view(torch.bfloat16)
        out_dtype, bits, np_bits = to_torch[output_dtype]
        return src.to(out_dtype).view(bits).numpy().view(np_bits)
    interpreter._convert_float = convert_rne


def choose_kernels(device: torch.device) -> dict:
    """Probe SGLang's JIT builds (nvcc via tvm-ffi) once; where one fails, patch in the fallback.
    Returns the record for the JSON; `Kernels.align` serves the sgl_kernel stand-in."""
    notes: dict = {}
    Kernels.align = moe_align_block_size_torch
    if device.type != "cuda":  # SGLang's CPU path: its moe_align needs sgl_kernel's CPU build
        cpu_custom_ops()
        interpreter_like_gpu()
        mab = module("sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size")
        mab.sgl_moe_align_block_size = moe_align_block_size_torch
        notes["moe_align"] = "plain torch (CPU run: SGLang has no CPU moe-align without sgl_kernel)"
        notes["silu_and_mul"] = "SGLang's CPU fallback (torch)"
        notes["fp8_act_quant"] = "SGLang's Triton per_token_group_quant (its non-CUDA path)"
        notes["moe_sum_reduce"] = "SGLang's moe_sum_reduce_triton (its non-CUDA path)"
        return notes

    # a build that hangs falls back like one that fails, within the run's budget (SGLang: 1800 s)
    module("sglang.kernels.jit.utils.compile.ninja")._NINJA_TIMEOUT_S = 180
    g = torch.Generator(device=device).manual_seed(1)
    # moe-align: the JIT build of the kernel sgl_kernel ships, probed at 512 pairs, 257 buckets
    t0 = time.perf_counter()
    try:
        from sglang.kernels.ops.moe.moe_align import moe_align_block_size as jit_align

        ids = torch.randint(0, 256, (64, 8), generator=g, device=device, dtype=torch.int32)
        bufs = align_buffers(ids, 256, 16)
        jit_align(ids, 257, 16, *bufs, True)
        torch.cuda.synchronize()
        Kernels.align = jit_align
        notes["moe_align"] = f"SGLang JIT (sglang/kernels/ops/moe/moe_align.py), built/loaded in {time.perf_counter() - t0:.1f} s"
    except Exception as e:  # noqa: BLE001 - a failed nvcc build: record it, run plain torch
        notes["moe_align"] = f"plain torch (moe_align_block_size_torch): the JIT build failed: {e!r}"[:2000]
    # SiLU-and-mul: SGLang's JIT activation kernel, else the same math in torch
    t0 = time.perf_counter()
    try:
        from sglang.kernels.ops.activation.activation import silu_and_mul

        a = torch.randn(8, 512, generator=g, device=device).to(torch.bfloat16)
        out = torch.empty(8, 256, dtype=torch.bfloat16, device=device)
        silu_and_mul(a, out)
        want = (F.silu(a[:, :256].float()) * a[:, 256:].float()).to(torch.bfloat16)
        ok = torch.allclose(out.float(), want.float(), rtol=2e-2, atol=1e-3)
        notes["silu_and_mul"] = f"SGLang JIT, built/loaded in {time.perf_counter() - t0:.1f} s" + (
            "" if ok else " (differs from torch beyond bf16 rounding: see equality)")
    except Exception as e:  # noqa: BLE001 - a failed nvcc build: record it, run plain torch
        fm = module("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe")

        def silu_and_mul_torch(x, out, *args, **kwargs):  # every row: the filtered ones unused
            d = x.shape[-1] // 2
            out.copy_(F.silu(x[..., :d].float()) * x[..., d:].float())
        fm.silu_and_mul = silu_and_mul_torch
        notes["silu_and_mul"] = f"plain torch: the JIT build failed: {e!r}"[:2000]
    # FP8 activation quantization: SGLang's JIT per_token_group_quant, else its Triton version
    t0 = time.perf_counter()
    try:
        from sglang.kernels.ops.quantization.fp8_kernel import sglang_per_token_group_quant_fp8

        a = torch.randn(8, 512, generator=g, device=device).to(torch.bfloat16)
        sglang_per_token_group_quant_fp8(a, 128)
        torch.cuda.synchronize()
        notes["fp8_act_quant"] = f"SGLang JIT per_token_group_quant, built/loaded in {time.perf_counter() - t0:.1f} s"
    except Exception as e:  # noqa: BLE001 - a failed nvcc build: record it, run SGLang's Triton
        from sglang.kernels.ops.quantization.fp8_kernel import _per_token_group_quant_8bit_raw

        fk = module("sglang.kernels.ops.moe.fused_moe_triton_kernels")
        fk.sglang_per_token_group_quant_fp8 = _per_token_group_quant_8bit_raw
        notes["fp8_act_quant"] = f"SGLang's Triton per_token_group_quant: the JIT build failed: {e!r}"[:2000]
    notes["moe_sum_reduce"] = ("SGLang's moe_sum_reduce_triton for M > 32 (sgl_kernel's CUDA "
                               "moe_sum_reduce is not installed); at M <= 32 SGLang itself picks "
                               "moe_sum_reduce_triton on sm90")
    return notes


def check_align(ids_all: torch.Tensor, Ms: list[int], block_sizes: list[int], E: int) -> dict:
    """moe_align_block_size_torch against SGLang's moe-align on the benchmark's routing: its
    dispatching wrapper (what the layer calls: the one-launch Triton kernel up to 64 routed
    pairs on CUDA, above it `Kernels.align`), the one-launch Triton kernel called directly
    (exact at any size; tried up to 128 pairs on a GPU, where larger tiles spill and compile
    slowly) and, when it built, the JIT kernel."""
    from sglang.kernels.ops.moe.moe_align_small_numel import moe_align_small_numel
    from sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size import (
        moe_align_block_size,
    )

    cases = {}
    for M in Ms:
        ids = ids_all[:M]
        for bs in block_sizes:
            mine = align_buffers(ids, E, bs)
            moe_align_block_size_torch(ids, E + 1, bs, *mine, True)
            theirs = {}
            if ids.is_cuda:  # (on the CPU the wrapper calls moe_align_block_size_torch itself)
                theirs["sglang_wrapper"] = moe_align_block_size(ids, bs, E)
            if ids.numel() <= (128 if ids.is_cuda else 512):  # its [numel, numel] tiles
                b = align_buffers(ids, E, bs)
                moe_align_small_numel(ids, E + 1, bs, *b[:3])
                theirs["small_numel_triton"] = b[:3]
            if Kernels.align is not moe_align_block_size_torch:
                b = align_buffers(ids, E, bs)
                Kernels.align(ids, E + 1, bs, *b, True)
                theirs["jit"] = b[:3]
            for name, res in theirs.items():
                diff = align_semantics_differ(res, mine[:3], ids.numel(), bs)
                cases[f"M={M},block={bs},{name}"] = diff or "equal"
    return {"cases": cases, "equal": all(v == "equal" for v in cases.values())}


def moe_config_record(shape: MoEShape, scheme: str, M: int) -> dict:
    """The Triton config SGLang's own lookup gives this call (tuned file or default)."""
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import (
        get_config_file_name,
        get_moe_configs,
        try_get_optimal_moe_config,
    )

    E, H, I = shape.E, shape.H, shape.I
    if scheme == "fp8_block":
        dtype, block, w1, w2 = "fp8_w8a8", list(FP8_BLOCK), (E, 2 * I, H), (E, H, I)
    else:
        dtype, block = "int4_w4a16", [0, int(scheme.removeprefix("int4_g"))]
        w1, w2 = (E, 2 * I, H // 2), (E, H, I // 2)
    N = w2[2]
    tuned = get_moe_configs(E, N, dtype, block[0], block[1])
    config, (down, _) = try_get_optimal_moe_config(w1, w2, shape.top_k, dtype, M, block_shape=block,
                                                   return_down_config=True)
    return {"file": get_config_file_name(E, N, dtype, block),
            "source": "tuned file" if tuned else "default (get_default_config)",
            "config": dict(config), "down_config": dict(down) if down else None}


# --------------------------------------------------------------------------------------------
# Timing.


class Timing(NamedTuple):
    median_us: float
    min_us: float
    n: int


def time_eager(fn: Callable, device: torch.device, iters: int, warmup: int) -> Timing:
    """CUDA events around each call (wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
    else:
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
        for a, b in ev:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        ts = [a.elapsed_time(b) * 1e3 for a, b in ev]
    ts.sort()
    return Timing(ts[len(ts) // 2], ts[0], len(ts))


def time_graph(fn: Callable, iters: int, warmup: int) -> Timing:
    """The call captured once as a CUDA graph, replayed with events around each replay: the
    GPU's time without Python and launch overhead (what decode under CUDA graphs pays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    t = time_eager(graph.replay, torch.device("cuda"), iters, warmup)
    del graph
    return t


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the bytes read and the bytes
    written: the memory's usable rate, the most a kernel streaming its weights in can reach."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_eager(lambda: dst.copy_(src), device, iters, warmup=3)
    return 2 * nbytes / (t.median_us * 1e-6)


# --------------------------------------------------------------------------------------------
# The run.


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda}
    for pkg in ("triton", "sglang", "compressed-tensors", "transformers", "apache-tvm-ffi"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def device_record(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": platform.processor() or "cpu", "type": "cpu"}
    p = torch.cuda.get_device_properties(device)
    return {"name": p.name, "type": "cuda", "capability": list(torch.cuda.get_device_capability(device)),
            "multiprocessors": p.multi_processor_count, "memory_bytes": p.total_memory}


class Routing(NamedTuple):
    """The layer's input after the router: the same for INT4, FP8 and the references."""

    x: torch.Tensor  # bf16 (T, H)
    topk_weights: torch.Tensor  # f32 (T, top_k)
    topk_ids: torch.Tensor  # int32 (T, top_k)

    def first(self, M: int) -> Routing:  # tokens are independent: M tokens = the first M rows
        return Routing(self.x[:M], self.topk_weights[:M], self.topk_ids[:M])


ROUTING = ("x ~ N(0, 1) in bf16; GLM-style router: sigmoid of N(0, 1) logits, top-k, weights "
           "divided by their sum (f32), ids int32; the same for INT4, FP8 and the references")


def make_routing(T: int, shape: MoEShape, device: torch.device, seed: int) -> Routing:
    g = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(T, shape.H, generator=g, device=device).to(torch.bfloat16)
    scores = torch.sigmoid(torch.randn(T, shape.E, generator=g, device=device))
    w, ids = torch.topk(scores, shape.top_k, dim=-1)
    return Routing(x, (w / w.sum(-1, keepdim=True)).float().contiguous(),
                   ids.to(torch.int32).contiguous())


Call = Callable[[Routing], Callable[[], torch.Tensor]]  # routing -> the timed call


class Run:
    """The result JSON being filled in, its failures, and where it is saved after each phase."""

    def __init__(self, out: Path, result: dict):
        self.out, self.result, self.failures = out, result, []
        self.t0 = time.perf_counter()

    def fail(self, why: str) -> None:
        self.failures.append(why)

    def save(self) -> None:
        from quantize.write.shards import write_json_atomic  # strict JSON: non-finite -> null

        self.result["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.result["stubs"]["touched"] = sorted(STUB_TOUCHED)
        self.result["failures"] = self.failures
        self.out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.out, self.result)


def errors_by_M(call: Call, r: Routing, ref: torch.Tensor, Ms: list[int], tol: float) -> dict:
    """The layer's output against `ref` at every M (a crash recorded as that M's error)."""
    rec: dict = {"by_M": {}}
    for M in Ms:
        try:
            rec["by_M"][str(M)] = rel_errors(call(r.first(M))(), ref[:M])
        except Exception:  # noqa: BLE001 - recorded with its traceback; the run fails below
            rec["by_M"][str(M)] = {"error": traceback.format_exc()[-3000:]}
    errs = [v for v in rec["by_M"].values() if "max_rel" in v]
    rec["max_rel"] = max((v["max_rel"] for v in errs), default=None)
    rec["mean_rel"] = sum(v["mean_rel"] for v in errs) / len(errs) if errs else None
    rec["passed"] = len(errs) == len(Ms) and rec["max_rel"] <= tol
    return rec


def int4_phase(run: Run, shape: MoEShape, g: int, src: FP8Experts, r: Routing,
               ref_src: torch.Tensor, Ms: list[int], shard_experts: int, workdir: Path,
               device: torch.device) -> tuple[Call, object]:
    """Convert at group size g, round-trip the shard, load into SGLang, check. Returns the
    layer's call and its MoeRunnerConfig."""
    key = f"int4_g{g}"
    t0 = time.perf_counter()
    ckpt = convert_experts(src, g)
    convert_s = time.perf_counter() - t0
    n = min(shard_experts, shape.E)
    rt = shard_round_trip(ckpt, [f"{PREFIX}.{e}.{p}.{s}" for e in range(n) for p in PROJS
                                 for s in SUFFIXES], workdir)
    run.result["bytes_round_trip"][key] = {"experts": n, **rt}
    if not rt["equal"]:
        run.fail(f"{key}: tensors read back from the shard differ: {rt['unequal'][:5]}")
    built = build_int4_layer(shape, g, ckpt, device)
    ref = moe_reference(r.x, r.topk_weights, r.topk_ids,
                        lambda e: tuple(int4_weight(ckpt, e, p, torch.float64) for p in PROJS))
    ckpt.clear()  # the layer holds its own copies

    def call(rr: Routing, layer=built.layer):
        return int4_call(layer, dispatch(*rr))
    rec = {"sglang_scheme": built.scheme, "convert_s": round(convert_s, 1),
           "sglang_load_and_repack_s": round(built.load_s, 1),
           "loaded_equal_file": not built.loaded_unequal,
           "repacked_dequant_equal_ours": not built.repacked_unequal,
           **errors_by_M(call, r, ref, Ms, TOL_INT4),
           "int4_vs_fp8_source": rel_errors(call(r)(), ref_src)}  # the quantization error itself
    rec["passed"] = rec["passed"] and not built.loaded_unequal and not built.repacked_unequal
    if built.scheme != "CompressedTensorsWNA16TritonMoE":
        run.fail(f"{key}: SGLang chose {built.scheme}, not the Triton WNA16 scheme")
    if built.loaded_unequal:
        run.fail(f"{key}: loaded parameters differ from the file: {built.loaded_unequal[:5]}")
    if built.repacked_unequal:
        run.fail(f"{key}: repacked weights differ from ours: {built.repacked_unequal[:5]}")
    if not rec["passed"]:
        run.fail(f"{key}: equality failed (max_rel {rec['max_rel']}, tolerance {TOL_INT4})")
    run.result["equality"][key] = rec
    run.save()
    return call, built.layer.moe_runner_config


def timing_phase(run: Run, shape: MoEShape, calls: dict[str, Call], r: Routing, Ms: list[int],
                 device: torch.device, iters: int, warmup: int) -> None:
    """Each scheme at each M, eager and replayed as a CUDA graph, beside its bandwidth floor."""
    bw = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (16 << 20))
    timing: dict = {"copy_bandwidth_GBps": bw / 1e9, "iters": iters, "warmup": warmup,
                    "floor": "bytes of expert weights the call reads / copy bandwidth",
                    "decode_gain": "t_fp8 / t_int4 - 1", "slower_by": "t_int4 / t_fp8 - 1",
                    "per_M": {}}
    run.result["timing"] = timing
    for M in Ms:
        rr = r.first(M)
        touched = int(rr.topk_ids.unique().numel())
        n = max(5, iters // 5) if M > 1024 else iters
        row: dict = {"experts_touched": touched}
        for key, call in calls.items():
            cell: dict = {"weight_bytes": touched * weight_bytes(shape, key)}
            cell["floor_us"] = cell["weight_bytes"] / bw * 1e6
            try:
                cell["config"] = moe_config_record(shape, key, M)
                fn = call(rr)
                cell["eager"] = time_eager(fn, device, n, warmup)._asdict()
            except Exception:  # noqa: BLE001 - recorded with its traceback; the run fails
                cell["error"] = traceback.format_exc()[-3000:]
                run.fail(f"timing {key} M={M} failed")
            if device.type == "cuda" and "eager" in cell:
                try:
                    cell["graph"] = time_graph(fn, n, warmup)._asdict()
                    cell["graph_floor_fraction"] = cell["floor_us"] / cell["graph"]["median_us"]
                except Exception:  # noqa: BLE001 - optional: a capture failure is recorded
                    cell["graph_error"] = traceback.format_exc()[-3000:]
            row[key] = cell
        for key in calls:
            for mode in ("eager", "graph"):
                if key != "fp8_block" and mode in row[key] and mode in row["fp8_block"]:
                    t4, t8 = row[key][mode]["median_us"], row["fp8_block"][mode]["median_us"]
                    row[f"{key}_vs_fp8_{mode}"] = {"ratio_int4_over_fp8": t4 / t8,
                                                   "decode_gain": t8 / t4 - 1,
                                                   "slower_by": t4 / t8 - 1}
        if M in WRITEUP_DECODE_GAIN:
            row["writeup"] = {"decode_gain": WRITEUP_DECODE_GAIN[M]}
        elif M >= 1024:
            row["writeup"] = {"prefill_slower_by": WRITEUP_PREFILL_SLOWER}
        timing["per_M"][str(M)] = row
        run.save()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON written (strict JSON)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="E=16, H=256, I=128, top-4 (CPU check)")
    ap.add_argument("--group-size", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--tp", type=int, default=1,
                    help="time one tensor-parallel rank's shard: expert width I / tp")
    ap.add_argument("--tokens", type=int, nargs="+", default=None,
                    help="M values (default 1 8 16 32 64 4096; tiny: 1 4 16 40)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--shard-experts", type=int, default=16,
                    help="experts whose tensors go through a safetensors shard and back")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=None, help="where the shard is written")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # SGLang's Triton kernels on the CPU
    shape = TINY if args.tiny else GLM52
    shape = shape._replace(I=shape.I // args.tp)
    if shape.I * args.tp != (TINY if args.tiny else GLM52).I or shape.I % 128:
        ap.error(f"--tp {args.tp}: the expert width must split into multiples of 128")
    Ms = args.tokens or ([1, 4, 16, 40] if args.tiny else [1, 8, 16, 32, 64, 4096])
    iters, warmup = (args.iters, args.warmup) if device.type == "cuda" else (2, 1)
    run = Run(args.out, {"script": "scripts/bench_sglang_moe.py", "complete": False,
                         "passed": None, "argv": sys.argv[1:], "device": device_record(device),
                         "shape": {"experts": shape.E, "top_k": shape.top_k, "hidden": shape.H,
                                   "intermediate": shape.I, "tp": args.tp,
                                   "activations": "bfloat16"},
                         "tokens": Ms, "stubs": install_stubs()})
    run.save()

    t0 = time.perf_counter()
    sglang_context(device)
    run.result["versions"] = versions()
    run.result["sglang_import_and_context_s"] = round(time.perf_counter() - t0, 1)
    run.result["kernels"] = choose_kernels(device)
    run.save()

    r = make_routing(max(Ms), shape, device, args.seed)
    run.result["routing"] = ROUTING
    run.result["align_check"] = check_align(r.topk_ids, Ms, [16, 64], shape.E)
    if not run.result["align_check"]["equal"]:
        run.fail("moe_align_block_size_torch disagrees with SGLang's moe-align")
    run.save()

    t0 = time.perf_counter()
    src = make_fp8_experts(shape, device, args.seed)
    run.result["fp8_source_s"] = round(time.perf_counter() - t0, 1)
    ref_src = moe_reference(r.x, r.topk_weights, r.topk_ids, src.dequantized)
    run.result["equality"] = {
        "tolerance_int4": TOL_INT4, "tolerance_fp8": TOL_FP8,
        "metric": "per-token ||y - y_ref|| / ||y_ref||: max and mean over the tokens",
        "bf16_rounding_of_reference": rel_errors(ref_src.to(torch.bfloat16), ref_src)}
    run.result["bytes_round_trip"] = {}
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_sglang_moe_"))
    workdir.mkdir(parents=True, exist_ok=True)
    calls: dict[str, Call] = {}
    for g in args.group_size:
        calls[f"int4_g{g}"], runner_config = int4_phase(run, shape, g, src, r, ref_src, Ms,
                                                        args.shard_experts, workdir, device)
    if args.workdir is None:
        workdir.rmdir()  # (each shard is removed once read back)

    from sglang.srt.layers.moe.moe_runner.runner import MoeRunner
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    # SGLang's Triton runner with the INT4 layer's MoeRunnerConfig (E, top-k, silu, out of place)
    runner = MoeRunner(MoeRunnerBackend.TRITON, runner_config)
    calls["fp8_block"] = lambda rr: fp8_call(runner, src, dispatch(*rr))
    rec = errors_by_M(calls["fp8_block"], r, ref_src, Ms, TOL_FP8)
    if not rec["passed"]:
        run.fail(f"fp8_block: off its reference (max_rel {rec['max_rel']}, tolerance {TOL_FP8})")
    run.result["equality"]["fp8_block"] = rec
    run.save()

    timing_phase(run, shape, calls, r, Ms, device, iters, warmup)
    run.result["complete"] = True
    run.result["passed"] = not run.failures
    run.save()
    print(summary(run.result), flush=True)
    return 0 if not run.failures else 1


def summary(r: dict) -> str:
    v = r["versions"]
    lines = [f"{r['device']['name']}  torch {v['torch']}  triton {v['triton']}  sglang {v['sglang']}"]
    for k, e in r["equality"].items():
        if isinstance(e, dict) and "passed" in e:
            lines.append(f"equality {k}: max_rel {e['max_rel']}  passed {e['passed']}")
    for M, row in r["timing"]["per_M"].items():
        cells = []
        for key, cell in row.items():
            if isinstance(cell, dict) and "graph" in cell:
                cells.append(f"{key} {cell['graph']['median_us']:.1f} us (floor {cell['floor_us']:.1f})")
            elif isinstance(cell, dict) and "eager" in cell:
                cells.append(f"{key} {cell['eager']['median_us']:.1f} us eager")
        lines.append(f"M={M}: " + "; ".join(cells))
    lines.append(f"passed: {r['passed']}  failures: {r['failures']}")
    return "\n".join(lines)


if __name__ == "__main__":
    with torch.no_grad():  # as SGLang serves (its custom ops call straight through then)
        sys.exit(main())
