"""`kvrdma.nixl.merging`: how many descriptors NIXL's merging leaves, and when kvrdma turns
merging off (fewer runs than its copy threads can share evenly, long descriptors only)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest

from kvrdma.nixl.merging import RUNS_PER_THREAD, SKIP_MERGE_MIN_BYTES, contiguous_runs, skip_merge

KIB = 1024


def rows(n: int, size: int, base: int = 1 << 20, dev: int = 0) -> np.ndarray:
    addrs = base + np.arange(n, dtype=np.uint64) * np.uint64(size)
    return np.stack([addrs, np.full(n, size, np.uint64), np.full(n, dev, np.uint64)], 1)


def strided(n: int, size: int, base: int = 1 << 20) -> np.ndarray:
    """The same blocks as `rows(n, size, base)`, as two strided (N, 5) rows."""
    half = n // 2
    return np.array(
        [[base, size, 0, size, half], [base + half * size, size, 0, size, n - half]],
        dtype=np.uint64,
    )


def lists(n: int, size: int) -> tuple[SimpleNamespace, SimpleNamespace]:
    return (
        SimpleNamespace(rows=rows(n, size), min_len=size),
        SimpleNamespace(rows=rows(n, size, base=1 << 30), min_len=size),
    )


@pytest.mark.parametrize("form", [rows, strided])
def test_runs_count_pairs_adjacent_on_both_sides(form: Callable[..., np.ndarray]) -> None:
    local, remote = form(64, 4096), form(64, 4096, base=1 << 30)
    ids = np.arange(16)
    assert contiguous_runs(local, ids, remote, ids) == 1
    assert contiguous_runs(local, ids, remote, ids[::-1].copy()) == 16  # remote goes backwards
    assert contiguous_runs(local, [0, 1, 2, 10, 11], remote, [5, 6, 7, 8, 9]) == 2
    assert contiguous_runs(local, [3], remote, [4]) == 1
    assert contiguous_runs(local, np.arange(30, 34), remote, np.arange(40, 44)) == 1  # across rows


def test_a_device_change_breaks_a_run() -> None:
    local = np.concatenate([rows(2, 4096, dev=0), rows(2, 4096, base=(1 << 20) + 8192, dev=1)])
    remote = rows(4, 4096, base=1 << 30)
    assert contiguous_runs(local, np.arange(4), remote, np.arange(4)) == 2


def test_merging_goes_off_only_for_long_descriptors_in_few_runs() -> None:
    long, short = lists(64, SKIP_MERGE_MIN_BYTES), lists(64, SKIP_MERGE_MIN_BYTES // 2)
    one_run = np.arange(32)
    eight_runs = (np.arange(8)[:, None] * 8 + np.arange(4)[None, :]).reshape(-1)
    assert skip_merge(long[0], one_run, long[1], one_run, threads=2)
    assert not skip_merge(short[0], one_run, short[1], one_run, threads=2)
    assert not skip_merge(long[0], one_run, long[1], one_run, threads=1)  # nothing to spread
    assert not skip_merge(long[0], eight_runs, long[1], eight_runs, threads=2)
    assert skip_merge(long[0], eight_runs, long[1], eight_runs, threads=8 // RUNS_PER_THREAD + 1)
