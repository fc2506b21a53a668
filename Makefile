# kvrdma — two commands for a newcomer:  `make demo`  and  `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kvrdma-installed
DEMO_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup demo test lint typecheck unit integration e2e bench sysdeps clean

# The CPU build of torch lies on this machine's disk; installing it first keeps pip
# from pulling a multi-GB CUDA build when nixl/the package ask for torch.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvrdma demo $(DEMO_ARGS)

# System tools the e2e tests drive (promtool/prometheus, kubectl); installed when missing.
sysdeps:
	@bash .ci/sysdeps

lint: $(STAMP)
	$(BIN)/ruff check kvrdma tests benchmarks
	$(BIN)/mypy

test: $(STAMP) sysdeps lint
	$(BIN)/pytest $(PYTEST_ARGS)

unit: $(STAMP)
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

integration: $(STAMP)
	$(BIN)/pytest tests/integration $(PYTEST_ARGS)

e2e: $(STAMP) sysdeps
	$(BIN)/pytest tests/e2e $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/kvrdma bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
