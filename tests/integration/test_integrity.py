"""Integrity mode with real agents in separate processes: a byte of a held producer block
flipped after `hold` makes the decoder report exactly the local block it landed in invalid
(outcome corrupt), every other block of the read and every other read stay valid, and with
the mode off (the default) nothing is added to the READs and the flip goes unnoticed. A
table published the way earlier kvrdma producers did (region after region) is checked the same.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
from rank_host import EnginePair, EngineSpec, HostPool

from kvrdma.metadata import WorkerMetadata

pytest.importorskip("nixl")

BLOCK = 16
P_BLOCKS = 40
D_BLOCKS = 24
ON = {"integrity_checksums": True}
SHAPE = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 8, "latent_dim": 12}
MAMBA = {"mamba_layers": 1, "mamba_state": 64, "mamba_conv": 16}
# (cache_layout, kv_cache_order or "", P tp, D tp, model heads, region flipped)
CASES = [
    ("split_kv", "", 1, 1, 4, 0),
    ("blocks_first", "", 1, 1, 4, 0),
    ("mla", "", 1, 1, 1, 0),
    ("unified", "LBHNC", 1, 1, 4, 0),
    ("unified", "BLHNC", 1, 1, 4, 0),
    ("split_kv", "", 1, 2, 4, 0),  # each D rank reads half of every P block's heads
    ("blocks_first", "", 2, 1, 4, 0),  # the D rank reads every P block from two P ranks
    ("cross_layer", "", 1, 2, 4, 0),  # every layer's K and V in one block, half the heads
    ("mamba", "", 1, 2, 4, -1),  # the Mamba state, each D rank reading half of it
]
REMOTE, LOCAL = [7, 3, 39], [5, 0, 23]
OTHER_REMOTE, OTHER_LOCAL = [10, 11], [1, 2]


def _pair(
    pool: HostPool, layout: str, order: str, p_tp: int, d_tp: int, heads: int, **extra: Any
) -> EnginePair:
    shape = {**SHAPE, "num_kv_heads": heads, **(MAMBA if layout == "mamba" else {})}
    order_args = {"kv_cache_order": order} if order else {}
    p = EngineSpec(p_tp, BLOCK, P_BLOCKS, layout, "HND", shape, extra=dict(extra), **order_args)
    d = EngineSpec(d_tp, BLOCK, D_BLOCKS, layout, "HND", shape, extra=dict(extra), **order_args)
    return EnginePair(pool, p, d)


@pytest.mark.parametrize(
    ("layout", "order", "p_tp", "d_tp", "heads", "region"),
    [pytest.param(*c, id=f"{c[0]}{c[1] and '-' + c[1]}-p{c[2]}d{c[3]}") for c in CASES],
)
def test_a_flipped_byte_makes_exactly_its_block_invalid(
    rank_hosts: HostPool, layout: str, order: str, p_tp: int, d_tp: int, heads: int, region: int
) -> None:
    with _pair(rank_hosts, layout, order, p_tp, d_tp, heads, **ON) as pair:
        pair.connect()
        pair.hold([("r", REMOTE), ("other", OTHER_REMOTE)])
        # after hold: the first byte of remote block 3 (its first head) on P rank 0
        pair.p[0].call("corrupt", REMOTE[1], region)
        by_rank = pair.read([("r", LOCAL, REMOTE), ("other", OTHER_LOCAL, OTHER_REMOTE)])
    seen = []
    for rank, (r, other) in enumerate(by_rank):
        assert (other["outcome"], other["wrong"], other["invalid"]) == ("success", 0, []), other
        if r["outcome"] == "success":
            assert r["wrong"] == 0, (rank, r)  # a rank reading none of the flipped head
            continue
        assert (r["outcome"], r["invalid"]) == ("corrupt", [LOCAL[1]]), (rank, r)
        seen.append(rank)
    # the flipped byte is P rank 0's first head (state part): D rank 0 reads it, whatever the TP mix
    assert seen == [0], by_rank


def test_off_by_default_adds_nothing_and_a_flip_goes_unnoticed(rank_hosts: HostPool) -> None:
    with _pair(rank_hosts, "split_kv", "", 1, 1, 4) as off:
        meta = msgspec.msgpack.decode(off.p_meta[0], type=WorkerMetadata)
        assert (meta.checksum_addr, meta.checksum_table_addr, meta.checksum_chunks) == (0, 0, [])
        [plain] = off.connect()
        off.hold([("r", REMOTE)])
        off.p[0].call("corrupt", REMOTE[1])
        [[r]] = off.read([("r", LOCAL, REMOTE)])
        assert r["outcome"] == "success" and r["wrong"] > 0, r  # what the mode would catch
    with _pair(rank_hosts, "split_kv", "", 1, 1, 4, **ON) as on:
        [checked] = on.connect()
    # the mode adds one checksum row: a block's checksums of every region lie side by side;
    # off, the READs are the plain plan's
    assert checked["entries"] == plain["entries"] + 1, (plain, checked)


@contextlib.contextmanager
def _workers(
    layout: str = "split_kv", d_block: int = BLOCK
) -> Iterator[tuple[Any, Any, Callable[[int], Any]]]:
    """A producer and a decoder `Worker` in this process (integrity on, the decoder's blocks
    `d_block` tokens), the decoder connected, and the byte view of one of the producer's
    blocks (of its last region)."""
    from kvrdma.config import load_kv_transfer_config
    from kvrdma.layout import build_regions
    from kvrdma.testing.synthetic import CacheSpec, ModelShape, fill, make_caches
    from kvrdma.worker import Worker

    shape = ModelShape(2, 4, 8, latent_dim=12)
    workers = []
    try:
        for engine, role, tokens in (("P", "kv_producer", BLOCK), ("D", "kv_consumer", d_block)):
            spec = CacheSpec(shape, layout, "HND", 0, 1, tokens, P_BLOCKS)
            caches, _ = make_caches(spec)
            fill(spec, caches)
            config = load_kv_transfer_config(
                {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine,
                 "kv_connector_extra_config": ON},
                environ={},
            )  # fmt: skip
            w = Worker.create(config, tp_rank=0, tp_size=1, total_num_kv_heads=4)
            workers.append(w)
            w.register_kv_caches(caches, cache_layout=layout, block_size=tokens)
            if role == "kv_producer":
                regions = build_regions(caches, cache_layout=layout, block_size=tokens)
        p, d = workers
        d.add_remote({0: p.metadata})
        yield p, d, lambda block: regions.regions[-1].data[block]
    finally:
        for w in reversed(workers):
            w.close()


def _read(p: Any, d: Any, rid: str, local: list[int], remote: list[int], flip: Any = None) -> Any:
    """`d`'s READ of `remote` into `local`, held by `p` first (then `flip()` if given): its
    `get_finished` output."""
    p.hold(rid, remote)
    if flip is not None:
        flip()
    d.start_read(rid, local, remote, "P")
    end = time.monotonic() + 10
    while rid not in (out := d.get_finished()).finished_recving:
        p.get_finished()
        assert time.monotonic() < end
    return out


@pytest.mark.parametrize("one_block_passes", [False, True], ids=["passes-4MiB", "passes-1block"])
@pytest.mark.parametrize("flipped", [0, 2, 4])  # in the first half of the blocks, in the second
def test_checks_cut_over_two_cores_find_the_same_block(
    monkeypatch: pytest.MonkeyPatch, flipped: int, one_block_passes: bool
) -> None:
    """Checksumming on two cores (`TWO_CORES_BYTES`, here for any size): the producer's rows
    and the decoder's check of every block half on each core, one flipped byte still caught
    in exactly its block; also when blocks are gathered one per pass (`_PASS_BYTES`)."""
    from kvrdma import integrity, twocores

    cut: list[int] = []
    real = twocores.both

    def spy(mine: Any, theirs: Any) -> Any:
        cut.append(1)
        return real(mine, theirs)

    monkeypatch.setattr(integrity, "TWO_CORES_BYTES", 1)
    if one_block_passes:
        monkeypatch.setattr(integrity, "_PASS_BYTES", 1)
    monkeypatch.setattr(twocores, "both", spy)
    remote, local = [7, 3, 39, 12, 20, 8], [5, 0, 23, 1, 2, 9]
    with _workers() as (p, d, block):

        def flip() -> None:
            assert cut == [1]  # the producer's rows
            block(remote[flipped])[0] ^= 0xFF

        out = _read(p, d, "r", local, remote, flip)
        assert out.invalid_block_ids == {"r": {local[flipped]}}
        assert cut == [1, 1]  # the decoder's check


def test_a_table_published_region_after_region_is_checked_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A producer of an earlier kvrdma publishes its table region after region in
    `checksum_addr`: the decoder reads those rows instead and still finds exactly the
    flipped block."""
    import msgspec

    from kvrdma import integrity

    def old_publish(self: integrity.ChecksumTable, meta: WorkerMetadata) -> WorkerMetadata:
        chunks = list(self.chunks)
        return msgspec.structs.replace(
            meta, checksum_addr=self.table.data_ptr(), checksum_chunks=chunks
        )

    real_init = integrity.ChecksumTable.__init__

    def old_init(self: integrity.ChecksumTable, *args: Any) -> None:
        real_init(self, *args)
        self.layout = integrity._region_major([r.meta for r in self.regions], self.chunks)

    monkeypatch.setattr(integrity.ChecksumTable, "__init__", old_init)
    monkeypatch.setattr(integrity.ChecksumTable, "publish", old_publish)
    with _workers() as (p, d, block):
        assert (p.metadata.checksum_table_addr, p.metadata.checksum_layout) == (0, [])
        assert p.metadata.checksum_addr
        clean = _read(p, d, "clean", [1, 2], [10, 11])
        assert (clean.finished_recving, clean.invalid_block_ids) == ({"clean"}, {})

        def flip() -> None:
            block(3)[5] ^= 0x01

        out = _read(p, d, "r", [5, 0, 23], [7, 3, 39], flip)
        assert out.invalid_block_ids == {"r": {0}}


@pytest.mark.parametrize("layout", ["split_kv", "blocks_first", "cross_layer", "mla"])
def test_a_decoder_with_larger_blocks_finds_the_block_a_flip_landed_in(layout: str) -> None:
    """Decoder blocks twice the producer's: two producer blocks land in one decoder block,
    and a byte flipped in one of them makes exactly that decoder block invalid."""
    with _workers(layout, d_block=2 * BLOCK) as (p, d, block):
        clean = _read(p, d, "clean", [1, 2], [4, 5, 6, 7])
        assert (clean.finished_recving, clean.invalid_block_ids) == ({"clean"}, {})

        def flip() -> None:
            block(11)[3] ^= 0x01  # the first half of local block 6

        out = _read(p, d, "r", [5, 6], [9, 10, 11, 12], flip)
        assert out.invalid_block_ids == {"r": {6}}
