"""A rank keeps itself published: a sidecar restarted on its own (Kubernetes restarts a native
sidecar container alone) holds the rank again within one period, without the worker
restarting; a sidecar that is down costs one warning, not one per attempt."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from kvrdma.errors import HandshakeError
from kvrdma.handshake import HandshakeServer
from kvrdma.handshake.publisher import KeepPublished
from tests.integration.sidecar_helpers import ENGINE, worker

pytestmark = pytest.mark.timeout(60)


def _sidecar(address: str) -> HandshakeServer:
    return HandshakeServer("127.0.0.1", 0, publish_address=address)


def _until(check: object, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_a_restarted_sidecar_gets_the_rank_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    address = f"ipc://{tmp_path}/publish.sock"
    first = _sidecar(address)
    keeper = KeepPublished(lambda: worker(0), address, every=0.1, timeout=0.5)
    try:
        assert first.published_ranks(ENGINE) == [0]  # published before the constructor returned
        first.close()
        with caplog.at_level(logging.WARNING, "kvrdma.handshake.publisher"):
            time.sleep(1.0)  # several periods with no sidecar
        assert caplog.text.count("publishing to the sidecar again failed") == 1
        second = _sidecar(address)
        try:
            assert _until(lambda: second.published_ranks(ENGINE) == [0])
        finally:
            second.close()
    finally:
        keeper.close()
    assert not keeper._thread.is_alive()


def test_a_first_publish_that_fails_raises(tmp_path: Path) -> None:
    with pytest.raises(HandshakeError, match="sidecar"):
        KeepPublished(lambda: worker(0), f"ipc://{tmp_path}/nobody.sock", timeout=0.3)
