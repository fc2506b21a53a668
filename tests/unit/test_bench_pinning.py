"""The bandwidth benchmark's thread pinning: threads started inside the block are pinned one
per usable CPU in turn, UCX's "async" thread and threads started before stay free."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
from collections.abc import Iterator

import pytest

from benchmarks.harness import pinned_new_threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux threads")

PR_SET_NAME = 15


def _spawn(n: int, name: bytes | None = None) -> tuple[list[int], threading.Event]:
    """n threads that report their kernel thread id and wait; optional kernel name."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    stop, ids, ready = threading.Event(), [], threading.Semaphore(0)

    def body() -> None:
        if name is not None:
            libc.prctl(PR_SET_NAME, name, 0, 0, 0)
        ids.append(threading.get_native_id())
        ready.release()
        stop.wait(30)

    for _ in range(n):
        threading.Thread(target=body, daemon=True).start()
    for _ in range(n):
        assert ready.acquire(timeout=10)
    return ids, stop


@pytest.fixture
def cpus() -> Iterator[list[int]]:
    allowed = sorted(os.sched_getaffinity(0))
    yield allowed
    os.sched_setaffinity(0, allowed)


def test_new_threads_are_pinned_one_per_cpu_in_turn(cpus: list[int]) -> None:
    old, stop_old = _spawn(1)
    try:
        with pinned_new_threads() as pinned:
            new, stop = _spawn(len(cpus) + 1)
            ucx_async, stop_async = _spawn(1, b"async")
        try:
            assert sorted(pinned) == sorted(new)
            by_start = sorted(new)  # the i-th thread id (in id order) on the i-th CPU
            for i, tid in enumerate(by_start):
                assert os.sched_getaffinity(tid) == {cpus[i % len(cpus)]}
            assert os.sched_getaffinity(ucx_async[0]) == set(cpus)
            assert os.sched_getaffinity(old[0]) == set(cpus)
            assert os.sched_getaffinity(0) == set(cpus)  # the calling thread stays free
        finally:
            stop.set()
            stop_async.set()
    finally:
        stop_old.set()


def test_disabled_pins_nothing(cpus: list[int]) -> None:
    with pinned_new_threads(False) as pinned:
        new, stop = _spawn(2)
    try:
        assert pinned == []
        assert all(os.sched_getaffinity(t) == set(cpus) for t in new)
    finally:
        stop.set()
