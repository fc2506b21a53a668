"""Heartbeats and the producer's lease (real NIXL, one process, one fake clock for both
workers): a heartbeat renews the lease only if the producer still held the request when it
got there, so a decoder counts one toward its read cutoff only if it left in time."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from kvrdma import notify
from kvrdma.config import load_kv_transfer_config
from kvrdma.lease import ClockOffset
from kvrdma.retirement import retire_reader
from kvrdma.testing import synthetic
from kvrdma.testing.synthetic import CacheSpec, ModelShape, fill, make_caches
from kvrdma.types import Outcome
from kvrdma.worker import FinishedOutput, Worker

pytest.importorskip("nixl")
pytestmark = pytest.mark.timeout(60)

SHAPE = ModelShape(num_layers=2, num_kv_heads=4, head_dim=8)
LEASE = 30.0  # the default kv_lease_duration


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(
    engine: str, role: str, clock: Callable[[], float], **extra: object
) -> tuple[Worker, CacheSpec, dict[str, torch.Tensor]]:
    spec = CacheSpec(SHAPE, "split_kv", "HND", 0, 1, 16, 16)
    caches, _ = make_caches(spec)
    fill(spec, caches)
    raw = {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine}
    config = load_kv_transfer_config(raw | {"kv_connector_extra_config": extra}, environ={})
    w = Worker.create(
        config, tp_rank=0, tp_size=1, total_num_kv_heads=SHAPE.num_kv_heads, clock=clock
    )
    w.register_kv_caches(caches, cache_layout="split_kv", block_size=16)
    return w, spec, caches


@contextmanager
def connected(
    **producer_extra: object,
) -> Iterator[tuple[Clock, Worker, Worker, CacheSpec, dict[str, torch.Tensor]]]:
    """P (with `producer_extra` config) and D on the defaults, one fake clock, connected."""
    clock = Clock()
    p, spec, p_caches = make("P", "kv_producer", clock, **producer_extra)
    d, _, _ = make("D", "kv_consumer", clock)
    try:
        d.add_remote({0: p.metadata})
        assert d.consumer is not None
        # what the handshake learns: both workers read the same clock
        d.consumer.clock_offsets["P"] = ClockOffset(0.0, 0.001)
        yield clock, p, d, spec, p_caches
    finally:
        d.close()
        p.close()


@pytest.fixture
def pair() -> Iterator[tuple[Clock, Worker, Worker, CacheSpec, dict[str, torch.Tensor]]]:
    with connected() as made:
        yield made


def settle(p: Worker, d: Worker, rid: str) -> FinishedOutput:
    """Step both until D reported `rid` (the fake clock stands still meanwhile)."""
    got = FinishedOutput()
    end = time.monotonic() + 10
    while rid not in got.finished_recving:
        out = d.get_finished()
        got.finished_recving |= out.finished_recving
        got.failures.update(out.failures)
        got.invalid_block_ids.update(out.invalid_block_ids)
        p.get_finished()
        assert time.monotonic() < end, got
    return got


def heartbeat(p: Worker, d: Worker, rid: str) -> int:
    """D heartbeats `rid` once and P takes it in; P's heartbeat count."""
    assert p.producer is not None
    before = p.producer.ledger.counters
    seen = before.heartbeats + before.unknown_notifs
    d.keep_alive(rid, "P")
    end = time.monotonic() + 10
    while (c := p.producer.ledger.counters).heartbeats + c.unknown_notifs == seen:
        d.get_finished()
        p.get_finished()
        assert time.monotonic() < end, "P never got the heartbeat"
    return c.heartbeats


def test_a_heartbeat_sent_after_the_lease_ended_lets_no_read_of_reused_blocks(
    pair: tuple[Clock, Worker, Worker, CacheSpec, dict[str, torch.Tensor]],
) -> None:
    clock, p, d, spec, p_caches = pair
    expires = p.hold("r", [3, 9])
    clock.now = expires + 1.0  # the decoder got the request late: P freed and reused the blocks
    assert p.get_finished().finished_sending == {"r"}
    for _, _, view in synthetic.attention_views(spec, p_caches):
        view[[3, 9]] = 7  # another request's KV
    assert heartbeat(p, d, "r") == 0  # P no longer holds "r": the heartbeat renews nothing
    d.start_read("r", [0, 1], [3, 9], "P", remote_expires_at=expires)
    got = settle(p, d, "r")
    assert got.failures["r"].outcome == Outcome.EXPIRED, got
    assert got.invalid_block_ids == {"r": {0, 1}}


def test_heartbeats_sent_in_time_keep_a_late_read_valid(
    pair: tuple[Clock, Worker, Worker, CacheSpec, dict[str, torch.Tensor]],
) -> None:
    clock, p, d, _, _ = pair
    expires = p.hold("r", [3, 9])
    for _ in range(3):  # one heartbeat per half lease: P holds "r" for 1.5 leases more
        clock.now += LEASE / 2
        assert heartbeat(p, d, "r") >= 1
    clock.now += LEASE / 2
    assert clock.now > expires and p.lease_expiry("r") is not None
    d.start_read("r", [0, 1], [3, 9], "P", remote_expires_at=expires)
    got = settle(p, d, "r")
    assert got.failures == {} and got.invalid_block_ids == {}, got


def test_a_producer_lease_shorter_than_the_decoders_is_kept_by_its_heartbeats() -> None:
    """The decoder (default 30 s lease) heartbeats as often as the producer's 3 s lease needs."""
    with connected(kv_lease_duration=3.0) as (clock, p, d, _, _):
        expires = p.hold("r", [3, 9])
        d.keep_alive("r", "P")
        for _ in range(12):  # two of the producer's leases, a quarter lease at a time
            clock.now += 0.75
            end = time.monotonic() + 0.05  # real time for heartbeats to arrive
            while time.monotonic() < end:
                d.get_finished()
                assert "r" not in p.get_finished().finished_sending, f"freed at {clock.now}"
        assert p.lease_expiry("r") is not None
        d.start_read("r", [0, 1], [3, 9], "P", remote_expires_at=expires)
        got = settle(p, d, "r")
        assert got.failures == {} and got.invalid_block_ids == {}, got


def test_a_heartbeat_from_a_retired_agent_read_after_the_read_is_no_failed_notification(
    pair: tuple[Clock, Worker, Worker, CacheSpec, dict[str, torch.Tensor]],
) -> None:
    """D heartbeats "r" from its reading agent, a retirement replaces that agent, and D reads
    "r" through the new one. NIXL hands P different agents' notifications in no set order,
    so P may read a heartbeat of the old agent after the new agent's "done": it was sent
    before the read, and is no notification for a request whose lease expired."""
    _, p, d, _, _ = pair
    assert p.producer is not None
    led = p.producer.ledger
    expires = p.hold("r", [3, 9])
    assert heartbeat(p, d, "r") == 1
    old = d.metadata.agent_name
    retire_reader(d._s, [], "a read passed its deadline")
    assert d.metadata.agent_name != old
    d.start_read("r", [0, 1], [3, 9], "P", remote_expires_at=expires)
    got = settle(p, d, "r")
    assert got.failures == {}, got
    end = time.monotonic() + 10
    while "r" not in led.finished:  # P reads the new agent's "done"
        p.get_finished()
        assert time.monotonic() < end, "P never freed the request"
    assert led.counters.notified == 1
    stale = notify.encode("heartbeat", "r", expected=1, sender_engine="D", sender_rank=0)
    p.producer.on_notifs({old: [stale]})
    assert led.counters.unknown_notifs == 0, led.counters
