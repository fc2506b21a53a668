"""HandlerPool: jobs run on kept threads, and no job's failure costs the pool a thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from kvrdma.handler_pool import HandlerPool

pytestmark = pytest.mark.timeout(30)


class _Stop(BaseException):
    """What a job may raise past `except Exception` (as `SystemExit` from a library would)."""


@pytest.mark.parametrize("failure", [ValueError, _Stop, SystemExit])
def test_a_failing_job_leaves_its_thread_serving_the_next_job(
    failure: type[BaseException],
) -> None:
    pool = HandlerPool(1, "test")
    ran = threading.Event()

    def fail() -> None:
        raise failure("job failed")

    try:
        assert pool.try_submit(fail)
        # the slot frees once the failed job is done; the next job then needs a live thread
        assert _submit_within(pool, ran.set, seconds=5)
        assert ran.wait(5), f"a job after one raising {failure.__name__} never ran"
    finally:
        pool.close()


def _submit_within(pool: HandlerPool, job: Callable[[], None], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not pool.try_submit(job):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_thread_that_cannot_start_makes_the_pool_busy_not_raise(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Out of threads (a container's pids limit), the HTTP server's loop must not get an
    exception with a traceback logged on every 5 ms retry: the job waits as for a full pool."""
    pool = HandlerPool(2, "test")
    start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    ran = threading.Semaphore(0)
    try:
        monkeypatch.setattr(threading.Thread, "start", refuse)
        assert [pool.try_submit(ran.release) for _ in range(5)] == [False] * 5
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
        monkeypatch.setattr(threading.Thread, "start", start)
        assert pool.try_submit(ran.release) and pool.try_submit(ran.release)  # slots are back
        assert ran.acquire(timeout=5) and ran.acquire(timeout=5)
    finally:
        pool.close()
