"""Reads in flight (real NIXL, one process): what `Worker.get_finished` does while a worker
only has reads to watch, and a read whose posting failed after a part was posted.

Between notification fetches (at most every `worker.NOTIFS_EVERY` of the worker's clock) a
call only checks the running READs; a READ's end, a deadline or anything else due is still
handled by the same call that sees it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvrdma import worker as worker_mod
from kvrdma.config import load_kv_transfer_config
from kvrdma.errors import TransferError
from kvrdma.nixl import XferResult, XferState
from kvrdma.testing import synthetic
from kvrdma.testing.synthetic import CacheSpec, ModelShape, fill, make_caches, verify
from kvrdma.transfer import parked
from kvrdma.types import Outcome
from kvrdma.worker import FinishedOutput, Worker

pytest.importorskip("nixl")

SHAPE = ModelShape(num_layers=2, num_kv_heads=4, head_dim=8)
BLOCKS = 16


def _worker(
    engine: str,
    role: str,
    clock: Callable[[], float] = time.monotonic,
    rank: int = 0,
    tp: int = 1,
) -> tuple[Worker, CacheSpec, dict[str, torch.Tensor]]:
    spec = CacheSpec(SHAPE, "split_kv", "HND", rank, tp, 16, BLOCKS)
    caches, _ = make_caches(spec)
    fill(spec, caches)
    config = load_kv_transfer_config(
        {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine}, environ={}
    )
    w = Worker.create(
        config, tp_rank=rank, tp_size=tp, total_num_kv_heads=SHAPE.num_kv_heads, clock=clock
    )
    w.register_kv_caches(caches, cache_layout="split_kv", block_size=16)
    return w, spec, caches  # type: ignore[return-value]


def test_reads_in_flight_are_checked_between_notification_fetches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    d, spec, caches = _worker("D", "kv_consumer", clock=lambda: now[0])
    p, _, _ = _worker("P", "kv_producer")
    try:
        fetches: list[bool] = []  # one per fetch: was a read in flight?
        real = d.backend.get_notifs

        def spy() -> Any:
            assert d.consumer is not None
            fetches.append(bool(d.consumer.inflight))
            return real()

        monkeypatch.setattr(d.backend, "get_notifs", spy)
        d.add_remote({0: p.metadata})
        for _, _, view in synthetic.attention_views(spec, caches):
            view[:2] = 0
        p.hold("r", [3, 9])
        d.start_read("r", [0, 1], [3, 9], "P")
        # the READ carries D's notification: it ends only once P's agent has progressed, and
        # P is not stepped yet. With D's clock standing still, one fetch, then checks only.
        outs = [d.get_finished() for _ in range(100)]
        assert not any(outs), outs
        assert fetches == [True]
        now[0] += worker_mod.NOTIFS_EVERY
        assert not d.get_finished()
        assert fetches == [True, True]
        # P steps: the read ends and is reported by the call that sees it (clock still frozen)
        got, freed = FinishedOutput(), set()
        end = time.monotonic() + 10
        while "r" not in got.finished_recving or "r" not in freed:
            out = d.get_finished()
            got.finished_recving |= out.finished_recving
            got.invalid_block_ids.update(out.invalid_block_ids)
            freed |= p.get_finished().finished_sending
            assert time.monotonic() < end, (got, freed)
        assert got.invalid_block_ids == {}
        assert verify(spec, caches, [0, 1], [3, 9], 16) == 0
        assert fetches[:2] == [True, True] and not any(fetches[2:])  # none while reading since
    finally:
        d.close()
        p.close()


def test_a_deadline_is_seen_between_notification_fetches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_mod, "NOTIFS_EVERY", 60.0)
    now = [1000.0]
    d, _, _ = _worker("D", "kv_consumer", clock=lambda: now[0])
    p, _, _ = _worker("P", "kv_producer")
    try:
        d.add_remote({0: p.metadata})
        p.hold("r", [3, 9])
        d.start_read("r", [0, 1], [3, 9], "P", deadline=0.5)
        assert not d.get_finished()  # fetches notifications; P never steps
        assert not d.get_finished()  # only checks the read
        now[0] += 0.5  # past the deadline, long before the next fetch
        out = d.get_finished()
        assert out.finished_recving == {"r"} and out.invalid_block_ids == {"r": {0, 1}}
        reason = out.failures["r"]
        assert (reason.outcome, reason.remote_engine) == (Outcome.TIMEOUT, "P"), reason
        assert "deadline" in reason.error
    finally:
        d.close()
        p.close()


def _read_whole(d: Worker, ps: list[Worker], rid: str) -> None:
    """Read `rid` (P's blocks 3 and 9 into D's 0 and 1) from every rank of `ps` to its end."""
    for w in ps:
        w.hold(rid, [3, 9])
    d.start_read(rid, [0, 1], [3, 9], "P")
    end = time.monotonic() + 10
    while rid not in d.get_finished().finished_recving:
        for w in ps:
            w.get_finished()
        assert time.monotonic() < end, f"read {rid!r} not reported"


@pytest.mark.parametrize("exc", [TransferError("injected refusal"), RuntimeError("injected bug")])
def test_a_post_failing_after_a_part_was_posted_waits_for_that_part(
    monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    """D (tp 1) reads from P ranks 0 and 1: the READ from rank 0 is posted, posting the one
    from rank 1 fails. The first keeps running, so the read is reported (invalid) only once
    it has ended: no byte lands after the report. (A first read wires both connections up:
    on a cold one the READ would wait unposted for its warm-up, and be dropped instead; on a
    wired one in this process it ends at once, so it reads as running until told.)"""
    d, _, _ = _worker("D", "kv_consumer")
    ps = [_worker("P", "kv_producer", rank=r, tp=2)[0] for r in range(2)]
    try:
        d.add_remote({r: w.metadata for r, w in enumerate(ps)})
        _read_whole(d, ps, "warm")
        real = d._s.reader.post
        posted: list[Any] = []

        def second_post_fails(*a: Any) -> Any:
            if posted:
                raise exc
            posted.append(real(*a))
            return posted[0]

        real_poll, running = d._s.reader.poll, [True]

        def poll(x: Any) -> XferResult:
            return XferResult(XferState.PROC) if running[0] and x is posted[0] else real_poll(x)

        monkeypatch.setattr(d._s.reader, "post", second_post_fails)
        monkeypatch.setattr(d._s.reader, "poll", poll)
        for w in ps:
            w.hold("r", [3, 9])
        if isinstance(exc, TransferError):
            d.start_read("r", [0, 1], [3, 9], "P")
        else:
            with pytest.raises(RuntimeError, match="injected bug"):
                d.start_read("r", [0, 1], [3, 9], "P")
        assert len(posted) == 1 and not parked(posted[0])  # handed to NIXL: it may land
        assert not any(d.get_finished() for _ in range(20))  # running: nothing reported
        running[0] = False
        got = FinishedOutput()
        end = time.monotonic() + 10
        while "r" not in got.finished_recving:
            for w in ps:
                w.get_finished()
            out = d.get_finished()
            got.finished_recving |= out.finished_recving
            got.invalid_block_ids.update(out.invalid_block_ids)
            assert time.monotonic() < end, got
        assert got.invalid_block_ids == {"r": {0, 1}}
        assert d._s.reader.poll(posted[0]).state is XferState.DONE  # it ran to its end
    finally:
        d.close()
        for w in ps:
            w.close()


def test_a_hold_after_every_reader_is_done_finishes_the_request() -> None:
    """The reader's "done" reaches P before P's own hold (a read racing the hold, as in the
    demo with host staging): the hold returns a lease end and the request is sent at once."""
    d, spec, caches = _worker("D", "kv_consumer")
    p, _, _ = _worker("P", "kv_producer")
    try:
        d.add_remote({0: p.metadata})
        d.start_read("r", [0, 1], [3, 9], "P")
        end = time.monotonic() + 10
        got = FinishedOutput()
        while p.producer is None or "r" not in p.producer.ledger.early:
            assert not p.get_finished()  # nothing held: nothing to report
            out = d.get_finished()
            got.finished_recving |= out.finished_recving
            got.invalid_block_ids.update(out.invalid_block_ids)
            assert time.monotonic() < end
        assert got.finished_recving == {"r"} and not got.invalid_block_ids
        assert p.hold("r", [3, 9]) > time.monotonic()
        assert p.lease_expiry("r") is None  # nothing left to hold
        assert p.get_finished().finished_sending == {"r"}
        assert verify(spec, caches, [0, 1], [3, 9], 16) == 0
    finally:
        d.close()
        p.close()
