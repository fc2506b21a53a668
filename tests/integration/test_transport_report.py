"""What an agent says about the transport UCX can use: a fallback from RDMA to TCP is a
warning naming why, a TCP-only setting is not (real NIXL agents, in this process)."""

from __future__ import annotations

import logging
import os

import pytest

from kvrdma.nixl.transport import describe

pytest.importorskip("nixl")
pytestmark = pytest.mark.timeout(60)


def _agent_log(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    from kvrdma.nixl import BackendConfig, NixlBackend

    with caplog.at_level(logging.INFO, logger="kvrdma.nixl.create"):
        NixlBackend(BackendConfig(name=f"transport-{os.getpid()}")).close()
    return [r for r in caplog.records if "UCX transport" in r.getMessage()]


@pytest.mark.skipif(describe({"UCX_TLS": "rc,tcp"}).kind == "rdma", reason="an RDMA device is here")
def test_rdma_asked_for_and_tcp_left_is_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("UCX_TLS", "rc,ud,tcp")
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    (record,) = _agent_log(caplog)
    assert record.levelno == logging.WARNING
    assert "UCX transport tcp (UCX_TLS='rc,ud,tcp'" in record.getMessage()
    assert "no RDMA device visible" in record.getMessage()


def test_tcp_only_is_reported_quietly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvrdma.testing.ucx import tcp_only

    monkeypatch.setenv("UCX_TLS", tcp_only())
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    (record,) = _agent_log(caplog)
    assert record.levelno == logging.INFO
    assert "UCX transport tcp" in record.getMessage()
    assert "allows no RDMA transport" in record.getMessage()
