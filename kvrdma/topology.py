"""Tensor-parallel and Mamba mapping between a local worker and a remote engine (SPEC §3–4).

Pure functions of numbers: which remote ranks a local rank reads, which heads, at which byte
offsets, and how local descriptors are split between source ranks. Impossible mappings raise
`ConfigError` with the numbers in the message. Names follow vLLM's so its users recognise them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrdma.errors import ConfigError
from kvrdma.metadata import WorkerMetadata

HeadRange = tuple[int, int]  # [start, stop)


def physical_heads(rank: int, tp_size: int, total_num_kv_heads: int) -> HeadRange:
    """KV heads held by `rank` at `tp_size`: a contiguous slice, or one shared (replicated) head."""
    k = total_num_kv_heads
    if tp_size <= k:
        per = k // tp_size
        return (rank * per, (rank + 1) * per)
    head = rank * k // tp_size
    return (head, head + 1)


def check_heads_divisible(tp_size: int, total_num_kv_heads: int, who: str) -> None:
    k = total_num_kv_heads
    if k < 1:
        raise ConfigError(f"total_num_kv_heads must be >= 1, got {k}")
    if tp_size < 1:
        raise ConfigError(f"{who} tp_size must be >= 1, got {tp_size}")
    if tp_size <= k and k % tp_size:
        raise ConfigError(
            f"{who} tp_size {tp_size} does not divide total_num_kv_heads {k}: "
            "every rank must hold the same number of KV heads"
        )
    if tp_size > k and tp_size % k:
        raise ConfigError(
            f"{who} tp_size {tp_size} is not a multiple of total_num_kv_heads {k}: "
            "replicated heads must be shared by the same number of ranks"
        )


@dataclass(frozen=True)
class EngineTransferInfo:
    """What a local rank needs to know to read from one remote engine (attention only)."""

    remote_engine_id: str
    remote_tp_size: int
    remote_block_size: int
    remote_block_len: int
    remote_physical_blocks_per_logical: int
    tp_ratio: int
    block_size_ratio: int
    handshake_ranks: tuple[int, ...]
    fa_sources: tuple[int, ...]
    all_sources: tuple[int, ...]
    fa_descriptor_bytes: int

    @property
    def is_mamba(self) -> bool:
        return False


@dataclass(frozen=True)
class MambaEngineTransferInfo(EngineTransferInfo):
    """Plan for a hybrid (attention + Mamba) remote engine."""

    mamba_range: tuple[int, ...] = field(default=())
    abs_tp: int = 1

    @property
    def is_mamba(self) -> bool:
        return True


class TransferTopology:
    """The local worker's side of every TP/block-size mapping."""

    def __init__(
        self,
        *,
        tp_rank: int,
        tp_size: int,
        block_size: int,
        engine_id: str,
        is_mla: bool,
        is_mamba: bool,
        total_num_kv_heads: int,
        is_blocks_first: bool = False,
        is_cross_layer: bool = False,
    ) -> None:
        if not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        if not is_mla:
            check_heads_divisible(tp_size, total_num_kv_heads, "local")
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.block_size = block_size
        self.engine_id = engine_id
        self.is_mla = is_mla
        self.is_mamba = is_mamba
        self.total_num_kv_heads = total_num_kv_heads
        self.is_blocks_first = is_blocks_first
        self.is_cross_layer = is_cross_layer
        self._engines: dict[str, EngineTransferInfo] = {}

    # ---- ratios and ranks -------------------------------------------------------------
    def tp_ratio(self, remote_tp_size: int) -> int:
        """`Lt/Rt` when local TP >= remote TP, else `-(Rt/Lt)`; sizes must divide."""
        lt, rt = self.tp_size, remote_tp_size
        if rt < 1:
            raise ConfigError(f"remote tp_size must be >= 1, got {rt}")
        if lt >= rt:
            if lt % rt:
                raise ConfigError(
                    f"remote tp_size {rt} does not divide local tp_size {lt}; "
                    "TP sizes must divide one another"
                )
            return lt // rt
        if rt % lt:
            raise ConfigError(
                f"local tp_size {lt} does not divide remote tp_size {rt}; "
                "TP sizes must divide one another"
            )
        return -(rt // lt)

    def block_size_ratio(self, remote_block_size: int) -> int:
        """Local block size / remote block size; only a remote block size that divides it."""
        if remote_block_size < 1:
            raise ConfigError(f"remote block_size must be >= 1, got {remote_block_size}")
        if remote_block_size > self.block_size or self.block_size % remote_block_size:
            raise ConfigError(
                f"remote block_size {remote_block_size} must divide local block_size "
                f"{self.block_size} (only a smaller remote block size is supported)"
            )
        return self.block_size // remote_block_size

    def handshake_target_ranks(self, remote_tp_size: int) -> list[int]:
        ratio = self.tp_ratio(remote_tp_size)
        if ratio > 0:
            return [self.tp_rank // ratio]
        k = -ratio
        return list(range(self.tp_rank * k, self.tp_rank * k + k))

    def is_kv_replicated(self, remote_tp_size: int) -> bool:
        """The remote engine replicates KV heads (more remote ranks than heads, or MLA)."""
        return self.is_mla or remote_tp_size > self.total_num_kv_heads

    @property
    def replicates_kv_cache(self) -> bool:
        """This worker holds replicated heads (MLA, or more local ranks than heads)."""
        return self.is_mla or self.tp_size > self.total_num_kv_heads

    def local_heads(self) -> HeadRange:
        return physical_heads(self.tp_rank, self.tp_size, self.total_num_kv_heads)

    def remote_heads(self, remote_rank: int, remote_tp_size: int) -> HeadRange:
        return physical_heads(remote_rank, remote_tp_size, self.total_num_kv_heads)

    # ---- per remote engine ------------------------------------------------------------
    def register_remote_engine(
        self,
        remote_engine_id: str,
        remote_tp_size: int,
        remote_block_size: int,
        remote_block_len: int,
        remote_physical_blocks_per_logical: int,
        *,
        local_block_len: int,
        local_physical_blocks_per_logical: int = 1,
    ) -> EngineTransferInfo:
        """Validate the mapping to a remote engine and remember its plan."""
        if not self.is_mla:
            check_heads_divisible(remote_tp_size, self.total_num_kv_heads, "remote")
        ratio = self.tp_ratio(remote_tp_size)
        bs_ratio = self.block_size_ratio(remote_block_size)
        if remote_physical_blocks_per_logical != local_physical_blocks_per_logical:
            raise ConfigError(
                f"remote physical_blocks_per_logical {remote_physical_blocks_per_logical} != "
                f"local {local_physical_blocks_per_logical} (engine {remote_engine_id!r})"
            )
        if self.is_mamba and bs_ratio != 1:
            raise ConfigError(
                f"Mamba/hybrid engines need equal block sizes: local {self.block_size}, "
                f"remote {remote_block_size} (engine {remote_engine_id!r})"
            )
        if remote_block_len < 1 or local_block_len < 1:
            raise ConfigError(
                f"block lengths must be >= 1: local {local_block_len}, remote {remote_block_len}"
            )
        handshake = tuple(self.handshake_target_ranks(remote_tp_size))
        fa_sources = self._fa_sources(ratio, remote_tp_size, handshake)
        fa_bytes = min(local_block_len, remote_block_len)
        if self.is_blocks_first:
            fa_bytes //= 2
        common = dict(
            remote_engine_id=remote_engine_id,
            remote_tp_size=remote_tp_size,
            remote_block_size=remote_block_size,
            remote_block_len=remote_block_len,
            remote_physical_blocks_per_logical=remote_physical_blocks_per_logical,
            tp_ratio=ratio,
            block_size_ratio=bs_ratio,
            handshake_ranks=handshake,
            fa_sources=fa_sources,
            fa_descriptor_bytes=fa_bytes,
        )
        info: EngineTransferInfo
        if self.is_mamba:
            abs_tp = -ratio if ratio < 0 else 1
            mamba_range = handshake if ratio < 0 else ()
            if mamba_range and abs_tp > len(fa_sources):
                extra = tuple(p for p in fa_sources if p not in mamba_range)
                all_sources = mamba_range + extra
            else:
                all_sources = fa_sources
            info = MambaEngineTransferInfo(
                **common,  # type: ignore[arg-type]
                all_sources=all_sources,
                mamba_range=mamba_range,
                abs_tp=abs_tp,
            )
        else:
            info = EngineTransferInfo(**common, all_sources=fa_sources)  # type: ignore[arg-type]
        self._engines[remote_engine_id] = info
        return info

    @classmethod
    def for_worker(cls, meta: WorkerMetadata) -> TransferTopology:
        """The topology of the worker `meta` describes (its layout decides the flags)."""
        return cls(
            tp_rank=meta.tp_rank,
            tp_size=meta.tp_size,
            block_size=meta.block_size,
            engine_id=meta.engine_id,
            is_mla=meta.is_mla,
            is_mamba=meta.is_mamba,
            total_num_kv_heads=meta.total_num_kv_heads,
            is_blocks_first=meta.cache_layout in ("blocks_first", "mamba"),
            is_cross_layer=meta.cache_layout == "cross_layer",
        )

    def engine(self, remote_engine_id: str) -> EngineTransferInfo:
        try:
            return self._engines[remote_engine_id]
        except KeyError:
            raise ConfigError(
                f"remote engine {remote_engine_id!r} is not registered "
                f"(known: {sorted(self._engines)})"
            ) from None

    def _fa_sources(
        self, ratio: int, remote_tp_size: int, handshake: Sequence[int]
    ) -> tuple[int, ...]:
        if self.is_mla:
            # Every rank holds the whole latent cache: read the first handshake rank (for a
            # Mamba hybrid that is the first rank of this rank's Mamba range).
            return (handshake[0],)
        if ratio > 0:
            return (self.tp_rank // ratio,)
        need = self.local_heads()

        def scan(ranks: Sequence[int]) -> list[int]:
            seen: set[HeadRange] = set()
            out = []
            for p in ranks:
                rh = self.remote_heads(p, remote_tp_size)
                ov = (max(need[0], rh[0]), min(need[1], rh[1]))
                if ov[0] < ov[1] and ov not in seen:
                    seen.add(ov)
                    out.append(p)
            return out

        found = scan(handshake) or scan(range(remote_tp_size))
        return tuple(found)

    def target_remote_ranks(self, remote_engine_id: str) -> list[int]:
        """Remote ranks this rank reads any bytes from."""
        return list(self.engine(remote_engine_id).all_sources)

    def fa_head_slot(self, remote_engine_id: str, remote_rank: int) -> int:
        """Index of `remote_rank`'s chunk inside a local attention descriptor."""
        info = self.engine(remote_engine_id)
        if remote_rank in info.fa_sources:
            return info.fa_sources.index(remote_rank)
        rh = self.remote_heads(remote_rank, info.remote_tp_size)
        for slot, p in enumerate(info.fa_sources):
            ph = self.remote_heads(p, info.remote_tp_size)
            if max(rh[0], ph[0]) < min(rh[1], ph[1]):
                return slot
        return 0

    def fa_rank_offset(self, remote_engine_id: str, remote_kv_block_len: int) -> int:
        """Byte offset of this rank's heads inside a remote attention block (or K/V half)."""
        info = self.engine(remote_engine_id)
        ratio = info.tp_ratio
        if self.is_mla or ratio <= 0:
            return 0
        k = self.total_num_kv_heads
        if self.tp_size > k:
            p0 = info.fa_sources[0]
            heads = self.tp_rank * k // self.tp_size - p0 * k // info.remote_tp_size
            return heads * remote_kv_block_len
        return (self.tp_rank % ratio) * remote_kv_block_len

    def needs_split_handles(self, remote_engine_id: str) -> bool:
        info = self.engine(remote_engine_id)
        return info.tp_ratio < 0 and not self.is_mla and len(info.all_sources) > 1

    def compute_split_handle_data(
        self,
        remote_engine_id: str,
        local_descs: Sequence[tuple[int, int]],
        num_fa_descs: int,
    ) -> dict[int, list[tuple[int, int]]]:
        """Split each local (addr, len) descriptor into the chunk each source rank fills.

        The first `num_fa_descs` are attention descriptors, split by head slot over the FA
        reads; the rest are Mamba descriptors, split evenly over the Mamba range.
        """
        info = self.engine(remote_engine_id)
        fa_reads = len(info.fa_sources)
        abs_tp = info.abs_tp if isinstance(info, MambaEngineTransferInfo) else 1
        out: dict[int, list[tuple[int, int]]] = {}
        for i, p in enumerate(info.all_sources):
            slot = self.fa_head_slot(remote_engine_id, p)
            descs = []
            for j, (addr, length) in enumerate(local_descs):
                if j < num_fa_descs:
                    if length % fa_reads:
                        raise ConfigError(
                            f"attention descriptor of {length} bytes does not split into "
                            f"{fa_reads} head chunks"
                        )
                    chunk = length // fa_reads
                    descs.append((addr + slot * chunk, chunk))
                else:
                    if length % abs_tp:
                        raise ConfigError(
                            f"Mamba descriptor of {length} bytes does not split into "
                            f"{abs_tp} rank chunks"
                        )
                    chunk = length // abs_tp
                    descs.append((addr + i * chunk, chunk))
            out[p] = descs
        return out

    def filter_block_ids_for_rank(
        self,
        remote_engine_id: str,
        remote_rank: int,
        block_id_groups: Sequence[Sequence[int]],
        is_mamba_group: Sequence[bool] | None = None,
    ) -> list[list[int]]:
        """A rank that is not an FA source reads no attention blocks: empty those groups."""
        info = self.engine(remote_engine_id)
        if remote_rank in info.fa_sources:
            return [list(g) for g in block_id_groups]
        flags = (
            [bool(m) for m in is_mamba_group]
            if is_mamba_group is not None
            else [False] * len(block_id_groups)
        )
        return [list(g) if m else [] for g, m in zip(block_id_groups, flags, strict=True)]

    def describe(self) -> str:
        lines = [
            f"engine {self.engine_id!r} rank {self.tp_rank}/{self.tp_size} block_size "
            f"{self.block_size} kv_heads {self.total_num_kv_heads}"
            f"{' mla' if self.is_mla else ''}{' mamba' if self.is_mamba else ''}"
            f"{' blocks-first' if self.is_blocks_first else ''}"
            f"{' cross-layer' if self.is_cross_layer else ''}"
            + ("" if self.is_mla else f" heads {list(range(*self.local_heads()))}")
        ]
        for eid, info in self._engines.items():
            lines.append(
                f"  <- {eid!r}: tp {info.remote_tp_size} ratio {info.tp_ratio} "
                f"block_size_ratio {info.block_size_ratio} handshake {list(info.handshake_ranks)} "
                f"fa_sources {list(info.fa_sources)} all_sources {list(info.all_sources)}"
            )
        return "\n".join(lines)
