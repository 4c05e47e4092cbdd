# The README's commands: `make demo` and `make test` (both set up .venv first).
# For the edit-test loop: `make test-fast` (tests/unit: no process, no server) and `make lint`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast test-torch lint typecheck check bench clean

$(BIN)/ckptflow: pyproject.toml constraints.txt csrc/_memcopy.c $(wildcard third_party/xxhash/*)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the local CPU build. A looser spec pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test,lint]'
	touch $(BIN)/ckptflow

setup: $(BIN)/ckptflow

demo: setup
	$(BIN)/ckptflow demo

# tests/unit, tests/integration (one real part: torchrun jobs, a Prefect server, S3 over HTTP) and
# tests/e2e (the README's paths, started as a user starts them). Most tests wait on child
# processes and servers more than they compute: on 2 cores four workers keep both cores busy
# where two left a third idle. Each worker takes one test file at a time (a module's fixtures
# start once), except the files that use the session Prefect server, which run as two groups on
# two workers (two servers, not four). tests/conftest.py sends the groups and the longest files
# out first, so that none starts last and runs alone at the end.
# The few that assert timings run alone afterwards (marker `serial`).
# The suite starts about 600 Python processes; where the environment forbids writing bytecode
# (PYTHONDONTWRITEBYTECODE), each would compile ckptflow's modules again: compile them once.
TEST_WORKERS ?= 4

test: setup
	$(BIN)/python -m compileall -q ckptflow flows tasks trainer tests benchmarks
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial" --durations=30
	sync  # what the parallel part wrote is on disk before the timed tests start (its writeback would compete with them)
	$(BIN)/python -m pytest -q -m serial --durations=5

test-fast: setup
	$(BIN)/python -m pytest -q tests/unit

# The supported torch window (pyproject: 2.11-2.14) beyond the pinned build the suite runs on:
# `make test-torch TORCH=2.11.0` installs that release from the registry (a CUDA build; it runs
# on CPU) into its own venv and runs the trainer's core tests against it: save, kill and exact
# resume, resume at another world size, plain DCP and torch.save reading every checkpoint.
TORCH ?= 2.14.1
TORCH_VENV := .venv-torch$(TORCH)
TORCH_TESTS := tests/unit tests/integration/test_exact_resume.py tests/integration/test_any_loop.py \
	tests/integration/test_snapshot.py tests/integration/test_fastwrite.py tests/integration/test_fastload.py \
	tests/integration/test_commit_crash.py

test-torch:
	test -x $(TORCH_VENV)/bin/python || $(PY) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/pip install -q --upgrade pip
	# No pip cache: a CUDA build is several GB, and a cached copy beside the installed one has
	# filled a CI machine's disk before.
	$(TORCH_VENV)/bin/pip install -q --no-cache-dir torch==$(TORCH)
	grep -v '^torch==' constraints.txt > $(TORCH_VENV)/constraints.txt
	$(TORCH_VENV)/bin/pip install -q --no-cache-dir -c $(TORCH_VENV)/constraints.txt -e '.[test]'
	$(TORCH_VENV)/bin/python -c 'import torch; assert torch.__version__.split("+")[0] == "$(TORCH)", torch.__version__'
	$(TORCH_VENV)/bin/python -m pytest -q -n 2 --dist loadfile -p no:cacheprovider $(TORCH_TESTS)

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
	rm -rf $(VENV) .venv-torch* .ckptflow .pytest_cache build
