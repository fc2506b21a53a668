"""`Worker.connect` against a real handshake server, producers in real processes, real NIXL.

The decode worker runs in the test process; each producer rank is a child that builds its
worker from the default config, publishes its metadata to the test's `HandshakeServer`
through the publish socket, and steps until told to stop (or is killed).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from kvrdma.config import load_kv_transfer_config
from kvrdma.errors import (
    ConfigError,
    HandshakeError,
    HandshakeRefused,
    HandshakeTimeout,
    PeerUnreachable,
)
from kvrdma.handshake import HandshakeClient, HandshakeServer, SidecarPublisher
from kvrdma.telemetry import KvrdmaMetrics
from kvrdma.testing.synthetic import CacheSpec, ModelShape, attention_views, make_caches, verify
from kvrdma.types import Outcome
from kvrdma.worker import Worker

pytest.importorskip("nixl")
pytestmark = pytest.mark.timeout(180)

HOST = "127.0.0.1"
SHAPE = ModelShape(num_layers=2, num_kv_heads=4, head_dim=8)
BLOCKS = 16


def _config(engine: str, role: str, **extra: Any) -> Any:
    return load_kv_transfer_config(
        {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "engine_id": engine,
            "kv_connector_extra_config": extra,
        },
        environ={},
    )


def producer(
    conn: Connection, publish: str, rank: int, tp: int, tag: str, delay: float = 0.0
) -> None:
    """P rank `rank` of engine "P": publish after `delay` seconds, then serve until "stop";
    its agent is named by `tag` and its pid, or by default (the same after a restart)."""
    from kvrdma.handshake import SidecarPublisher
    from kvrdma.testing.synthetic import fill

    spec = CacheSpec(SHAPE, "split_kv", "HND", rank, tp, 16, BLOCKS)
    caches, _ = make_caches(spec)
    fill(spec, caches)
    agent = f"P-tp{rank}-{tag}-{os.getpid()}" if tag else None
    w = Worker.create(
        _config("P", "kv_producer"),
        tp_rank=rank,
        tp_size=tp,
        total_num_kv_heads=SHAPE.num_kv_heads,
        agent_name=agent,
    )
    try:
        w.register_kv_caches(caches, cache_layout="split_kv", block_size=16)
        time.sleep(delay)
        with SidecarPublisher(publish, timeout=10.0) as pub:
            pub.publish(w.metadata)
        conn.send(("ready", w.metadata.agent_name))
        while True:
            if conn.poll(0.001):
                msg = conn.recv()
                if msg[0] == "stop":
                    return
                if msg[0] == "hold":
                    w.hold(msg[1], msg[2])
            w.get_finished()
    finally:
        w.close()


@pytest.fixture
def server() -> Iterator[HandshakeServer]:
    with HandshakeServer(HOST, 0, publish_address="tcp://127.0.0.1:0") as s:
        yield s


class Decoder:
    """The decode rank in this process, with its own metrics registry."""

    def __init__(self, rank: int = 0, tp: int = 1, **extra: Any) -> None:
        self.registry = CollectorRegistry()
        metrics = KvrdmaMetrics(registry=self.registry, engine_id="D", role="consumer", tp_rank=0)
        self.spec = CacheSpec(SHAPE, "split_kv", "HND", rank, tp, 16, BLOCKS)
        self.caches, _ = make_caches(self.spec)
        self.worker = Worker.create(
            _config("D", "kv_consumer", **extra),
            tp_rank=rank,
            tp_size=tp,
            total_num_kv_heads=SHAPE.num_kv_heads,
            metrics=metrics,
        )
        self.worker.register_kv_caches(self.caches, cache_layout="split_kv", block_size=16)

    def handshakes(self, outcome: str) -> float:
        labels = {"engine_id": "D", "role": "consumer", "tp_rank": "0", "remote_engine": "P"}
        value = self.registry.get_sample_value(
            "kvrdma_handshakes_total", {**labels, "outcome": outcome}
        )
        return value or 0.0

    def read(self, rid: str, local: list[int], remote: list[int], timeout: float = 30.0) -> Any:
        """One read, stepped to its end; returns the step output that reported it."""
        for _, _, view in attention_views(self.spec, self.caches):
            view[local] = 0
        self.worker.start_read(rid, local, remote, "P")
        end = time.monotonic() + timeout
        while True:
            out = self.worker.get_finished()
            if rid in out.finished_recving:
                return out
            assert time.monotonic() < end, f"read {rid!r} did not finish"
            time.sleep(0.001)

    def verify(self, local: list[int], remote: list[int]) -> int:
        return verify(self.spec, self.caches, local, remote, 16)


def _start_producers(
    spawn_child: Callable[..., Any], server: HandshakeServer, tp: int, tag: str, delay: float = 0
) -> list[Any]:
    assert server.publish_address is not None
    kids = [
        spawn_child(producer, server.publish_address, r, tp, tag, delay, deadline=150.0)
        for r in range(tp)
    ]
    for k in kids:
        assert k.recv(timeout=90.0)[0] == "ready"
    return kids


def _reads_exact(d: Decoder, producer: Any) -> None:
    """D reads two of `producer`'s blocks byte for byte; then the producer stops."""
    producer.send(("hold", "r1", [5, 6]))
    assert d.read("r1", [1, 2], [5, 6]).failures == {}
    assert d.verify([1, 2], [5, 6]) == 0
    producer.send(("stop",))


def test_connect_learns_the_remote_tp_size_and_reads(
    spawn_child: Callable[..., Any], server: HandshakeServer
) -> None:
    """D at TP 1 reads from P at TP 2: connect asks rank 0 for the TP size, then both ranks
    it reads from; a second connect is answered without a handshake, and one for another
    data-parallel rank of the same engine id is refused (never answered with dp 0's plan)."""
    kids = _start_producers(spawn_child, server, 2, "a")
    d = Decoder()
    try:
        plan = d.worker.connect("P", HOST, server.port)
        assert sorted(src.remote_rank for src in plan.sources) == [0, 1]
        assert d.handshakes("success") == 1
        served = server.stats["requests_ok"]
        assert d.worker.connect("P", HOST, server.port) is plan
        assert server.stats["requests_ok"] == served and d.handshakes("success") == 1
        for refresh in (False, True):
            with pytest.raises(ConfigError, match=r"^dp_index: engine 'P' is added from dp_in"):
                d.worker.connect("P", HOST, server.port, dp_index=1, refresh=refresh)
        assert server.stats["requests_ok"] == served and d.handshakes("incompatible") == 2
        with HandshakeClient(tp_size=1, compat_hash="") as client:
            dp1 = {
                r: msgspec.structs.replace(m, dp_index=1)
                for r, m in client.fetch(HOST, server.port, "P", [0, 1]).items()
            }
        with pytest.raises(ConfigError, match=r"^dp_index: engine 'P' is added from dp_index 0"):
            d.worker.add_remote(dp1)  # what `connect` checks again under the worker's lock
        for k in kids:
            k.send(("hold", "r1", [3, 4, 5]))
        out = d.read("r1", [0, 1, 2], [3, 4, 5])
        assert out.invalid_block_ids == {} and out.failures == {}
        assert d.verify([0, 1, 2], [3, 4, 5]) == 0
    finally:
        d.worker.close()
        for k in kids:
            k.send(("stop",))


def test_connect_after_a_producer_restart_waits_for_the_new_agent(
    spawn_child: Callable[..., Any], server: HandshakeServer
) -> None:
    """P killed: the read fails as peer_lost. A handshake answered from a cache (the old
    agent) cannot add the engine back; connect re-fetches until the restarted P has
    published its new agent, then reads from it."""
    (p1,) = _start_producers(spawn_child, server, 1, "first")
    d = Decoder()
    try:
        d.worker.connect("P", HOST, server.port)
        p1.send(("hold", "r1", [7]))
        assert d.read("r1", [1], [7]).failures == {}
        p1.kill()
        lost = d.read("r2", [2], [8])
        assert lost.failures["r2"].outcome is Outcome.PEER_LOST, lost.failures
        assert lost.invalid_block_ids == {"r2": {2}}
        assert d.worker.suspect_engines == {"P"}
        # what the callers of add_remote did: the cached handshake names the lost agent
        with HandshakeClient(tp_size=1, compat_hash="") as client:
            stale = client.fetch(HOST, server.port, "P", [0])
            with pytest.raises(HandshakeError, match="waiting for the restarted engine"):
                d.worker.add_remote(stale)
        assert server.publish_address is not None
        p2 = spawn_child(producer, server.publish_address, 0, 1, "second", 1.0, deadline=150.0)
        t0 = time.monotonic()
        d.worker.connect("P", HOST, server.port, timeout=60.0)
        assert time.monotonic() - t0 >= 0.5  # it waited for the new agent to be published
        (agent,) = [m.agent_name for m in d.worker.consumer.remotes["P"].metas.values()]
        assert p2.recv(timeout=30.0) == ("ready", agent)
        assert d.worker.suspect_engines == set()
        p2.send(("hold", "r3", [9, 10]))
        assert d.read("r3", [3, 4], [9, 10]).failures == {}
        assert d.verify([3, 4], [9, 10]) == 0
        assert d.handshakes("success") == 2
        p2.send(("stop",))
    finally:
        d.worker.close()


def test_connect_to_an_engine_whose_published_agent_died_waits_for_its_successor(
    spawn_child: Callable[..., Any], server: HandshakeServer
) -> None:
    """P publishes, then dies before D ever loaded it: the handshake still names its agent,
    which refuses connections. Connect says so (`PeerUnreachable`, counted as "unreachable")
    rather than blaming the metadata, and, given time, waits for the agent the restarted P
    publishes and reads from it."""
    (p1,) = _start_producers(spawn_child, server, 1, "dead")
    p1.kill()
    d = Decoder()
    try:
        dead = r"cannot connect to agent 'P-tp0-dead-.*after 1 s"
        with pytest.raises(PeerUnreachable, match=dead):
            d.worker.connect("P", HOST, server.port, timeout=1.0)
        assert d.handshakes("unreachable") == 1
        assert server.publish_address is not None
        p2 = spawn_child(producer, server.publish_address, 0, 1, "next", 1.0, deadline=150.0)
        d.worker.connect("P", HOST, server.port, timeout=60.0)
        (agent,) = [m.agent_name for m in d.worker.consumer.remotes["P"].metas.values()]
        assert p2.recv(timeout=30.0) == ("ready", agent)
        _reads_exact(d, p2)
    finally:
        d.worker.close()


def test_a_producer_restarted_under_its_default_agent_name_is_loaded_once_it_publishes(
    spawn_child: Callable[..., Any], server: HandshakeServer
) -> None:
    """The default agent name (`P-dp0-tp0`) outlives a restart: connect tells the agent the
    restarted P publishes from the dead one it could not reach by its metadata's checksum."""
    (p1,) = _start_producers(spawn_child, server, 1, "")
    p1.kill()
    d = Decoder()
    try:
        assert server.publish_address is not None
        p2 = spawn_child(producer, server.publish_address, 0, 1, "", 1.0, deadline=150.0)
        d.worker.connect("P", HOST, server.port, timeout=20.0)
        assert p2.recv(timeout=30.0) == ("ready", "P-dp0-tp0")
        _reads_exact(d, p2)
    finally:
        d.worker.close()


def test_connect_waits_for_a_lost_engine_no_longer_published(
    spawn_child: Callable[..., Any], server: HandshakeServer
) -> None:
    """P is lost and none of its ranks is published any more (a clean shutdown unpublishes
    them, the sidecar's ttl drops a killed one's): connect polls until its deadline, as for a
    dead agent still published, saying how long it waited, and then reads from the restarted
    P. An engine never added is refused after its 1 + handshake_retries attempts."""
    assert server.publish_address is not None
    (p1,) = _start_producers(spawn_child, server, 1, "first")
    d = Decoder()
    try:
        t0 = time.monotonic()
        with pytest.raises(HandshakeRefused, match=r"after 4 attempt\(s\) in [0-9.]+ s"):
            d.worker.connect("Q", HOST, server.port)
        assert time.monotonic() - t0 < 2.0  # the backoffs (0.7 s), not the handshake deadline
        d.worker.connect("P", HOST, server.port)
        p1.kill()
        with SidecarPublisher(server.publish_address, timeout=5.0) as pub:
            pub.unpublish("P", 0)
        assert d.read("r1", [1], [7]).failures["r1"].outcome is Outcome.PEER_LOST
        t0 = time.monotonic()
        with pytest.raises(HandshakeRefused, match=r"still not published after 2[.0-9]* s"):
            d.worker.connect("P", HOST, server.port, timeout=2.0)
        assert time.monotonic() - t0 >= 2.0 and d.handshakes("refused") == 1
        p2 = spawn_child(producer, server.publish_address, 0, 1, "second", 1.0, deadline=150.0)
        d.worker.connect("P", HOST, server.port, timeout=60.0)
        (agent,) = [m.agent_name for m in d.worker.consumer.remotes["P"].metas.values()]
        assert p2.recv(timeout=30.0) == ("ready", agent)
        p2.send(("hold", "r2", [9]))
        assert d.read("r2", [2], [9]).failures == {}
        assert d.verify([2], [9]) == 0
        p2.send(("stop",))
    finally:
        d.worker.close()


def test_a_failed_readd_of_a_dropped_engine_keeps_its_other_ranks(
    spawn_child: Callable[..., Any], server: HandshakeServer
) -> None:
    """A retirement drops P's dead rank 1 and keeps rank 0. Re-adding P cannot load rank 1
    (still published, refusing connections): rank 0 stays loaded (unloading a stopped peer
    makes UCX abort it when it resumes) and P stays added and suspect, to be tried again."""
    kids = _start_producers(spawn_child, server, 2, "a")
    d = Decoder()
    w, c = d.worker, d.worker.consumer
    assert c is not None
    reader = w._s.reader
    try:
        w.connect("P", HOST, server.port)
        agents = dict(c.remotes["P"].agents)
        assert reader.wait_standby(10.0)
        kids[1].kill()
        assert reader.retire("test") == []  # its standby had loaded both ranks while alive
        assert reader.wait_standby(10.0)  # the next standby cannot load dead rank 1
        assert reader.retire("test") == [agents[1]]
        c.dropped.add("P")  # what `ConsumerSide._end` does with the engine of a dropped rank
        for _ in range(2):  # a failed re-add is tried again by the next connect
            with pytest.raises(PeerUnreachable, match=agents[1]):
                w.connect("P", HOST, server.port, timeout=1.0)
            assert reader.remotes() == [agents[0]]
            assert c.remotes["P"].agents == agents and w.suspect_engines == {"P"}
    finally:
        w.close()
        kids[0].send(("stop",))


def test_connect_applies_handshake_timeout_and_retries() -> None:
    """A handshake agent that never answers: connect gives up after `handshake_timeout`,
    having sent `1 + handshake_retries` requests, and counts a timeout."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port(f"tcp://{HOST}")
    d = Decoder(handshake_timeout=1.0, handshake_retries=2)
    try:
        t0 = time.monotonic()
        with pytest.raises(HandshakeTimeout, match=r"no reply within [0-9.]+ s \(3 attempt"):
            d.worker.connect("P", HOST, port)
        assert 0.9 <= time.monotonic() - t0 < 3.0
        requests = 0
        while router.poll(100):
            router.recv_multipart()
            requests += 1
        assert requests == 3
        assert d.handshakes("timeout") == 1
    finally:
        d.worker.close()
        router.close(0)
        ctx.term()


def test_connect_to_a_closed_port_fails_within_its_timeout() -> None:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]  # closed again once this block ends
    d = Decoder()
    try:
        t0 = time.monotonic()
        with pytest.raises(HandshakeTimeout):
            d.worker.connect("P", HOST, port, timeout=0.5)
        assert time.monotonic() - t0 < 2.0
    finally:
        d.worker.close()
