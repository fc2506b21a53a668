"""HandlerPool: jobs run on kept threads, and no job's failure costs the pool a thread."""

from __future__ import annotations

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
