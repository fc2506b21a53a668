"""A rank keeps itself published: a sidecar restarted on its own (Kubernetes restarts a native
sidecar container alone) holds the rank again within one period, without the worker
restarting; a sidecar that is down costs one warning, not one per attempt."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from kvrdma.errors import ConfigError, HandshakeError
from kvrdma.handshake import HandshakeServer
from kvrdma.handshake.publisher import EXPIRE_AFTER_PERIODS, KeepPublished, SidecarPublisher
from kvrdma.handshake.wire import MAX_PUBLISH_TTL_S, PublishRequest, with_checksum
from tests.integration.sidecar_helpers import ENGINE, keeping_published, stop, worker

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
        warned = "publishing to the sidecar again failed"
        with caplog.at_level(logging.WARNING, "kvrdma.handshake.publisher"):
            assert _until(lambda: warned in caplog.text)
            time.sleep(1.0)  # several periods more with no sidecar
        assert caplog.text.count(warned) == 1
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


def test_a_close_that_cannot_reach_the_sidecar_logs_it_and_returns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine shutting down while its sidecar is gone is not held past the unpublish's
    timeout, nor failed by it: the rank's ttl drops it if the sidecar comes back."""
    address = f"ipc://{tmp_path}/publish.sock"
    sidecar = _sidecar(address)
    keeper = KeepPublished(lambda: worker(0), address)
    sidecar.close()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, "kvrdma.handshake.publisher"):
        keeper.close()
        keeper.close()  # idempotent: nothing sent, nothing logged again
    assert time.monotonic() - start < keeper._timeout + 2.0
    assert caplog.text.count("unpublishing from the sidecar failed") == 1
    assert not keeper._thread.is_alive()


def test_the_rank_of_a_worker_killed_without_unpublishing_is_dropped_after_its_ttl(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A SIGKILLed (or OOM-killed) engine never unpublishes: its ranks stop being served once
    its last publish outlived the ttl `KeepPublished` gives it, not served to peers forever."""
    address = f"ipc://{tmp_path}/publish.sock"
    sidecar = _sidecar(address)
    child = keeping_published(address, 0, tp=2, every=0.2)
    try:
        time.sleep(1.0)  # five periods: kept published all along
        assert sidecar.published_ranks(ENGINE) == [0]
        child.kill()
        child.wait(timeout=10)
        killed = time.monotonic()
        with caplog.at_level(logging.WARNING, "kvrdma.handshake.server"):
            assert _until(lambda: sidecar.published_ranks(ENGINE) == [], timeout=5.0)
        gone = time.monotonic() - killed
        assert gone <= EXPIRE_AFTER_PERIODS * 0.2 + 0.5
        assert caplog.text.count("was not published again within its ttl") == 1
        assert sidecar.stats["publish_expired"] == 1 and sidecar.published() == {}
    finally:
        stop(child)
        sidecar.close()


def test_a_rank_published_without_a_ttl_stays_until_withdrawn(tmp_path: Path) -> None:
    """Only a publish that asks for a ttl expires; publishing again without one keeps the rank."""
    now = [0.0]
    server = HandshakeServer("127.0.0.1", 0, clock=lambda: now[0])
    try:
        server.publish(worker(0), ttl=5.0)
        server.publish(worker(1))
        now[0] = 4.9
        assert server.published_ranks(ENGINE) == [0, 1]
        now[0] = 5.0
        assert server.published_ranks(ENGINE) == [1]
        server.publish(worker(0), ttl=5.0)
        server.publish(worker(0))  # a later publish without a ttl replaces the expiring one
        now[0] = 1e9
        assert server.published_ranks(ENGINE) == [0, 1]
    finally:
        server.close()


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("nan"), float("inf"), MAX_PUBLISH_TTL_S * 2])
def test_a_server_refuses_a_ttl_out_of_range_publishing_nothing(ttl: float) -> None:
    """In process too: a NaN ttl would serve the rank forever, a negative one publish it
    only to drop it at the next read."""
    server = HandshakeServer("127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError, match=r"ttl: expected seconds in \(0, 86400\]"):
            server.publish(worker(0), ttl=ttl)
        assert server.published_ranks(ENGINE) == []
    finally:
        server.close()


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("nan"), float("inf"), MAX_PUBLISH_TTL_S * 2])
def test_a_ttl_out_of_range_is_refused_naming_it(tmp_path: Path, ttl: float) -> None:
    address = f"ipc://{tmp_path}/publish.sock"
    sidecar = _sidecar(address)
    try:
        with SidecarPublisher(address, timeout=2.0) as pub:
            with pytest.raises(ConfigError, match=r"ttl: expected seconds in \(0, 86400\]"):
                pub.publish(worker(0), ttl=ttl)
            # the sidecar checks what it decodes too: a peer's bad ttl publishes nothing
            pub.publish = lambda meta, **_: pub._call(  # type: ignore[method-assign]
                PublishRequest(worker=with_checksum(meta), ttl=ttl), "publishing", None
            )
            with pytest.raises(HandshakeError, match=r"\$\.ttl"):
                pub.publish(worker(0))
        assert sidecar.published_ranks(ENGINE) == []
    finally:
        sidecar.close()


def test_by_default_a_kept_rank_lasts_thirty_seconds_at_the_sidecar(tmp_path: Path) -> None:
    """The promise of deploy/k8s/README.md: with the default period (10 s) a publish lasts
    30 s at the agent, so a killed engine's ranks are gone within that."""
    address, now = f"ipc://{tmp_path}/publish.sock", [0.0]
    sidecar = HandshakeServer("127.0.0.1", 0, publish_address=address, clock=lambda: now[0])
    keeper = KeepPublished(lambda: worker(0), address)
    try:
        now[0] = 29.9
        assert sidecar.published_ranks(ENGINE) == [0]
        now[0] = 30.0
        assert sidecar.published_ranks(ENGINE) == []
    finally:
        keeper.close()
        sidecar.close()


def test_a_worker_that_publishes_once_lasts_thirty_seconds_at_the_sidecar(tmp_path: Path) -> None:
    """`Worker.publish` gives its rank the 30 s of deploy/k8s/README.md too: a worker killed
    after publishing once is not served, and its agent not ready, for as long as it runs."""
    pytest.importorskip("nixl")
    from kvrdma.config import load_kv_transfer_config
    from kvrdma.testing.synthetic import CacheSpec, ModelShape, make_caches
    from kvrdma.worker import Worker

    spec = CacheSpec(
        ModelShape(num_layers=1, num_kv_heads=1, head_dim=8), "split_kv", "HND", 0, 1, 16, 4
    )
    config = load_kv_transfer_config(
        {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": ENGINE},
        environ={},
    )
    address, now = f"ipc://{tmp_path}/publish.sock", [0.0]
    sidecar = HandshakeServer("127.0.0.1", 0, publish_address=address, clock=lambda: now[0])
    w = Worker.create(config, tp_rank=0, tp_size=1, total_num_kv_heads=1)
    try:
        w.register_kv_caches(make_caches(spec)[0], cache_layout="split_kv", block_size=16)
        w.publish(address)
        now[0] = 29.9
        assert sidecar.published_ranks(ENGINE) == [0]
        now[0] = 30.0
        assert sidecar.published_ranks(ENGINE) == []
        assert sidecar.stats["publish_expired"] == 1
        w.publish(address, ttl=None)  # unless the caller asks to be served until unpublished
        now[0] = 1e9
        assert sidecar.published_ranks(ENGINE) == [0]
    finally:
        w.close()
        sidecar.close()
