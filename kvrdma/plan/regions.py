"""One rule per region kind: the strided rows a remote rank fills for one region pair.

Each rule appends parallel local/remote rows `(addr, len, dev, stride, count)` to a `Rows` of
one source rank and checks that the two regions' sizes agree, naming region, rank and engine
when they do not. Attention is the one kind whose landing order may need a `BlockPermute`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrdma.errors import ConfigError
from kvrdma.metadata import RegionMeta, WorkerMetadata
from kvrdma.permute import BlockPermute
from kvrdma.plan.unified import layers_per_head
from kvrdma.topology import (
    EngineTransferInfo,
    MambaEngineTransferInfo,
    TransferTopology,
    physical_heads,
)

Row = tuple[int, int, int, int, int]


def heads_per_rank(meta: WorkerMetadata) -> int:
    lo, hi = physical_heads(meta.tp_rank, meta.tp_size, meta.total_num_kv_heads)
    return hi - lo


@dataclass(frozen=True)
class SourceContext:
    """What the region rules need to plan the READs from one remote rank."""

    topo: TransferTopology
    info: EngineTransferInfo
    local: WorkerMetadata
    remote: WorkerMetadata
    rank: int

    @property
    def engine_id(self) -> str:
        return self.info.remote_engine_id

    @property
    def ratio(self) -> int:
        return self.info.block_size_ratio

    @property
    def local_heads(self) -> int:
        return 0 if self.local.is_mla else heads_per_rank(self.local)

    @property
    def local_first_head(self) -> int:
        return 0 if self.local.is_mla else self.topo.local_heads()[0]


@dataclass
class Rows:
    """The parallel rows one source rank fills, and the bytes it moves per local block."""

    local: list[Row] = field(default_factory=list)
    remote: list[Row] = field(default_factory=list)
    mamba: list[bool] = field(default_factory=list)
    per_block: int = 0

    def add(self, local: Row, remote: Row, *, mamba: bool = False) -> None:
        self.local.append(local)
        self.remote.append(remote)
        self.mamba.append(mamba)


def mamba_rows(
    ctx: SourceContext,
    j: int,
    lr: RegionMeta,
    rr: RegionMeta,
    rows: Rows,
    states: Sequence[int] = (),
) -> None:
    """A Mamba page is split evenly over the remote ranks of this rank's Mamba range.

    `states` are the sizes of the states filling one page (conv, ssm), as registered on one
    side; TP splits each state on its own, so each is split on its own, at its place in each
    side's page (same model: both pages in the same proportions). An empty `states` is one
    state, split as a whole.
    """
    info, p = ctx.info, ctx.rank
    if isinstance(info, MambaEngineTransferInfo) and info.mamba_range:
        if p not in info.mamba_range:
            return
        i, split = info.mamba_range.index(p), info.abs_tp
    else:
        i, split = 0, 1
    ratio = max(info.tp_ratio, 1)
    expect_rlen = lr.block_len * ratio // split
    if lr.block_len % split or rr.block_len != expect_rlen:
        raise ConfigError(
            f"Mamba region {j}: local state {lr.block_len} bytes, remote rank {p} "
            f"has {rr.block_len}, expected {expect_rlen}"
        )
    if split == 1 and ratio == 1:  # equal TP: the page moves whole
        states = ()
    local_parts = _state_parts(j, lr.block_len, states, "local rank")
    remote_parts = _state_parts(j, rr.block_len, states, f"remote rank {p} of {ctx.engine_id!r}")
    for k, ((lo, llen), (ro, _)) in enumerate(zip(local_parts, remote_parts, strict=True)):
        if llen % split:
            raise ConfigError(
                f"Mamba region {j}: state {k} of {llen} bytes does not split into {split} "
                f"equal parts (one per remote rank)"
            )
        chunk = llen // split
        roff = (ctx.topo.tp_rank % ratio) * chunk
        rows.add(
            (lr.base_addr + lo + i * chunk, chunk, lr.device_id, lr.block_len, lr.num_blocks),
            (rr.base_addr + ro + roff, chunk, rr.device_id, rr.block_len, rr.num_blocks),
            mamba=True,
        )
        rows.per_block += chunk


def _state_parts(j: int, page: int, states: Sequence[int], side: str) -> list[tuple[int, int]]:
    """(offset, bytes) of each state in a `page`-byte page cut in the proportions of `states`."""
    total = sum(states)
    if len(states) <= 1:
        return [(0, page)]
    if any(s * page % total for s in states):
        raise ConfigError(
            f"Mamba region {j}: the {page}-byte page ({side}) cannot be cut in the "
            f"proportions of the registered states {list(states)} (P and D must run the "
            "same model)"
        )
    sizes = [s * page // total for s in states]
    return list(zip(itertools.accumulate(sizes[:-1], initial=0), sizes, strict=True))


def head_rows(ctx: SourceContext, j: int, lr: RegionMeta, rr: RegionMeta, rows: Rows) -> None:
    """LHBNC: one head's [tokens, content], so remote sub-blocks concatenate as they are."""
    r = ctx.ratio
    sub_len = lr.block_len // r
    if rr.block_len * r != lr.block_len:
        raise ConfigError(
            f"head region {j}: local block {lr.block_len} bytes / ratio {r} "
            f"!= remote rank {ctx.rank} block {rr.block_len} bytes"
        )
    rows.add(
        (lr.base_addr, sub_len, lr.device_id, sub_len, lr.num_blocks * r),
        (rr.base_addr, sub_len, rr.device_id, sub_len, rr.num_blocks),
    )
    rows.per_block += lr.block_len


def mla_rows(ctx: SourceContext, j: int, lr: RegionMeta, rr: RegionMeta, rows: Rows) -> None:
    """MLA: every rank holds the whole latent block, read from one source rank."""
    r = ctx.ratio
    sub_len = lr.block_len // r
    if rr.block_len != sub_len or lr.block_len % r:
        raise ConfigError(
            f"MLA region {j}: local block {lr.block_len} bytes / ratio {r} "
            f"!= remote rank {ctx.rank} block {rr.block_len} bytes"
        )
    rows.add(
        (lr.base_addr, sub_len, lr.device_id, sub_len, lr.num_blocks * r),
        (rr.base_addr, sub_len, rr.device_id, rr.block_len, rr.num_blocks),
    )
    rows.per_block += lr.block_len


@dataclass(frozen=True)
class _HeadChunk:
    """Which heads of a remote attention block land in which chunk of the local one."""

    heads: int  # heads per chunk
    slot: int  # chunk index inside a local fragment
    head_offset: int  # first head read, counted inside the remote rank's heads
    remote_heads: int  # heads the remote rank holds
    head_bytes: int  # one head's bytes inside one remote fragment


def _head_chunk(ctx: SourceContext, j: int, lr: RegionMeta, rr: RegionMeta) -> _HeadChunk:
    """The heads `ctx.rank` contributes to region `j`, checked against both block sizes."""
    f, r, p = lr.fragments, ctx.ratio, ctx.rank
    h_local, n_chunks = ctx.local_heads, len(ctx.info.fa_sources)
    h_remote = heads_per_rank(ctx.remote)
    hc = h_local // n_chunks
    head_bytes = rr.block_len // f // h_remote
    if hc * n_chunks != h_local or lr.block_len // (f * r) != hc * n_chunks * head_bytes:
        raise ConfigError(
            f"attention region {j}: local block {lr.block_len} bytes ({h_local} heads, "
            f"{f} fragments, block_size_ratio {r}) does not match remote rank {p} "
            f"block {rr.block_len} bytes ({h_remote} heads)"
        )
    slot = ctx.topo.fa_head_slot(ctx.info, p)
    rh0 = ctx.topo.remote_heads(p, ctx.remote.tp_size)[0]
    want = ctx.local_first_head + (slot * hc if ctx.info.tp_ratio < 0 else 0)
    head_off = want - rh0
    if head_off < 0 or head_off + hc > h_remote:
        raise ConfigError(
            f"heads [{want}, {want + hc}) are not on remote rank {p} of {ctx.engine_id!r} "
            f"(it holds [{rh0}, {rh0 + h_remote}))"
        )
    return _HeadChunk(hc, slot, head_off, h_remote, head_bytes)


def _check_sliceable(ctx: SourceContext, hc: int, h_remote: int) -> None:
    """Reading some of a remote block's heads needs them contiguous inside each token row."""
    rmeta = ctx.remote
    if hc >= h_remote or rmeta.kv_layout != "NHD" or rmeta.block_size <= 1:
        return
    if rmeta.kv_cache_order:
        raise ConfigError(
            f"kv_cache_order {rmeta.kv_cache_order} of engine {ctx.engine_id!r} keeps "
            f"heads apart inside a block: P tp {rmeta.tp_size} -> D tp "
            f"{ctx.local.tp_size} needs {hc} of its {h_remote} heads (use LBHNC, "
            "LHBNC, BLHNC or BHLNC, or equal TP sizes)"
        )
    raise ConfigError(
        f"remote rank {ctx.rank} of {ctx.engine_id!r} uses NHD blocks; reading {hc} of its "
        f"{h_remote} heads needs HND on the sender (kv_layout) "
    )


def attention_rows(
    ctx: SourceContext, j: int, lr: RegionMeta, rr: RegionMeta, rows: Rows
) -> BlockPermute:
    """Heads of remote rank `ctx.rank` land in their chunk of every local fragment; returns
    how to permute the landed blocks into the local layout."""
    f, r = lr.fragments, ctx.ratio
    hc = _head_chunk(ctx, j, lr, rr)
    _check_sliceable(ctx, hc.heads, hc.remote_heads)
    n_chunks = len(ctx.info.fa_sources)
    sub_len = lr.block_len // r
    chunk_len = hc.heads * hc.head_bytes
    if n_chunks == 1 and hc.heads >= hc.remote_heads:
        # whole remote blocks, one descriptor per block and region
        rows.add(
            (lr.base_addr, sub_len, lr.device_id, sub_len, lr.num_blocks * r),
            (rr.base_addr, rr.block_len, rr.device_id, rr.block_len, rr.num_blocks),
        )
    else:
        lfrag_sub, rfrag = lr.block_len // (f * r), rr.block_len // f
        for frag in range(f):
            laddr = lr.base_addr + frag * lfrag_sub + hc.slot * chunk_len
            raddr = rr.base_addr + frag * rfrag + hc.head_offset * hc.head_bytes
            rows.add(
                (laddr, chunk_len, lr.device_id, sub_len, lr.num_blocks * r),
                (raddr, chunk_len, rr.device_id, rr.block_len, rr.num_blocks),
            )
    rows.per_block += chunk_len * f * r
    local = ctx.local
    return BlockPermute(
        region=j,
        ratio=r,
        fragments=f,
        chunks=n_chunks,
        chunk_heads=hc.heads,
        remote_block_size=ctx.remote.block_size,
        head_bytes=local.head_dim * local.element_size,
        remote_layout=ctx.remote.kv_layout,
        local_layout=local.kv_layout,
        layers=layers_per_head(local, lr, ctx.local_heads),
    )
