# kvrdma — two commands for a newcomer:  `make demo`  and  `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kvrdma-installed
# The vLLM tier (tests/vllm) runs in its own CPU vLLM venv: vLLM pins its own torch and
# friends, so it never shares the main venv. The stamp names the version: bumping it rebuilds.
VLLM_VERSION ?= 0.32.0
VLLM_VENV ?= .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.vllm-$(VLLM_VERSION)-installed
# vLLM's runtime imports, installed by name because vllm itself goes in with --no-deps
# (its declared dependencies pull CUDA wheels); tests/vllm needs only its CPU code paths.
VLLM_RUNTIME_DEPS := numpy packaging regex psutil pyzmq urllib3 transformers cbor2 aiohttp \
	requests openai_harmony openai pillow pybase64 cachetools msgspec cloudpickle uvloop \
	py-cpuinfo prometheus_client fastapi partial_json_parser llguidance einops apache-tvm-ffi==0.1.11
# xgrammar goes in without its dependencies, at vLLM's pin: they name triton, a large GPU-only
# wheel the CPU code paths never import.
VLLM_XGRAMMAR := xgrammar==0.2.8
# A dropped connection mid-download resumes instead of failing the build.
export PIP_RETRIES ?= 10
export PIP_RESUME_RETRIES ?= 20
DEMO_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup setup-vllm demo test lint typecheck unit integration e2e vllm bench sysdeps clean

# The CPU build of torch lies on this machine's disk; installing it first keeps pip
# from pulling a multi-GB CUDA build when nixl/the package ask for torch.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# pip's resolver complains about vllm's undeclared-by-us dependencies (CUDA extras, vllm._C):
# expected on CPU, hence no `pip check` here; kvrdma goes in editable and without deps.
$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q torch==2.13.0
	$(VLLM_BIN)/pip install -q --no-deps vllm==$(VLLM_VERSION)
	$(VLLM_BIN)/pip install -q $(VLLM_RUNTIME_DEPS)
	$(VLLM_BIN)/pip install -q --no-deps $(VLLM_XGRAMMAR)
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q nixl prometheus-client 'pytest>=8' 'pytest-timeout>=2.3' \
		'hypothesis>=6.100'
	$(VLLM_BIN)/pip install -q --no-deps -e .
	$(VLLM_BIN)/python -c "import vllm, nixl, kvrdma"
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/kvrdma demo $(DEMO_ARGS)

# System tools the e2e tests drive (promtool/prometheus, kubectl); installed when missing.
sysdeps:
	@bash .ci/sysdeps

lint: $(STAMP)
	$(BIN)/ruff check kvrdma tests benchmarks
	$(BIN)/mypy

test: $(STAMP) $(VLLM_STAMP) sysdeps lint
	$(BIN)/pytest $(PYTEST_ARGS)
	$(VLLM_BIN)/pytest tests/vllm $(PYTEST_ARGS)

unit: $(STAMP)
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

integration: $(STAMP)
	$(BIN)/pytest tests/integration $(PYTEST_ARGS)

e2e: $(STAMP) sysdeps
	$(BIN)/pytest tests/e2e $(PYTEST_ARGS)

vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/pytest tests/vllm $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/kvrdma bench

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
