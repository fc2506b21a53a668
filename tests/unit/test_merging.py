"""`kvrdma.nixl.merging`: the contiguous runs of a request's ids, when kvrdma turns NIXL's
descriptor merging off (long descriptors in fewer runs than its copy threads can share), and
when it cuts a large merged request into a share per thread instead (shorter descriptors, or
a NIXL without the switch)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrdma.nixl.merging import (
    RUNS_PER_THREAD,
    SKIP_MERGE_MIN_BYTES,
    SPREAD_MIN_BYTES,
    contiguous_runs,
    plan_post,
)

LONG, MID, SHORT = SKIP_MERGE_MIN_BYTES, SKIP_MERGE_MIN_BYTES // 2, SKIP_MERGE_MIN_BYTES // 4
EIGHT_RUNS = (np.arange(8)[:, None] * 8 + np.arange(4)[None, :]).reshape(-1)


def test_runs_join_pairs_whose_ids_both_go_up_by_one() -> None:
    ids = np.arange(16, dtype=np.int32)
    assert contiguous_runs(ids, ids + 7) == 1
    assert contiguous_runs(ids, ids[::-1].copy()) == 16  # remote goes backwards
    assert contiguous_runs([0, 1, 2, 10, 11], [5, 6, 7, 8, 9]) == 2  # local jumps once
    assert contiguous_runs([3], [4]) == 1
    assert contiguous_runs(EIGHT_RUNS, EIGHT_RUNS + 100) == 8


def test_merging_goes_off_only_for_long_descriptors_in_few_runs() -> None:
    one_run = np.arange(32)
    assert skip_merge(LONG, one_run, one_run, threads=2)
    assert not skip_merge(SHORT, one_run, one_run, threads=2)
    assert not skip_merge(LONG, one_run, one_run, threads=1)  # nothing to spread
    assert not skip_merge(LONG, EIGHT_RUNS, EIGHT_RUNS, threads=8 // RUNS_PER_THREAD)
    assert skip_merge(LONG, EIGHT_RUNS, EIGHT_RUNS, threads=8 // RUNS_PER_THREAD + 1)
    scattered = np.random.default_rng(0).permutation(64)[:3]
    assert skip_merge(LONG, scattered, scattered, threads=2)  # 3 descriptors: too few for 2x2
    for ids in (one_run, EIGHT_RUNS):  # a small request's lists decide as its arrays would
        for threads in (2, 4, 5):
            want = skip_merge(LONG, ids, ids, threads=threads)
            assert skip_merge(LONG, ids.tolist(), ids.tolist(), threads=threads) is want


def test_shorter_descriptors_stay_merged_even_into_one() -> None:
    """Below `SKIP_MERGE_MIN_BYTES` one thread copying a merged run beats every thread
    paying the per-descriptor cost."""
    one_run = np.arange(32)
    for size in (MID, LONG - 1):
        for threads in (2, 4):
            assert not skip_merge(size, one_run, one_run + 5, threads=threads)
    assert skip_merge(LONG, one_run, one_run + 5, threads=2)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=40),
    st.integers(1, 12),
)
def test_runs_are_counted_alike_from_lists_and_arrays(pairs: list, stop_at: int) -> None:
    """Small requests hand over lists, large ones arrays: both count the same runs, and a
    count cut at `stop_at` is the full count or `stop_at`, whichever is less."""
    lids, rids = [a for a, _ in pairs], [b for _, b in pairs]
    full = contiguous_runs(np.array(lids, dtype=np.int32), np.array(rids, dtype=np.int32))
    assert contiguous_runs(lids, rids) == full
    assert full == sum(
        1
        for i in range(len(pairs))
        if i == 0 or (lids[i] - lids[i - 1], rids[i] - rids[i - 1]) != (1, 1)
    )
    for ids in ((lids, rids), (np.array(lids), np.array(rids))):
        assert contiguous_runs(*ids, stop_at=stop_at) == min(full, stop_at)


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 6000), st.lists(st.integers(1, 5999), max_size=300), st.data())
def test_a_count_cut_at_stop_at_reads_windows_yet_counts_as_the_whole(
    n: int, cuts: list[int], data: st.DataObject
) -> None:
    """Arrays are counted a window at a time (the first of 1024 pairs, then doubling) and
    stop once `stop_at` is reached: runs that span a window's edge count once."""
    edges = data.draw(st.sets(st.sampled_from([1023, 1024, 1025, 3071, 3072, 3073])))
    cuts = [*cuts, *edges]  # runs starting at a window's first or last id, or just after
    lids = np.arange(n, dtype=np.int64)
    for c in sorted({c for c in cuts if c < n}):
        lids[c:] += 3  # the pair (c-1, c) jumps: a new run starts at c
    full = 1 + len({c for c in cuts if c < n})
    rids = lids + 11
    assert contiguous_runs(lids, rids) == full
    for stop_at in (data.draw(st.integers(1, n + 2)), full, full + 1, 1024, 1025):
        assert contiguous_runs(lids, rids, stop_at=stop_at) == min(full, stop_at)


def skip_merge(min_len: int, lids: object, rids: object, threads: int) -> bool:
    return plan_post(min_len, lids, rids, threads).unmerged


def spread_runs(min_len: int, lids: object, rids: object, threads: int) -> tuple | None:
    """The cut ids, or None where `plan_post` leaves the request as it is."""
    plan = plan_post(min_len, lids, rids, threads)
    assert not plan.unmerged
    if plan.lids is lids and plan.rids is rids:
        return None
    return plan.lids, plan.rids


def _pairs(lids: object, rids: object) -> list[tuple[int, int]]:
    return sorted(zip(np.asarray(lids).tolist(), np.asarray(rids).tolist(), strict=True))


def test_a_large_request_in_one_run_is_cut_into_a_share_per_thread() -> None:
    n = SPREAD_MIN_BYTES // SHORT  # exactly the threshold
    ids = np.arange(n, dtype=np.int32)
    for threads in (2, 4):
        got = spread_runs(SHORT, ids, ids + 3, threads)
        assert got is not None
        lids, rids = got
        assert lids.dtype == np.int32  # what NIXL takes without converting
        assert _pairs(lids, rids) == _pairs(ids, ids + 3)
        assert contiguous_runs(lids, rids) == RUNS_PER_THREAD * threads
        as_lists = spread_runs(SHORT, ids.tolist(), (ids + 3).tolist(), threads)
        assert as_lists is not None and as_lists[0] == lids.tolist()


def test_a_request_is_left_as_it_is_when_cutting_would_not_pay() -> None:
    n = SPREAD_MIN_BYTES // SHORT
    ids = np.arange(n)
    assert spread_runs(SHORT, ids[:-1], ids[:-1], threads=2) is None  # under the threshold
    assert spread_runs(SHORT, ids, ids, threads=1) is None  # one copy thread
    assert spread_runs(SHORT, EIGHT_RUNS, EIGHT_RUNS, threads=2) is None  # 32 ids: too small
    scattered = np.random.default_rng(0).permutation(n)
    assert spread_runs(SHORT, scattered, scattered, threads=2) is None  # runs enough already


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 5000)), min_size=4, max_size=64))
def test_a_cut_request_carries_the_same_pairs(pairs: list) -> None:
    lids, rids = [a for a, _ in pairs], [b for _, b in pairs]
    got = spread_runs(SPREAD_MIN_BYTES, lids, rids, threads=2)  # any 1 descriptor is enough
    runs = contiguous_runs(lids, rids)
    if runs >= 2 * RUNS_PER_THREAD:
        assert got is None
    else:
        assert got is not None and _pairs(*got) == _pairs(lids, rids)


def test_without_the_switch_few_runs_of_long_descriptors_are_cut_instead() -> None:
    """A NIXL without `skip_desc_merge`: a large request of long descriptors in one run is
    cut like one of shorter descriptors, a small one is left as it is."""
    n = SPREAD_MIN_BYTES // LONG
    ids = np.arange(n)
    plan = plan_post(LONG, ids, ids + 1, 2, can_unmerge=False)
    assert not plan.unmerged
    assert contiguous_runs(plan.lids, plan.rids) == 2 * RUNS_PER_THREAD
    assert _pairs(plan.lids, plan.rids) == _pairs(ids, ids + 1)
    few = ids[:3]
    assert plan_post(LONG, few, few, 2, can_unmerge=False) == (False, few, few)
    assert plan_post(LONG, few, few, 2) == (True, few, few)


def test_runs_are_counted_once_per_post(monkeypatch: object) -> None:
    """Deciding how to post counts a request's runs at most once (a large request's count
    is a pass over its ids)."""
    import kvrdma.nixl.merging as merging

    calls: list[int] = []
    count = merging.contiguous_runs

    def counting(*a: object, **kw: object) -> int:
        calls.append(1)
        return count(*a, **kw)

    monkeypatch.setattr(merging, "contiguous_runs", counting)  # type: ignore[attr-defined]
    n = SPREAD_MIN_BYTES // SHORT
    scattered = np.random.default_rng(1).permutation(n)
    cases = [(LONG, np.arange(n)), (SHORT, np.arange(n)), (LONG, EIGHT_RUNS), (LONG, scattered)]
    for size, ids in cases:
        for threads in (1, 2, 4):
            calls.clear()
            plan_post(size, ids, ids, threads)
            assert len(calls) <= 1, (size, len(ids), threads)
