"""Shared fixtures: tiny GLM checkpoints in the release layouts, written into tmp dirs."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

from quantize.source.synth import tiny_config, write_checkpoint


@pytest.fixture(scope="session")
def dsa_fp8(tmp_path_factory):
    """GLM-5-style block-FP8 glm_moe_dsa: ragged dims, MTP layer, scale in another shard."""
    return write_checkpoint(tmp_path_factory.mktemp("dsa_fp8"), tiny_config("glm_moe_dsa"),
                            "fp8-block", seed=1, shard_bytes=2**20)


@pytest.fixture(scope="session")
def glm4_fp8(tmp_path_factory):
    """GLM-4.x-style compressed-tensors channel-FP8 glm4_moe."""
    return write_checkpoint(tmp_path_factory.mktemp("glm4_fp8"), tiny_config("glm4_moe"),
                            "fp8-channel", seed=2, shard_bytes=2**20)


@pytest.fixture(scope="session")
def dsa_bf16(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dsa_bf16"), tiny_config("glm_moe_dsa"),
                            "bf16", seed=3, shard_bytes=2**20)


@pytest.fixture(autouse=True)
def _default_dtype_is_left_alone():
    """A test that leaves torch's default dtype changed (transformers' model building sets it
    while it builds) would turn every later test's float32 tensors into BF16: said where it
    happens, and restored for the rest of the run."""
    before = torch.get_default_dtype()
    yield
    after = torch.get_default_dtype()
    if after != before:
        torch.set_default_dtype(before)
        pytest.fail(f"torch's default dtype was left at {after} (was {before})")
