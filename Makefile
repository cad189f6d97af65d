# Two entry points for a fresh machine; each sets itself up idempotently.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: it resolves to the CPU wheel on disk instead of a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/opd run full

test: $(STAMP)
	PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false \
	  $(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
