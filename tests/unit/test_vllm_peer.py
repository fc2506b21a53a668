"""kvrdma.handshake.vllm_peer: telling vLLM's NixlConnector side channel and kvrdma's apart."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrdma.handshake import vllm_peer
from kvrdma.handshake.wire import MetadataRequest, server_codec

pack = msgspec.msgpack.encode


@pytest.mark.parametrize(
    ("payload", "tag"),
    [
        (pack((b"get_meta_msg", 0, 0)), b"get_meta_msg"),  # vLLM's decoder, as it encodes it
        (pack((b"get_meta_msg", 1, 7)), b"get_meta_msg"),
        (vllm_peer.PROBE_FRAMES[1], b"kvrdma_probe"),
        (pack((b"other_msg", 0, 0)), None),
        (pack(("get_meta_msg", 0, 0)), None),  # a str, not vLLM's bytes
        (pack((b"get_meta_msg", 0)), None),
        (pack((b"get_meta_msg", 0, 0, 0)), None),
        (pack((b"get_meta_msg", -1.5, 0)), None),
        (pack({"a": 1, "b": 2, "c": 3}), None),
        (server_codec().encode(MetadataRequest(engine_id="e", ranks=[0])), None),
        (b"", None),
        (b"\x93", None),
        (pack((b"get_meta_msg" * 10, 0, 0)), None),  # longer than any vLLM request
    ],
)
def test_parse_request_recognises_only_vllm_shaped_requests(
    payload: bytes, tag: bytes | None
) -> None:
    assert vllm_peer.parse_request(payload) == tag


@given(st.binary(max_size=80))
def test_parse_request_never_raises(payload: bytes) -> None:
    assert vllm_peer.parse_request(payload) in (None, b"get_meta_msg", b"kvrdma_probe")


def test_answer_is_what_vllms_decoder_reads_and_names_kvrdma() -> None:
    payload, stamp = vllm_peer.answer_frames()
    decoded = msgspec.msgpack.decode(payload)
    assert decoded == {"compatibility_hash": vllm_peer.KVRDMA_HASH, "agent_metadata_bytes": b""}
    assert "not a vLLM NixlConnector" in decoded["compatibility_hash"]
    assert isinstance(msgspec.msgpack.decode(stamp), float)


VLLM_ANSWER = pack({"compatibility_hash": "f" * 64, "agent_metadata_bytes": b"md"})


@pytest.mark.parametrize(
    ("parts", "kind"),
    [
        ([b"", *vllm_peer.answer_frames()], "kvrdma"),
        ([b"", b"an ErrorReply from a kvrdma agent that predates the probe"], "kvrdma"),
        ([b"", VLLM_ANSWER, pack(1.5)], "vllm"),
        ([b"", b"\xc1", pack(1.5)], "unknown"),
        ([b"", pack([1, 2]), pack(1.5)], "unknown"),
        ([VLLM_ANSWER, pack(1.5)], "unknown"),
        ([b"x", VLLM_ANSWER, pack(1.5)], "unknown"),
        ([b"only-one-frame"], "unknown"),
        # a field nested past the decoder's depth limit
        ([b"", b"\x81\xa1x" + b"\x91" * 3000 + b"\xc0", pack(1.5)], "unknown"),
    ],
)
def test_probe_reply_kind(parts: list[bytes], kind: str) -> None:
    assert vllm_peer.probe_reply_kind(parts) == kind
