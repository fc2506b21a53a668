"""Descriptor tables and block-id → descriptor-id mapping (SPEC §2–5), NumPy-vectorised.

A table is a list of *entries*; each entry is one strided row `(addr, len, dev, stride, count)`
that NIXL expands to `count` descriptors (NIXL-NOTES: a strided row costs the same at any N).
Descriptor id of block `s` in entry `e` is `start[e] + s`: region-major, then fragment, then
block — for one fragment per block this is SPEC §2's `region * num_blocks + block`.

A `ReadPlan` says, for one local worker and one remote engine, which entries each source rank
fills and where the bytes land. The landing order inside a local block is
`[sub-block of the block-size ratio][fragment][source chunk][remote chunk layout]`;
`postprocess` permutes it to the local layout when that differs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NoReturn

import numpy as np
import numpy.typing as npt

from kvrdma.backend import BlockIds, DescArray, DescIds, IdArray, out_of_range_ids
from kvrdma.errors import ConfigError
from kvrdma.metadata import RegionMeta, WorkerMetadata
from kvrdma.postprocess import BlockPermute
from kvrdma.topology import (
    MambaEngineTransferInfo,
    TransferTopology,
    physical_heads,
)
from kvrdma.unified_plan import check_orders, layers_per_head, per_head_pairs

Strided = npt.NDArray[np.uint64]  # (E, 5): addr, len, dev, stride, count
_MAX_DESCRIPTORS = 2**31 - 1  # NIXL's descriptor indices are int32
# Requests of at most this many descriptor ids are planned with Python lists, not NumPy:
# right after a large copy NumPy's code is out of the CPU caches and each of the few calls
# a request needs costs 10-40 µs, more than the list work (NIXL takes the lists as they
# are). Measured here after a 64 MiB READ: 32 ids, lists ~35 µs vs NumPy ~110; about even
# at 128; NumPy ahead at 512.
SMALL_REQUEST = 128


def block_ids_to_descriptor_ids(
    num_regions: int, num_blocks: int, block_ids: npt.ArrayLike
) -> IdArray:
    """SPEC §2: `region * num_blocks + block` for every region, region-major."""
    ids = np.asarray(block_ids, dtype=np.int64)
    offsets = np.arange(num_regions, dtype=np.int64) * num_blocks
    return (offsets[:, None] + ids[None, :]).reshape(-1)


def _int64_vector(ids: npt.ArrayLike) -> IdArray:
    a = np.asarray(ids, dtype=np.int64)
    return a if a.ndim == 1 else a.reshape(-1)


def _int_list(ids: npt.ArrayLike, limit: int) -> list[int] | None:
    """At most `limit` ids as a list of ints (from a 1-D integer array, or a list or tuple
    of ints), or None: anything else takes the NumPy path."""
    if isinstance(ids, np.ndarray):
        if ids.ndim == 1 and ids.dtype.kind in "iu" and len(ids) <= limit:
            return ids.tolist()
        return None
    if isinstance(ids, list | tuple) and len(ids) <= limit and all(type(b) is int for b in ids):
        return list(ids)
    return None


def expand_block_ids(block_ids: npt.ArrayLike, ratio: int, count: int | None = None) -> IdArray:
    """Local block `b` → remote-sized sub-blocks `b*ratio + i`, optionally cut to `count`."""
    ids = np.asarray(block_ids, dtype=np.int64)
    out = (ids[:, None] * ratio + np.arange(ratio, dtype=np.int64)[None, :]).reshape(-1)
    return out if count is None else out[:count]


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


def heads_per_rank(meta: WorkerMetadata) -> int:
    lo, hi = physical_heads(meta.tp_rank, meta.tp_size, meta.total_num_kv_heads)
    return hi - lo


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
            r = self.block_ratio
            if r == 1:
                return ll, ll, rl
            return ll, [b * r + i for b in ll for i in range(r)][: len(rl)], rl
        lb = _int64_vector(local_block_ids)
        rb = _int64_vector(remote_block_ids)
        self._check_counts(len(lb), len(rb))
        for name, ids, n in (
            ("local", lb, self.local_num_blocks),
            ("remote", rb, self.remote_num_blocks),
        ):
            bad = out_of_range_ids(ids, n)
            if bad.size:
                self._out_of_range(name, n, bad[:8].tolist())
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


def _row(addr: int, length: int, dev: int, stride: int, count: int) -> tuple[int, ...]:
    return (addr, length, dev, stride, count)


def build_read_plan(
    topo: TransferTopology,
    local: WorkerMetadata,
    remotes: Mapping[int, WorkerMetadata],
) -> ReadPlan:
    """Plan the READs of `local` from the ranks of one remote engine (their metadata by rank)."""
    if not remotes:
        raise ConfigError("no remote metadata to plan from")
    any_remote = next(iter(remotes.values()))
    engine_id = any_remote.engine_id
    _check_compatible(local, any_remote)
    attn_len = next((r.block_len for r in local.regions if r.kind != "mamba"), 0)
    rattn_len = next((r.block_len for r in any_remote.regions if r.kind != "mamba"), 0)
    info = topo.register_remote_engine(
        engine_id,
        any_remote.tp_size,
        any_remote.block_size,
        rattn_len or 1,
        any_remote.physical_blocks_per_logical,
        local_block_len=attn_len or 1,
        local_physical_blocks_per_logical=local.physical_blocks_per_logical,
    )
    missing = [p for p in info.all_sources if p not in remotes]
    if missing:
        raise ConfigError(f"metadata for remote ranks {missing} of engine {engine_id!r} missing")
    r_ratio = info.block_size_ratio
    fa = info.fa_sources
    n_chunks = len(fa)
    mamba_range = info.mamba_range if isinstance(info, MambaEngineTransferInfo) else ()
    abs_tp = info.abs_tp if isinstance(info, MambaEngineTransferInfo) else 1
    h_local = 0 if local.is_mla else heads_per_rank(local)
    local_first = 0 if local.is_mla else topo.local_heads()[0]

    sources: list[SourcePlan] = []
    permutes: dict[int, BlockPermute] = {}
    for p in info.all_sources:
        rmeta = remotes[p]
        _check_compatible(local, rmeta)
        per_head = local.kv_cache_order == "LHBNC"
        if not per_head and len(rmeta.regions) != len(local.regions):
            raise ConfigError(
                f"remote rank {p} of {engine_id!r} has {len(rmeta.regions)} regions, "
                f"local has {len(local.regions)}"
            )
        lrows: list[tuple[int, ...]] = []
        rrows: list[tuple[int, ...]] = []
        mamba_flags: list[bool] = []
        per_block = 0
        is_fa = p in fa
        if per_head:
            pairs = per_head_pairs(topo, local, rmeta, p if is_fa else None)
        else:
            pairs = list(enumerate(zip(local.regions, rmeta.regions, strict=True)))
        for j, (lr, rr) in pairs:
            if lr.kind != rr.kind or lr.fragments != rr.fragments:
                raise ConfigError(
                    f"region {j}: local is {lr.kind}×{lr.fragments} fragments, remote rank {p} "
                    f"of {engine_id!r} is {rr.kind}×{rr.fragments}"
                )
            if lr.kind == "mamba":
                if mamba_range:
                    if p not in mamba_range:
                        continue
                    i, split = mamba_range.index(p), abs_tp
                else:
                    i, split = 0, 1
                chunk = lr.block_len // split
                if info.tp_ratio > 0:
                    roff, expect_rlen = (
                        (topo.tp_rank % info.tp_ratio) * chunk,
                        chunk * info.tp_ratio,
                    )
                else:
                    roff, expect_rlen = 0, chunk
                if lr.block_len % split or rr.block_len != expect_rlen:
                    raise ConfigError(
                        f"Mamba region {j}: local state {lr.block_len} bytes, remote rank {p} "
                        f"has {rr.block_len}, expected {expect_rlen}"
                    )
                lrows.append(
                    _row(lr.base_addr + i * chunk, chunk, lr.device_id, lr.block_len, lr.num_blocks)
                )
                rrows.append(
                    _row(rr.base_addr + roff, chunk, rr.device_id, rr.block_len, rr.num_blocks)
                )
                mamba_flags.append(True)
                per_block += chunk
                continue
            if not is_fa:
                continue
            sub_len = lr.block_len // r_ratio
            if per_head:  # one head's [tokens, content]: sub-blocks concatenate as they are
                if rr.block_len * r_ratio != lr.block_len:
                    raise ConfigError(
                        f"head region {j}: local block {lr.block_len} bytes / ratio {r_ratio} "
                        f"!= remote rank {p} block {rr.block_len} bytes"
                    )
                lrows.append(
                    _row(lr.base_addr, sub_len, lr.device_id, sub_len, lr.num_blocks * r_ratio)
                )
                rrows.append(_row(rr.base_addr, sub_len, rr.device_id, sub_len, rr.num_blocks))
                mamba_flags.append(False)
                per_block += lr.block_len
                continue
            if lr.kind == "mla":
                if rr.block_len != sub_len or lr.block_len % r_ratio:
                    raise ConfigError(
                        f"MLA region {j}: local block {lr.block_len} bytes / ratio {r_ratio} "
                        f"!= remote rank {p} block {rr.block_len} bytes"
                    )
                lrows.append(
                    _row(lr.base_addr, sub_len, lr.device_id, sub_len, lr.num_blocks * r_ratio)
                )
                rrows.append(_row(rr.base_addr, sub_len, rr.device_id, rr.block_len, rr.num_blocks))
                mamba_flags.append(False)
                per_block += lr.block_len
                continue
            # attention: heads [h0, h0 + hc) of remote rank p land in chunk `slot`
            f = lr.fragments
            h_remote = heads_per_rank(rmeta)
            hc = h_local // n_chunks
            rfrag = rr.block_len // f
            lfrag_sub = lr.block_len // (f * r_ratio)
            head_bytes_remote = rfrag // h_remote
            if hc * n_chunks != h_local or lfrag_sub != hc * n_chunks * head_bytes_remote:
                raise ConfigError(
                    f"attention region {j}: local block {lr.block_len} bytes ({h_local} heads, "
                    f"{f} fragments, block_size_ratio {r_ratio}) does not match remote rank {p} "
                    f"block {rr.block_len} bytes ({h_remote} heads)"
                )
            slot = topo.fa_head_slot(engine_id, p)
            rh0 = topo.remote_heads(p, rmeta.tp_size)[0]
            want = local_first + slot * hc if info.tp_ratio < 0 else local_first
            head_off = want - rh0
            if head_off < 0 or head_off + hc > h_remote:
                raise ConfigError(
                    f"heads [{want}, {want + hc}) are not on remote rank {p} of {engine_id!r} "
                    f"(it holds [{rh0}, {rh0 + h_remote}))"
                )
            chunk_len = hc * head_bytes_remote
            sliced = hc < h_remote
            if sliced and rmeta.kv_layout == "NHD" and rmeta.block_size > 1:
                if rmeta.kv_cache_order:
                    raise ConfigError(
                        f"kv_cache_order {rmeta.kv_cache_order} of engine {engine_id!r} keeps "
                        f"heads apart inside a block: P tp {rmeta.tp_size} -> D tp "
                        f"{local.tp_size} needs {hc} of its {h_remote} heads (use LBHNC, "
                        "LHBNC, BLHNC or BHLNC, or equal TP sizes)"
                    )
                raise ConfigError(
                    f"remote rank {p} of {engine_id!r} uses NHD blocks; reading {hc} of its "
                    f"{h_remote} heads needs HND on the sender (kv_layout) "
                )
            if n_chunks == 1 and not sliced:
                # whole remote blocks, one descriptor per block and region
                lrows.append(
                    _row(lr.base_addr, sub_len, lr.device_id, sub_len, lr.num_blocks * r_ratio)
                )
                rrows.append(
                    _row(rr.base_addr, rr.block_len, rr.device_id, rr.block_len, rr.num_blocks)
                )
                mamba_flags.append(False)
            else:
                for frag in range(f):
                    laddr = lr.base_addr + frag * lfrag_sub + slot * chunk_len
                    raddr = rr.base_addr + frag * rfrag + head_off * (rfrag // h_remote)
                    lrows.append(
                        _row(laddr, chunk_len, lr.device_id, sub_len, lr.num_blocks * r_ratio)
                    )
                    rrows.append(_row(raddr, chunk_len, rr.device_id, rr.block_len, rr.num_blocks))
                    mamba_flags.append(False)
            per_block += chunk_len * f * r_ratio
            if j not in permutes:
                permutes[j] = BlockPermute(
                    region=j,
                    ratio=r_ratio,
                    fragments=f,
                    chunks=n_chunks,
                    chunk_heads=hc,
                    remote_block_size=rmeta.block_size,
                    head_bytes=local.head_dim * local.element_size,
                    remote_layout=rmeta.kv_layout,
                    local_layout=local.kv_layout,
                    layers=layers_per_head(local, lr, h_local),
                )
        if not lrows:
            continue
        la = np.array(lrows, dtype=np.uint64).reshape(-1, 5)
        ra = np.array(rrows, dtype=np.uint64).reshape(-1, 5)
        sources.append(
            SourcePlan(
                remote_rank=p,
                local_rows=la,
                remote_rows=ra,
                local_starts=_starts(la),
                remote_starts=_starts(ra),
                is_mamba_entry=np.array(mamba_flags, dtype=bool),
                bytes_per_block=per_block,
            )
        )
    expected = info.tp_ratio if info.tp_ratio > 0 else 1
    return ReadPlan(
        remote_engine_id=engine_id,
        block_ratio=r_ratio,
        remote_num_blocks=any_remote.num_blocks,
        local_num_blocks=local.num_blocks,
        sources=tuple(sources),
        permutes=tuple(p for p in permutes.values() if not p.is_identity),
        notify_ranks=info.handshake_ranks,
        notify_expected=expected,
    )


def _starts(rows: Strided) -> DescIds:
    counts = rows[:, 4].astype(np.int64)
    total = int(counts.sum())
    if total > _MAX_DESCRIPTORS:
        raise ConfigError(
            f"a descriptor list of the read plan needs {total} descriptors; NIXL indexes at most "
            f"{_MAX_DESCRIPTORS} (int32)"
        )
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int32)


def _check_compatible(local: WorkerMetadata, remote: WorkerMetadata) -> None:
    check_orders(local, remote)
    pairs = (
        ("cache_layout", local.cache_layout, remote.cache_layout),
        ("total_num_kv_heads", local.total_num_kv_heads, remote.total_num_kv_heads),
        ("head_dim", local.head_dim, remote.head_dim),
        ("dtype", local.dtype, remote.dtype),
    )
    for name, lv, rv in pairs:
        if lv != rv:
            raise ConfigError(
                f"{name} differs: local {lv!r}, remote engine {remote.engine_id!r} rank "
                f"{remote.tp_rank} has {rv!r}"
            )
