"""Every notification a worker fails to send is counted against the engine it was for
(`kvrdma_failed_notifications_total{reason="send_failed"}`): a decoder's heartbeat, a
decoder's Abort of a push, a producer's Ended. Real NIXL agents in one process; the send
that fails is made to raise as NIXL does for an agent it cannot reach."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvrdma import notify
from kvrdma.config import load_kv_transfer_config
from kvrdma.errors import TransferError
from kvrdma.telemetry import KvrdmaMetrics
from kvrdma.testing.synthetic import CacheSpec, ModelShape, fill, make_caches
from kvrdma.transfer import ReadOp
from kvrdma.worker import Worker
from tests.integration.worker_pair import step_until

pytest.importorskip("nixl")
pytestmark = pytest.mark.timeout(60)

SPEC = CacheSpec(ModelShape(num_layers=2, num_kv_heads=4, head_dim=8), "split_kv", "HND", 0, 1,
                 16, 16)  # fmt: skip


def _worker(engine: str, role: str, registry: CollectorRegistry) -> Worker:
    caches, _ = make_caches(SPEC)
    if role == "kv_producer":
        fill(SPEC, caches)
    raw = {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine}
    config = load_kv_transfer_config(raw, environ={})
    side = "producer" if role == "kv_producer" else "consumer"
    metrics = KvrdmaMetrics(registry=registry, engine_id=engine, role=side, tp_rank=0)
    w = Worker.create(config, tp_rank=0, tp_size=1, total_num_kv_heads=4, metrics=metrics)
    w.register_kv_caches(caches, cache_layout="split_kv", block_size=16)
    return w


@contextmanager
def _pair() -> Iterator[tuple[Worker, Worker, CollectorRegistry, CollectorRegistry]]:
    """A producer "P" and a consumer "D" with a registry each, D connected to P."""
    p_registry, d_registry = CollectorRegistry(), CollectorRegistry()
    p = _worker("P", "kv_producer", p_registry)
    try:
        d = _worker("D", "kv_consumer", d_registry)
        try:
            d.add_remote({0: p.metadata})
            yield p, d, p_registry, d_registry
        finally:
            d.close()
    finally:
        p.close()


def _unreachable(*_: Any) -> None:
    raise TransferError("send_notif to the peer failed: NIXL_ERR_NOT_FOUND")


def _lost(registry: CollectorRegistry, engine: str, role: str, remote: str) -> float | None:
    labels = {"engine_id": engine, "role": role, "tp_rank": "0", "remote_engine": remote}
    return registry.get_sample_value(
        "kvrdma_failed_notifications_total", {**labels, "reason": "send_failed"}
    )


def test_a_heartbeat_that_cannot_be_sent_is_counted_for_its_producer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _pair() as (p, d, _, d_registry):
        p.hold("r", [1, 2])
        d.keep_alive("r", "P")
        monkeypatch.setattr(d._s.reader, "send_notif", _unreachable)
        d.get_finished()  # the first heartbeat is due at once
        assert _lost(d_registry, "D", "consumer", "P") == 1


def test_an_abort_that_cannot_be_sent_is_counted_for_its_producer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _pair() as (_, d, _, d_registry):
        d.expect_push("r", [0, 1], "P")  # its Expect is sent to P
        monkeypatch.setattr(d._s.reader, "send_notif", _unreachable)
        d.forget("r")  # its Abort does not
        assert _lost(d_registry, "D", "consumer", "P") == 1


def test_an_ended_that_cannot_be_sent_is_counted_for_its_decoder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _pair() as (p, d, p_registry, _):
        p.push("r", [4, 9], layerwise=True)  # no layer is ready: nothing is written
        d.expect_push("r", [0, 1], "P")
        assert p.producer is not None
        pusher = p.producer.pusher
        step_until(p, d, lambda: bool(pusher.jobs["r"].targets))
        monkeypatch.setattr(p.backend, "send_notif", _unreachable)
        p.abort_push("r")  # D is never told that nothing more comes
        assert _lost(p_registry, "P", "producer", "D") == 1


@pytest.mark.parametrize("how", ["unsent", "unanswered"])
def test_a_push_release_that_never_reaches_its_producer_is_counted(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A release (D only tells P to let go, expecting none of its blocks) that fails leaves P
    holding the request's blocks until its lease ends, as a pull release that fails does."""
    with _pair() as (_, d, _, d_registry):
        if how == "unsent":
            monkeypatch.setattr(d._s.reader, "send_notif", _unreachable)
        # unanswered: P never steps, so it never reads the Expect nor answers it
        d.expect_push("r", [], "P", remote_request_id="p1", deadline=0.2, release_only=True)
        end = time.monotonic() + 5.0
        while "r" not in d.get_finished().failures:
            assert time.monotonic() < end, "the release was never reported"
        assert _lost(d_registry, "D", "consumer", "P") == 1


def test_a_done_notification_cut_off_by_removing_its_engine_is_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Removing an engine (as `connect` does to re-add it) cancels the one-byte READs still
    carrying its done notifications: its producer holds those blocks until the lease."""
    with _pair() as (_, d, _, d_registry):
        assert d.consumer is not None
        acks, now = d.consumer.acks, time.monotonic()
        monkeypatch.setattr(acks, "poll", lambda *_: None)  # the READ is still on its way
        op = ReadOp("r", "P", np.array([0]), np.array([4]), now + 5.0, now, None)
        op.notif = b"done"
        acks.post(op, d.consumer.remotes["P"].ack_lists, [0], now + 5.0)
        d.remove_remote("P")
        assert len(acks) == 0
        assert _lost(d_registry, "D", "consumer", "P") == 1


def test_a_done_notification_delivered_before_its_engine_is_removed_is_not_counted() -> None:
    """The producer got it (and freed the blocks), though no step polled it yet."""
    with _pair() as (p, d, _, d_registry):
        assert d.consumer is not None
        p.hold("r", [1, 2])
        acks, now = d.consumer.acks, time.monotonic()
        op = ReadOp("r", "P", np.array([0]), np.array([4]), now + 5.0, now, None)
        op.notif = notify.encode("done", "r", expected=1, sender_engine="D", sender_rank=0)
        acks.post(op, d.consumer.remotes["P"].ack_lists, [0], now + 5.0)
        x, freed = acks.running[0].xfer, set()
        end = time.monotonic() + 10.0
        while "r" not in freed:  # D does not step: the READ stays on its list
            assert time.monotonic() < end, "the producer was never told"
            d._s.reader.poll(x)
            freed |= p.get_finished().finished_sending
        assert len(acks) == 1
        d.remove_remote("P")
        assert not _lost(d_registry, "D", "consumer", "P")
