"""The vLLM tier: tests that drive vLLM 0.32's own code against kvrdma.

They need vLLM, which the main venv does not have (vLLM pins its own torch): `make test`
builds `.venv-vllm` (a CPU vLLM with kvrdma installed into it without deps) and runs
`.venv-vllm/bin/pytest tests/vllm` after the main suite. Under a Python without vLLM this
directory is not collected, and the run's summary says so. Every test here carries the
`vllm` marker.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import pytest

HERE = Path(__file__).parent
HAVE_VLLM = importlib.util.find_spec("vllm") is not None

# Not collected at all without vLLM: the test modules import it at top level.
collect_ignore_glob = [] if HAVE_VLLM else ["*"]

# torch (as vLLM imports it) warns about its own deprecated API at import time; only that
# warning is allowed, every other one stays an error as in the rest of the suite.
_TORCH_IMPORT_WARNING = "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"

if HAVE_VLLM:
    # vLLM picks its platform at import: CPU here, and never reach for the Hugging Face hub.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch")
        import vllm.config  # noqa: F401  (the import warnings land here, not in a test)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("filterwarnings", _TORCH_IMPORT_WARNING)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.vllm)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not HAVE_VLLM:
        terminalreporter.write_line(
            "tests/vllm not run: vllm is not installed in this Python "
            "(`make test` runs it with .venv-vllm/bin/pytest tests/vllm)"
        )
