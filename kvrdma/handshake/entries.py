"""What a handshake server keeps per published rank, and the checks a rank passes to get there."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import msgspec

from kvrdma.handshake.wire import (
    MAX_ENGINE_ID_LENGTH,
    MAX_PUBLISHED_BYTES,
    Codec,
    MetadataResponse,
    ProtocolViolation,
    RankDescriptors,
    descriptor_spans,
    worker_problems,
)
from kvrdma.metadata import WorkerMetadata

__all__ = ["Entry", "hold", "servable_entry"]


@dataclass(frozen=True)
class Entry:
    """One published rank: its metadata, its descriptor table and its share of a reply."""

    meta: WorkerMetadata
    descriptors: RankDescriptors
    size: int  # bytes this rank adds to a reply
    expires: float | None = None  # the server clock's time it stops being served (None: never)


def servable_entry(
    meta: WorkerMetadata,
    *,
    codec: Codec[Any],
    max_frame: int,
    engine_id: str | None,
    dp_index: int | None = None,
) -> Entry:
    """`meta` as an entry every later reply can carry; a `ProtocolViolation` says why not.

    `engine_id` and `dp_index` are the one engine and DP rank the server serves (None: any);
    `codec` encodes its replies, which may not exceed `max_frame` bytes.
    """
    engine = str(meta.engine_id)[:MAX_ENGINE_ID_LENGTH]
    what = f"cannot publish engine {engine!r} rank {meta.tp_rank}"
    if engine_id is not None and meta.engine_id != engine_id:
        raise ProtocolViolation(
            "wrong_engine", f"{what}: this agent serves engine {engine_id!r} only"
        )
    if dp_index is not None and meta.dp_index != dp_index:
        # another DP rank's peers ask another port: held here, the rank would never be served
        raise ProtocolViolation(
            "wrong_engine",
            f"{what}: this agent serves dp_index {dp_index} only, got dp_index {meta.dp_index} "
            "(run one agent per DP rank, each with its own --publish address)",
        )
    problems = worker_problems(meta)
    if problems:
        raise ProtocolViolation("invalid_metadata", f"{what}: " + "; ".join(problems))
    try:
        descriptors = descriptor_spans(meta)
        # Encoding once here means no reply carrying this rank can fail to encode later.
        size = len(
            codec.encode(
                MetadataResponse(
                    engine_id=meta.engine_id, workers=[meta], descriptors=[descriptors]
                )
            )
        )
    except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as exc:
        raise ProtocolViolation("invalid_metadata", f"{what}: cannot be encoded: {exc}") from exc
    if size > max_frame:
        raise ProtocolViolation(
            "too_large",
            f"{what}: its reply would be {size} bytes, over the {max_frame}-byte limit",
        )
    return Entry(meta, descriptors, size)


def hold(
    ranks: dict[tuple[str, int], dict[int, Entry]], held: int, entry: Entry, expires: float | None
) -> tuple[Entry | None, int]:
    """Put `entry` (until `expires`) in `ranks`, by (engine_id, dp_index) then TP rank, where
    the entries hold `held` reply bytes; returns the entry it replaced and the bytes now held.
    A `ProtocolViolation` refuses it when that would be over `MAX_PUBLISHED_BYTES`."""
    meta = entry.meta
    engine = ranks.get((meta.engine_id, meta.dp_index), {})
    previous = engine.get(meta.tp_rank)
    held += entry.size - (0 if previous is None else previous.size)
    if held > MAX_PUBLISHED_BYTES:
        raise ProtocolViolation(
            "too_large",
            f"cannot publish engine {meta.engine_id!r} rank {meta.tp_rank}: the ranks published "
            f"here would hold {held} bytes, over the {MAX_PUBLISHED_BYTES} bytes a server holds "
            "(unpublish the ranks no longer served)",
        )
    ranks[(meta.engine_id, meta.dp_index)] = engine
    engine[meta.tp_rank] = replace(entry, expires=expires)
    return previous, held
