"""kvrdma.posting: `Poster` posts a read that fits the budget whole and a larger one in
slices sized from the learnt cost per descriptor, the done notification only on a part posted
whole; the `Backlog` thread posts what is left under the worker's lock."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvrdma import posting
from kvrdma.nixl.protocol import XferResult, XferState
from kvrdma.posting import MIN_SLICE, Backlog, Poster
from kvrdma.state import WorkerLock
from kvrdma.transfer import Part, ReadOp

COST = 1e-7  # seconds the fake NIXL takes per descriptor posted


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(posting.time, "perf_counter", c)
    return c


def _op(*sizes: int) -> ReadOp:
    op = ReadOp("r", "P", [], [], deadline=1.0, started=0.0)
    op.notif = b"done"
    for rank, n in enumerate(sizes):
        ids = np.arange(n, dtype=np.int64)
        op.pending.append(Part(rank, f"local-{rank}", ids, f"remote-{rank}", ids))  # type: ignore[arg-type]
    return op


class Reader:
    """Posts READs as NIXL would, `COST` seconds per descriptor; records (rank, n, notif)."""

    def __init__(self, clock: Clock, refuse: bool = False, parked: bool = False) -> None:
        self.clock, self.refuse, self.parked = clock, refuse, parked
        self.sent: list[tuple[int, int, bytes]] = []
        self.failed: set[object] = set()  # READs NIXL reports ended in error

    def poll(self, x: object) -> XferResult:
        return XferResult(XferState.ERR if x in self.failed else XferState.PROC)

    def post(self, op: str, local: str, lids: Any, remote: str, rids: Any, notif: bytes) -> object:
        if self.refuse:
            raise RuntimeError("refused")
        rank = int(local.removeprefix("local-"))
        assert op == "READ" and remote == f"remote-{rank}" and len(lids) == len(rids)
        self.sent.append((rank, len(lids), notif))
        if self.parked:  # as NixlBackend parks a READ until its peer is wired up: no cost
            return Parked()
        self.clock.t += len(lids) * COST
        return object()


class Parked:
    held = ("lists", "ids", "notif")


class Shared:
    """What `post_oldest` reads of the worker's state: its reader, and a clock at 0.5."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader

    def clock(self) -> float:
        return 0.5


def test_a_request_within_the_budget_goes_whole_with_its_notification(clock: Clock) -> None:
    op, reader, poster = _op(800, 300), Reader(clock), Poster(0.0005)
    poster.per_descriptor = COST  # learnt
    poster.post(op, reader, 0.0005, force=True)  # type: ignore[arg-type]
    assert reader.sent == [(0, 800, b"done"), (1, 300, b"done")]
    assert not op.pending and not op.notify_after and len(op.xfers) == 2


def test_a_large_request_is_sliced_to_the_budget_and_told_done_after_all(clock: Clock) -> None:
    """From the first guess (dearer than this NIXL) the slices grow as the cost is learnt,
    and no call overruns its budget."""
    op, reader, poster = _op(400_000), Reader(clock), Poster(0.0005)
    sent, calls = reader.sent, 0
    while op.pending:
        start = clock.t
        poster.post(op, reader, start + poster.budget, force=True)  # type: ignore[arg-type]
        calls += 1
        # a slice is cut to the room left: a call whose room is below the smallest slice's
        # cost ends, and the first guess errs on the dear side
        assert clock.t - start <= poster.budget * (1 + 1e-9)
    assert sum(n for _, n, _ in sent) == 400_000
    assert sent[0][1] == MIN_SLICE  # budget / first guess, at least a minimal slice
    assert all(notif == b"" for *_, notif in sent)
    assert op.notify_after == [0]
    assert calls > 1 and poster.per_descriptor == pytest.approx(COST, rel=0.01)
    # once learnt, a slice fills the budget: about budget / cost descriptors
    assert sent[-2][1] == pytest.approx(0.0005 / COST, rel=0.05)


def test_a_tail_shorter_than_a_slice_goes_in_the_room_left(clock: Clock) -> None:
    """A call stops where even the smallest slice would overrun its budget, but a part with
    fewer descriptors left than that is posted if they fit."""
    op, reader, poster = _op(4800, 150), Reader(clock), Poster(0.0005)
    poster.per_descriptor = COST  # learnt: 5,000 descriptors per budget
    poster.post(op, reader, clock.t + poster.budget, force=True)  # type: ignore[arg-type]
    assert [(rank, n) for rank, n, _ in reader.sent] == [(0, 4800), (1, 150)]
    op, reader = _op(4800, 300), Reader(clock)
    poster.post(op, reader, clock.t + poster.budget, force=True)  # type: ignore[arg-type]
    assert [(rank, n) for rank, n, _ in reader.sent] == [(0, 4800)]  # 300 would overrun


def test_a_call_whose_budget_is_spent_still_posts_one_slice_when_forced(clock: Clock) -> None:
    op, reader, poster = _op(100_000, 100_000), Reader(clock), Poster(0.0005)
    poster.post(op, reader, clock.t - 1.0, force=True)  # type: ignore[arg-type]
    assert [n for _, n, _ in reader.sent] == [MIN_SLICE]
    poster.post(op, reader, clock.t - 1.0, force=False)  # type: ignore[arg-type]
    assert len(reader.sent) == 1  # not forced: nothing


def test_a_zero_budget_posts_everything_whole(clock: Clock) -> None:
    op, reader, poster = _op(1_000_000, 5), Reader(clock), Poster(0.0)
    op.descriptors = 1_000_005
    assert poster.fits(op)
    poster.post_read(op, reader, None)  # type: ignore[arg-type]
    assert reader.sent == [(0, 1_000_000, b"done"), (1, 5, b"done")] and not op.pending


def test_a_read_fits_the_budget_by_its_descriptors_once_merged() -> None:
    poster = Poster(0.0005)  # 5,000 descriptors at POST_COST

    def op_of(ids: np.ndarray, parts: int = 2) -> ReadOp:
        op = _op(*[len(ids)] * parts)
        for part in op.pending:
            part.local_ids = part.remote_ids = ids
        op.descriptors = parts * len(ids)
        return op

    assert poster.fits(op_of(np.arange(2000)))  # 4,000 descriptors
    assert not poster.fits(op_of(np.arange(0, 200_000, 2)))  # 200,000 scattered
    assert poster.fits(op_of(np.arange(100_000)))  # 200,000, merged into 2
    runs = np.concatenate([np.arange(k * 10, k * 10 + 4) for k in range(1300)])
    assert poster.fits(op_of(runs))  # 2 x 1,300 runs
    assert not poster.fits(op_of(runs, parts=4))  # 4 x 1,300
    assert Poster(0.0).fits(op_of(np.arange(0, 200_000, 2)))  # no budget: all whole


def test_a_failed_send_leaves_its_slice_unposted(clock: Clock) -> None:
    op, poster = _op(100_000), Poster(0.0005)
    with pytest.raises(RuntimeError):
        poster.post(op, Reader(clock, refuse=True), 1.0, force=True)  # type: ignore[arg-type]
    assert op.pending[0].posted == 0 and not op.xfers


def test_the_cost_per_descriptor_rises_at_once_and_falls_gradually() -> None:
    assert posting._learnt(1e-7, 1e-6) == 1e-6  # dearer: the next slice shrinks at once
    assert posting._learnt(1e-6, 1e-9) == pytest.approx(0.75e-6, rel=0.01)


def test_a_parked_slice_teaches_no_cost_and_ends_the_call(clock: Clock) -> None:
    """Posts parked until the peer is wired up cost nothing, then go out all at once: one
    parked slice per call, and the cost per descriptor stays what it was."""
    op, reader, poster = _op(100_000), Reader(clock, parked=True), Poster(0.0005)
    poster.post(op, reader, clock.t + poster.budget, force=True)  # type: ignore[arg-type]
    assert [n for _, n, _ in reader.sent] == [max(MIN_SLICE, int(0.0005 / posting.FIRST_GUESS))]
    assert poster.per_descriptor == posting.FIRST_GUESS and op.pending


def test_post_oldest_posts_one_budget_of_the_first_read_still_postable(clock: Clock) -> None:
    class Shared:
        def __init__(self) -> None:
            self.reader, self.now = Reader(clock), 0.5

        def clock(self) -> float:
            return self.now

    shared, poster = Shared(), Poster(0.0005)
    late, expired, first, second = _op(100_000), _op(100_000), _op(100_000), _op(100)
    late.deadline = 0.5  # past its deadline: the next poll ends it
    expired.cutoff = 0.4  # past the producer's lease
    ops = [late, expired, first, second]
    assert poster.post_oldest(ops, shared)  # type: ignore[arg-type]
    assert shared.reader.sent and all(r == 0 for r, *_ in shared.reader.sent)
    assert late.pending[0].posted == expired.pending[0].posted == 0
    assert first.pending and second.pending[0].posted == 0
    while first.pending:
        assert poster.post_oldest(ops, shared)  # type: ignore[arg-type]
    assert not poster.post_oldest(ops, shared)  # type: ignore[arg-type]
    assert not second.pending  # went whole, with its notification
    assert shared.reader.sent[-1] == (0, 100, b"done")
    assert not poster.post_oldest([late, expired], shared)  # type: ignore[arg-type]
    waiting = _op(100_000)  # its last slice parked until the peer is wired up
    waiting.xfers.append((0, Parked()))  # type: ignore[arg-type]
    sent = len(shared.reader.sent)
    assert not poster.post_oldest([waiting], shared)  # type: ignore[arg-type]
    assert len(shared.reader.sent) == sent  # the poll that posts the parked one kicks again


def test_post_oldest_posts_no_more_of_a_read_whose_posted_slice_failed(clock: Clock) -> None:
    shared, poster, op = Shared(Reader(clock)), Poster(0.0005), _op(100_000)
    assert poster.post_oldest([op], shared)  # type: ignore[arg-type]
    shared.reader.failed.add(op.xfers[0][1])  # no poll has seen it yet
    sent = len(shared.reader.sent)
    assert not poster.post_oldest([op], shared)  # type: ignore[arg-type]
    assert len(shared.reader.sent) == sent and not op.pending


def _wait(cond: Any, seconds: float = 5.0) -> bool:
    ends = time.monotonic() + seconds
    while not cond() and time.monotonic() < ends:
        time.sleep(0.001)
    return bool(cond())


def test_the_backlog_thread_posts_everything_holding_the_lock_in_turns() -> None:
    """The thread posts without the caller calling again, only while holding the worker's
    lock, and lets a caller holding the lock in between its budgets."""
    lock, left, owned = WorkerLock(), [50], []

    def post_next() -> bool:
        owned.append(lock.owned())
        time.sleep(0.001)  # a budget's post
        left[0] -= 1
        return left[0] > 0

    backlog = Backlog(lock, post_next)
    try:
        with lock:
            assert backlog.kick()
            time.sleep(0.02)
            assert not owned  # the caller holds the lock: nothing posted
        got_in = 0
        while left[0] > 0:  # a caller's calls get in while the thread works
            with lock:
                got_in += 1
            time.sleep(0.0005)
        assert _wait(lambda: left[0] == 0) and all(owned) and len(owned) == 50
        assert got_in > 5 and _wait(lambda: not backlog.busy)  # idle: nothing left
        with lock:
            left[0] = 3
            assert backlog.kick()  # work after it went idle is not missed
        assert _wait(lambda: left[0] == 0)
    finally:
        with lock:
            backlog.close()
            # its thread may not have seen it yet, but pending parts are the caller's now
            assert not backlog.busy
    thread = backlog._thread
    assert thread is not None and _wait(lambda: not thread.is_alive())
    assert not backlog.kick()  # closed: the caller posts itself


def test_a_backlog_post_that_raises_stops_until_the_next_kick() -> None:
    lock, calls = WorkerLock(), [0]

    def post_next() -> bool:
        calls[0] += 1
        raise RuntimeError("a bug")

    backlog = Backlog(lock, post_next)
    with lock:
        backlog.kick()
    assert _wait(lambda: calls[0] == 1) and _wait(lambda: not backlog.busy)
    time.sleep(0.02)
    assert calls[0] == 1  # no busy loop of failures
    with lock:
        backlog.kick()  # the thread lives on: the next kick posts again
    assert _wait(lambda: calls[0] == 2)
    with lock:
        backlog.close()


def test_a_caller_in_a_tight_loop_lets_the_waiting_backlog_thread_in() -> None:
    """An unfair lock would go back to a caller that takes it again at once; the thread,
    once it waits, gets its turn before the caller's next one."""
    lock, turns = WorkerLock(), [0]

    def post_next() -> bool:
        turns[0] += 1
        return turns[0] < 20

    backlog = Backlog(lock, post_next)
    ends = time.monotonic() + 5
    with lock:
        backlog.kick()
    calls = 0
    while turns[0] < 20 and time.monotonic() < ends:
        with lock:  # a caller's call, back to back
            time.sleep(0.0002)
        calls += 1
    assert turns[0] == 20 and calls <= 120  # unfair: about ten caller calls per turn
    with lock:
        backlog.close()


def test_a_waiting_caller_gets_in_before_the_backlog_thread_takes_another_turn() -> None:
    lock, turns, most = WorkerLock(), [0], 0

    def post_next() -> bool:
        turns[0] += 1
        time.sleep(0.01)  # a budget's post, long beside the scheduler's jitter
        return turns[0] < 60

    backlog = Backlog(lock, post_next)
    with lock:
        backlog.kick()
    ends = time.monotonic() + 10
    while turns[0] < 60 and time.monotonic() < ends:
        before = turns[0]
        with lock:  # a caller's call: it waits for at most the turn under way
            most = max(most, turns[0] - before)
        time.sleep(0.0003)  # the caller's own work between calls
    assert turns[0] == 60 and most <= 3
    with lock:
        backlog.close()


def test_the_lock_is_reentrant_for_its_holder_even_while_the_thread_waits() -> None:
    lock, entered = WorkerLock(), threading.Event()

    def wait_turn() -> None:
        with lock.turn():
            entered.set()

    with lock:
        t = threading.Thread(target=wait_turn)
        t.start()
        assert _wait(lambda: lock._waiting)
        with lock:  # nested: no waiting for a thread that waits for us
            assert lock.owned()
    t.join(5)
    assert entered.is_set() and not lock.owned()


def test_no_slice_is_posted_after_one_ended_in_error_at_once(clock: Clock) -> None:
    class Refused:
        result = XferResult(XferState.ERR, "peer gone", peer_lost=True)

    class Gone(Reader):
        def post(self, *args: Any) -> object:
            super().post(*args)
            return Refused()

    op, reader, poster = _op(1000, 1000), Gone(clock), Poster(0.0005)
    poster.post(op, reader, clock.t + 1.0, force=True)  # type: ignore[arg-type]
    assert reader.sent == [(0, 1000, b"done")] and not op.pending  # the next poll fails it


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork with threads alive
def test_a_forked_child_does_not_wait_for_its_parents_backlog_thread() -> None:
    lock, held = WorkerLock(), threading.Event()

    def hold() -> None:
        with lock.turn():  # the parent's thread holds the lock as the process forks
            held.set()
            time.sleep(0.5)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(5)
    lock._waiting = True  # and asks for its next turn
    pid = os.fork()
    if pid == 0:  # the child: no thread to wait for
        code = 1
        try:
            signal.alarm(5)  # a child waiting for good dies of it
            with lock:
                code = 0
        finally:
            os._exit(code)
    t.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_posting_a_read_of_many_slices_looks_at_each_ended_slice_once(clock: Clock) -> None:
    """Before each turn the backlog thread looks for a failed slice: with no poll between
    turns (a busy caller), a slice seen done is not looked at again on every later turn."""

    class Ending(Reader):
        polls = 0

        def poll(self, x: object) -> XferResult:  # every READ ends at once, as over memory
            self.polls += 1
            return XferResult(XferState.ERR if x in self.failed else XferState.DONE)

    reader, poster, op = Ending(clock), Poster(0.0005), _op(1_000_000)
    while poster.post_oldest([op], Shared(reader)):  # type: ignore[arg-type]
        pass
    assert len(op.xfers) > 100 and not op.pending
    assert reader.polls <= len(op.xfers)
