"""Opt-in end-to-end integrity (`kv_connector_extra_config.integrity_checksums`): the producer
checksums every block it holds, the decoder checks what its READ landed against them.

How the checksums reach the decoder: the producer keeps them in a *checksum table* registered
with NIXL next to its KV regions (same memory type and device), one 8-byte word per chunk at
an address fixed by the chunk's position, and publishes the table's address with its metadata.
The decoder adds, for every descriptor it reads, the table rows of exactly those bytes to the
same descriptor lists, so one READ brings data and checksums together: nothing extra is posted,
no message goes from producer to reader (readers are unknown at `hold` and producers never
message them), and the producer's "done" notification still fires only after both landed.

Granularity: a region's bytes are cut into equal chunks that divide every slice a reader can
take (see `chunk_bytes`): one head of one fragment for attention, so a decoder of another TP
size that reads a head range of the producer's block checks exactly its heads. The checksum of
a chunk is the sum of its words times fixed odd weights modulo 2**64: a change inside any one
word is always caught (an odd weight is invertible modulo 2**64). It guards against bugs and
faults, not against an attacker (it is no MAC).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
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
_BATCH_BYTES = 64 << 20  # bytes checksummed per pass: bounds the temporaries
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


def table_offsets(regions: Sequence[RegionMeta], chunks: Sequence[int]) -> list[int]:
    """Where each region's rows start in the checksum table, in words (one per chunk)."""
    sizes = [r.num_blocks * r.block_len // c for r, c in zip(regions, chunks, strict=True)]
    return [0, *np.cumsum(sizes).tolist()][: len(sizes)]


class ChecksumTable:
    """The producer's checksums of its held blocks, in registered memory readers READ."""

    def __init__(self, regions: Sequence[Region], meta: WorkerMetadata) -> None:
        self.regions = list(regions)
        self.chunks = [chunk_bytes(meta, r.meta) for r in self.regions]
        self.offsets = table_offsets([r.meta for r in self.regions], self.chunks)
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
            meta, checksum_addr=self.table.data_ptr(), checksum_chunks=list(self.chunks)
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
        for (region, g), off in zip(self._pairs(), self.offsets, strict=True):
            n, blen = region.meta.num_blocks, region.meta.block_len
            rows = self.table[off : off + n * blen // g].view(n, blen // g)
            step = max(1, _BATCH_BYTES // blen)
            for i in range(0, len(block_ids), step):
                ids = torch.tensor(block_ids[i : i + step], dtype=torch.long)
                ids = ids.to(region.data.device)
                data = region.data.index_select(0, ids).reshape(-1, g)
                rows[ids] = checksums(data).view(len(ids), blen // g)


@dataclass(frozen=True)
class _Entry:
    """One data entry of a source plan, as the decoder checks it after the READ."""

    region: torch.Tensor  # the local region the bytes land in, `[num_blocks, block_len]`
    offset: int  # bytes from the region's start to the entry's first landing
    stride: int  # bytes between the landings of consecutive local sub-blocks
    count: int  # local sub-blocks
    length: int  # bytes per landing
    chunk: int  # the producer's checksum chunk
    landing: int  # first word of the entry's expected checksums in the landing table


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
        self._entries: list[_Entry] = []
        pending: list[tuple[SourcePlan, list[list[int]], list[list[int]]]] = []
        words = 0
        for src in plan.sources:
            remote = remotes[src.remote_rank]
            _check_published(remote)
            lrows, rrows = [], []
            for lrow, rrow in zip(src.local_rows.tolist(), src.remote_rows.tolist(), strict=True):
                crow, g = _checksum_row(remote, rrow)
                j, off = _find(local.regions, lrow[0], "local", local)
                n = lrow[1] // g
                entry = _Entry(regions[j], off, lrow[3], lrow[4], lrow[1], g, words)
                self._entries.append(entry)
                lrows.append([words * 8, n * 8, lrow[2], n * 8, lrow[4]])  # base added below
                rrows.append(crow)
                words += n * lrow[4]
            pending.append((src, lrows, rrows))
        device = regions[0].device if regions else torch.device("cpu")
        self.landing = torch.zeros(max(1, words), dtype=torch.int64, device=device)
        base = self.landing.data_ptr()
        sources = []
        for src, lrows, rrows in pending:
            for row in lrows:
                row[0] += base
            sources.append(
                SourcePlan.from_rows(
                    src.remote_rank,
                    [*src.local_rows.tolist(), *lrows],
                    [*src.remote_rows.tolist(), *rrows],
                    [*src.is_mamba_entry.tolist(), *src.is_mamba_entry.tolist()],
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
            ).index_select(0, idx)
            got = checksums(landed.reshape(-1, e.chunk)).view(-1, n)
            want = self.landing[e.landing : e.landing + n * e.count].view(e.count, n)[idx]
            bad |= (got != want).any(dim=1)
        return bad


def _check_published(remote: WorkerMetadata) -> None:
    chunks, regions = remote.checksum_chunks, remote.regions
    if not remote.checksum_addr or len(chunks) != len(regions):
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


def _checksum_row(remote: WorkerMetadata, rrow: list[int]) -> tuple[list[int], int]:
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
    start = table_offsets(remote.regions, remote.checksum_chunks)[j]
    return [
        remote.checksum_addr + (start + off // g) * 8,
        length // g * 8,
        dev,
        stride // g * 8,
        count,
    ], g
