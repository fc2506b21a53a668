"""`kvrdma.push.wire`: any bytes a peer sends decode to a push message or None, never raise."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrdma.push import wire

SEGMENT = wire.encode(wire.Segment(wire.PUSH_VERSION, "r", "P", 0, 0, 1))


def test_a_field_nested_past_the_decoders_depth_limit_is_no_message() -> None:
    nested = bytes([SEGMENT[0] + 1]) + SEGMENT[1:] + b"\x91" * 3000 + b"\xc0"
    assert wire.decode(nested) is None
    shallow = bytes([SEGMENT[0] + 1]) + SEGMENT[1:] + b"\x91" * 10 + b"\xc0"
    assert wire.decode(shallow) == wire.decode(SEGMENT)  # later fields are skipped


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 4000))
def test_any_bytes_after_a_push_prefix_decode_or_are_none(tail: bytes, depth: int) -> None:
    data = SEGMENT[:10] + b"\x91" * depth + tail
    assert wire.is_push(data)
    assert wire.decode(data) is None or isinstance(wire.decode(data), wire.PushMessage)
