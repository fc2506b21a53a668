"""What kvrdma reads off vLLM's `VllmConfig` before it serves an engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvrdma.errors import ConfigError
from kvrdma.vllm.config import kvrdma_config


def _vllm_config(**parallel: int) -> SimpleNamespace:
    kv = SimpleNamespace(kv_connector="KvrdmaConnector", kv_role="kv_consumer")
    return SimpleNamespace(kv_transfer_config=kv, parallel_config=SimpleNamespace(**parallel))


def test_a_plain_tensor_parallel_engine_is_served() -> None:
    cfg = _vllm_config(decode_context_parallel_size=1, prefill_context_parallel_size=1)
    assert kvrdma_config(cfg).kv_role == "kv_consumer"  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallel_engines_are_refused_naming_the_setting(name: str) -> None:
    with pytest.raises(ConfigError, match=f"parallel_config.{name}.*expected 1, got 2"):
        kvrdma_config(_vllm_config(**{name: 2}))  # type: ignore[arg-type]
