"""Wire protocol: round trips, tagged-union dispatch, and ProtocolError for bad peer bytes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrdma.errors import ProtocolError
from kvrdma.handshake.wire import (
    MAX_RANKS_PER_REQUEST,
    PROTOCOL_VERSION,
    DescriptorSpan,
    ErrorReply,
    MetadataRequest,
    MetadataResponse,
    ProtocolViolation,
    PublishAck,
    PublishRequest,
    UnpublishRequest,
    client_codec,
    descriptor_spans,
    publish_client_codec,
    publish_server_codec,
    server_codec,
    with_checksum,
    worker_problems,
)
from kvrdma.metadata import RegionMeta, WorkerMetadata, sha256_hex
from kvrdma.testing import worker_metadata

pytestmark = pytest.mark.timeout(60)


def worker(
    rank: int = 0,
    tp: int = 2,
    *,
    layout: str = "split_kv",
    regions: list[RegionMeta] | None = None,
    blob: bytes = b"nixl-agent-metadata",
) -> WorkerMetadata:
    regions = regions or [RegionMeta(0x1000_0000 * (i + 1), 10, 4096) for i in range(4)]
    fields = {"cache_layout": layout, "regions": regions, "compat_hash": "c" * 64}
    return worker_metadata("prefill-0", rank, tp, num_blocks=10, agent_metadata=blob, **fields)


def raw(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def request_dict(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "type": "metadata_request",
        "version": PROTOCOL_VERSION,
        "engine_id": "prefill-0",
        "ranks": [0, 1],
    }
    base.update(overrides)
    return base


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize(
    ("codec_of_receiver", "msg"),
    [
        (
            server_codec,
            MetadataRequest(
                engine_id="e",
                ranks=[3, 1],
                dp_index=2,
                requester="decode-0/rank1",
                compat_hash="ab" * 32,
                tp_size=4,
                block_size=32,
            ),
        ),
        (
            client_codec,
            MetadataResponse(
                engine_id="prefill-0",
                workers=[worker(0), worker(1)],
                descriptors=[descriptor_spans(worker(0)), descriptor_spans(worker(1))],
            ),
        ),
        (client_codec, ErrorReply(code="unknown_rank", message="rank 3 not published")),
        (publish_server_codec, PublishRequest(worker=worker(1))),
        (publish_server_codec, UnpublishRequest(engine_id="e", tp_rank=1, dp_index=1)),
        (
            publish_client_codec,
            PublishAck(engine_id="e", tp_rank=1, dp_index=0, published_ranks=[0, 1]),
        ),
        (publish_client_codec, ErrorReply(code="invalid_metadata", message="bad")),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, msgspec.Struct) else v.__name__,
)
def test_round_trip(codec_of_receiver: Callable[[], Any], msg: msgspec.Struct) -> None:
    codec = codec_of_receiver()
    decoded = codec.decode(codec.encode(msg), "test")
    assert decoded == msg
    assert type(decoded) is type(msg)


def test_tag_then_version_lead_every_message() -> None:
    for msg in (
        MetadataRequest(engine_id="e", ranks=[0]),
        ErrorReply(code="internal", message="x"),
        PublishAck(engine_id="e", tp_rank=0),
    ):
        keys = list(msgspec.msgpack.decode(server_codec().encode(msg)))
        assert keys[:2] == ["type", "version"], keys
        assert msg.version == PROTOCOL_VERSION


def test_tagged_union_dispatches_on_type() -> None:
    codec = client_codec()
    err = codec.decode(raw({"type": "error", "version": 1, "code": "x", "message": "m"}))
    assert isinstance(err, ErrorReply)
    resp = codec.decode(raw({"type": "metadata_response", "engine_id": "e", "workers": []}))
    assert isinstance(resp, MetadataResponse)
    assert resp.version == PROTOCOL_VERSION
    pub = publish_server_codec().decode(
        raw({"type": "unpublish", "version": 1, "engine_id": "e", "tp_rank": 2})
    )
    assert pub == UnpublishRequest(engine_id="e", tp_rank=2)


def test_later_fields_unknown_to_us_are_ignored() -> None:
    # Schema evolution: a same-version peer that appended a field is still understood.
    msg = server_codec().decode(raw(request_dict(future_field=[1, 2, 3])))
    assert msg.ranks == [0, 1]


# ---------------------------------------------------------------------------- errors
def test_wrong_message_type_names_expected_and_received() -> None:
    with pytest.raises(ProtocolError) as info:
        server_codec().decode(raw({"type": "publish", "version": 1}), "peer X")
    text = str(info.value)
    assert "expected a metadata_request message" in text
    assert "'publish'" in text or "`publish`" in text
    assert "peer X" in text


@pytest.mark.parametrize("version", [0, 2, 99, -1])
def test_wrong_version_is_named(version: int) -> None:
    with pytest.raises(ProtocolViolation) as info:
        server_codec().decode(raw(request_dict(version=version)), "peer")
    assert info.value.code == "bad_version"
    assert f"got version {version}" in str(info.value)
    assert f"{PROTOCOL_VERSION}" in str(info.value)


def test_wrong_version_explains_even_when_fields_changed() -> None:
    # A v2 message whose fields we cannot decode is reported as a version problem.
    frame = raw({"type": "metadata_request", "version": 2, "engine": 7})
    with pytest.raises(ProtocolViolation) as info:
        server_codec().decode(frame)
    assert info.value.code == "bad_version"


@pytest.mark.parametrize(
    ("overrides", "where"),
    [
        ({"ranks": "0"}, "$.ranks"),
        ({"ranks": [0, "1"]}, "$.ranks[1]"),
        ({"ranks": [-1]}, "$.ranks[0]"),
        ({"ranks": []}, "$.ranks"),
        ({"ranks": list(range(MAX_RANKS_PER_REQUEST + 1))}, "$.ranks"),
        ({"engine_id": 5}, "$.engine_id"),
        ({"engine_id": ""}, "$.engine_id"),
        ({"engine_id": "x" * 1000}, "$.engine_id"),
        ({"version": "1"}, "$.version"),
        ({"tp_size": 0}, "$.tp_size"),
        ({"dp_index": 1.5}, "$.dp_index"),
    ],
)
def test_wrong_field_types_name_the_field(overrides: dict[str, object], where: str) -> None:
    with pytest.raises(ProtocolViolation) as info:
        server_codec().decode(raw(request_dict(**overrides)), "10.0.0.1")
    assert info.value.code == "bad_message"
    assert where in str(info.value)
    assert "10.0.0.1" in str(info.value)


@pytest.mark.parametrize(
    ("frame", "code", "fragment"),
    [
        (b"", "bad_frame", "empty frame"),
        (b"\xc1", "bad_message", "malformed"),
        (b"\x93\x01\x02", "bad_message", "got `array`"),
        (b"\x83\xa4type", "bad_message", "truncated"),
        (b"\x2a", "bad_message", "Expected `object`, got `int`"),
        (b"\x81\xa1z" + b"\x91" * 100_000 + b"\x01", "bad_message", "nested too deeply"),
        # a map declaring 2**32-1 entries / a bin declaring 4 GiB: refused, nothing allocated
        (b"\xdf\xff\xff\xff\xff", "bad_message", "truncated"),
        (b"\x81\xa5ranks\xc6\xff\xff\xff\xf0", "bad_message", "truncated"),
    ],
)
def test_garbage_frames(frame: bytes, code: str, fragment: str) -> None:
    with pytest.raises(ProtocolViolation) as info:
        server_codec().decode(frame)
    assert info.value.code == code
    assert fragment in str(info.value)
    assert "expected a metadata_request message" in str(info.value)


def test_frame_size_limit_is_checked_before_decoding() -> None:
    codec = server_codec(max_frame_bytes=1024)
    frame = raw(request_dict(requester="x" * 2000))
    with pytest.raises(ProtocolViolation) as info:
        codec.decode(frame)
    assert info.value.code == "bad_frame"
    assert "at most 1024 bytes" in str(info.value)
    assert f"got {len(frame)} bytes" in str(info.value)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_any_bytes_decode_or_raise_protocol_error_only(data: bytes) -> None:
    for make in (server_codec, client_codec, publish_server_codec, publish_client_codec):
        with contextlib.suppress(ProtocolError):
            make().decode(data)


@settings(max_examples=200, deadline=None)
@given(
    engine_id=st.text(min_size=1, max_size=40),
    ranks=st.lists(st.integers(0, 4096), min_size=1, max_size=16),
    dp_index=st.integers(0, 64),
    tp_size=st.integers(1, 64),
    block_size=st.integers(0, 1024),
    compat=st.text(alphabet="0123456789abcdef", max_size=64),
)
def test_request_round_trip_property(
    engine_id: str, ranks: list[int], dp_index: int, tp_size: int, block_size: int, compat: str
) -> None:
    codec = server_codec()
    msg = MetadataRequest(
        engine_id=engine_id,
        ranks=ranks,
        dp_index=dp_index,
        tp_size=tp_size,
        block_size=block_size,
        compat_hash=compat,
    )
    assert codec.decode(codec.encode(msg)) == msg


# ---------------------------------------------------------------------------- payload rules
def test_descriptor_spans_split_kv_one_row_per_region() -> None:
    w = worker()
    table = descriptor_spans(w)
    assert table.tp_rank == 0
    assert table.spans == [
        DescriptorSpan(0x1000_0000 * (i + 1), 4096, 0, 4096, 10) for i in range(4)
    ]
    # SPEC §2 reference: 4 regions, 10 blocks, block ids [1, 3] -> ids [1,3,11,13,21,23,31,33]
    ids = [r * 10 + b for r, span in enumerate(table.spans) for b in (1, 3) if b < span.count]
    assert ids == [1, 3, 11, 13, 21, 23, 31, 33]


def test_descriptor_spans_blocks_first_k_then_v_and_mamba_sizes() -> None:
    regions = [
        RegionMeta(1000, 10, 400, "attn", 2),
        RegionMeta(9000, 10, 600, "mamba", 1),
    ]
    table = descriptor_spans(worker(layout="mamba", regions=regions))
    assert table.spans == [
        DescriptorSpan(1000, 200, 0, 400, 10),
        DescriptorSpan(1200, 200, 0, 400, 10),
        DescriptorSpan(9000, 600, 0, 600, 10),
    ]
    assert table.mamba_state_sizes == [600]


def test_cross_layer_region_is_not_split() -> None:
    regions = [RegionMeta(1000, 10, 8 * 512, "attn", 8)]
    table = descriptor_spans(worker(layout="cross_layer", regions=regions))
    assert table.spans == [DescriptorSpan(1000, 4096, 0, 4096, 10)]


def test_worker_problems() -> None:
    assert worker_problems(worker()) == []
    bad_sum = msgspec.structs.replace(worker(), agent_metadata=b"corrupted")
    (problem,) = worker_problems(bad_sum)
    assert "agent_metadata_sha256" in problem
    assert sha256_hex(b"corrupted") in problem
    bad_rank = msgspec.structs.replace(worker(), tp_rank=2, tp_size=2)
    assert any("tp_rank 2" in p for p in worker_problems(bad_rank))
    bad_region = worker(regions=[RegionMeta(0, 10, 0)])
    assert any("region 0" in p for p in worker_problems(bad_region))


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"tp_size": 2**40}, f"tp_size {2**40} is over {2**20}"),  # a reader lists its ranks
        ({"mem_type": "GPU0"}, "mem_type 'GPU0' is not one of ['DRAM', 'VRAM']"),
        ({"num_blocks": 64}, "region 0 has 10 blocks, fewer than num_blocks 64"),
    ],
)
def test_worker_problems_name_what_a_reader_could_not_use(fields: dict, named: str) -> None:
    assert named in worker_problems(msgspec.structs.replace(worker(), **fields))


def test_with_checksum_fills_only_when_empty() -> None:
    unsummed = msgspec.structs.replace(worker(), agent_metadata_sha256="")
    assert with_checksum(unsummed).agent_metadata_sha256 == sha256_hex(b"nixl-agent-metadata")
    wrong = msgspec.structs.replace(worker(), agent_metadata_sha256="0" * 64)
    assert with_checksum(wrong) is wrong
