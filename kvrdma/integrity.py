"""Opt-in end-to-end integrity (`kv_connector_extra_config.integrity_checksums`): the producer
checksums every block it holds, the decoder checks what its READ landed against them.

How the checksums reach the decoder: the producer keeps them in a *checksum table* registered
with NIXL next to its KV regions (same memory type and device), one 8-byte word per chunk at
an address fixed by the chunk's position, and publishes the table's address and layout with its
metadata. The decoder adds, for every descriptor it reads, the table rows of exactly those bytes
to the same descriptor lists, so one READ brings data and checksums together: nothing extra is
posted, no message goes from producer to reader (readers are unknown at `hold` and producers
never message them), and the producer's "done" notification still fires only after both landed.

The table is laid out block by block: one block's checksums of every region (of the same block
count) lie side by side, and so do a local block's in the decoder's landing table. A read of
whole blocks then brings all of a block's checksums in one descriptor rather than one per
region: each descriptor costs about as much as a small copy.

Granularity: a region's bytes are cut into equal chunks that divide every slice a reader can
take (see `chunk_bytes`): one head of one fragment for attention, so a decoder of another TP
size that reads a head range of the producer's block checks exactly its heads. The checksum of
a chunk is the sum of its words times fixed odd weights modulo 2**64: a change inside any one
word is always caught (an odd weight is invertible modulo 2**64). It guards against bugs and
faults, not against an attacker (it is no MAC).
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import msgspec
import numpy as np
import torch

from kvrdma.descriptors import ReadPlan, SourcePlan
from kvrdma.errors import ConfigError
from kvrdma.layout import Region
from kvrdma.metadata import RegionMeta, WorkerMetadata
from kvrdma.nixl.protocol import BlockIds, DescArray
from kvrdma.topology import physical_heads
from kvrdma.twocores import by_halves

__all__ = ["ChecksumTable", "LandedChecksums", "checksums", "chunk_bytes"]

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# bytes gathered per pass into a buffer kept for the next: a fresh buffer each pass costs a
# page fault per page, more than the gather itself
_PASS_BYTES = 4 << 20
_MAMBA_SPLITS = 64  # a Mamba state is checked in up to this many parts (power-of-two TP splits)
# host blocks of at least this many bytes are checksummed half on a helper thread: a second
# core then pays for the hand-off many times over
TWO_CORES_BYTES = 8 << 20


@functools.lru_cache(maxsize=64)
def _weights(n: int, device: torch.device) -> torch.Tensor:
    """`n` odd 64-bit weights (splitmix64 of the position), the same on every host."""
    z = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = (z ^ (z >> np.uint64(31))) | np.uint64(1)
    return torch.from_numpy(z.view(np.int64)).to(device)


def checksums(chunks: torch.Tensor) -> torch.Tensor:
    """One int64 checksum per row of a contiguous uint8 `[n, chunk]` tensor."""
    if chunks.dtype != torch.uint8 or chunks.dim() != 2:
        raise ValueError(
            f"checksums: expected a 2-D uint8 tensor, got {chunks.dtype} {chunks.dim()}-D"
        )
    g = chunks.shape[1]
    w = next(w for w in (8, 4, 2, 1) if g % w == 0)
    words = chunks.contiguous().view(_WORDS[w]).to(torch.int64)
    weights = _weights(g // w, chunks.device)
    if words.is_cuda:  # CUDA has no integer matmul
        return (words * weights).sum(dim=1)
    if words.is_cpu:  # numpy's einsum sums the products in a vectorised loop; torch's
        # integer matmul does not (unsigned, so the wrap-around modulo 2**64 is defined)
        sums = np.einsum("ij,j->i", words.numpy().view(np.uint64), weights.numpy().view(np.uint64))
        return torch.from_numpy(sums.view(np.int64))
    return words.matmul(weights)  # the same sums, in one pass without a temporary


def chunk_bytes(meta: WorkerMetadata, region: RegionMeta) -> int:
    """The checksum chunk of `region`: it divides the block and every slice a reader takes —
    one head of one fragment (attention), a whole fragment (MLA, shared pages), a power-of-two
    part of a Mamba state (readers of another TP size read such parts)."""
    n, f = region.block_len, region.fragments
    if region.kind == "mamba":
        return n >> min((n & -n).bit_length() - 1, _MAMBA_SPLITS.bit_length() - 1)
    if region.kind == "mla" or meta.shared_pages:
        return math.gcd(n, n // f)
    lo, hi = physical_heads(meta.tp_rank, meta.tp_size, meta.total_num_kv_heads)
    return math.gcd(n, n // f, n // (f * max(1, hi - lo)))


def table_layout(regions: Sequence[RegionMeta], chunks: Sequence[int]) -> list[tuple[int, int]]:
    """Where each region's checksums sit in the table, in words: (first word, words from one
    block's checksums to the next block's). Consecutive regions with the same number of blocks
    share their rows block by block."""
    layout: list[tuple[int, int]] = []
    start = 0
    pairs = zip(regions, chunks, strict=True)
    for num_blocks, group in itertools.groupby(pairs, key=lambda pair: pair[0].num_blocks):
        widths = [r.block_len // c for r, c in group]
        every = sum(widths)
        layout += [(start + w, every) for w in itertools.accumulate(widths[:-1], initial=0)]
        start += num_blocks * every
    return layout


def _region_major(regions: Sequence[RegionMeta], chunks: Sequence[int]) -> list[tuple[int, int]]:
    """The layout of a table published in `checksum_addr`: region after region."""
    layout: list[tuple[int, int]] = []
    start = 0
    for r, c in zip(regions, chunks, strict=True):
        layout.append((start, r.block_len // c))
        start += r.num_blocks * r.block_len // c
    return layout


class ChecksumTable:
    """The producer's checksums of its held blocks, in registered memory readers READ."""

    def __init__(self, regions: Sequence[Region], meta: WorkerMetadata) -> None:
        self.regions = list(regions)
        self.chunks = [chunk_bytes(meta, r.meta) for r in self.regions]
        self.layout = table_layout([r.meta for r in self.regions], self.chunks)
        total = sum(r.meta.num_blocks * r.meta.block_len // c for r, c in self._pairs())
        device = self.regions[0].data.device if self.regions else torch.device("cpu")
        self.table = torch.zeros(total, dtype=torch.int64, device=device)

    def _pairs(self) -> list[tuple[Region, int]]:
        return list(zip(self.regions, self.chunks, strict=True))

    def row(self) -> DescArray:
        """The table's (addr, len, dev) for registration."""
        dev = self.regions[0].meta.device_id if self.regions else 0
        return np.array([[self.table.data_ptr(), self.table.numel() * 8, dev]], dtype=np.uint64)

    def publish(self, meta: WorkerMetadata) -> WorkerMetadata:
        """`meta` telling readers where the table is and how it is cut."""
        return msgspec.structs.replace(
            meta,
            checksum_table_addr=self.table.data_ptr(),
            checksum_layout=[list(x) for x in self.layout],
            checksum_chunks=list(self.chunks),
        )

    def update(self, block_ids: Sequence[int]) -> None:
        """Checksum these blocks of every region now (before any reader is told of them)."""
        if not block_ids:
            return
        ids = list(block_ids)
        nbytes = len(ids) * sum(r.meta.block_len for r in self.regions)
        by_halves(self._update, ids, split=not self.table.is_cuda and nbytes >= TWO_CORES_BYTES)
        if self.table.is_cuda:
            torch.cuda.synchronize(self.table.device)  # the rows are read by NIXL, not a stream

    def _update(self, block_ids: Sequence[int]) -> None:
        ids = torch.tensor(block_ids, dtype=torch.long).to(self.table.device)
        for (region, g), (first, every) in zip(self._pairs(), self.layout, strict=True):
            n, blen = region.meta.num_blocks, region.meta.block_len
            rows = torch.as_strided(self.table, (n, blen // g), (every, 1), first)
            for _, sel, data in _gathered(region.data, ids):
                rows[sel] = checksums(data.view(-1, g)).view(len(sel), blen // g)


_buffers = threading.local()  # per thread (`twocores` runs two), by device: the gather buffer


def _gathered(
    rows: torch.Tensor, ids: torch.Tensor
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """`(first position, ids, rows[ids])` pass by pass over `ids`, gathered into a buffer this
    thread keeps for the next call; each pass's rows are valid until the next pass."""
    length = rows.shape[1]
    step = max(1, _PASS_BYTES // length)
    kept: dict[torch.device, torch.Tensor] = _buffers.__dict__.setdefault("by_device", {})
    buf = kept.get(rows.device)
    if buf is None or buf.numel() < step * length:
        buf = kept[rows.device] = torch.empty(step * length, dtype=torch.uint8, device=rows.device)
    for i in range(0, ids.numel(), step):
        sel = ids[i : i + step]
        out = buf[: sel.numel() * length].view(sel.numel(), length)
        yield i, sel, torch.index_select(rows, 0, sel, out=out)


@dataclass(frozen=True)
class _Entry:
    """One data entry of a source plan, as the decoder checks it after the READ."""

    region: torch.Tensor  # the local region the bytes land in, `[num_blocks, block_len]`
    offset: int  # bytes from the region's start to the entry's first landing
    stride: int  # bytes between the landings of consecutive local sub-blocks
    count: int  # local sub-blocks
    length: int  # bytes per landing
    chunk: int  # the producer's checksum chunk
    landing: int  # word of sub-block 0's expected checksums in the landing table
    every: int  # words from one sub-block's expected checksums to the next's


class LandedChecksums:
    """A decoder's integrity check of one remote engine: the read plan extended by the
    checksum rows, the table they land in, and the comparison after each READ."""

    def __init__(
        self,
        plan: ReadPlan,
        local: WorkerMetadata,
        regions: Sequence[torch.Tensor],
        remotes: Mapping[int, WorkerMetadata],
    ) -> None:
        self.ratio = plan.block_ratio
        # entries of one sub-block count share landing rows sub-block by sub-block, like the
        # producer's table, so a source's checksum rows of adjacent words become one row
        widths: dict[int, int] = {}  # sub-block count -> landing words per sub-block
        found: list[tuple[SourcePlan, list[tuple[list[int], int, int, int, int]]]] = []
        for src in plan.sources:
            remote = remotes[src.remote_rank]
            table, layout = _published(remote)
            rows = []
            for lrow, rrow in zip(src.local_rows.tolist(), src.remote_rows.tolist(), strict=True):
                crow, g = _checksum_row(remote, rrow, table, layout)
                j, off = _find(local.regions, lrow[0], "local", local)
                count, n = lrow[4], lrow[1] // g
                rows.append((crow, j, off, g, widths.get(count, 0)))
                widths[count] = widths.get(count, 0) + n
            found.append((src, rows))
        bases, words = {}, 0
        for count, width in widths.items():
            bases[count], words = words, words + count * width
        device = regions[0].device if regions else torch.device("cpu")
        self.landing = torch.zeros(max(1, words), dtype=torch.int64, device=device)
        self._entries: list[_Entry] = []
        sources = []
        for src, rows in found:
            lrows: list[list[int]] = []
            crows: list[list[int]] = []
            flags: list[bool] = []
            for (crow, j, off, g, at), lrow, mamba in zip(
                rows, src.local_rows.tolist(), src.is_mamba_entry.tolist(), strict=True
            ):
                count, every = lrow[4], widths[lrow[4]]
                first = bases[count] + at
                self._entries.append(
                    _Entry(regions[j], off, lrow[3], count, lrow[1], g, first, every)
                )
                mine = [self.landing.data_ptr() + first * 8, crow[1], lrow[2], every * 8, count]
                if lrows and flags[-1] == mamba and _adjacent(lrows[-1], mine, crows[-1], crow):
                    lrows[-1][1] += mine[1]
                    crows[-1][1] += crow[1]
                    continue
                lrows.append(mine)
                crows.append(crow)
                flags.append(mamba)
            sources.append(
                SourcePlan.from_rows(
                    src.remote_rank,
                    [*src.local_rows.tolist(), *lrows],
                    [*src.remote_rows.tolist(), *crows],
                    [*src.is_mamba_entry.tolist(), *flags],
                    src.bytes_per_block,
                )
            )
        self.plan = replace(plan, sources=tuple(sources))
        self._dev = int(local.regions[0].device_id) if local.regions else 0

    def row(self) -> DescArray:
        """The landing table's (addr, len, dev) for registration."""
        return np.array(
            [[self.landing.data_ptr(), self.landing.numel() * 8, self._dev]], dtype=np.uint64
        )

    def bad_blocks(self, local_sub_ids: BlockIds) -> list[int]:
        """Local blocks (of a finished READ of these sub-block ids) whose landed bytes do not
        match the producer's checksums."""
        sub = torch.as_tensor(np.asarray(local_sub_ids, dtype=np.int64))
        n = sub.numel()
        if n == 0:
            return []
        idx = sub.to(self.landing.device)
        nbytes = n * sum(e.length for e in self._entries)
        bad = torch.cat(
            by_halves(self._bad, idx, split=self.landing.is_cpu and nbytes >= TWO_CORES_BYTES)
        )
        subs = sub[bad.cpu()].tolist()
        return sorted({s // self.ratio for s in subs})

    def _bad(self, idx: torch.Tensor) -> torch.Tensor:
        """Which of the blocks `idx` landed bytes that do not match."""
        bad = torch.zeros(idx.numel(), dtype=torch.bool, device=self.landing.device)
        for e in self._entries:
            n = e.length // e.chunk
            landed = torch.as_strided(
                e.region, (e.count, e.length), (e.stride, 1), e.region.storage_offset() + e.offset
            )
            want = torch.as_strided(self.landing, (e.count, n), (e.every, 1), e.landing)
            for i, sel, data in _gathered(landed, idx):
                got = checksums(data.view(-1, e.chunk)).view(-1, n)
                bad[i : i + len(sel)] |= (got != want[sel]).any(dim=1)
        return bad


def _published(remote: WorkerMetadata) -> tuple[int, list[tuple[int, int]]]:
    """The address and layout of `remote`'s checksum table, checked against its regions."""
    chunks, regions = remote.checksum_chunks, remote.regions
    table = remote.checksum_table_addr or remote.checksum_addr
    if not table or len(chunks) != len(regions):
        raise ConfigError(
            f"integrity_checksums: engine {remote.engine_id!r} rank {remote.tp_rank} publishes "
            f"no checksum table ({len(chunks)} chunk sizes for {len(regions)} regions); "
            "enable integrity_checksums on the producer too"
        )
    for j, (c, r) in enumerate(zip(chunks, regions, strict=True)):
        if c <= 0 or r.block_len % c:
            raise ConfigError(
                f"integrity_checksums: engine {remote.engine_id!r} rank {remote.tp_rank} region "
                f"{j}: checksum chunk {c} does not divide its block of {r.block_len} bytes"
            )
    if not remote.checksum_table_addr:  # a table published region after region
        return table, _region_major(regions, chunks)
    layout = [tuple(x) for x in remote.checksum_layout]
    for j, (r, c, x) in enumerate(zip(regions, chunks, [*layout, None], strict=False)):
        if x is None or len(x) != 2 or x[0] < 0 or x[1] < r.block_len // c:
            raise ConfigError(
                f"integrity_checksums: engine {remote.engine_id!r} rank {remote.tp_rank} region "
                f"{j}: checksum layout {x} is not [first word >= 0, words per block >= "
                f"{r.block_len // c}]"
            )
    return table, [(int(a), int(b)) for a, b in layout]


def _find(
    regions: Sequence[RegionMeta], addr: int, side: str, meta: WorkerMetadata
) -> tuple[int, int]:
    """(region index, offset) of the byte at `addr`."""
    for j, r in enumerate(regions):
        if r.base_addr <= addr < r.base_addr + r.num_blocks * r.block_len:
            return j, addr - r.base_addr
    raise ConfigError(
        f"integrity_checksums: {side} address {addr:#x} is in no region of engine "
        f"{meta.engine_id!r} rank {meta.tp_rank}"
    )


def _checksum_row(
    remote: WorkerMetadata, rrow: list[int], table: int, layout: Sequence[tuple[int, int]]
) -> tuple[list[int], int]:
    """The table rows of the remote data row `(addr, len, dev, stride, count)`, and its chunk."""
    addr, length, dev, stride, count = rrow
    j, off = _find(remote.regions, addr, "remote", remote)
    g = remote.checksum_chunks[j]
    if off % g or length % g or stride % g:
        raise ConfigError(
            f"integrity_checksums: a read of {length} bytes at offset {off} (stride {stride}) of "
            f"region {j} of engine {remote.engine_id!r} rank {remote.tp_rank} does not align "
            f"with its checksum chunk of {g} bytes"
        )
    first, every = layout[j]
    width = remote.regions[j].block_len // g  # words of one block
    block, within = divmod(off // g, width)
    n, step = length // g, stride // g
    if every != width and (within + n > width or step % width):
        raise ConfigError(
            f"integrity_checksums: a read of {length} bytes at offset {off} (stride {stride}) of "
            f"region {j} of engine {remote.engine_id!r} rank {remote.tp_rank} is not within "
            "whole blocks, as its block-by-block checksum table needs"
        )
    if every != width:
        step = step // width * every
    word = first + block * every + within
    return [table + word * 8, n * 8, dev, step * 8, count], g


def _adjacent(la: list[int], lb: list[int], ra: list[int], rb: list[int]) -> bool:
    """Whether rows b continue rows a on both sides (one row can then stand for both)."""
    return all(a[0] + a[1] == b[0] and a[2:] == b[2:] for a, b in ((la, lb), (ra, rb)))
