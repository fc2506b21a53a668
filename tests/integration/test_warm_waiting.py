"""Reads still waiting for their peer's connection warm-up (`kvrdma.nixl.warm`: posted to
nobody yet) when they end: real NIXL, D and P in one process. Such a read passing its
deadline (or the producer's lease cutoff), or losing its engine, just fails with its blocks
invalid: nothing of it can land, so the reading agent is not retired (which would cancel
every other read on it); one whose peer has just become warm is dropped unposted too. A
warm-up round NIXL refuses fails the reads waiting for it instead of raising out of the step.
A read of two producer ranks whose part from one fails is reported at once, its part still
waiting for the other rank's warm-up dropped unposted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvrdma.lease import ClockOffset
from kvrdma.testing.synthetic import CacheSpec, ModelShape, verify
from kvrdma.types import FinishedOutput, Outcome
from kvrdma.worker import Worker
from tests.integration.worker_pair import local_worker, reader_pair

pytest.importorskip("nixl")

SHAPE = ModelShape(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32")
BLOCK_SIZE, BLOCKS = 2, 64
SPEC = CacheSpec(SHAPE, "split_kv", "HND", 0, 1, BLOCK_SIZE, BLOCKS)
LB, RB = [5, 9, 2], [1, 7, 3]  # the read that waits: D blocks, P blocks


def _start_waiting_read(d: Worker, p: Worker) -> None:
    """Start read "r" (`RB` into `LB`): its READ waits for P's warm-up."""
    p.hold("r", RB)
    d.start_read("r", LB, RB, "P")
    assert d.consumer is not None
    xfers = [x for _, x in d.consumer.inflight["r"].xfers]
    assert xfers and all(getattr(x, "held", None) is not None for x in xfers)


def _finish_warm_up(d: Worker, p: Worker) -> int:
    """Complete the warm-up of D's connection to P without polling D's reads (a parked READ's
    next poll would post it); the READs D's agent has posted so far."""
    agent: Any = d.backend
    peer = p.backend.agent_name
    ends = time.monotonic() + 10.0
    while not agent._warm.ready(peer):
        assert time.monotonic() < ends, f"no warm-up of {peer!r} in 10 s"
        agent._warm.step(peer)
        p.get_finished()
    return int(agent._posted)


def _run(d: Worker, p: Worker, rid: str, seconds: float = 30.0) -> FinishedOutput:
    """Step both until D reports `rid`; its `get_finished` output."""
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        p.get_finished()
        out = d.get_finished()
        if rid in out.finished_recving:
            return out
    raise AssertionError(f"read {rid!r} not reported in {seconds} s")


def _still_works(d: Worker, p: Worker, caches: dict[str, torch.Tensor]) -> None:
    """After some progress nothing landed in D's blocks, and a new read lands exactly."""
    ends = time.monotonic() + 0.3
    while time.monotonic() < ends:
        p.get_finished()
        d.get_finished()
    assert all(int(t.count_nonzero()) == 0 for t in caches.values())
    p.hold("after", [4, 6])
    d.start_read("after", [20, 21], [4, 6], "P")
    out = _run(d, p, "after")
    assert not out.failures, out.failures
    assert verify(SPEC, caches, [20, 21], [4, 6], BLOCK_SIZE) == 0


@pytest.mark.timeout(60)
def test_a_read_waiting_for_warm_up_at_its_deadline_fails_without_a_retirement() -> None:
    now = [1000.0]
    with reader_pair(SPEC, lambda: now[0]) as (d, p, caches):
        name = d.backend.agent_name
        _start_waiting_read(d, p)
        now[0] += 3600.0
        out = d.get_finished()  # the READ, still waiting for the warm-up, is dropped unposted
        assert "r" in out.finished_recving
        assert out.failures["r"].outcome is Outcome.TIMEOUT
        assert out.invalid_block_ids["r"] == set(LB)
        assert d._s.retirements == 0 and d.backend.agent_name == name
        _still_works(d, p, caches)
        assert d._s.retirements == 0 and d.backend.agent_name == name


@pytest.mark.timeout(60)
def test_a_failed_read_on_a_cold_link_owes_its_done_notification_until_delivered() -> None:
    """The producer is told of a failed read on a connection not yet wired up only while D
    progresses its agent: D counts that notification owed (so an idle engine keeps
    stepping) until it is delivered, and P frees the blocks without waiting for its lease."""
    now = [1000.0]
    with reader_pair(SPEC, lambda: now[0]) as (d, p, _):
        _start_waiting_read(d, p)
        now[0] += 3600.0
        assert d.get_finished().failures["r"].outcome is Outcome.TIMEOUT
        assert d.pending_notifications > 0, "the failed read's done notification is not owed"
        freed = False
        ends = time.monotonic() + 10.0
        while d.pending_notifications and time.monotonic() < ends:  # an engine kept stepping
            d.get_finished()
            freed |= "r" in p.get_finished().finished_sending
        assert not d.pending_notifications, "the done notification is still owed after 10 s"
        ends = time.monotonic() + 5.0  # D idle from now on
        while not freed and time.monotonic() < ends:
            freed = "r" in p.get_finished().finished_sending
        assert freed and p.lease_expiry("r") is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("late", ["deadline", "lease cutoff"])
def test_a_late_read_parked_on_a_warm_peer_is_dropped_unposted(late: str) -> None:
    now = [1000.0]
    with reader_pair(SPEC, lambda: now[0]) as (d, p, caches):
        name = d.backend.agent_name
        assert d.consumer is not None
        d.consumer.clock_offsets["P"] = ClockOffset(0.0, 0.001)  # D's and P's clocks agree
        d.consumer.send_notifications = False  # the failure's ack READ would count as posted
        p.hold("r", RB)
        expires = 1005.0 if late == "lease cutoff" else None  # the deadline: 1010
        d.start_read("r", LB, RB, "P", remote_expires_at=expires)
        agent: Any = d.backend
        posted = _finish_warm_up(d, p)
        now[0] += 5.0 if late == "lease cutoff" else 10.0
        out = d.get_finished()
        assert agent._posted == posted, "the late read's parked READ was posted"
        assert "r" in out.finished_recving
        outcome = Outcome.TIMEOUT if late == "deadline" else Outcome.EXPIRED
        assert out.failures["r"].outcome is outcome
        assert "1 waiting for a warm-up: dropped unposted" in out.failures["r"].error
        assert out.invalid_block_ids["r"] == set(LB)
        assert d._s.retirements == 0 and d.backend.agent_name == name
        _still_works(d, p, caches)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("warm", [False, True], ids=["peer warming up", "peer just warm"])
def test_removing_the_engine_of_a_parked_read_posts_and_retires_nothing(warm: bool) -> None:
    """Once the peer is warm the parked READ's next poll would post it: removing the engine
    drops it unposted, as while the warm-up is still under way."""
    with reader_pair(SPEC) as (d, p, caches):
        name = d.backend.agent_name
        _start_waiting_read(d, p)
        agent: Any = d.backend
        posted = _finish_warm_up(d, p) if warm else agent._posted
        d.remove_remote("P")
        assert agent._posted == posted, "removing the engine posted the parked READ"
        out = d.get_finished()
        assert out.failures["r"].outcome is Outcome.PEER_LOST
        assert out.invalid_block_ids["r"] == set(LB)
        assert d._s.retirements == 0 and d.backend.agent_name == name
        d.add_remote({0: p.metadata})
        _still_works(d, p, caches)


@pytest.mark.timeout(60)
def test_a_warm_up_round_nixl_refuses_fails_the_waiting_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from nixl._bindings import nixlInvalidParamError

    with reader_pair(SPEC) as (d, p, caches):
        _start_waiting_read(d, p)
        agent = d.backend._agent  # type: ignore[attr-defined]

        def refuse(*args: object, **kwargs: object) -> None:
            raise nixlInvalidParamError("test: refused")

        monkeypatch.setattr(agent, "make_prepped_xfer", refuse)
        out = d.get_finished()  # the warm-up round is refused: the read fails, nothing raises
        monkeypatch.undo()
        assert "r" in out.finished_recving
        failure = out.failures["r"]
        assert failure.outcome is Outcome.FAILED
        assert "warming up the connection to agent" in failure.error
        assert "nixlInvalidParamError: test: refused" in failure.error
        assert out.invalid_block_ids["r"] == set(LB)
        _still_works(d, p, caches)  # the next read warms P up afresh


# D at TP 1 reads each block from both ranks of P at TP 2 (one KV head each): one part per rank
SPEC_TP2 = CacheSpec(dataclasses.replace(SHAPE, num_kv_heads=2), "split_kv", "HND", 0, 1, 2, 64)


@contextlib.contextmanager
def _reader_of_two_ranks() -> Iterator[tuple[Worker, list[Worker], dict[str, torch.Tensor]]]:
    """(D, P's ranks 0 and 1, D's caches); nothing read yet, so both connections are cold."""
    d, caches = local_worker(SPEC_TP2, "D", "kv_consumer", time.monotonic)
    ps: list[Worker] = []
    try:
        for rank in (0, 1):
            spec = dataclasses.replace(SPEC_TP2, tp_rank=rank, tp_size=2)
            ps.append(local_worker(spec, "P", "kv_producer", time.monotonic)[0])
        d.add_remote({r: p.metadata for r, p in enumerate(ps)})
        yield d, ps, caches
    finally:
        for w in (d, *ps):
            w.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("when", "rank"),
    [("post", 1), ("parked", 0), ("parked", 1)],
    ids=["rank 1 refused at post", "rank 0 ended while parked", "rank 1 ended while parked"],
)
def test_a_read_whose_part_fails_is_reported_at_once_without_its_parked_part(
    when: str, rank: int
) -> None:
    with _reader_of_two_ranks() as (d, ps, caches):
        name = d.backend.agent_name
        assert d.consumer is not None
        d.consumer.send_notifications = False  # the failure's ack READs would count as posted
        for p in ps:
            p.hold("r", RB)
        lost = ps[rank].backend.agent_name  # dropped as a retirement drops a peer it can't reach
        if when == "post":  # its lists go stale: posting its part is refused
            d._s.reader.remove_remote(lost)
        d.start_read("r", LB, RB, "P")
        if when == "parked":  # its part, parked like the other rank's, ends ERR
            d._s.reader.remove_remote(lost)
        agent: Any = d.backend
        posted = agent._posted  # transfers posted so far, warm-up rounds included
        out = d.get_finished()  # the other rank's warm-up has barely begun
        assert "r" in out.finished_recving, "the read waited for the other rank's warm-up"
        assert out.failures["r"].outcome is Outcome.FAILED
        assert repr(lost) in out.failures["r"].error
        assert out.invalid_block_ids["r"] == set(LB)
        assert d._s.retirements == 0 and d.backend.agent_name == name
        if (when, rank) != ("parked", 1):  # else rank 0's part was polled before rank 1's failed
            assert agent._posted == posted, "a warm-up round was posted for the dropped part"
        ends = time.monotonic() + 0.5  # enough for a warm-up: the parked part is never posted
        while time.monotonic() < ends:
            for p in ps:
                p.get_finished()
            d.get_finished()
        assert all(int(t.count_nonzero()) == 0 for t in caches.values())
        d.remove_remote("P")
        d.add_remote({r: p.metadata for r, p in enumerate(ps)})
        for p in ps:  # a read whose parts both wait for a warm-up, then succeed, lands whole
            p.hold("after", [4, 6])
        d.start_read("after", [20, 21], [4, 6], "P")
        ends, out = time.monotonic() + 30, FinishedOutput()
        while "after" not in out.finished_recving and time.monotonic() < ends:
            for p in ps:
                p.get_finished()
            out = d.get_finished()
        assert "after" in out.finished_recving and not out.failures, out.failures
        assert verify(SPEC_TP2, caches, [20, 21], [4, 6], 2) == 0


@pytest.mark.timeout(60)
def test_a_read_whose_post_raises_still_tells_the_producer(monkeypatch: Any) -> None:
    """An unexpected error while posting (not a `TransferError`) propagates out of
    `start_read`, and the read it left tracked fails at the next step: P is told "done"
    as for any failed read, so it frees the blocks without waiting for its lease."""
    with reader_pair(SPEC) as (d, p, _):
        assert d.consumer is not None

        def broken(*args: object) -> None:
            raise RuntimeError("posting broke")

        monkeypatch.setattr(d.consumer.poster, "_post_whole", broken)
        p.hold("r", RB)
        with pytest.raises(RuntimeError, match="posting broke"):
            d.start_read("r", LB, RB, "P")
        out = d.get_finished()
        assert out.invalid_block_ids["r"] == set(LB), out
        freed = False
        ends = time.monotonic() + 10.0
        while not freed and time.monotonic() < ends:
            d.get_finished()
            freed = "r" in p.get_finished().finished_sending
        assert freed and p.lease_expiry("r") is None
