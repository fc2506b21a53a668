"""`kvrdma agent`'s /readyz against what the engine's ranks actually published."""

from __future__ import annotations

import json
import time

import pytest
import zmq

from kvrdma.handshake import SidecarPublisher
from kvrdma.handshake.publisher import EXPIRE_AFTER_PERIODS, KeepPublished
from tests.integration.sidecar_helpers import (
    ENGINE,
    HOST,
    Agent,
    crash_handshake_thread,
    http_get,
    in_process_sidecar,
    keeping_published,
    metric,
    stop,
    worker,
)

pytestmark = pytest.mark.timeout(60)


def test_readyz_is_not_ready_when_the_ranks_report_another_tp_size(
    agent: Agent, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    # The engine runs TP 4 while the agent expects 2: ranks 2 and 3 will be asked for by peers
    # and the agent must not call itself ready after ranks 0 and 1 alone.
    with SidecarPublisher(agent.publish, context=ctx, timeout=5.0) as pub:
        pub.publish(worker(0, tp=4))
        pub.publish(worker(1, tp=4))
    status, body = http_get(agent.http + "/readyz")
    assert status == 503, body
    assert "tp_size" in json.loads(body)["problem"]
    assert metric(http_get(agent.http + "/metrics")[1], "kvrdma_agent_ready") == 0


def test_published_ranks_gauge_reads_zero_once_every_rank_unpublished(
    agent: Agent, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    series = f'kvrdma_agent_published_ranks{{dp_index="0",engine_id="{ENGINE}"}}'
    assert metric(http_get(agent.http + "/metrics")[1], series) == 0  # before any publish
    with SidecarPublisher(agent.publish, context=ctx, timeout=5.0) as pub:
        pub.publish(worker(0))
        assert metric(http_get(agent.http + "/metrics")[1], series) == 1
        pub.unpublish(worker(0).engine_id, 0)
    # a vanished series reads as "no data" on dashboards and in alerts, not as zero ranks
    assert metric(http_get(agent.http + "/metrics")[1], series) == 0


def test_readyz_fails_once_the_handshake_thread_is_gone() -> None:
    with in_process_sidecar() as sidecar:
        sidecar.server.publish(worker(0, tp=1))
        url = f"http://{HOST}:{sidecar.http_port}/readyz"
        assert http_get(url)[0] == 200
        crash_handshake_thread(sidecar)  # peers routed here get no answer
        status, body = http_get(url)
        assert status == 503, body
        assert "handshake server stopped" in json.loads(body)["problem"]


def test_readyz_fails_at_once_when_a_kept_rank_closes_cleanly() -> None:
    """A clean engine shutdown (`KeepPublished.close()`, as the vLLM connector's) unpublishes
    its rank: the agent stops serving it and is not ready, without waiting for its ttl."""
    with in_process_sidecar() as sidecar:
        url = f"http://{HOST}:{sidecar.http_port}/readyz"
        assert sidecar.server.publish_address is not None
        keeper = KeepPublished(lambda: worker(0, tp=1), sidecar.server.publish_address)
        try:
            assert http_get(url)[0] == 200
        finally:
            keeper.close()
        status, body = http_get(url)
        assert status == 503 and json.loads(body)["missing_ranks"] == [0], body
        assert sidecar.server.published() == {}
        assert sidecar.server.stats["unpublish_ok"] == 1
        assert sidecar.server.stats["publish_expired"] == 0


def test_readyz_fails_once_a_rank_killed_without_unpublishing_has_expired(agent: Agent) -> None:
    """An engine rank SIGKILLed (or OOM-killed) never unpublishes: once its last publish has
    lasted `EXPIRE_AFTER_PERIODS` periods, the agent stops serving it, /readyz names the rank
    missing and the expiry is counted."""
    kept = keeping_published(agent.publish, 0, tp=2, every=5.0)  # alive: no expiry here
    killed = keeping_published(agent.publish, 1, tp=2, every=0.2)
    try:
        assert http_get(agent.http + "/readyz")[0] == 200
        stop(killed)
        end = time.monotonic() + EXPIRE_AFTER_PERIODS * 0.2 + 2.0
        while (status := http_get(agent.http + "/readyz"))[0] == 200:
            assert time.monotonic() < end, "the killed rank is still served"
            time.sleep(0.05)
        assert status[0] == 503 and json.loads(status[1])["missing_ranks"] == [1], status
        text = http_get(agent.http + "/metrics")[1]
        assert metric(text, 'kvrdma_agent_publishes_total{outcome="expired"}') == 1
        assert (
            metric(text, f'kvrdma_agent_published_ranks{{dp_index="0",engine_id="{ENGINE}"}}') == 1
        )
    finally:
        stop(kept)
        if killed.returncode is None:
            stop(killed)
