"""What a handshake server keeps per published rank, and the checks a rank passes to get there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvrdma.handshake.wire import (
    MAX_ENGINE_ID_LENGTH,
    Codec,
    MetadataResponse,
    ProtocolViolation,
    RankDescriptors,
    descriptor_spans,
    worker_problems,
)
from kvrdma.metadata import WorkerMetadata

__all__ = ["Entry", "servable_entry"]


@dataclass(frozen=True)
class Entry:
    """One published rank: its metadata, its descriptor table and its share of a reply."""

    meta: WorkerMetadata
    descriptors: RankDescriptors
    size: int  # bytes this rank adds to a reply
    expires: float | None = None  # the server clock's time it stops being served (None: never)


def servable_entry(
    meta: WorkerMetadata, *, codec: Codec[Any], max_frame: int, engine_id: str | None
) -> Entry:
    """`meta` as an entry every later reply can carry; a `ProtocolViolation` says why not.

    `engine_id` is the one engine the server serves (None: any); `codec` encodes its replies,
    which may not exceed `max_frame` bytes.
    """
    engine = str(meta.engine_id)[:MAX_ENGINE_ID_LENGTH]
    what = f"cannot publish engine {engine!r} rank {meta.tp_rank}"
    if engine_id is not None and meta.engine_id != engine_id:
        raise ProtocolViolation(
            "wrong_engine", f"{what}: this agent serves engine {engine_id!r} only"
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
