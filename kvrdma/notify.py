"""Notifications D → P: "done reading request X" and "still coming for request X" (heartbeat).

Carried by NIXL's notification channel as a small msgpack array; P decodes them with one
typed decoder and never trusts them (a malformed one is counted, not a crash).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvrdma.errors import MALFORMED

NOTIF_VERSION = 1


class Notif(msgspec.Struct, frozen=True, array_like=True, tag="kvrdma.n"):
    """`kind` done: this D rank finished reading `request_id`; `expected` is how many D ranks
    will each send one (P frees the blocks when that many arrived). heartbeat: renew the lease."""

    version: int
    kind: Literal["done", "heartbeat"]
    request_id: str
    expected: int
    sender_engine: str
    sender_rank: int


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Notif)
MAX_NOTIF_BYTES = 4096
# the longest request id a notification names: with an engine id it fits `MAX_NOTIF_BYTES`
MAX_REQUEST_ID_BYTES = 1024


def encode(
    kind: Literal["done", "heartbeat"],
    request_id: str,
    *,
    expected: int,
    sender_engine: str,
    sender_rank: int,
) -> bytes:
    return _ENCODER.encode(
        Notif(NOTIF_VERSION, kind, request_id, expected, sender_engine, sender_rank)
    )


def decode(data: bytes) -> Notif | None:
    """The notification, or None if `data` is not one of ours (caller counts it)."""
    if len(data) > MAX_NOTIF_BYTES:
        return None
    try:
        n = _DECODER.decode(data)
    except MALFORMED:
        return None
    if n.version != NOTIF_VERSION or n.expected < 1 or not n.request_id:
        return None
    return n
