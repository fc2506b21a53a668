"""kvrdma.posting.Poster: slices sized to the call's budget from the learnt cost per
descriptor, the done notification only on a part posted whole, and progress on every call."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvrdma import posting
from kvrdma.posting import MIN_SLICE, Poster
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


def test_a_request_within_the_budget_goes_whole_with_its_notification(clock: Clock) -> None:
    op, reader = _op(800, 300), Reader(clock)
    Poster(0.0005).post(op, reader, 0.0005, force=True)  # type: ignore[arg-type]
    assert reader.sent == [(0, 800, b"done"), (1, 300, b"done")]
    assert not op.pending and not op.notify_after and len(op.xfers) == 2


def test_a_large_request_is_sliced_to_the_budget_and_told_done_after_all(clock: Clock) -> None:
    op, reader, poster = _op(100_000), Reader(clock), Poster(0.0005)
    sent, calls = reader.sent, 0
    while op.pending:
        start = clock.t
        poster.post(op, reader, start + poster.budget, force=True)  # type: ignore[arg-type]
        calls += 1
        # a call overshoots its budget by at most one slice while the cost is being learnt
        assert clock.t - start <= 2 * poster.budget
    assert sum(n for _, n, _ in sent) == 100_000
    assert all(notif == b"" for *_, notif in sent)
    assert op.notify_after == [0]
    assert calls > 1 and poster.per_descriptor == pytest.approx(COST, rel=0.01)
    # once learnt, a slice fills the budget: about budget / cost descriptors
    assert sent[-2][1] == pytest.approx(0.0005 / COST, rel=0.05)


def test_a_call_whose_budget_is_spent_still_posts_one_slice_when_forced(clock: Clock) -> None:
    op, reader, poster = _op(100_000, 100_000), Reader(clock), Poster(0.0005)
    poster.post(op, reader, clock.t - 1.0, force=True)  # type: ignore[arg-type]
    assert [n for _, n, _ in reader.sent] == [MIN_SLICE]
    poster.post(op, reader, clock.t - 1.0, force=False)  # type: ignore[arg-type]
    assert len(reader.sent) == 1  # not forced: nothing


def test_a_zero_budget_posts_everything_whole(clock: Clock) -> None:
    op, reader = _op(1_000_000, 5), Reader(clock)
    Poster(0.0).post(op, reader, clock.t, force=True)  # type: ignore[arg-type]
    assert reader.sent == [(0, 1_000_000, b"done"), (1, 5, b"done")]


def test_a_failed_send_leaves_its_slice_unposted(clock: Clock) -> None:
    op, poster = _op(100_000), Poster(0.0005)
    with pytest.raises(RuntimeError):
        poster.post(op, Reader(clock, refuse=True), 1.0, force=True)  # type: ignore[arg-type]
    assert op.pending[0].posted == 0 and not op.xfers


def test_the_cost_per_descriptor_rises_at_once_and_falls_gradually() -> None:
    poster = Poster(0.0005)
    poster._learn(1e-6)
    assert poster.per_descriptor == 1e-6  # dearer: the next slice shrinks at once
    poster._learn(1e-9)  # e.g. a post parked until its peer is wired up
    assert poster.per_descriptor == pytest.approx(0.75e-6, rel=0.01)


def test_a_parked_slice_teaches_no_cost_and_ends_the_call(clock: Clock) -> None:
    """Posts parked until the peer is wired up cost nothing, then go out all at once: one
    parked slice per call, and the cost per descriptor stays what it was."""
    op, reader, poster = _op(100_000), Reader(clock, parked=True), Poster(0.0005)
    poster.post(op, reader, clock.t + poster.budget, force=True)  # type: ignore[arg-type]
    assert [n for _, n, _ in reader.sent] == [5000]  # budget / first guess
    assert poster.per_descriptor == posting.FIRST_GUESS and op.pending
