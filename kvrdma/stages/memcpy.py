"""Host memory copies for packing: one memcpy per piece, split with a helper thread when there
is enough to copy that a second core pays for the hand-off.

torch's own copy wakes its OpenMP threads once per tensor, which costs more than a mid-size
tensor's copy when they sleep between calls; a memcpy copies on one core. From
`PARALLEL_BYTES` on, a helper thread copies half (ctypes lets go of the GIL in memmove).
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["PARALLEL_BYTES", "copy_all"]

# below this a copy is done before a sleeping helper thread would have woken up
PARALLEL_BYTES = 16 << 20

Job = tuple[int, int, int]  # (destination address, source address, bytes)

_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the pid it belongs to, the helper)


def copy_all(jobs: list[Job]) -> None:
    """Copy every job's bytes (the ranges must not overlap); returns once all are done."""
    total = sum(n for _, _, n in jobs)
    if total < PARALLEL_BYTES:
        _copy(jobs)
        return
    mine, theirs = _halves(jobs, total // 2)
    try:
        done = _helper().submit(_copy, theirs)
    except RuntimeError:  # the interpreter is shutting down: no new threads
        _copy(jobs)
        return
    try:
        _copy(mine)
    finally:
        _wait(done)


def _wait(done: Future[None]) -> None:
    """Wait for the helper's half even through an interrupt: the caller may free the memory
    it copies as soon as this returns or raises."""
    interrupted: BaseException | None = None
    while True:
        try:
            done.result()
            break
        except BaseException as exc:
            if done.done():
                raise
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted


def _halves(jobs: list[Job], first: int) -> tuple[list[Job], list[Job]]:
    """`jobs` cut after `first` bytes (a job spanning the cut split in two)."""
    head: list[Job] = []
    for i, (dst, src, n) in enumerate(jobs):
        if n >= first:
            tail = [(dst + first, src + first, n - first)] if n > first else []
            return [*head, (dst, src, first)], tail + jobs[i + 1 :]
        head.append((dst, src, n))
        first -= n
    return head, []


def _copy(jobs: list[Job]) -> None:
    for dst, src, n in jobs:
        ctypes.memmove(dst, src, n)


def _helper() -> ThreadPoolExecutor:
    """The helper thread of this process (a forked child starts its own)."""
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="kvrdma-memcpy"))
        return _pool[1]
