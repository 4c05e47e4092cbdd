# The README's commands: `make demo` and `make test` (both set up .venv first).
# For the edit-test loop: `make test-fast` (no torchrun jobs or servers) and `make lint`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast lint typecheck check bench clean

$(BIN)/ckptflow: pyproject.toml constraints.txt trainer/_memcopy.c $(wildcard trainer/_xxhash/*)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the local CPU build. A looser spec pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test,lint]'
	touch $(BIN)/ckptflow

setup: $(BIN)/ckptflow

demo: setup
	$(BIN)/ckptflow demo

# Most tests wait on child processes and servers more than they compute: two workers (one test
# file each at a time, so a module's fixtures start once) take the suite from ~31 to ~19 min on
# 2 cores. The few that assert timings run alone afterwards (marker `serial`).
TEST_WORKERS ?= 2

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=30
	$(BIN)/python -m pytest -q -m serial --durations=5

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
