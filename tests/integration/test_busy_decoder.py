"""A decoder that always has reads running (real NIXL, producers in its process, the default
copy threads), as a busy engine's does.

A producer added meanwhile is proven warm as on an idle agent: a warm-up round proves which
copy threads copied only while no other transfer runs, so it holds the other posts back for
a moment. Closing the decoder with reads running lets them end first: cancelled under UCX's
copy threads, with the peer then removed and the agent destroyed, they aborted the process."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from kvrdma.nixl.warm import MAX_ROUNDS
from kvrdma.testing.synthetic import CacheSpec, ModelShape, verify
from kvrdma.worker import Worker
from tests.integration.worker_pair import local_worker

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

pytest.importorskip("nixl")

SHAPE = ModelShape(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16")
SPEC = CacheSpec(SHAPE, "split_kv", "HND", 0, 1, 16, 256)
IN_FLIGHT = 2  # reads from A kept running
BUSY = range(64)  # the blocks each read from A moves (2 MiB)
NEW = [200, 201]  # what D reads from B


class _Traffic:
    """D keeps `IN_FLIGHT` reads from A running, as a busy engine's steps would."""

    def __init__(self, d: Worker, a: Worker, *others: Worker) -> None:
        self.d, self.a, self.others = d, a, others
        self.seq, self.running, self.done = 0, set[str](), 0

    def step(self) -> set[str]:
        self.start()
        for p in (self.a, *self.others):
            p.get_finished()
        out = self.d.get_finished()
        failed = {r: f for r, f in out.failures.items() if r in self.running}
        assert not failed, f"reads from A failed: {failed}"
        self.done += len(self.running & out.finished_recving)
        self.running -= out.finished_recving
        return out.finished_recving

    def start(self) -> None:
        """Reads from A until `IN_FLIGHT` run."""
        while len(self.running) < IN_FLIGHT:
            self.seq += 1
            rid = f"a{self.seq}"
            self.a.hold(rid, list(BUSY))
            self.d.start_read(rid, list(BUSY), list(BUSY), "A")
            self.running.add(rid)

    def drain(self) -> None:
        ends = time.monotonic() + 10.0
        while self.running:
            assert time.monotonic() < ends, f"reads from A still running: {self.running}"
            self.a.get_finished()
            self.running -= self.d.get_finished().finished_recving


@pytest.mark.timeout(120)
def test_a_producer_added_while_the_decoder_is_busy_is_proven_warm(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d, caches = local_worker(SPEC, "D", "kv_consumer", time.monotonic)
    a, _ = local_worker(SPEC, "A", "kv_producer", time.monotonic)
    b, _ = local_worker(SPEC, "B", "kv_producer", time.monotonic)
    traffic = _Traffic(d, a, b)
    try:
        d.add_remote({0: a.metadata})
        ends = time.monotonic() + 0.3
        while time.monotonic() < ends:  # A's connections warm, reads running
            traffic.step()
        caplog.set_level(logging.INFO, logger="kvrdma.nixl.warm")
        d.add_remote({0: b.metadata})
        b.hold("new", NEW)
        d.start_read("new", NEW, NEW, "B")
        before, ends = traffic.done, time.monotonic() + 30.0
        while "new" not in traffic.step():
            assert time.monotonic() < ends, "the read from B was not reported in 30 s"
        traffic.drain()
        assert traffic.done > before, "nothing was read from A meanwhile"
        assert verify(SPEC, caches, NEW, NEW, SPEC.block_size) == 0
        warm = d.backend._warm._peers[b.backend.agent_name]  # type: ignore[attr-defined]
        threads = set(d.backend._threads)  # type: ignore[attr-defined]
        assert threads and warm.proven == threads, (warm.proven, threads, warm.rounds)
        assert warm.rounds < MAX_ROUNDS
        assert "never seen reading" not in caplog.text
    finally:
        for w in (d, a, b):
            w.close()


def close_while_reading(conn: Connection, cycles: int) -> int:
    """`cycles` times: a decoder reading from A, closed with reads running; then A."""
    for _ in range(cycles):
        d, _ = local_worker(SPEC, "D", "kv_consumer", time.monotonic)
        a, _ = local_worker(SPEC, "A", "kv_producer", time.monotonic)
        try:
            d.add_remote({0: a.metadata})
            traffic, ends = _Traffic(d, a), time.monotonic() + 0.3
            while time.monotonic() < ends or traffic.done < 2:
                traffic.step()
            traffic.start()  # closed right after posting: READs still on the copy threads
            assert d.consumer is not None and len(d.consumer.inflight) >= 1
        finally:
            d.close()
            a.close()
    return cycles


@pytest.mark.timeout(120)
def test_closing_a_decoder_with_reads_running_does_not_crash(
    spawn_child: Callable[..., Any],
) -> None:
    child = spawn_child(close_while_reading, 6, deadline=90.0)
    assert child.result(timeout=100) == 6
