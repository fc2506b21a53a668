"""Whether a request is posted with NIXL's descriptor merging off.

NIXL merges descriptors that are adjacent on both sides into one, and a UCX copy thread
copies a descriptor alone. Merging saves the per-descriptor cost, but a request whose pieces
form fewer contiguous runs than its copy threads can share evenly (`RUNS_PER_THREAD` each)
leaves threads idle once merged; unmerged, its pieces spread over all of them. Below
`SKIP_MERGE_MIN_BYTES` per descriptor the per-descriptor cost outweighs the parallel copy,
so short descriptors are always merged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["RUNS_PER_THREAD", "SKIP_MERGE_MIN_BYTES", "contiguous_runs", "skip_merge"]

SKIP_MERGE_MIN_BYTES = 64 * 1024
# merged runs per copy thread from which merging keeps every thread busy (a thread's share
# differs from another's by at most one run)
RUNS_PER_THREAD = 2

_U64 = npt.NDArray[np.uint64]


def skip_merge(local: Any, lids: Any, remote: Any, rids: Any, threads: int) -> bool:
    """True when `local[lids]` → `remote[rids]` should go unmerged over `threads` copy
    threads (prepared lists: their `min_len` and the `rows` they were prepared from)."""
    if threads < 2 or min(local.min_len, remote.min_len) < SKIP_MERGE_MIN_BYTES:
        return False
    return contiguous_runs(local.rows, lids, remote.rows, rids) < RUNS_PER_THREAD * threads


def contiguous_runs(local: _U64, lids: Any, remote: _U64, rids: Any) -> int:
    """How many descriptors NIXL's merging leaves: runs of consecutive pairs adjacent on both
    sides (same device). `local`/`remote` are (N, 3) or strided (N, 5) rows."""
    la, ll, ld = _pick(local, lids)
    ra, rl, rd = _pick(remote, rids)
    if la.size < 2:
        return int(la.size)
    joined = (la[:-1] + ll[:-1] == la[1:]) & (ra[:-1] + rl[:-1] == ra[1:])
    joined &= (ld[:-1] == ld[1:]) & (rd[:-1] == rd[1:])
    return int(la.size - np.count_nonzero(joined))


def _pick(rows: _U64, ids: Any) -> tuple[_U64, _U64, _U64]:
    """Address, length and device of descriptors `ids` (block by block for strided rows)."""
    idx = np.asarray(ids, dtype=np.int64)
    if rows.shape[1] == 3:
        return rows[idx, 0], rows[idx, 1], rows[idx, 2]
    starts = np.cumsum(rows[:, 4], dtype=np.int64) - rows[:, 4].astype(np.int64)
    row = np.searchsorted(starts, idx, side="right") - 1
    offset = (idx - starts[row]).astype(np.uint64)
    return rows[row, 0] + offset * rows[row, 3], rows[row, 1], rows[row, 2]
