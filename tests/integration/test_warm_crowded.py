"""A warm-up round proves which copy threads read from a new peer only while nothing else runs
on them (`kvrdma.nixl.warm`), so it waits for the transfers beside it to end. One that never
ends (a READ over a cold connection to a stopped peer, which a given-up stage receive or a
push probe can leave) must not keep every new peer from ever being read: after `ALONE_S` the
peer is declared warm unproven, with an error saying why. Real NIXL over TCP (where a stopped
peer stalls a READ), the reader with the default copy threads."""

from __future__ import annotations

import logging
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from test_nixl_backend import BLOCK, MiB, Remote, pattern, producer, wait
from test_retire import _connected, _stalled_read, reader

from kvrdma.defaults import ucx_num_threads
from kvrdma.nixl import NixlBackend, XferState, warm
from kvrdma.nixl.warm import ALONE_S, FIRST_S, MAX_ROUNDS
from kvrdma.testing import tcp_only

pytest.importorskip("nixl")

NBYTES = 4 * MiB


@pytest.fixture
def d(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[NixlBackend, Any, Any]]:
    """Reader agent "D" over TCP with the default copy threads."""
    monkeypatch.setenv("UCX_TLS", tcp_only())  # children inherit it
    with reader(ucx_num_threads()) as r:
        yield r


@pytest.mark.timeout(120)
def test_a_transfer_that_never_ends_does_not_keep_a_new_peer_cold(
    spawn_child: Callable[..., Any], d: Any, caplog: pytest.LogCaptureFixture
) -> None:
    backend, buf, local = d
    if ucx_num_threads() == 0:
        pytest.skip("without copy threads a warm-up round never waits for others")
    a = _connected(spawn_child, backend, local, "A", 5)
    stalled = _stalled_read(backend, local, a)  # A is stopped: it runs until A resumes
    try:
        b = Remote(backend, spawn_child(producer, "B", NBYTES, 6), NBYTES, 6)
        caplog.set_level(logging.ERROR, logger="kvrdma.nixl.warm")
        t0 = time.monotonic()
        x = backend.post("READ", local, np.arange(200, 202), b.lists, np.arange(2), b"")
        res = wait(backend, x, timeout=ALONE_S + 8.0)
        took = time.monotonic() - t0
        x.release()
        assert res.state is XferState.DONE, res
        assert ALONE_S <= took < ALONE_S + 8.0, took
        got = buf[200 * BLOCK : 202 * BLOCK].numpy()
        assert np.array_equal(got, pattern(NBYTES, 6)[: 2 * BLOCK])
        assert "none alone" in caplog.text and "never seen reading" in caplog.text
        assert backend.poll(stalled).state is XferState.PROC  # still there, never cancelled
    finally:
        os.kill(a.child.pid, signal.SIGCONT)
    assert wait(backend, stalled).state is XferState.DONE
    stalled.release()


@pytest.mark.timeout(120)
def test_the_reads_a_long_warm_up_held_back_go_between_its_rounds(
    spawn_child: Callable[..., Any], d: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a copy thread takes no page fault reading (a NIC copies: RDMA) no round proves
    one, and a new peer's warm-up runs all `MAX_ROUNDS`. A READ to a warm peer that a round
    held back is posted before the next round, though the new peer's read is polled first."""
    backend, _, local = d
    if ucx_num_threads() == 0:
        pytest.skip("without copy threads a warm-up round never holds others back")
    a = _connected(spawn_child, backend, local, "A", 5)
    monkeypatch.setattr(warm, "_faults", lambda tid: 0)  # no copy thread ever seen
    xa: Any = None
    held_at_rounds: list[bool] = []  # per round posted: whether A's READ was still held back
    post_round = warm.Warmup._post_round

    def recording(self: warm.Warmup, peer: str, p: Any) -> None:
        held_at_rounds.append(xa is not None and xa.held is not None)
        post_round(self, peer, p)

    monkeypatch.setattr(warm.Warmup, "_post_round", recording)
    b = Remote(backend, spawn_child(producer, "B", NBYTES, 6), NBYTES, 6)
    xb = backend.post("READ", local, np.arange(200, 202), b.lists, np.arange(2), b"")
    done, ends = 0, time.monotonic() + 60.0
    while backend.poll(xb).state is XferState.PROC:  # B's first, as a step's order may be
        assert time.monotonic() < ends, "B's warm-up did not end in 60 s"
        if xa is None:
            xa = backend.post("READ", local, np.arange(300, 302), a.lists, np.arange(2), b"")
        if (res := backend.poll(xa)).state is not XferState.PROC:
            assert res.state is XferState.DONE, res
            xa.release()
            xa, done = None, done + 1
    assert backend.poll(xb).state is XferState.DONE
    xb.release()
    if xa is not None:
        assert wait(backend, xa).state is XferState.DONE
        xa.release()
    assert backend._warm._peers[b.name].rounds == MAX_ROUNDS  # type: ignore[attr-defined]
    late = [i for i, held in enumerate(held_at_rounds) if held]
    # (A's READ polled more than `FIRST_S` after B's, the test preempted, lets a round go on)
    assert len(late) <= 3, f"rounds {late} of {len(held_at_rounds)} posted with A's READ held"
    # one READ between rounds, but for those that ended before the test posted the next
    assert done >= MAX_ROUNDS // 2, f"{done} reads from A during {MAX_ROUNDS} rounds"


@pytest.mark.timeout(120)
def test_a_held_back_read_nobody_polls_does_not_hold_up_the_warm_up(
    spawn_child: Callable[..., Any], d: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Posts a round held back go before the next round only while their owners poll them:
    one nobody polls holds each next round back `FIRST_S`, no longer, and is posted by its
    first poll."""
    backend, _, local = d
    if ucx_num_threads() == 0:
        pytest.skip("without copy threads a warm-up round never holds others back")
    a = _connected(spawn_child, backend, local, "A", 5)
    monkeypatch.setattr(warm, "_faults", lambda tid: 0)  # all `MAX_ROUNDS` rounds
    # B answers: a round's hold ends when a poll sees it end, not after this (A's READ is
    # held however long the test takes from seeing the hold to posting it)
    monkeypatch.setattr(warm, "STALLED_S", 5.0)
    ended: list[float] = []  # when each round was seen completed
    posted: list[float] = []  # when each round was posted
    count, post_round = warm.Warmup._count, warm.Warmup._post_round

    def counting(self: warm.Warmup, p: Any, clean: bool) -> None:
        ended.append(time.monotonic())
        count(self, p, clean)

    def posting(self: warm.Warmup, peer: str, p: Any) -> None:
        posted.append(time.monotonic())
        post_round(self, peer, p)

    monkeypatch.setattr(warm.Warmup, "_count", counting)
    monkeypatch.setattr(warm.Warmup, "_post_round", posting)
    b = Remote(backend, spawn_child(producer, "B", NBYTES, 6), NBYTES, 6)
    xb = backend.post("READ", local, np.arange(200, 202), b.lists, np.arange(2), b"")
    while not backend._warm.holding():  # type: ignore[attr-defined]
        assert backend.poll(xb).state is XferState.PROC, "B's warm-up ended without a round"
    xa = backend.post("READ", local, np.arange(300, 302), a.lists, np.arange(2), b"")
    assert xa.held is not None  # type: ignore[attr-defined]
    held_from = len(ended)  # rounds that end from now on end with A's READ held
    assert wait(backend, xb, timeout=60.0).state is XferState.DONE
    xb.release()
    assert backend._warm._peers[b.name].rounds == MAX_ROUNDS  # type: ignore[attr-defined]
    # from each round's end to the next round posted
    gaps = [min(t for t in posted if t > e) - e for e in ended[held_from:-1]]
    assert len(gaps) >= MAX_ROUNDS - 4, gaps
    assert min(gaps) >= 0.8 * FIRST_S, f"a round went on at once: {min(gaps):.3f} s"
    assert statistics.median(gaps) < FIRST_S + 0.1, f"{statistics.median(gaps):.3f} s"
    assert xa.held is not None  # type: ignore[attr-defined]
    assert wait(backend, xa).state is XferState.DONE
    xa.release()
