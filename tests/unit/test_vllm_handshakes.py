"""`kvrdma.vllm.handshakes.HandshakeJobs`: handshakes off the step thread, one per engine,
bounded, collected without waiting (a fake fetch: the pool's logic, not the network)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvrdma.errors import HandshakeTimeout
from kvrdma.vllm.handshakes import HandshakeJobs

pytestmark = pytest.mark.timeout(30)


def remote(engine: str) -> Any:
    return SimpleNamespace(engine_id=engine, host="127.0.0.1", port=1, tp_size=1)


def _until(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.001)


def _collect(jobs: HandshakeJobs, n: int) -> list[Any]:
    done: list[Any] = []
    _until(lambda: len(done.extend(jobs.take_done()) or done) >= n)
    return done


def test_one_handshake_per_engine_and_results_collected_without_waiting() -> None:
    release = threading.Event()
    calls: list[tuple[str, list[int], float]] = []

    def fetch(r: Any, ranks: list[int], timeout: float) -> Any:
        calls.append((r.engine_id, ranks, timeout))
        assert release.wait(5)
        return f"metas of {r.engine_id}"

    jobs = HandshakeJobs(fetch, timeout=2.0)
    try:
        assert jobs.submit(remote("a"), [0, 1]) is True
        assert jobs.submit(remote("a"), [0, 1]) is False  # already under way
        assert jobs.in_flight("a") and not jobs.in_flight("b")
        t0 = time.monotonic()
        assert jobs.take_done() == []  # the producer has not answered: nothing, at once
        assert time.monotonic() - t0 < 0.5
        release.set()
        (done,) = _collect(jobs, 1)
        assert (done.remote.engine_id, done.result, done.error) == ("a", "metas of a", None)
        assert calls == [("a", [0, 1], 2.0)]
        assert not jobs.in_flight("a")
        assert jobs.submit(remote("a"), [0]) is True  # again, once the last one ended
    finally:
        release.set()
        jobs.close()
        jobs.join(5)


def test_a_failed_handshake_is_reported_not_raised() -> None:
    def fetch(r: Any, ranks: list[int], timeout: float) -> Any:
        if r.engine_id == "slow":
            raise HandshakeTimeout("no reply within 2 s")
        raise ValueError("a bug")

    jobs = HandshakeJobs(fetch, timeout=2.0)
    try:
        jobs.submit(remote("slow"), [0])
        jobs.submit(remote("buggy"), [0])
        done = {d.remote.engine_id: d for d in _collect(jobs, 2)}
        assert isinstance(done["slow"].error, HandshakeTimeout) and done["slow"].result is None
        assert "crashed" in str(done["buggy"].error) and "a bug" in str(done["buggy"].error)
    finally:
        jobs.close()
        jobs.join(5)


def test_close_drops_queued_handshakes_and_refuses_new_ones() -> None:
    release = threading.Event()
    started: list[str] = []

    def fetch(r: Any, ranks: list[int], timeout: float) -> Any:
        started.append(r.engine_id)
        assert release.wait(5)
        return None

    jobs = HandshakeJobs(fetch, timeout=2.0, max_workers=1)
    jobs.submit(remote("a"), [0])
    jobs.submit(remote("b"), [0])  # queued behind "a" on the one thread
    _until(lambda: started == ["a"])
    jobs.close()
    release.set()
    jobs.join(5)
    assert started == ["a"]  # "b" never ran
    with pytest.raises(RuntimeError, match="after close"):
        jobs.submit(remote("c"), [0])
