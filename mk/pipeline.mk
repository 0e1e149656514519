# The pipeline as make targets: plan -> convert -> verify -> [eval] -> push.
# Included by the main Makefile, which defines PY and QUANTIZE. Every recipe is one CLI call;
# each step produces a file, so a re-run skips finished steps:
#
#   $(OUT).convert-flags                 the convert command's arguments, rewritten only when
#                                        they change (METHOD, GROUP_SIZE, ...): then plan and
#                                        convert run again, and convert either redoes nothing
#                                        (same options) or refuses the finished OUT with the
#                                        difference; a changed option never reuses OUT silently
#   $(OUT).plan.json                     plan (next to OUT: convert wants OUT empty or its own)
#   $(OUT)/model.safetensors.index.json  convert; only "made" once the manifest is complete, so
#                                        an interrupted convert is resumed by the next `make`
#   $(OUT)/verify.json                   verify; removed when verify fails, so it runs again
#   $(OUT)/eval.json                     eval (on by default; EVAL=0 skips it; EVAL_FLAGS e.g. --num-samples 64)
#   $(OUT)/.pushed-ORG--NAME@REVISION    push (a stamp, outside the uploaded file list)
#
#   make all MODEL=zai-org/GLM-5.2-FP8 OUT=./GLM-5.2-INT4 REPO=my-org/GLM-5.2-INT4
#   make all MODEL=... OUT=... REPO=... DRY_RUN=1     # everything but the upload

PY ?= .venv/bin/python
QUANTIZE ?= .venv/bin/quantize
# Run before any step (order-only), e.g. PIPELINE_PREREQ := install in the main Makefile.
PIPELINE_PREREQ ?=

MODEL ?=
OUT ?=
METHOD ?= rtn
GROUP_SIZE ?= 32
TARGETS ?= routed
CALIB ?=
NUM_SAMPLES ?=
SEQ_LEN ?=
# every other convert option, passed when set (empty: the CLI's default)
SCHEME ?=
MTP ?=
KEEP_FP8 ?=
ASYMMETRIC ?=
SEED ?=
EXPERT_CALIBRATION ?=
MIN_EXPERT_TOKENS ?=
EXPERT_COVERAGE ?=
PERCDAMP ?=
MSE_CLIP ?=
SCALE_REFIT ?=
CHECKPOINT_INTERVAL ?=
MAX_GPU_MEMORY ?=
BASE_MODEL ?=
CONFIG ?=
TP ?= 8
DEVICE ?= auto
MAX_SHARD_SIZE ?= 5GB
MIN_SQNR ?= 12
REVISION ?=
REPO ?=
REPO_REVISION ?= main
PRIVATE ?=
DRY_RUN ?=
EVAL ?= 1
EVAL_FLAGS ?=

PIPELINE_GOALS := convert verify eval push all

INDEX := $(OUT)/model.safetensors.index.json
PLAN_JSON := $(OUT).plan.json
CONVERT_STAMP := $(OUT).convert-flags
VERIFY_JSON := $(OUT)/verify.json
EVAL_JSON := $(OUT)/eval.json
PUSH_STAMP := $(OUT)/.pushed-$(subst /,--,$(REPO))@$(REPO_REVISION)

SRC_FLAGS := $(if $(REVISION),--revision $(REVISION))
QUANT_FLAGS := --method $(METHOD) --group-size $(GROUP_SIZE) --targets $(TARGETS) $(if $(CALIB),--calib $(CALIB)) \
  $(if $(NUM_SAMPLES),--num-samples $(NUM_SAMPLES)) $(if $(SEQ_LEN),--seq-len $(SEQ_LEN)) \
  $(if $(ASYMMETRIC),--asymmetric) $(if $(SEED),--seed $(SEED)) $(if $(SCHEME),--scheme $(SCHEME)) \
  $(if $(MTP),--mtp $(MTP)) $(if $(KEEP_FP8),--keep-fp8) $(if $(EXPERT_CALIBRATION),--expert-calibration $(EXPERT_CALIBRATION)) \
  $(if $(MIN_EXPERT_TOKENS),--min-expert-tokens $(MIN_EXPERT_TOKENS)) \
  $(if $(EXPERT_COVERAGE),--expert-coverage $(EXPERT_COVERAGE)) \
  $(if $(PERCDAMP),--percdamp $(PERCDAMP)) $(if $(filter 0 no false off,$(MSE_CLIP)),--no-mse-clip,$(if $(MSE_CLIP),--mse-clip)) \
  $(if $(SCALE_REFIT),--scale-refit $(SCALE_REFIT)) \
  $(if $(BASE_MODEL),--base-model $(BASE_MODEL)) $(if $(CONFIG),--config $(CONFIG))
CONVERT_FLAGS := --tp $(TP) --device $(DEVICE) --max-shard-size $(MAX_SHARD_SIZE) \
  $(if $(CHECKPOINT_INTERVAL),--checkpoint-interval $(CHECKPOINT_INTERVAL)) \
  $(if $(MAX_GPU_MEMORY),--max-gpu-memory $(MAX_GPU_MEMORY))
PLAN_FLAGS := --tp $(TP) --group-size $(GROUP_SIZE) --targets $(TARGETS) --max-shard-size $(MAX_SHARD_SIZE) \
  $(if $(ASYMMETRIC),--asymmetric) $(if $(SCHEME),--scheme $(SCHEME)) $(if $(MTP),--mtp $(MTP)) $(if $(KEEP_FP8),--keep-fp8) --method $(METHOD) $(if $(NUM_SAMPLES),--num-samples $(NUM_SAMPLES)) \
  $(if $(SEQ_LEN),--seq-len $(SEQ_LEN))
PUSH_FLAGS := --revision $(REPO_REVISION) $(if $(PRIVATE),--private)

need = $(if $($(1)),,$(error $(1) is required, e.g. make $(2) $(1)=$(3)))

ifneq ($(filter $(PIPELINE_GOALS),$(MAKECMDGOALS)),)
$(call need,MODEL,all,zai-org/GLM-5.2-FP8)
$(call need,OUT,all,./GLM-5.2-INT4)
endif

.PHONY: plan convert verify eval push all

plan: | $(PIPELINE_PREREQ)
plan: ## print the size plan and the serving checks (MODEL, GROUP_SIZE, TARGETS, TP)
	$(call need,MODEL,plan,zai-org/GLM-5.2-FP8)
	$(QUANTIZE) plan $(MODEL) $(SRC_FLAGS) $(PLAN_FLAGS)

# The stamp holds convert's arguments, --device aside (convert does not count where it runs as
# part of the output, so a resume may move to another machine). Compared when make reads this
# file, like the manifest status below, so `make -n` shows exactly what a run would redo.
CONVERT_ARGS := $(strip $(MODEL) $(OUT) $(SRC_FLAGS) $(QUANT_FLAGS) --tp $(TP) \
                  --max-shard-size $(MAX_SHARD_SIZE))
ifneq ($(strip $(shell cat $(CONVERT_STAMP) 2>/dev/null)),$(CONVERT_ARGS))
$(CONVERT_STAMP): FORCE
endif

$(CONVERT_STAMP):
	printf '%s\n' '$(CONVERT_ARGS)' > $@

$(PLAN_JSON): $(CONVERT_STAMP) | $(PIPELINE_PREREQ)
	$(QUANTIZE) plan $(MODEL) $(SRC_FLAGS) $(PLAN_FLAGS) --strict --json > $@.tmp
	mv $@.tmp $@

# The index exists before the manifest says complete (and after a crash in between): the
# manifest's status, not the file's presence, decides whether convert still has work to do.
CONVERT_STATUS := $(shell $(PY) -c 'import json,sys; print(json.load(open(sys.argv[1])).get("status"))' \
                    $(OUT)/quantize-manifest.json 2>/dev/null)
ifneq ($(CONVERT_STATUS),complete)
$(INDEX): FORCE
endif
FORCE:
.PHONY: FORCE

$(INDEX): $(CONVERT_STAMP) | $(PLAN_JSON)
	$(QUANTIZE) convert $(MODEL) $(OUT) $(SRC_FLAGS) $(QUANT_FLAGS) $(CONVERT_FLAGS)

convert: $(INDEX) ## convert MODEL into OUT (resumes an interrupted run)

$(VERIFY_JSON): $(INDEX)
	$(QUANTIZE) verify $(MODEL) $(OUT) $(SRC_FLAGS) --min-sqnr $(MIN_SQNR) || { rm -f $@; exit 1; }

verify: $(VERIFY_JSON) ## check every output tensor against MODEL; writes OUT/verify.json

$(EVAL_JSON): $(VERIFY_JSON)
	$(QUANTIZE) eval $(MODEL) $(OUT) $(SRC_FLAGS) --device $(DEVICE) $(EVAL_FLAGS) || { rm -f $@; exit 1; }

eval: $(EVAL_JSON) ## evaluate OUT against MODEL; writes OUT/eval.json

PUSH_DEPS := $(VERIFY_JSON) $(if $(filter 1,$(EVAL)),$(EVAL_JSON))

$(PUSH_STAMP): $(PUSH_DEPS)
	$(call need,REPO,push,my-org/GLM-5.2-INT4)
	$(QUANTIZE) push $(OUT) $(REPO) $(PUSH_FLAGS)
	touch $@

ifeq ($(DRY_RUN),)
push: $(PUSH_STAMP) ## upload OUT to REPO with its model card (DRY_RUN=1: list files, print card)
else
push: $(PUSH_DEPS)
	$(call need,REPO,push,my-org/GLM-5.2-INT4)
	$(QUANTIZE) push $(OUT) $(REPO) $(PUSH_FLAGS) --dry-run
endif

all: push ## the chain: plan -> convert -> verify -> eval (EVAL=0 skips it) -> push
