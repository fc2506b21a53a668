"""How a request is posted: with NIXL's descriptor merging on or off, its ids as given or cut.

NIXL merges descriptors that are adjacent on both sides into one, and a UCX copy thread
copies a descriptor alone. Merging saves the per-descriptor cost, but a request whose pieces
form fewer contiguous runs than its copy threads can share evenly (`RUNS_PER_THREAD` each)
leaves threads idle once merged; unmerged, its pieces spread over all of them. Below
`SKIP_MERGE_MIN_BYTES` per descriptor the per-descriptor cost outweighs that, even for a
request that merges into one descriptor: shorter descriptors are always merged.

A large request of shorter descriptors that would merge into fewer runs than that is cut
instead: its ids are reordered, last piece first, so that NIXL merges each piece on its own
and every copy thread gets its share. Below `SPREAD_MIN_BYTES` one thread
copies the whole run before the others would have started.

Runs are counted from the descriptor ids alone, which costs microseconds where addresses
would cost tens: in kvrdma's lists consecutive ids are adjacent blocks of a region, so the
count is at most what merging leaves, and where it errs merging goes off.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "RUNS_PER_THREAD",
    "SKIP_MERGE_MIN_BYTES",
    "SPREAD_MIN_BYTES",
    "Posting",
    "contiguous_runs",
    "plan_post",
]

SKIP_MERGE_MIN_BYTES = 64 * 1024
# merged runs per copy thread from which merging keeps every thread busy (a thread's share
# differs from another's by at most one run)
RUNS_PER_THREAD = 2
SPREAD_MIN_BYTES = 8 << 20
# pairs `contiguous_runs` reads before it first looks at `stop_at` (then twice as many each time)
_FIRST_WINDOW = 1024


class Posting(NamedTuple):
    """How to post a request: its ids (reordered when cut) and whether merging goes off."""

    unmerged: bool
    lids: Any
    rids: Any


def plan_post(
    min_len: int, lids: Any, rids: Any, threads: int, *, can_unmerge: bool = True
) -> Posting:
    """How a request of descriptors at least `min_len` bytes long, local ids `lids` and
    remote ids `rids`, is posted over `threads` copy threads so that each gets its share.

    Few runs of long descriptors go unmerged (where `can_unmerge`: the NIXL has the
    switch); a large request in few runs of shorter ones is cut into `RUNS_PER_THREAD`
    pieces per thread, the pieces in reverse order (within a run, a piece's last pair then
    never continues into the next piece's first, so NIXL merges each alone). Anything else
    is posted as it is."""
    enough = RUNS_PER_THREAD * threads
    n = len(lids)
    long = can_unmerge and min_len >= SKIP_MERGE_MIN_BYTES
    large = n >= enough and n * min_len >= SPREAD_MIN_BYTES
    if threads < 2 or not (long or large):
        return Posting(False, lids, rids)
    if n >= enough and contiguous_runs(lids, rids, stop_at=enough) >= enough:
        return Posting(False, lids, rids)
    if long:
        return Posting(True, lids, rids)
    if not large:
        return Posting(False, lids, rids)
    cuts = [n * i // enough for i in range(enough + 1)]
    pieces = [slice(cuts[i], cuts[i + 1]) for i in reversed(range(enough))]
    if isinstance(lids, list):
        return Posting(
            False, [x for p in pieces for x in lids[p]], [x for p in pieces for x in rids[p]]
        )
    la, ra = np.asarray(lids), np.asarray(rids)
    return Posting(
        False, np.concatenate([la[p] for p in pieces]), np.concatenate([ra[p] for p in pieces])
    )


def contiguous_runs(lids: Any, rids: Any, *, stop_at: int | None = None) -> int:
    """Runs of pairs whose local and remote ids both go up by one; at most `stop_at`, where
    the count may stop as soon as it gets there."""
    if isinstance(lids, list) and isinstance(rids, list):
        # a small request's lists: converting them for NumPy costs more than this loop
        runs, limit = 0, len(lids) if stop_at is None else stop_at
        last_l = last_r = -2
        for a, b in zip(lids, rids, strict=True):
            if a - last_l != 1 or b - last_r != 1:
                runs += 1
                if runs >= limit:
                    break
            last_l, last_r = a, b
        return runs if stop_at is None else min(runs, stop_at)
    lo, ro = np.asarray(lids), np.asarray(rids)
    n = lo.size
    limit = n if stop_at is None else stop_at
    if n < 2:
        return min(n, limit)
    # a window at a time, each twice the last: a scattered request reaches `stop_at` in
    # its first window, and the rest of its ids is never read
    runs, i, window = 1, 0, n if stop_at is None else max(stop_at, _FIRST_WINDOW)
    while i < n - 1 and runs < limit:
        j = min(n, i + window + 1)  # the pairs (i, i+1) .. (j-2, j-1)
        same = (np.diff(lo[i:j]) == 1) & (np.diff(ro[i:j]) == 1)
        runs += j - 1 - i - int(np.count_nonzero(same))
        i, window = j - 1, 2 * window
    return min(runs, limit)
