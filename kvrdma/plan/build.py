"""The read planner: which rows each rank of one remote engine fills, region kind by kind.

`build_read_plan` validates the two engines against each other, computes the TP/block-size
mapping (`transfer_info`), pairs the regions (by index, or by head for LHBNC) and hands each
pair to its kind's rule in `kvrdma.plan.regions`. Planning is pure: no torch, no NIXL, and
nothing remembered between calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvrdma.descriptors import ReadPlan, SourcePlan
from kvrdma.errors import ConfigError
from kvrdma.metadata import RegionMeta, WorkerMetadata
from kvrdma.permute import BlockPermute
from kvrdma.plan.regions import (
    Rows,
    SourceContext,
    attention_rows,
    head_rows,
    mamba_rows,
    mla_rows,
)
from kvrdma.plan.unified import check_orders, per_head_pairs
from kvrdma.topology import EngineTransferInfo, TransferTopology

RegionPairs = list[tuple[int, tuple[RegionMeta, RegionMeta]]]
# per Mamba region, in region order: the bytes of each state filling one page, as one side
# registered them (`KVLayoutInfo.mamba_states`); the wire metadata does not carry them
MambaStates = Sequence[Sequence[int]]


def transfer_info(
    topo: TransferTopology, local: WorkerMetadata, remote: WorkerMetadata
) -> EngineTransferInfo:
    """The TP/block-size mapping from `local` to the engine `remote` is one rank of."""
    attn_len = next((r.block_len for r in local.regions if r.kind != "mamba"), 0)
    rattn_len = next((r.block_len for r in remote.regions if r.kind != "mamba"), 0)
    return topo.engine_info(
        remote.engine_id,
        remote.tp_size,
        remote.block_size,
        rattn_len or 1,
        remote.physical_blocks_per_logical,
        local_block_len=attn_len or 1,
        local_physical_blocks_per_logical=local.physical_blocks_per_logical,
    )


def build_read_plan(
    topo: TransferTopology,
    local: WorkerMetadata,
    remotes: Mapping[int, WorkerMetadata],
    *,
    mamba_states: MambaStates = (),
) -> ReadPlan:
    """Plan the READs of `local` from the ranks of one remote engine (their metadata by rank).

    `mamba_states` (local or remote registration, the same model on both sides) lets a Mamba
    page of several states be split state by state across TP sizes; without it every page is
    one state."""
    if not remotes:
        raise ConfigError("no remote metadata to plan from")
    any_remote = next(iter(remotes.values()))
    engine_id = any_remote.engine_id
    _check_compatible(local, any_remote)
    info = transfer_info(topo, local, any_remote)
    missing = [p for p in info.all_sources if p not in remotes]
    if missing:
        raise ConfigError(f"metadata for remote ranks {missing} of engine {engine_id!r} missing")
    return _plan(topo, info, local, remotes, info.all_sources, mamba_states)


def build_source_plan(
    topo: TransferTopology,
    local: WorkerMetadata,
    remote: WorkerMetadata,
    *,
    mamba_states: MambaStates = (),
) -> ReadPlan | None:
    """The part of `local`'s plan that one remote rank fills (its only source), or None when
    `local` reads nothing from that rank: what a pushing producer rank writes to `local`."""
    _check_compatible(local, remote)
    info = transfer_info(topo, local, remote)
    if remote.tp_rank not in info.all_sources:
        return None
    plan = _plan(topo, info, local, {remote.tp_rank: remote}, (remote.tp_rank,), mamba_states)
    return plan if plan.sources else None


def _plan(
    topo: TransferTopology,
    info: EngineTransferInfo,
    local: WorkerMetadata,
    remotes: Mapping[int, WorkerMetadata],
    ranks: Sequence[int],
    mamba_states: MambaStates,
) -> ReadPlan:
    any_remote = next(iter(remotes.values()))
    engine_id = any_remote.engine_id
    counts = {r: m.num_blocks for r, m in sorted(remotes.items())}
    if len(set(counts.values())) > 1:  # block ids are checked once, against every rank
        raise ConfigError(
            f"num_blocks differs between ranks of engine {engine_id!r} ({counts}): every "
            "rank of an engine needs as many blocks"
        )
    num_mamba = sum(r.kind == "mamba" for r in local.regions)
    if mamba_states and len(mamba_states) != num_mamba:
        raise ConfigError(
            f"{len(mamba_states)} Mamba state lists given for {num_mamba} Mamba regions"
        )
    sources: list[SourcePlan] = []
    permutes: dict[int, BlockPermute] = {}
    for p in ranks:
        _check_compatible(local, remotes[p])
        ctx = SourceContext(topo, info, local, remotes[p], p)
        rows = _source_rows(ctx, permutes, mamba_states)
        if rows.local:
            sources.append(
                SourcePlan.from_rows(p, rows.local, rows.remote, rows.mamba, rows.per_block)
            )
    return ReadPlan(
        remote_engine_id=engine_id,
        block_ratio=info.block_size_ratio,
        remote_num_blocks=any_remote.num_blocks,
        local_num_blocks=local.num_blocks,
        sources=tuple(sources),
        permutes=tuple(p for p in permutes.values() if not p.is_identity),
        notify_ranks=info.handshake_ranks,
        notify_expected=info.tp_ratio if info.tp_ratio > 0 else 1,
    )


def _region_pairs(ctx: SourceContext) -> RegionPairs:
    """(local region index, (local, remote region)) for every region this rank may fill."""
    local, rmeta, p = ctx.local, ctx.remote, ctx.rank
    if local.kv_cache_order == "LHBNC":
        fa_rank = p if p in ctx.info.fa_sources else None
        return per_head_pairs(ctx.topo, ctx.info, local, rmeta, fa_rank)
    if len(rmeta.regions) != len(local.regions):
        raise ConfigError(
            f"remote rank {p} of {ctx.engine_id!r} has {len(rmeta.regions)} regions, "
            f"local has {len(local.regions)}"
        )
    return list(enumerate(zip(local.regions, rmeta.regions, strict=True)))


def _source_rows(
    ctx: SourceContext, permutes: dict[int, BlockPermute], mamba_states: MambaStates
) -> Rows:
    """Every row remote rank `ctx.rank` fills; the first permute of each region is kept."""
    rows = Rows()
    states = iter(mamba_states)
    is_fa = ctx.rank in ctx.info.fa_sources
    per_head = ctx.local.kv_cache_order == "LHBNC"
    for j, (lr, rr) in _region_pairs(ctx):
        if lr.kind != rr.kind or lr.fragments != rr.fragments:
            raise ConfigError(
                f"region {j}: local is {lr.kind}×{lr.fragments} fragments, remote rank "
                f"{ctx.rank} of {ctx.engine_id!r} is {rr.kind}×{rr.fragments}"
            )
        if lr.kind == "mamba":
            mamba_rows(ctx, j, lr, rr, rows, next(states, ()))
        elif not is_fa:
            continue  # a Mamba-only source reads no attention bytes
        elif per_head:
            head_rows(ctx, j, lr, rr, rows)
        elif lr.kind == "mla":
            mla_rows(ctx, j, lr, rr, rows)
        else:
            permutes.setdefault(j, attention_rows(ctx, j, lr, rr, rows))
    return rows


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
