"""Planning rules of vLLM's unified layout that the other layouts do not have.

`LHBNC` registers a region per (layer, head): a remote rank's regions pair with the local ones
by global head, not by index. `BHLNC` keeps every layer inside a head's bytes. Only orders
with the same regions convert on receive (LBHNC/LBNHC, BLHNC/BLNHC: HND <-> NHD).
"""

from __future__ import annotations

from kvrdma.errors import ConfigError
from kvrdma.metadata import RegionMeta, WorkerMetadata
from kvrdma.topology import TransferTopology, physical_heads

_CONVERTIBLE = ({"LBHNC", "LBNHC"}, {"BLHNC", "BLNHC"})


def check_orders(local: WorkerMetadata, remote: WorkerMetadata) -> None:
    """Refuse peers whose unified orders cut the cache into different regions."""
    lo, ro = local.kv_cache_order, remote.kv_cache_order
    if lo != ro and {lo, ro} not in _CONVERTIBLE:
        raise ConfigError(
            f"kv_cache_order differs: local {lo!r}, remote engine {remote.engine_id!r} rank "
            f"{remote.tp_rank} has {ro!r} (only LBHNC/LBNHC and BLHNC/BLNHC convert on receive)"
        )
    check_shared_pages(local, remote)


def check_shared_pages(local: WorkerMetadata, remote: WorkerMetadata) -> None:
    """Pages that are attention for one block and Mamba state for another can be moved only
    whole, rank to rank, unpermuted: refuse other TP mixes, block sizes and orders."""
    if not (local.shared_pages or remote.shared_pages):
        return
    mine = (local.shared_pages, local.kv_cache_order, local.tp_size, local.block_size)
    theirs = (remote.shared_pages, remote.kv_cache_order, remote.tp_size, remote.block_size)
    if mine != theirs:
        raise ConfigError(
            f"Mamba state shares attention pages (vLLM's HMA) under kv_cache_order "
            f"{local.kv_cache_order or remote.kv_cache_order}: pages move only whole, so P tp "
            f"{remote.tp_size} -> D tp {local.tp_size}, block sizes {remote.block_size} -> "
            f"{local.block_size} and orders must be equal on engine {remote.engine_id!r} "
            f"(shared pages: local {local.shared_pages}, remote {remote.shared_pages})"
        )


def _heads(meta: WorkerMetadata) -> int:
    lo, hi = physical_heads(meta.tp_rank, meta.tp_size, meta.total_num_kv_heads)
    return hi - lo


def layers_per_head(local: WorkerMetadata, region: RegionMeta, heads: int) -> int:
    """Layers inside each head's bytes of a block: all of them for BHLNC, else 1."""
    if local.kv_cache_order != "BHLNC":
        return 1
    return region.block_len // (heads * local.block_size * local.head_dim * local.element_size)


def per_head_pairs(
    topo: TransferTopology, local: WorkerMetadata, remote: WorkerMetadata, fa_rank: int | None
) -> list[tuple[int, tuple[RegionMeta, RegionMeta]]]:
    """LHBNC: (local region index, (local, remote region)) for every head region this remote
    rank fills (none when `fa_rank` is None: not an attention source), then every Mamba pair."""
    lattn = [r for r in local.regions if r.kind != "mamba"]
    rattn = [r for r in remote.regions if r.kind != "mamba"]
    lm = [r for r in local.regions if r.kind == "mamba"]
    rm = [r for r in remote.regions if r.kind == "mamba"]
    hl, hr = _heads(local), _heads(remote)
    if len(lattn) // hl != len(rattn) // hr or len(lm) != len(rm):
        raise ConfigError(
            f"remote rank {remote.tp_rank} of {remote.engine_id!r} has {len(rattn) // hr} "
            f"attention and {len(rm)} Mamba layers, local has {len(lattn) // hl} and {len(lm)}"
        )
    pairs: list[tuple[int, tuple[RegionMeta, RegionMeta]]] = []
    if fa_rank is not None:
        info = topo.engine(remote.engine_id)
        first = topo.local_heads()[0]
        hc = hl // len(info.fa_sources) if info.tp_ratio < 0 else hl
        slot = topo.fa_head_slot(remote.engine_id, fa_rank) if info.tp_ratio < 0 else 0
        rh0 = topo.remote_heads(fa_rank, remote.tp_size)[0]
        for g in range(first + slot * hc, first + slot * hc + hc):
            if not 0 <= g - rh0 < hr:
                raise ConfigError(
                    f"head {g} is not on remote rank {fa_rank} of {remote.engine_id!r} "
                    f"(it holds [{rh0}, {rh0 + hr}))"
                )
            for layer in range(len(lattn) // hl):
                j = layer * hl + g - first
                pairs.append((j, (lattn[j], rattn[layer * hr + g - rh0])))
    pairs.extend((len(lattn) + k, pair) for k, pair in enumerate(zip(lm, rm, strict=True)))
    return pairs
