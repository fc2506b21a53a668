"""Descriptor tables and block-id → descriptor-id mapping (SPEC §2–5), NumPy-vectorised.

A table is a list of *entries*; each entry is one strided row `(addr, len, dev, stride, count)`
that NIXL expands to `count` descriptors (NIXL-NOTES: a strided row costs the same at any N).
Descriptor id of block `s` in entry `e` is `start[e] + s`: region-major, then fragment, then
block — for one fragment per block this is SPEC §2's `region * num_blocks + block`.

A `ReadPlan` says, for one local worker and one remote engine, which entries each source rank
fills and where the bytes land; `kvrdma.plan` builds it. The landing order inside a local block
is `[sub-block of the block-size ratio][fragment][source chunk][remote chunk layout]`;
`postprocess` permutes it to the local layout when that differs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NoReturn

import numpy as np
import numpy.typing as npt

from kvrdma.errors import ConfigError
from kvrdma.metadata import RegionMeta
from kvrdma.nixl.protocol import BlockIds, DescArray, DescIds, IdArray, out_of_range_ids
from kvrdma.permute import BlockPermute

Strided = npt.NDArray[np.uint64]  # (E, 5): addr, len, dev, stride, count
_MAX_DESCRIPTORS = 2**31 - 1  # NIXL's descriptor indices are int32
# Requests of at most this many descriptor ids are planned with Python lists, not NumPy:
# right after a large copy NumPy's code is out of the CPU caches, so for a small request its
# few calls cost more than the list work (NIXL takes the lists as they are).
SMALL_REQUEST = 128
# Duplicates among ids this many times fewer than the blocks are found by a sort: a bitmap of
# every block would cost more than sorting so few ids.
_SORT_BELOW = 256


def block_ids_to_descriptor_ids(
    num_regions: int, num_blocks: int, block_ids: npt.ArrayLike
) -> IdArray:
    """SPEC §2: `region * num_blocks + block` for every region, region-major."""
    ids = np.asarray(block_ids, dtype=np.int64)
    offsets = np.arange(num_regions, dtype=np.int64) * num_blocks
    return (offsets[:, None] + ids[None, :]).reshape(-1)


_BOOLS = frozenset({bool, np.bool_})


def _int64_vector(ids: npt.ArrayLike, name: str) -> IdArray:
    """`ids` as an int64 vector, or a `ConfigError` naming `name`: NumPy would silently
    truncate floats and parse strings, reading blocks nobody asked for."""
    if isinstance(ids, np.ndarray):
        a = ids
    elif isinstance(ids, list | tuple | range) or hasattr(ids, "__array__"):
        if isinstance(ids, list | tuple) and not _BOOLS.isdisjoint(map(type, ids)):
            raise _bad_ids(name, ids)  # NumPy would read a bool among ints as 0 or 1
        try:
            a = np.asarray(ids)
        except (ValueError, TypeError) as exc:  # ragged nesting, unsized
            raise _bad_ids(name, ids) from exc
    else:
        raise _bad_ids(name, ids)
    if a.ndim == 1 and a.size == 0:
        return np.zeros(0, dtype=np.int64)  # an empty list reads as float64
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise _bad_ids(name, ids)
    return a.astype(np.int64, copy=False)


def _bad_ids(name: str, ids: object) -> ConfigError:
    shown = repr(ids)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    kind = f"{type(ids).__name__}" + (f" of {ids.dtype}" if isinstance(ids, np.ndarray) else "")
    return ConfigError(
        f"{name}: expected a sequence of integer block ids or a 1-D integer NumPy array, "
        f"got {kind} {shown}"
    )


def _int_list(ids: npt.ArrayLike, limit: int) -> list[int] | None:
    """At most `limit` ids as a list of ints (from a 1-D integer array, or a list or tuple
    of ints), or None: anything else takes the NumPy path."""
    if isinstance(ids, np.ndarray):
        if ids.ndim == 1 and ids.dtype.kind in "iu" and len(ids) <= limit:
            return ids.tolist()
        return None
    if isinstance(ids, (list, tuple)) and len(ids) <= limit:  # a tuple, not a union built per call
        for b in ids:
            if type(b) is not int:  # bools and NumPy integers take the NumPy path
                return None
        return list(ids)
    return None


def repeated_block_ids(ids: BlockIds, num_blocks: int) -> list[int]:
    """The in-range `ids` named more than once, the first 8 in id order (empty when none)."""
    n = len(ids)
    if n < 2:
        return []
    if isinstance(ids, list):
        if len(set(ids)) == n:
            return []
        return sorted(b for b, c in Counter(ids).items() if c > 1)[:8]
    if n * _SORT_BELOW < num_blocks:
        s = np.sort(ids)
        if not np.any(s[1:] == s[:-1]):
            return []
    else:
        seen = np.zeros(num_blocks, dtype=np.bool_)
        seen[ids] = True
        if np.count_nonzero(seen) == n:
            return []
    values, counts = np.unique(ids, return_counts=True)
    return values[counts > 1][:8].tolist()


def check_distinct_local(ids: BlockIds, num_blocks: int, engine_id: str) -> None:
    """`ConfigError` if a local block is named twice: two remote blocks would land in it, and
    which one stays would depend on NIXL's order (a remote block read twice is harmless)."""
    if bad := repeated_block_ids(ids, num_blocks):
        raise ConfigError(
            f"local_block_ids: expected each local block once (two remote blocks would land "
            f"in one), got {bad} more than once (engine {engine_id!r})"
        )


def expand_block_ids(block_ids: npt.ArrayLike, ratio: int, count: int | None = None) -> IdArray:
    """Local block `b` → remote-sized sub-blocks `b*ratio + i`, optionally cut to `count`."""
    ids = np.asarray(block_ids, dtype=np.int64)
    out = (ids[:, None] * ratio + np.arange(ratio, dtype=np.int64)[None, :]).reshape(-1)
    return out if count is None else out[:count]


def kernel_pairs(
    local: Sequence[int], remote: Sequence[int], per_logical: int, ratio: int
) -> tuple[list[int], list[int]]:
    """Logical (local, remote) block ids as kernel block ids, `per_logical` kernel blocks to
    a logical one on both sides, each local kernel block holding `ratio` remote ones: local
    kernel blocks past the remote ones' end (in a last, partial logical block) hold nothing
    of the producer's and are left out."""
    lk = [int(b) for b in expand_block_ids(local, per_logical)]
    rk = [int(b) for b in expand_block_ids(remote, per_logical)]
    return lk[: -(-len(rk) // ratio)], rk


def expand_strided(rows: Strided) -> DescArray:
    """The N×3 (addr, len, dev) table a strided table stands for (for tests and fallbacks)."""
    rows = np.asarray(rows, dtype=np.uint64).reshape(-1, 5)
    counts = rows[:, 4].astype(np.int64)
    total = int(counts.sum())
    entry = np.repeat(np.arange(len(rows)), counts)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    k = (np.arange(total, dtype=np.int64) - starts[entry]).astype(np.uint64)
    out = np.empty((total, 3), dtype=np.uint64)
    out[:, 0] = rows[entry, 0] + k * rows[entry, 3]
    out[:, 1] = rows[entry, 1]
    out[:, 2] = rows[entry, 2]
    return out


def region_table(regions: Sequence[RegionMeta]) -> DescArray:
    """(addr, len, dev) of whole regions, for registration."""
    return np.array(
        [(r.base_addr, r.num_blocks * r.block_len, r.device_id) for r in regions],
        dtype=np.uint64,
    ).reshape(-1, 3)


@dataclass(frozen=True)
class SourcePlan:
    """What one remote rank contributes: parallel local/remote strided entries."""

    remote_rank: int
    local_rows: Strided
    remote_rows: Strided
    local_starts: DescIds  # first descriptor id of each local entry
    remote_starts: DescIds
    is_mamba_entry: npt.NDArray[np.bool_]
    bytes_per_block: int  # bytes this source moves per local block (all entries)

    @classmethod
    def from_rows(
        cls,
        remote_rank: int,
        local_rows: Sequence[Sequence[int]],
        remote_rows: Sequence[Sequence[int]],
        mamba_flags: Sequence[bool],
        bytes_per_block: int,
    ) -> SourcePlan:
        """The plan of parallel local/remote `(addr, len, dev, stride, count)` rows."""
        la = np.array(local_rows, dtype=np.uint64).reshape(-1, 5)
        ra = np.array(remote_rows, dtype=np.uint64).reshape(-1, 5)
        return cls(
            remote_rank=remote_rank,
            local_rows=la,
            remote_rows=ra,
            local_starts=_starts(la),
            remote_starts=_starts(ra),
            is_mamba_entry=np.array(mamba_flags, dtype=bool),
            bytes_per_block=bytes_per_block,
        )

    @property
    def num_entries(self) -> int:
        return len(self.local_rows)

    @cached_property
    def _start_lists(self) -> dict[bool, tuple[list[int], list[int]]]:
        """The (local, remote) entry starts as lists, by `mamba_only`."""
        m = self.is_mamba_entry
        return {
            False: (self.local_starts.tolist(), self.remote_starts.tolist()),
            True: (self.local_starts[m].tolist(), self.remote_starts[m].tolist()),
        }

    def descriptor_ids(
        self, local_sub_ids: BlockIds, remote_ids: BlockIds, *, mamba_only: bool = False
    ) -> tuple[DescIds | list[int], DescIds | list[int]]:
        """Descriptor ids for every entry × block pair of checked block ids (entry-major:
        entry e's ids for every block, then entry e+1's): lists for lists, else the int32
        arrays NIXL takes (handing it int64 costs a conversion inside NIXL per READ)."""
        if isinstance(local_sub_ids, list) and isinstance(remote_ids, list):
            ls, rs = self._start_lists[mamba_only]
            return [a + b for a in ls for b in local_sub_ids], [
                a + b for a in rs for b in remote_ids
            ]
        lsub, rids = np.asarray(local_sub_ids), np.asarray(remote_ids)
        if not mamba_only and len(self.local_starts) == 1:  # one entry (cross-layer)
            return (
                np.add(lsub, self.local_starts[0], dtype=np.int32),
                np.add(rids, self.remote_starts[0], dtype=np.int32),
            )
        sel = self.is_mamba_entry if mamba_only else slice(None)
        # few NumPy calls: the hot path runs right after a copy has pushed NumPy's code out
        # of the CPU caches
        return (
            np.add.outer(self.local_starts[sel], lsub, dtype=np.int32).ravel(),
            np.add.outer(self.remote_starts[sel], rids, dtype=np.int32).ravel(),
        )


@dataclass(frozen=True)
class ReadPlan:
    """Everything needed to read one remote engine's blocks into this worker."""

    remote_engine_id: str
    block_ratio: int
    remote_num_blocks: int
    local_num_blocks: int
    sources: tuple[SourcePlan, ...]
    permutes: tuple[BlockPermute, ...]
    notify_ranks: tuple[int, ...]  # every handshake rank: each gets one notification
    notify_expected: int  # notifications a remote rank waits for per request

    @cached_property
    def num_entries(self) -> int:
        """Descriptors per remote block, over every source."""
        return sum(src.num_entries for src in self.sources)

    def checked_block_ids(
        self, local_block_ids: npt.ArrayLike, remote_block_ids: npt.ArrayLike
    ) -> tuple[BlockIds, BlockIds, BlockIds]:
        """Validate and pair: (local block ids, local sub-block ids, remote block ids) (the
        sub-block ids are the local ids themselves at block ratio 1). int64 arrays, or lists
        of ints for a small request (see SMALL_REQUEST); `descriptor_ids` takes either."""
        limit = SMALL_REQUEST // max(1, self.num_entries)
        rl = _int_list(remote_block_ids, limit)
        ll = _int_list(local_block_ids, limit) if rl is not None else None
        if rl is not None and ll is not None:
            self._check_counts(len(ll), len(rl))
            for name, lst, n in (
                ("local", ll, self.local_num_blocks),
                ("remote", rl, self.remote_num_blocks),
            ):
                if lst and (min(lst) < 0 or max(lst) >= n):
                    self._out_of_range(name, n, [b for b in lst if not 0 <= b < n])
            check_distinct_local(ll, self.local_num_blocks, self.remote_engine_id)
            r = self.block_ratio
            if r == 1:
                return ll, ll, rl
            return ll, [b * r + i for b in ll for i in range(r)][: len(rl)], rl
        lb = _int64_vector(local_block_ids, "local_block_ids")
        rb = _int64_vector(remote_block_ids, "remote_block_ids")
        self._check_counts(len(lb), len(rb))
        for name, ids, n in (
            ("local", lb, self.local_num_blocks),
            ("remote", rb, self.remote_num_blocks),
        ):
            bad = out_of_range_ids(ids, n)
            if bad.size:
                self._out_of_range(name, n, bad[:8].tolist())
        check_distinct_local(lb, self.local_num_blocks, self.remote_engine_id)
        r = self.block_ratio
        return lb, (lb if r == 1 else expand_block_ids(lb, r, len(rb))), rb

    def _check_counts(self, num_local: int, num_remote: int) -> None:
        r = self.block_ratio
        need = -(-num_remote // r)
        if num_local != need:
            raise ConfigError(
                f"{num_remote} remote blocks at block_size_ratio {r} need {need} local blocks, "
                f"got {num_local} (engine {self.remote_engine_id!r})"
            )

    def _out_of_range(self, name: str, n: int, bad: list[int]) -> NoReturn:
        raise ConfigError(
            f"{name} block ids out of range [0, {n}) for engine {self.remote_engine_id!r}: "
            f"{bad[:8]}"
        )

    @property
    def bytes_per_local_block(self) -> int:
        return sum(s.bytes_per_block for s in self.sources)

    def source_bytes(self, source: SourcePlan, num_remote_blocks: int) -> int:
        """Bytes `source` moves for a request of `num_remote_blocks` remote blocks (a partly
        filled last local block moves only its remote-sized sub-blocks)."""
        return source.bytes_per_block * num_remote_blocks // self.block_ratio

    def request_bytes(self, num_remote_blocks: int) -> int:
        """Bytes a request of `num_remote_blocks` remote blocks moves from every source."""
        return sum(self.source_bytes(s, num_remote_blocks) for s in self.sources)


def _starts(rows: Strided) -> DescIds:
    counts = rows[:, 4].astype(np.int64)
    total = int(counts.sum())
    if total > _MAX_DESCRIPTORS:
        raise ConfigError(
            f"a descriptor list of the read plan needs {total} descriptors; NIXL indexes at most "
            f"{_MAX_DESCRIPTORS} (int32)"
        )
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int32)
