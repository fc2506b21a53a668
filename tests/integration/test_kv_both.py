"""Workers with both roles, and the agent a worker reads through (real NIXL, one process).

A `kv_both` worker reads through a second NIXL agent of its own, so retiring it after a
read deadline never touches the published agent peers read from; a `kv_consumer` worker
reads through its only agent, and its metadata follows a retirement.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from kvrdma.config import load_kv_transfer_config
from kvrdma.metadata import sha256_hex
from kvrdma.retirement import retire_reader
from kvrdma.testing import synthetic
from kvrdma.testing.synthetic import CacheSpec, ModelShape, fill, make_caches, verify
from kvrdma.worker import FinishedOutput, Worker

pytest.importorskip("nixl")

SHAPE = ModelShape(num_layers=2, num_kv_heads=4, head_dim=8)
BLOCKS = 16


def _worker(engine: str, role: str) -> tuple[Worker, CacheSpec, dict[str, torch.Tensor]]:
    spec = CacheSpec(SHAPE, "split_kv", "HND", 0, 1, 16, BLOCKS)
    caches, _ = make_caches(spec)
    fill(spec, caches)
    config = load_kv_transfer_config(
        {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine}, environ={}
    )
    w = Worker.create(config, tp_rank=0, tp_size=1, total_num_kv_heads=SHAPE.num_kv_heads)
    w.register_kv_caches(caches, cache_layout="split_kv", block_size=16)
    return w, spec, caches  # type: ignore[return-value]


@pytest.fixture
def both() -> Iterator[tuple[tuple[Worker, CacheSpec, dict[str, torch.Tensor]], ...]]:
    a, b = _worker("A", "kv_both"), _worker("B", "kv_both")
    try:
        yield a, b
    finally:
        a[0].close()
        b[0].close()


def _read(reader: Worker, spec: CacheSpec, caches: dict[str, torch.Tensor], source: Worker,
          rid: str) -> FinishedOutput:  # fmt: skip
    """`reader` reads source blocks 3, 9 into its blocks 0, 1 (zeroed first); both step until
    the read is reported and the source has freed the request."""
    for _, _, view in synthetic.attention_views(spec, caches):
        view[:2] = 0
    assert verify(spec, caches, [0, 1], [3, 9], 16) > 0
    source.hold(rid, [3, 9])
    reader.start_read(rid, [0, 1], [3, 9], source.metadata.engine_id)
    got, sent = FinishedOutput(), set()
    end = time.monotonic() + 10
    while rid not in got.finished_recving or rid not in sent:
        out = reader.get_finished()
        got.finished_recving |= out.finished_recving
        got.invalid_block_ids.update(out.invalid_block_ids)
        sent |= source.get_finished().finished_sending
        assert time.monotonic() < end, f"{rid}: read {got}, source freed {sent}"
    assert got.invalid_block_ids == {}, got
    assert verify(spec, caches, [0, 1], [3, 9], 16) == 0
    return got


def test_kv_both_reads_through_its_own_agent_both_ways(
    both: tuple[tuple[Worker, CacheSpec, dict[str, torch.Tensor]], ...],
) -> None:
    (a, a_spec, a_caches), (b, b_spec, b_caches) = both
    for w in (a, b):
        assert w._s.reader is not w.backend
        assert w._s.reader.agent_name == f"{w.backend.agent_name}-reader"
        assert w.metadata.agent_name == w.backend.agent_name  # peers read the published one
    a.add_remote({0: b.metadata})
    b.add_remote({0: a.metadata})
    _read(a, a_spec, a_caches, b, "a1")
    _read(b, b_spec, b_caches, a, "b1")
    assert a.backend.remotes() == [] and a._s.reader.remotes() == [b.backend.agent_name]

    # retiring A's reading agent leaves what A publishes (and B reads) alone
    published = a.metadata
    a._s.reader.retire("test")
    assert a._s.reader.agent_name.endswith("-reader.r1")
    assert a.metadata == published
    _read(a, a_spec, a_caches, b, "a2")
    _read(b, b_spec, b_caches, a, "b2")


def test_kv_consumer_metadata_follows_a_retirement() -> None:
    w, _, _ = _worker("C", "kv_consumer")
    try:
        assert w._s.reader is w.backend
        before = w.metadata
        assert w.consumer is not None
        retired = retire_reader(w._s, [])
        assert retired is not None and "reading agent retired" in retired[0]
        assert retired[1] == []  # no peer to drop
        after = w.metadata
        assert after.agent_name == before.agent_name + ".r1" == w.backend.agent_name
        assert after.agent_metadata != before.agent_metadata
        assert after.agent_metadata_sha256 == sha256_hex(after.agent_metadata)
        assert w._s.retirements == 1
    finally:
        w.close()


def test_reader_agent_only_for_kv_both() -> None:
    w, _, _ = _worker("P", "kv_producer")
    try:
        assert w._s.reader is w.backend
    finally:
        w.close()
