"""tests/engine_sglang runs only under `make engine-check` (SGLang in .venv-sglang), which sets
QUANTIZE_SGLANG_CHECK=1; a plain `pytest` (make test) leaves the folder uncollected. Under
make engine-check nothing here skips: a missing or broken SGLang fails the import.

sglang 0.5.23 is a CUDA build (installed --no-deps on the CPU torch, Makefile). Its model
classes, its compressed-tensors schemes and its weight loaders run on the CPU with what this
file sets up before SGLang is imported, nothing more:

- `SGLANG_USE_CPU_ENGINE=0`: SGLang's generic (GPU-server) code paths, not its Xeon engine,
  which needs the CPU build of sgl-kernel (`cache_move.py` imports
  `copy_all_layer_kv_cache_cpu` from it at import time) and takes a CPU-only rope for DSA.
- Two import-only stubs, for packages that cannot install beside a CPU torch; nothing in them
  is called while a model is built and its weights loaded:
  - `torchvision` (with `transforms`, `transforms.functional`): PyPI's torchvision is built for
    PyPI's CUDA torch and fails to import on the CPU one ("operator torchvision::nms does not
    exist"). SGLang's config registry imports `InterpolationMode` from it for its OCR / VL
    configs (`configs/deepseek_ocr.py`, `multimodal/internvl_utils.py`). transformers is asked
    first whether torchvision is installed (it caches the answer, no), so it never takes the
    stub for the real package.
  - `vllm` (with `_custom_ops`): `layers/rotary_embedding/base.py` imports vLLM's rotary
    kernel when the platform is neither CUDA nor SGLang's CPU engine; vLLM is no CUDA-free
    install (its CPU build is 3.5 GB) and no rotary forward runs here.
- One patch, `CompressedTensorsConfig._check_scheme_supported`: SGLang asks it (for every
  quantized Linear, and to pick W4AFP8) whether the GPU's compute capability reaches the
  scheme's minimum, through `torch.cuda.get_device_capability()`, which a CPU torch cannot
  answer. The patch answers as an H100 / H200 (capability 90) does.

Each test builds its model in this one process; `sglang_runtime` starts SGLang's process
groups once (gloo, world size 1) and publishes the server arguments every build reads.
"""

from __future__ import annotations

import os
import sys
import types
from importlib.machinery import ModuleSpec

import pytest

CHECK = os.environ.get("QUANTIZE_SGLANG_CHECK") == "1"
collect_ignore_glob = [] if CHECK else ["*"]

H100_CAPABILITY = 90  # sm90: what the patch and the fusion rule (test module) answer as


def _stub(name: str, **attrs) -> None:
    """An empty module `name` (importable as a package) holding `attrs`."""
    m = types.ModuleType(name)
    m.__spec__ = ModuleSpec(name, None, is_package=True)
    m.__path__ = []
    m.__dict__.update(attrs)
    sys.modules[name] = m
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, m)


def _install() -> None:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "0"
    from transformers.utils.import_utils import is_torchvision_available

    assert not is_torchvision_available()  # (cached: transformers keeps this answer)
    _stub("torchvision")
    _stub("torchvision.transforms", InterpolationMode=None)
    _stub("torchvision.transforms.functional", InterpolationMode=None)
    _stub("vllm")
    _stub("vllm._custom_ops", rotary_embedding=None)

    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    def _check_scheme_supported(self, min_capability: int, error: bool = True) -> bool:
        supported = H100_CAPABILITY >= min_capability
        if error and not supported:
            raise RuntimeError(f"Quantization scheme is not supported on an H100: min "
                               f"capability {min_capability}")
        return supported

    CompressedTensorsConfig._check_scheme_supported = _check_scheme_supported


if CHECK:
    _install()


@pytest.fixture(scope="session")
def sglang_runtime(tmp_path_factory):
    """SGLang's process groups (gloo, one rank) and its published server arguments: a GPU
    server's (`device="cuda"`: the model classes take their GPU-server code paths, e.g. the
    DSA indexer's rope) at TP 1, as SGLang's own layer tests set them up."""
    import torch
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    init = tmp_path_factory.mktemp("dist") / "init"
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{init}")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1, device="cuda"),
            role="test", ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")
    yield
    torch.distributed.destroy_process_group()
