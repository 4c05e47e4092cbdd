# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

$(BIN)/ckptflow: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the local CPU build. A looser spec pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(BIN)/ckptflow

setup: $(BIN)/ckptflow

demo: setup
	$(BIN)/ckptflow demo

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python -m benchmarks.bench_trainer
	$(BIN)/python -m benchmarks.bench_codec
	$(BIN)/python -m benchmarks.bench_storage
	$(BIN)/python -m benchmarks.bench_restore
	$(BIN)/python -m benchmarks.bench_event_latency

clean:
	rm -rf $(VENV) .ckptflow .pytest_cache
