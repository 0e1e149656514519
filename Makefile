# quantize: FP8/BF16 GLM MoE -> compressed-tensors INT4.  `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
QUANTIZE := $(VENV)/bin/quantize
export OMP_NUM_THREADS ?= 1
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: help install demo test lint bench clean
# A bare `make` lists the targets (the included pipeline's first target would demand MODEL).
.DEFAULT_GOAL := help

# plan / convert / verify / eval / push / all: the pipeline on MODEL -> OUT (mk/pipeline.mk)
PIPELINE_PREREQ := install
include mk/pipeline.mk

help: ## list targets and variables
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 16
	@echo; echo "variables: MODEL OUT METHOD GROUP_SIZE TARGETS CALIB NUM_SAMPLES SEQ_LEN TP DEVICE"
	@echo "           MAX_SHARD_SIZE MIN_SQNR REVISION REPO REPO_REVISION PRIVATE DRY_RUN EVAL EVAL_FLAGS"
	@echo "e.g.  make all MODEL=zai-org/GLM-5.2-FP8 OUT=./GLM-5.2-INT4 METHOD=gptq REPO=my-org/GLM-5.2-INT4"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: takes the local CPU wheel instead of a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed ## create .venv with the package (CLI at .venv/bin/quantize)

demo: install ## tiny GLM-5 FP8 checkpoint: inspect -> plan -> convert (RTN, then AWQ+GPTQ) -> verify
	$(PY) scripts/demo.py build demo/GLM-tiny-FP8
	$(QUANTIZE) inspect demo/GLM-tiny-FP8
	$(QUANTIZE) plan demo/GLM-tiny-FP8 --tp 2
	$(QUANTIZE) convert demo/GLM-tiny-FP8 demo/GLM-tiny-INT4 --overwrite --max-shard-size 2MB --tp 2
	$(QUANTIZE) verify demo/GLM-tiny-FP8 demo/GLM-tiny-INT4
	$(QUANTIZE) convert demo/GLM-tiny-FP8 demo/GLM-tiny-INT4-awq-gptq --overwrite --max-shard-size 2MB \
	    --tp 2 --method awq+gptq --num-samples 16 --seq-len 128
	$(QUANTIZE) verify demo/GLM-tiny-FP8 demo/GLM-tiny-INT4-awq-gptq

test: install ## run the test suite (CPU only, no network)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -x

lint: install ## ruff
	$(VENV)/bin/ruff check quantize tests scripts

bench: install ## streaming benchmark: peak RSS vs depth, throughput vs plain copy (JSON)
	$(PY) scripts/bench_stream.py --out bench_out/bench_stream.json

clean: ## remove demo and benchmark outputs
	rm -rf demo bench_out
