"""The notifications of push mode, carried by NIXL's notification channel like `kvrdma.notify`.

D → P: `Expect` ("write request X into these blocks of mine", with this D rank's metadata, so
the producer needs no handshake with the decoder) and `Abort` ("stop writing request X").
P → D: `Segment` ("part k of n of request X has landed": NIXL delivers a WRITE's notification
after its data) and `Ended` ("nothing more of request X will land from me", and why).
Every message is decoded with one typed decoder and never trusted: a malformed one is None.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec

from kvrdma.errors import MALFORMED
from kvrdma.metadata import WorkerMetadata

PUSH_VERSION = 1
# an Expect carries block ids and a rank's metadata (regions and agent blob)
MAX_PUSH_BYTES = 1 << 20
# every push message starts with a fixarray byte and a fixstr byte, then its tag
_TAG_PREFIX = b"kvrdma.p"


class Expect(msgspec.Struct, frozen=True, array_like=True, tag="kvrdma.px"):
    """D rank `decoder.tp_rank` expects `request_id` (the producer's id) in `block_ids` (its
    own, logical) under `decoder_request_id` (its id with a suffix unique to this
    expectation, echoed in `Segment`/`Ended`), for `deadline` seconds from when it asked;
    `expected` decoder ranks send the producer rank one each (as many as pull's "done")."""

    version: int
    request_id: str
    decoder_request_id: str
    block_ids: list[int]
    deadline: float
    expected: int
    decoder: WorkerMetadata
    # which of the request's producer blocks go into `block_ids` (None: its last ones in
    # order, as many as `block_ids` hold: the decoder's prefix-cache hit covers the first)
    producer_block_ids: list[int] | None = None
    # sha256 of the agent metadata of the decoder rank's agents that retirements replaced:
    # an Expect that comes from one of them later than this one is stale
    replaced: list[str] = []


class Abort(msgspec.Struct, frozen=True, array_like=True, tag="kvrdma.pa"):
    """D rank `decoder_rank` of `decoder_engine` gave up on `request_id` (its
    `decoder_request_id`): stop writing to it and answer with `Ended` once nothing more can
    land."""

    version: int
    request_id: str
    decoder_request_id: str
    decoder_engine: str
    decoder_rank: int
    reason: str


class Segment(msgspec.Struct, frozen=True, array_like=True, tag="kvrdma.ps"):
    """Segment `index` of `count` of the decoder's `request_id` landed from `sender_rank`."""

    version: int
    request_id: str
    sender_engine: str
    sender_rank: int
    index: int
    count: int


class Ended(msgspec.Struct, frozen=True, array_like=True, tag="kvrdma.pe"):
    """No byte of the decoder's `request_id` lands from `sender_rank` any more; `reason` says
    why it stopped short (aborted, failed, lease over)."""

    version: int
    request_id: str
    sender_engine: str
    sender_rank: int
    reason: str


PushMessage = Expect | Abort | Segment | Ended
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(PushMessage)


def is_push(data: bytes) -> bool:
    """Whether `data` claims to be a push message (the rest are pull notifications)."""
    return data[2:10] == _TAG_PREFIX


def encode(message: PushMessage) -> bytes:
    return _ENCODER.encode(message)


def decode(data: bytes) -> PushMessage | None:
    """The message, or None if `data` is not a valid one (the caller counts it)."""
    if len(data) > MAX_PUSH_BYTES:
        return None
    try:
        m = _DECODER.decode(data)
    except MALFORMED:
        return None
    if m.version != PUSH_VERSION or not m.request_id:
        return None
    if isinstance(m, Segment) and not 0 <= m.index < m.count:
        return None
    if isinstance(m, Expect) and (
        not m.deadline > 0
        or m.expected < 1
        or any(b < 0 for b in m.block_ids)
        or any(b < 0 for b in m.producer_block_ids or ())
        or not m.decoder_request_id
    ):
        return None
    return m


def route(
    notifs: Mapping[str, list[bytes]],
    producer: Callable[[Expect | Abort], None] | None,
    decoder: Callable[[Segment | Ended], None] | None,
) -> tuple[dict[str, list[bytes]], list[str]]:
    """Hand each push message to its side (None: the worker lacks that role), in order.
    Returns the other (pull) notifications by agent, and the agents of push messages no side
    took: malformed, or for a role the worker lacks."""
    rest: dict[str, list[bytes]] = {}
    stray: list[str] = []
    for agent, msgs in notifs.items():
        for m in msgs:
            if not is_push(m):
                rest.setdefault(agent, []).append(m)
                continue
            msg = decode(m)
            if isinstance(msg, Expect | Abort) and producer is not None:
                producer(msg)
            elif isinstance(msg, Segment | Ended) and decoder is not None:
                decoder(msg)
            else:
                stray.append(agent)
    return rest, stray
