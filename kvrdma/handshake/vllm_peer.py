"""Recognise vLLM 0.32's NixlConnector side channel, so neither side harms the other.

vLLM's decoder sends, on a REQ socket, the msgpack array ``[b"get_meta_msg", pp, tp]`` and
expects two frames back: a msgpack map ``{compatibility_hash, agent_metadata_bytes}`` and a
msgpack float. vLLM's listener (a ROUTER) dies on any message that is not an empty delimiter
plus such a 3-array naming a (pp, tp) it serves, so a kvrdma client first sends a probe that
listener answers like any decoder: ``[b"kvrdma_probe", 0, 0]`` after an empty delimiter. A
kvrdma server answers probes, and vLLM's own requests, in vLLM's two-frame shape with a
compatibility hash that names kvrdma: vLLM's decoder then fails with its own mismatch error.
"""

from __future__ import annotations

import time
from typing import Final, Literal

import msgspec

from kvrdma.errors import MALFORMED

__all__ = [
    "KVRDMA_HASH",
    "PROBE_FRAMES",
    "VLLM_GET_META",
    "answer_frames",
    "parse_request",
    "probe_reply_kind",
]

VLLM_GET_META: Final = b"get_meta_msg"
KVRDMA_PROBE: Final = b"kvrdma_probe"
# The compatibility hash a kvrdma server answers with: vLLM shows it in its mismatch error.
KVRDMA_HASH: Final = (
    "kvrdma-agent (this side channel is a kvrdma agent, not a vLLM NixlConnector; run "
    "kv_connector KvrdmaConnector with kv_connector_module_path kvrdma.vllm on both sides)"
)
PROBE_FRAMES: Final = [b"", msgspec.msgpack.encode([KVRDMA_PROBE, 0, 0])]

_TRIPLE_MAX_BYTES = 64  # vLLM's request is ~20 bytes: anything larger is not one
_FIXARRAY_3 = 0x93


class _Payload(msgspec.Struct):
    """vLLM's `NixlHandshakePayload` as it travels: the fields a probe looks at."""

    compatibility_hash: str
    agent_metadata_bytes: bytes = b""


_PAYLOAD = msgspec.msgpack.Decoder(_Payload)
_TRIPLE = msgspec.msgpack.Decoder(tuple[bytes, int, int])


def parse_request(payload: bytes) -> bytes | None:
    """The tag of a vLLM-shaped ``[tag, pp, tp]`` request (vLLM's or kvrdma's probe), else None."""
    if not payload or len(payload) > _TRIPLE_MAX_BYTES or payload[0] != _FIXARRAY_3:
        return None
    try:
        tag, _, _ = _TRIPLE.decode(payload)
    except MALFORMED:
        return None
    return tag if tag in (VLLM_GET_META, KVRDMA_PROBE) else None


def answer_frames() -> list[bytes]:
    """A kvrdma server's reply to a vLLM-shaped request: vLLM's two frames, kvrdma's hash."""
    payload = msgspec.msgpack.encode(
        {"compatibility_hash": KVRDMA_HASH, "agent_metadata_bytes": b""}
    )
    return [payload, msgspec.msgpack.encode(time.perf_counter())]


def probe_reply_kind(parts: list[bytes]) -> Literal["kvrdma", "vllm", "unknown"]:
    """Who answered a probe, from the frames a DEALER received.

    A kvrdma server answers ``[b"", payload, ts]`` with `KVRDMA_HASH`, or (one that predates
    the probe) ``[b"", error]``; vLLM's listener answers ``[b"", payload, ts]`` with its own
    hash.
    """
    if len(parts) == 2 and parts[0] == b"":
        return "kvrdma"
    if len(parts) != 3 or parts[0] != b"":
        return "unknown"
    try:
        answer = _PAYLOAD.decode(parts[1])
    except MALFORMED:
        return "unknown"
    return "kvrdma" if answer.compatibility_hash == KVRDMA_HASH else "vllm"
