"""Where a vLLM engine rank serves its kvrdma_* series: `$KVRDMA_METRICS_PORT` + TP rank, the
same rule `kvrdma agent` scrapes by, and a bad value stops the engine at start, named."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from kvrdma.errors import ConfigError
from kvrdma.testing import free_port
from kvrdma.vllm.stats import serve_metrics

pytestmark = pytest.mark.timeout(30)


def test_unset_serves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVRDMA_METRICS_PORT", raising=False)
    assert serve_metrics(CollectorRegistry(), 0) is None


def test_a_rank_serves_at_the_base_port_plus_its_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    base = free_port()
    registry = CollectorRegistry()
    Counter("kvrdma_probe", "a series to find", registry=registry).inc()
    monkeypatch.setenv("KVRDMA_METRICS_PORT", str(base - 1))
    server = serve_metrics(registry, 1)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{base}/metrics", timeout=5) as reply:
            assert b"kvrdma_probe_total 1.0" in reply.read()
    finally:
        server.shutdown()


@pytest.mark.parametrize("bad", ["nine", "-1", "0", "65535", "9401.0"])
def test_a_bad_port_is_a_config_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv("KVRDMA_METRICS_PORT", bad)
    with pytest.raises(ConfigError, match="KVRDMA_METRICS_PORT"):
        serve_metrics(CollectorRegistry(), 1)
