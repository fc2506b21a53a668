"""What one worker (one TP rank of one engine) tells its peers: the handshake payload.

These are msgspec Structs so the handshake can carry them as they are. Fields are only ever
added at the end, with defaults (msgspec schema-evolution rules); bump `PROTOCOL_VERSION` in
`kvrdma.handshake.wire` and note it in CHANGELOG.md when the payload changes.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import msgspec

from kvrdma.errors import ConfigError, HandshakeError

RegionKind = Literal["attn", "mla", "mamba"]
KvLayout = Literal["NHD", "HND"]
CacheLayout = Literal["split_kv", "blocks_first", "mla", "cross_layer", "mamba", "unified"]
# vLLM's unified layout: the physical order of the logical [L, B, H, N, C] cache
KVCacheOrder = Literal["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]
KV_CACHE_ORDERS: tuple[KVCacheOrder, ...] = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


class RegionMeta(msgspec.Struct, frozen=True, array_like=True):
    """One registered region: `num_blocks` blocks of `block_len` bytes from `base_addr`.

    A block is `fragments` equal fragments (1 for split K/V and MLA, 2 for blocks-first K|V,
    2*layers for cross-layer). Attention fragments hold (heads-of-this-rank, tokens, head_dim)
    in the worker's `kv_layout`; MLA fragments (tokens, latent); Mamba blocks one state.
    """

    base_addr: int
    num_blocks: int
    block_len: int
    kind: RegionKind = "attn"
    fragments: int = 1
    device_id: int = 0


class WorkerMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a reader needs to plan READs from this worker."""

    engine_id: str
    agent_name: str
    agent_metadata: bytes
    tp_rank: int
    tp_size: int
    dp_index: int = 0
    block_size: int
    num_blocks: int
    cache_layout: CacheLayout
    kv_layout: KvLayout = "NHD"
    total_num_kv_heads: int
    head_dim: int
    dtype: str
    element_size: int
    physical_blocks_per_logical: int = 1
    mem_type: str = "DRAM"
    regions: list[RegionMeta] = []
    compat_hash: str = ""
    # sha256 of agent_metadata: a corrupted blob can break NIXL's entry for that agent for good.
    agent_metadata_sha256: str = ""
    # cache_layout "unified" only: the physical order of vLLM's logical [L, B, H, N, C] cache
    kv_cache_order: str = ""
    # unified only: Mamba state overlays attention pages (vLLM's HMA groups sharing one buffer);
    # a block is then an opaque page, read whole from one rank of equal TP and block size
    shared_pages: bool = False
    # the producer's lease in seconds (0: not told): each heartbeat a reader sends keeps the
    # blocks at least this long after it
    kv_lease_duration: float = 0.0
    # integrity mode (`kvrdma.integrity`): where the registered checksum table starts (0: none)
    # and each region's checksum chunk in bytes
    checksum_addr: int = 0
    checksum_chunks: list[int] = []
    # integrity mode, the table laid out block by block (`checksum_addr` then stays 0, so a
    # reader that knows only the region-by-region table refuses it): its address and, per
    # region, [first word, words from one block's checksums to the next block's]
    checksum_table_addr: int = 0
    checksum_layout: list[list[int]] = []

    @property
    def is_mla(self) -> bool:
        return self.cache_layout == "mla"

    @property
    def is_mamba(self) -> bool:
        """Hybrid: some regions hold Mamba state (cache_layout "mamba", or unified views)."""
        return self.cache_layout == "mamba" or any(r.kind == "mamba" for r in self.regions)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# hex characters of an agent's metadata checksum that name it (`agent_tag`): enough to tell a
# restarted process from the one before, short enough for every rank's in a request's params
AGENT_TAG_CHARS = 16
_TAG = re.compile(f"[0-9a-f]{{{AGENT_TAG_CHARS},64}}")


def agent_tag(meta: WorkerMetadata) -> str:
    """The short name of the NIXL agent serving `meta`'s rank: a prefix of its checksum, new
    with every process (a restarted one may keep the agent's name)."""
    return agent_checksum(meta)[:AGENT_TAG_CHARS]


def agent_checksum(meta: WorkerMetadata) -> str:
    """`agent_metadata_sha256`, computed where the metadata came without it."""
    return meta.agent_metadata_sha256 or sha256_hex(meta.agent_metadata)


def checked_agents(where: str, value: Any) -> dict[int, str]:
    """Producer ranks' agents as a request names them (rank -> its `agent_tag` or whole
    `agent_metadata_sha256`), from a mapping or a list by rank; else `ConfigError`."""
    ranked: Iterable[tuple[Any, Any]] | None = value.items() if isinstance(value, Mapping) else None
    if ranked is None and isinstance(value, Sequence) and not isinstance(value, str | bytes):
        ranked = enumerate(value)
    if ranked is None:
        raise ConfigError(f"{where}: expected agent checksums by producer rank, got {value!r:.80}")
    agents: dict[int, str] = {}
    for rank, tag in ranked:
        ok = isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0
        if not ok or not isinstance(tag, str) or not _TAG.fullmatch(tag):
            raise ConfigError(
                f"{where}: expected rank -> {AGENT_TAG_CHARS} to 64 lowercase hex digits of "
                f"the agent's metadata checksum, got {rank!r:.20} -> {tag!r:.80}"
            )
        agents[rank] = tag
    return agents


def compat_hash(
    *,
    version: str,
    model: str,
    dtype: str,
    total_num_kv_heads: int,
    head_dim: int,
    num_layers: int,
    attn_backend: str,
    cache_dtype: str,
    cross_layer: bool,
) -> str:
    """SPEC §7: SHA-256 over the sorted JSON of what must match between P and D."""
    fields = {
        "version": version,
        "model": model,
        "dtype": dtype,
        "total_num_kv_heads": total_num_kv_heads,
        "head_dim": head_dim,
        "num_layers": num_layers,
        "attn_backend": attn_backend,
        "cache_dtype": cache_dtype,
        "cross_layer": cross_layer,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def engine_of(metas: Mapping[int, WorkerMetadata]) -> str:
    """The one engine these ranks' metadata describe, checked rank by rank."""
    if not metas:
        raise ConfigError("add_remote needs the metadata of at least one remote rank")
    engine_ids = {m.engine_id for m in metas.values()}
    if len(engine_ids) != 1:
        raise ConfigError(f"add_remote got ranks of several engines: {sorted(engine_ids)}")
    engine = engine_ids.pop()
    for rank, m in metas.items():
        if m.tp_rank != rank:
            raise ConfigError(f"engine {engine!r}: metadata for rank {rank} says {m.tp_rank}")
        if m.agent_metadata_sha256 and m.agent_metadata_sha256 != sha256_hex(m.agent_metadata):
            raise HandshakeError(f"engine {engine!r} rank {rank}: agent metadata checksum mismatch")
    return engine


def dp_index_of(metas: Mapping[int, WorkerMetadata]) -> int:
    """The data-parallel rank of an engine's ranks (`engine_of` checked they are one engine)."""
    return next(iter(metas.values())).dp_index


def other_dp_rank(engine: str, added: int, asked: int) -> ConfigError:
    """The error for ranks of data-parallel rank `asked` of an engine added from `added`: its
    reads under way read that rank's memory, so one engine id names one rank."""
    return ConfigError(
        f"dp_index: engine {engine!r} is added from dp_index {added}, asked for {asked}; an "
        f"engine id names one data-parallel rank here (vLLM gives each its own): "
        f"remove_remote({engine!r}) first to switch"
    )
