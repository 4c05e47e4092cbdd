# The README's commands: `make demo` and `make test` (both set up .venv first).
# For the edit-test loop: `make test-fast` (no torchrun jobs or servers) and `make lint`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast lint typecheck check bench clean

$(BIN)/ckptflow: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the local CPU build. A looser spec pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test,lint]'
	touch $(BIN)/ckptflow

setup: $(BIN)/ckptflow

demo: setup
	$(BIN)/ckptflow demo

test: setup
	$(BIN)/python -m pytest -q --durations=30

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/python .ci/typecheck.py

check: lint typecheck test

bench: setup
	$(BIN)/python -m benchmarks.bench_trainer
	$(BIN)/python -m benchmarks.bench_codec
	$(BIN)/python -m benchmarks.bench_storage
	$(BIN)/python -m benchmarks.bench_restore
	$(BIN)/python -m benchmarks.bench_event_latency

clean:
	rm -rf $(VENV) .ckptflow .pytest_cache build
