"""A read of many descriptors is posted in slices by the backlog thread (real NIXL, one
process, the default `post_budget`): `start_read` leaves it to the thread, which posts it
without the caller calling again, every NIXL call of either thread made holding the worker's
lock. The bytes land exactly, the producer is told "done" only once every slice is done, and
a read whose deadline passes with slices unposted posts nothing more and fails whole. With
`post_budget` 0, or without UCX copy threads, a read is posted whole by `start_read`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvrdma.errors import TransferError
from kvrdma.testing.synthetic import CacheSpec, ModelShape, verify
from kvrdma.types import FinishedOutput, Outcome
from kvrdma.worker import Worker
from tests.integration.worker_pair import reader_pair

pytest.importorskip("nixl")

# 64-byte descriptors, 8 per block (4 layers, K and V): 12,800 blocks are 102,400 descriptors
SHAPE = ModelShape(num_layers=4, num_kv_heads=1, head_dim=8, dtype="float32")
BLOCK_SIZE, BLOCKS = 2, 12_800
SPEC = CacheSpec(SHAPE, "split_kv", "HND", 0, 1, BLOCK_SIZE, BLOCKS)


def _ids(seed: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)  # scattered: NIXL merges no neighbours
    return [int(b) for b in rng.permutation(BLOCKS)], [int(b) for b in rng.permutation(BLOCKS)]


def _wire_up(d: Worker, p: Worker) -> None:
    """One small read first: the large one then posts on a connection already wired up
    (before that, posts are parked until it is, and cost nothing)."""
    p.hold("warm", [0])
    d.start_read("warm", [0], [0], "P")
    ends = time.monotonic() + 30
    while "warm" not in d.get_finished().finished_recving and time.monotonic() < ends:
        p.get_finished()


def _read_and_free(d: Worker, p: Worker, lb: list[int], rb: list[int], *, warm: bool) -> list[str]:
    """Read `rb` into `lb` (after `_wire_up` when `warm`); which of D's report and P's
    release came first. When `warm`, the backlog thread posts it all before D calls again."""
    p.hold("r", rb)
    d.start_read("r", lb, rb, "P")
    assert d.consumer is not None
    op = d.consumer.inflight["r"]
    assert op.pending, "start_read posted all 102,400 descriptors in one call"
    if warm:  # else the first slice waits for D's poll to find the connection wired up
        ends = time.monotonic() + 60
        while op.pending and time.monotonic() < ends:  # only P steps
            p.get_finished()
        assert not op.pending, "the backlog thread did not post the read"
    first = len(op.xfers)
    order: list[str] = []
    ends = time.monotonic() + 60
    while len(order) < 2 and time.monotonic() < ends:
        out = d.get_finished()
        if "r" in out.finished_recving:
            assert out.invalid_block_ids.get("r") is None, out.failures
            order.append("D read it")
        if "r" in p.get_finished().finished_sending:
            order.append("P freed it")
    assert len(op.xfers) > 1 and op.notify_after == [0]
    assert len(op.xfers) == first or not warm
    assert p.producer is not None
    counters = p.producer.ledger.counters
    assert (counters.notified, counters.expired) == (1 + warm, 0), "freed by its lease, not told"
    return order


def test_a_large_read_is_posted_by_the_backlog_and_the_producer_told_after_all() -> None:
    with reader_pair(SPEC) as (d, p, caches):
        _wire_up(d, p)
        lock, calls = d._s.lock, []
        reader = d._s.reader
        for name in ("post", "poll", "get_notifs"):
            real = getattr(reader, name)

            def spy(*args: object, _real: Callable[..., object] = real) -> object:
                calls.append((threading.current_thread().name, lock.owned()))
                return _real(*args)

            setattr(reader, name, spy)
        lb, rb = _ids(1)
        assert _read_and_free(d, p, lb, rb, warm=True) == ["D read it", "P freed it"]
        assert verify(SPEC, caches, lb, rb, BLOCK_SIZE) == 0
    threads = {name for name, _ in calls}
    assert "kvrdma-backlog" in threads and len(threads) == 2, threads
    assert all(owned for _, owned in calls), "a NIXL call made without the worker's lock"


def test_a_producer_whose_ack_read_is_refused_is_told_by_a_notification(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with reader_pair(SPEC) as (d, p, caches):
        assert d.consumer is not None

        def refuse(*args: object) -> None:
            raise TransferError("ack READ refused (test)")

        monkeypatch.setattr(d.consumer.acks, "post", refuse)
        lb, rb = _ids(4)
        assert _read_and_free(d, p, lb, rb, warm=False) == ["D read it", "P freed it"]
        assert verify(SPEC, caches, lb, rb, BLOCK_SIZE) == 0


def test_a_read_whose_deadline_passes_with_slices_unposted_posts_no_more() -> None:
    now = [1000.0]
    with reader_pair(SPEC, lambda: now[0]) as (d, p, _):
        lb, rb = _ids(2)
        p.hold("r", rb)
        assert d.consumer is not None
        with d._s.lock:  # the backlog thread waits for it
            d.start_read("r", lb, rb, "P")
            op = d.consumer.inflight["r"]
            posted = len(op.xfers)
            assert op.pending
            now[0] += 3600.0
        out = d.get_finished()
        for _ in range(10_000):  # the read ends at the next poll, nothing posted
            if "r" in out.finished_recving:
                break
            out = d.get_finished()
        assert len(op.xfers) == posted
        assert out.failures["r"].outcome is Outcome.TIMEOUT
        assert "descriptors not posted" in out.failures["r"].error
        assert out.invalid_block_ids["r"] == set(lb)


def test_a_read_the_backlog_thread_cannot_post_is_posted_by_the_callers_polls() -> None:
    """With no thread to post them (it stopped, as at interpreter shutdown), the slices
    left are posted by `get_finished`: while they wait, no call may report "still running"
    without posting, and every slice is posted between the caller's polls."""
    with reader_pair(SPEC) as (d, p, caches):
        _wire_up(d, p)
        lb, rb = _ids(6)
        p.hold("r", rb)
        assert d.consumer is not None
        with d._s.lock:  # the thread stops before it takes a turn
            d.start_read("r", lb, rb, "P")
            op = d.consumer.inflight["r"]
            d.consumer.backlog.close()
            posted = len(op.xfers)
        assert op.pending
        d._next_notifs = time.monotonic() + 60  # as in a poll loop: the fast path is open
        d.get_finished()
        assert len(op.xfers) > posted, "a call reported a read with slices left as running"
        ends, done = time.monotonic() + 60, False
        while not done and time.monotonic() < ends:
            p.get_finished()
            before, left = len(op.xfers), bool(op.pending)
            out = d.get_finished()
            done = "r" in out.finished_recving
            assert len(op.xfers) > before or not left, "a poll left the slices unposted"
        assert done, f"not reported: {len(op.xfers)} slices, pending {bool(op.pending)}"
        assert out.invalid_block_ids.get("r") is None, out.failures
        assert len(op.xfers) > posted + 1 and op.polled == len(op.xfers)
        assert verify(SPEC, caches, lb, rb, BLOCK_SIZE) == 0


@pytest.mark.parametrize(
    "extra", [{"post_budget": 0}, {"num_threads": 0}], ids=["no budget", "no copy threads"]
)
def test_a_read_is_posted_whole_without_a_budget_or_without_copy_threads(
    extra: dict[str, object],
) -> None:
    with reader_pair(SPEC, **extra) as (d, p, caches):
        lb, rb = _ids(3)
        p.hold("r", rb)
        d.start_read("r", lb, rb, "P")
        assert d.consumer is not None
        op = d.consumer.inflight["r"]
        assert not op.pending and len(op.xfers) == 1
        ends = time.monotonic() + 60
        while time.monotonic() < ends:
            p.get_finished()
            if "r" in d.get_finished().finished_recving:
                break
        assert verify(SPEC, caches, lb, rb, BLOCK_SIZE) == 0


def test_closing_a_decoder_lets_its_done_notifications_end_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last slice's notification goes after the read, by an ack READ: closing right
    after the read lets it end before the agent's connections are torn down (with one
    queued, UCX can abort the process there)."""
    with reader_pair(SPEC) as (d, p, _):
        _wire_up(d, p)
        lb, rb = _ids(5)
        p.hold("r", rb)
        d.start_read("r", lb, rb, "P")
        ends = time.monotonic() + 60
        while "r" not in d.get_finished().finished_recving and time.monotonic() < ends:
            pass  # P is not stepped: the ack READ (it carries a notification) cannot end yet
        assert d.consumer is not None and d.pending_notifications == 1
        acks, in_flight_at_teardown = d.consumer.acks, []
        real_drop = acks.drop

        def drop(engine_id: str, lost: Callable[[str], None]) -> None:
            in_flight_at_teardown.append(len(acks.running))
            real_drop(engine_id, lost)

        monkeypatch.setattr(acks, "drop", drop)
        stop = threading.Event()

        def step_producer() -> None:  # P's own serving loop, on its own agent
            while not stop.is_set():
                p.get_finished()
                time.sleep(0.0002)

        loop = threading.Thread(target=step_producer)
        loop.start()
        try:
            d.close()
        finally:
            stop.set()
            loop.join()
        assert in_flight_at_teardown == [0]
        assert p.producer is not None
        assert p.producer.ledger.counters.notified == 2  # the wire-up read and "r"


def test_a_read_whose_posted_slice_failed_posts_no_more_before_the_next_poll() -> None:
    """NIXL reports a posted slice failed before the caller polls again: the backlog thread
    posts none of the read's remaining slices, and the next poll reports the read failed
    once, with exactly its blocks invalid."""
    with reader_pair(SPEC) as (d, p, _):
        _wire_up(d, p)
        lb, rb = _ids(7)
        p.hold("r", rb)
        assert d.consumer is not None
        reader: Any = d._s.reader
        backlog: Any = d.consumer.backlog
        post_next, first, go_on = backlog._post_next, threading.Event(), threading.Event()

        def first_turn_waits() -> bool:  # the thread stops after the turn that posted first
            more = post_next()
            if not first.is_set():
                first.set()
                go_on.wait(30)
            return more

        backlog._post_next = first_turn_waits
        d.start_read("r", lb, rb, "P")
        op = d.consumer.inflight["r"]
        assert first.wait(30), "the backlog thread posted no slice"  # D is not polled
        try:
            assert op.xfers and op.pending, "the first turn posted all or nothing of the read"
            unseen = [x for _, x in op.xfers if x.result is None]  # a slice seen done stays done
            assert unseen, "the backlog thread polls only before it posts: its last is unseen"
            failed, state = unseen[-1]._h, reader._check
            reader._check = lambda h: "ERR" if h is failed else state(h)
            posted = len(op.xfers)
        finally:
            go_on.set()
        ends = time.monotonic() + 30
        while op.pending and time.monotonic() < ends:  # only P steps
            p.get_finished()
        assert len(op.xfers) == posted, "slices posted after one of them had failed"
        outs: list[FinishedOutput] = []
        ends = time.monotonic() + 10  # slices posted before the failure run to their end first
        while not outs and time.monotonic() < ends:
            out = d.get_finished()
            outs += [out] if "r" in out.finished_recving else []
        for _ in range(100):  # and it is reported once
            out = d.get_finished()
            outs += [out] if "r" in out.finished_recving else []
        assert len(outs) == 1, outs
        assert outs[0].failures["r"].outcome is Outcome.FAILED
        assert outs[0].invalid_block_ids["r"] == set(lb)
