"""Host memory copies for packing: one memcpy per piece, split with a helper thread when there
is enough to copy that a second core pays for the hand-off.

torch's own copy wakes its OpenMP threads once per tensor, which costs more than a mid-size
tensor's copy when they sleep between calls; a memcpy copies on one core. From
`PARALLEL_BYTES` on, a helper thread copies half (ctypes lets go of the GIL in memmove).
"""

from __future__ import annotations

import ctypes

from kvrdma.twocores import both

__all__ = ["PARALLEL_BYTES", "copy_all"]

# below this a copy is done before a sleeping helper thread would have woken up
PARALLEL_BYTES = 16 << 20

Job = tuple[int, int, int]  # (destination address, source address, bytes)


def copy_all(jobs: list[Job]) -> None:
    """Copy every job's bytes (the ranges must not overlap); returns once all are done."""
    total = sum(n for _, _, n in jobs)
    if total < PARALLEL_BYTES:
        _copy(jobs)
        return
    mine, theirs = _halves(jobs, total // 2)
    both(lambda: _copy(mine), lambda: _copy(theirs))


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
