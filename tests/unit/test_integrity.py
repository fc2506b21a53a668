"""The integrity mode's pure parts: the checksum math, the chunk sizes, and how a data row a
decoder reads maps onto the rows of the producer's checksum table."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrdma.errors import ConfigError
from kvrdma.integrity import _checksum_row, _published, checksums, chunk_bytes, table_layout
from kvrdma.metadata import RegionMeta, WorkerMetadata


def meta(regions: list[RegionMeta], **over: Any) -> WorkerMetadata:
    fields: dict[str, Any] = {
        "engine_id": "P",
        "agent_name": "P-tp0",
        "agent_metadata": b"",
        "tp_rank": 0,
        "tp_size": 1,
        "block_size": 16,
        "num_blocks": 10,
        "cache_layout": "split_kv",
        "total_num_kv_heads": 4,
        "head_dim": 8,
        "dtype": "float16",
        "element_size": 2,
        "regions": regions,
        **over,
    }
    return WorkerMetadata(**fields)


@settings(max_examples=200, deadline=None)
@given(
    chunk=st.sampled_from([1, 2, 3, 4, 6, 8, 24, 256]),
    rows=st.integers(1, 4),
    data=st.data(),
)
def test_any_single_byte_change_changes_exactly_its_chunks_checksum(
    chunk: int, rows: int, data: st.DataObject
) -> None:
    raw = data.draw(st.binary(min_size=chunk * rows, max_size=chunk * rows))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(rows, chunk).clone()
    before = checksums(t)
    row, col = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, chunk - 1))
    t[row, col] ^= data.draw(st.integers(1, 255))
    after = checksums(t)
    changed = (before != after).nonzero().flatten().tolist()
    assert changed == [row]


def test_checksums_depend_on_position_and_are_stable() -> None:
    a = torch.zeros(2, 16, dtype=torch.uint8)
    a[0, 0], a[1, 8] = 1, 1  # the same word value at another position
    s = checksums(a)
    assert s[0] != s[1]
    assert torch.equal(checksums(a.clone()), s)  # same bytes, same sums (no hidden state)
    assert checksums(torch.zeros(3, 8, dtype=torch.uint8)).tolist() == [0, 0, 0]


def _reference(chunk: bytes) -> int:
    """The documented checksum in plain integers: the chunk's words (the widest of 8, 4, 2,
    1 bytes dividing it, little-endian, signed but bytes) times splitmix64 odd weights,
    summed modulo 2**64, as a signed 64-bit value."""
    m = (1 << 64) - 1
    w = next(w for w in (8, 4, 2, 1) if len(chunk) % w == 0)
    total = 0
    for i in range(len(chunk) // w):
        word = int.from_bytes(chunk[i * w : (i + 1) * w], "little", signed=w > 1)
        z = ((i + 1) * 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        total += word * ((z ^ (z >> 31)) | 1)
    total &= m
    return total - (1 << 64) if total >> 63 else total


@settings(max_examples=100, deadline=None)
@given(chunk=st.sampled_from([1, 2, 3, 4, 6, 8, 24, 256, 4096]), rows=st.integers(1, 3),
       fill=st.sampled_from(["random", "ones"]), data=st.data())  # fmt: skip
def test_checksums_are_the_documented_sums_so_producer_and_decoder_of_any_version_agree(
    chunk: int, rows: int, fill: str, data: st.DataObject
) -> None:
    # all-0xFF bytes make every product and the sum wrap around 2**64
    size = chunk * rows
    raw = b"\xff" * size if fill == "ones" else data.draw(st.binary(min_size=size, max_size=size))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(rows, chunk)
    want = [_reference(raw[r * chunk : (r + 1) * chunk]) for r in range(rows)]
    assert checksums(t).tolist() == want


def test_checksums_refuse_other_shapes_and_types() -> None:
    with pytest.raises(ValueError, match="2-D uint8"):
        checksums(torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="2-D uint8"):
        checksums(torch.zeros(2, 8, dtype=torch.float32))


@pytest.mark.parametrize(
    ("region", "over", "chunk"),
    [
        # split K/V, 4 heads of 16 tokens x 8 x fp16: one head = 256 bytes
        (RegionMeta(0, 10, 1024), {}, 256),
        # blocks-first K|V: one head of one fragment
        (RegionMeta(0, 10, 2048, fragments=2), {}, 256),
        # 2 of 4 heads on this rank (tp 2)
        (RegionMeta(0, 10, 512), {"tp_size": 2, "tp_rank": 1}, 256),
        (RegionMeta(0, 10, 384, kind="mla"), {"cache_layout": "mla"}, 384),
        # a Mamba state: at most 64 parts, always a power-of-two part of it
        (RegionMeta(0, 10, 4096, kind="mamba"), {}, 64),
        (RegionMeta(0, 10, 96, kind="mamba"), {}, 3),
    ],
)
def test_chunk_divides_every_slice_a_reader_takes(
    region: RegionMeta, over: dict[str, Any], chunk: int
) -> None:
    assert chunk_bytes(meta([region], **over), region) == chunk


def test_the_table_puts_each_blocks_checksums_of_every_region_side_by_side() -> None:
    regions = [
        RegionMeta(0, 10, 1024),
        RegionMeta(1 << 20, 10, 96, kind="mamba"),
        RegionMeta(2 << 20, 5, 512),  # another block count: rows of its own after the rest
    ]
    # 4 + 32 words per block for the first two, from word 10 * 36 the third's 2 per block
    assert table_layout(regions, [256, 3, 256]) == [(0, 36), (4, 36), (360, 2)]


def row_of(m: WorkerMetadata, rrow: list[int]) -> tuple[list[int], int]:
    return _checksum_row(m, rrow, *_published(m))


def test_a_head_slice_maps_to_the_checksums_of_exactly_those_heads() -> None:
    regions = [RegionMeta(0x1000, 10, 2048, fragments=2), RegionMeta(0x100000, 10, 2048)]
    layout = [[0, 12], [8, 12]]  # 8 + 4 words per block
    m = meta(
        regions, checksum_table_addr=0x9000, checksum_layout=layout, checksum_chunks=[256, 512]
    )
    # region 1, fragment 0, heads 2..3 (512 bytes at 512), every block
    assert row_of(m, [0x100000 + 512, 512, 0, 2048, 10]) == (
        [0x9000 + 9 * 8, 8, 0, 12 * 8, 10],
        512,
    )
    # region 0, fragment 1, head 1 of block 0; the same from block 2 on
    assert row_of(m, [0x1000 + 1024 + 256, 256, 0, 2048, 10])[0] == [0x9000 + 5 * 8, 8, 0, 96, 10]
    row, _ = row_of(m, [0x1000 + 2 * 2048 + 1024 + 256, 256, 0, 2048, 8])
    assert row == [0x9000 + (2 * 12 + 5) * 8, 8, 0, 96, 8]


def test_a_table_published_region_after_region_is_still_read() -> None:
    regions = [RegionMeta(0x1000, 10, 2048, fragments=2), RegionMeta(0x100000, 10, 2048)]
    m = meta(regions, checksum_addr=0x9000, checksum_chunks=[256, 512])
    row, g = row_of(m, [0x100000 + 512, 512, 0, 2048, 10])
    assert g == 512
    first = 0x9000 + (10 * 2048 // 256) * 8  # region 1's rows follow region 0's
    assert row == [first + 1 * 8, 1 * 8, 0, 4 * 8, 10]
    row, _ = row_of(m, [0x1000 + 1024 + 256, 256, 0, 2048, 10])  # fragment 1, head 1
    assert row == [0x9000 + 5 * 8, 8, 0, 8 * 8, 10]


def test_a_read_across_chunks_or_outside_the_regions_is_refused() -> None:
    m = meta(
        [RegionMeta(0x1000, 10, 1024)],
        checksum_table_addr=0x9000,
        checksum_layout=[[0, 8]],  # room for another region's 4 words per block
        checksum_chunks=[256],
    )
    with pytest.raises(ConfigError, match=r"region 0 of engine 'P' rank 0 .* chunk of 256"):
        row_of(m, [0x1000 + 128, 256, 0, 1024, 10])
    with pytest.raises(ConfigError, match="remote address 0x10 is in no region of engine 'P'"):
        row_of(m, [0x10, 256, 0, 1024, 10])
    with pytest.raises(ConfigError, match="rank 0 is not within whole blocks"):
        row_of(m, [0x1000 + 768, 512, 0, 1024, 10])  # across a block's end
    with pytest.raises(ConfigError, match="rank 0 is not within whole blocks"):
        row_of(m, [0x1000, 256, 0, 512, 10])  # half-block steps


def test_a_producer_without_the_mode_is_refused_with_the_remedy() -> None:
    plain = meta([RegionMeta(0x1000, 10, 1024)])
    with pytest.raises(ConfigError, match=r"no checksum table.*on the producer too"):
        _published(plain)
    odd = meta([RegionMeta(0x1000, 10, 1024)], checksum_addr=0x9000, checksum_chunks=[300])
    with pytest.raises(ConfigError, match="region 0: checksum chunk 300 does not divide"):
        _published(odd)


@pytest.mark.parametrize("layout", [[], [[0]], [[-1, 4]], [[0, 3]]])
def test_a_checksum_layout_that_does_not_fit_the_regions_is_refused(layout: Any) -> None:
    m = meta(
        [RegionMeta(0x1000, 10, 1024)],
        checksum_table_addr=0x9000,
        checksum_layout=layout,
        checksum_chunks=[256],
    )
    with pytest.raises(ConfigError, match=r"region 0: checksum layout .* per block >= 4\]"):
        _published(m)
