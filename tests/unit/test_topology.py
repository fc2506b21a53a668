"""TP / block-size / Mamba mapping (SPEC §3–4): reference cases, the full matrix, properties."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrdma.errors import ConfigError
from kvrdma.topology import (
    MambaEngineTransferInfo,
    TransferTopology,
    check_heads_divisible,
    physical_heads,
)

ENGINE = "prefill-0"
HEADS = [1, 2, 4, 8, 16]
TP_SIZES = range(1, 9)
LAYOUT_FLAGS = [(False, False), (True, False), (False, True)]  # (blocks_first, cross_layer)


def topo(
    rank: int,
    tp: int,
    heads: int = 8,
    *,
    mla: bool = False,
    mamba: bool = False,
    block_size: int = 16,
    blocks_first: bool = False,
    cross_layer: bool = False,
) -> TransferTopology:
    return TransferTopology(
        tp_rank=rank,
        tp_size=tp,
        block_size=block_size,
        engine_id="decode-0",
        is_mla=mla,
        is_mamba=mamba,
        total_num_kv_heads=heads,
        is_blocks_first=blocks_first,
        is_cross_layer=cross_layer,
    )


def register(
    t: TransferTopology,
    remote_tp: int,
    *,
    remote_block_size: int | None = None,
    remote_block_len: int = 4096,
    local_block_len: int = 4096,
    remote_pbpl: int = 1,
    local_pbpl: int = 1,
    engine: str = ENGINE,
):
    return t.engine_info(
        engine,
        remote_tp,
        t.block_size if remote_block_size is None else remote_block_size,
        remote_block_len,
        remote_pbpl,
        local_block_len=local_block_len,
        local_physical_blocks_per_logical=local_pbpl,
    )


def heads_ok(tp: int, k: int) -> bool:
    return (k % tp == 0) if tp <= k else (tp % k == 0)


def expected_ratio(lt: int, rt: int) -> int:
    return lt // rt if lt >= rt else -(rt // lt)


def expected_handshake(r: int, lt: int, rt: int) -> list[int]:
    ratio = expected_ratio(lt, rt)
    if ratio > 0:
        return [r // ratio]
    k = -ratio
    return list(range(r * k, r * k + k))


def head_set(rng: tuple[int, int]) -> set[int]:
    return set(range(*rng))


# ---- SPEC §4 reference cases ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("d_rank", "d_tp", "p_tp", "sources"),
    [(1, 2, 2, [1]), (2, 4, 2, [1]), (0, 1, 2, [0, 1])],
    ids=["d2r1-p2", "d4r2-p2", "d1-p2"],
)
def test_reference_sources_8_heads(d_rank, d_tp, p_tp, sources):
    t = topo(d_rank, d_tp, 8)
    info = register(t, p_tp)
    assert t.target_remote_ranks(info) == sources
    assert t.handshake_target_ranks(p_tp) == sources


def test_reference_fa_sources_gqa_dedup_d1_p4_2_heads():
    t = topo(0, 1, 2)
    info = register(t, 4)
    # P ranks 0,1 hold head 0; ranks 2,3 hold head 1: read each distinct head once
    assert list(info.fa_sources) == [0, 2]
    assert t.target_remote_ranks(info) == [0, 2]
    assert info.handshake_ranks == (0, 1, 2, 3)
    assert t.needs_split_handles(info)


def test_reference_handshake_d2r1_p8():
    t = topo(1, 2, 8)
    assert t.handshake_target_ranks(8) == [4, 5, 6, 7]
    info = register(t, 8)
    assert info.handshake_ranks == (4, 5, 6, 7)
    assert list(info.fa_sources) == [4, 5, 6, 7]


FA_DESCS = [(1000, 200), (2000, 200)]
SSM_DESC = (3000, 400)


@pytest.mark.parametrize(
    ("d_rank", "d_tp", "p_tp", "heads"),
    [(0, 1, 2, 1), (0, 2, 4, 2), (1, 2, 4, 2), (1, 2, 4, 1)],
    ids=["d1-p2-h1", "d2r0-p4-h2", "d2r1-p4-h2", "d2r1-p4-h1"],
)
def test_reference_mamba_split(d_rank, d_tp, p_tp, heads):
    """Replicated remote heads: one FA read, Mamba state split over the whole Mamba range."""
    t = topo(d_rank, d_tp, heads, mamba=True, blocks_first=True)
    info = register(t, p_tp)
    assert isinstance(info, MambaEngineTransferInfo)
    first, second = 2 * d_rank, 2 * d_rank + 1
    assert info.fa_sources == (first,)
    assert info.all_sources == (first, second)
    assert info.mamba_range == (first, second)
    assert info.abs_tp == 2
    assert t.needs_split_handles(info)
    split = t.compute_split_handle_data(info, [*FA_DESCS, SSM_DESC], num_fa_descs=2)
    assert split == {
        first: [(1000, 200), (2000, 200), (3000, 200)],
        second: [(1000, 200), (2000, 200), (3200, 200)],
    }
    assert t.fa_head_slot(info, second) == 0
    groups = [[1, 2, 3], [4, 5], [7]]
    is_mamba = [False, False, True]
    assert t.filter_block_ids_for_rank(info, first, groups, is_mamba) == groups
    assert t.filter_block_ids_for_rank(info, second, groups, is_mamba) == [[], [], [7]]
    # without group flags every group is an attention group
    assert t.filter_block_ids_for_rank(info, second, groups) == [[], [], []]


def test_mamba_split_without_replication():
    """D tp1 / P tp2 with 8 heads: both P ranks are FA sources, Mamba split in halves."""
    t = topo(0, 1, 8, mamba=True, blocks_first=True)
    info = register(t, 2)
    assert info.fa_sources == (0, 1)
    assert info.all_sources == (0, 1)
    split = t.compute_split_handle_data(info, [*FA_DESCS, SSM_DESC], num_fa_descs=2)
    assert split == {
        0: [(1000, 100), (2000, 100), (3000, 200)],
        1: [(1100, 100), (2100, 100), (3200, 200)],
    }


# ---- the full matrix -------------------------------------------------------------------------


def _matrix():
    for lt, rt, k in itertools.product(TP_SIZES, TP_SIZES, HEADS):
        yield pytest.param(lt, rt, k, id=f"L{lt}-R{rt}-K{k}")


def _error_patterns(lt: int, rt: int, k: int, mla: bool) -> list[str]:
    """Every reason this mapping is impossible, each as a regex naming the numbers."""
    out = []
    if not mla and not heads_ok(lt, k):
        out.append(rf"local tp_size {lt} .*total_num_kv_heads {k}\b")
    if not mla and not heads_ok(rt, k):
        out.append(rf"remote tp_size {rt} .*total_num_kv_heads {k}\b")
    if lt % rt and rt % lt:
        lo, hi = (rt, lt) if lt > rt else (lt, rt)
        out.append(rf"tp_size {lo} does not divide \w+ tp_size {hi}\b")
    return out


@pytest.mark.parametrize(("lt", "rt", "k"), list(_matrix()))
@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_tp_matrix(lt, rt, k, mla):
    """Every TP pair × heads × MLA; Mamba on/off and layout flags for every local rank."""
    reasons = _error_patterns(lt, rt, k, mla)
    for r, mamba in itertools.product(range(lt), (False, True)):
        if reasons:
            with pytest.raises(ConfigError) as exc:
                t = topo(r, lt, k, mla=mla, mamba=mamba)
                register(t, rt)
            msg = str(exc.value)
            assert any(re.search(p, msg) for p in reasons), (msg, reasons)
            continue
        for blocks_first, cross_layer in LAYOUT_FLAGS:
            t = topo(
                r, lt, k, mla=mla, mamba=mamba, blocks_first=blocks_first, cross_layer=cross_layer
            )
            _check_valid(t, r, lt, rt, k, mla, mamba, blocks_first)


def _check_valid(t, r, lt, rt, k, mla, mamba, blocks_first):
    ratio = expected_ratio(lt, rt)
    hb = 48  # bytes per head per block
    local_len = (1 if mla else len(head_set(t.local_heads()))) * hb
    remote_len = (1 if mla else len(head_set(physical_heads(0, rt, k)))) * hb
    info = register(t, rt, remote_block_len=remote_len, local_block_len=local_len)
    assert info.tp_ratio == ratio == t.tp_ratio(rt)
    assert list(info.handshake_ranks) == expected_handshake(r, lt, rt)
    assert t.handshake_target_ranks(rt) == expected_handshake(r, lt, rt)
    assert all(0 <= p < rt for p in info.handshake_ranks)
    assert info.block_size_ratio == 1
    assert t.is_kv_replicated(rt) == (mla or rt > k)
    assert t.replicates_kv_cache == (mla or lt > k)
    expected_bytes = min(local_len, remote_len) // (2 if blocks_first else 1)
    assert info.fa_descriptor_bytes == expected_bytes
    fa = info.fa_sources
    assert fa and set(fa) <= set(info.handshake_ranks)
    if mla:
        # one read; SPEC §4 says remote rank 0, the code reads the first handshake rank
        # (same bytes: every rank holds the whole latent cache) — pinned here on purpose
        assert fa == (info.handshake_ranks[0],)
    elif ratio > 0:
        assert fa == (r // ratio,)
    # heads: this rank reads exactly its own heads, each once
    if not mla:
        need = head_set(t.local_heads())
        got: list[int] = []
        for p in fa:
            got += sorted(need & head_set(physical_heads(p, rt, k)))
        assert sorted(got) == sorted(need), (fa, need)
    # sources
    if mamba:
        assert isinstance(info, MambaEngineTransferInfo)
        abs_tp = -ratio if ratio < 0 else 1
        assert info.abs_tp == abs_tp
        mamba_range = tuple(range(r * abs_tp, (r + 1) * abs_tp)) if ratio < 0 else ()
        assert info.mamba_range == mamba_range
        if mamba_range and abs_tp > len(fa):
            assert set(info.all_sources) == set(mamba_range) | set(fa)
            assert info.all_sources[: len(mamba_range)] == mamba_range
        else:
            assert info.all_sources == fa
    else:
        assert not info.is_mamba
        assert info.all_sources == fa
    assert t.target_remote_ranks(info) == list(info.all_sources)
    assert len(set(info.all_sources)) == len(info.all_sources)
    assert t.needs_split_handles(info) == (ratio < 0 and not mla and len(info.all_sources) > 1)
    # offsets
    off = t.fa_rank_offset(info, local_len)
    if mla or ratio <= 0:
        assert off == 0
    else:
        p0 = fa[0]
        assert off == (t.local_heads()[0] - physical_heads(p0, rt, k)[0]) * hb
        assert off >= 0 and off + local_len <= remote_len
    # slots: FA sources in order, every other source shares an FA source's slot
    for i, p in enumerate(fa):
        assert t.fa_head_slot(info, p) == i
    for p in info.all_sources:
        assert 0 <= t.fa_head_slot(info, p) < len(fa)
    text = t.describe(info)
    assert f"rank {r}/{lt}" in text and repr(ENGINE) in text
    assert f"fa_sources {list(fa)}" in text


# ---- invalid configurations name the offending numbers -------------------------------------


@pytest.mark.parametrize(
    ("local_bs", "remote_bs", "pattern"),
    [
        (16, 32, r"remote block_size 32 must divide local block_size 16"),
        (16, 5, r"remote block_size 5 must divide local block_size 16"),
        (12, 8, r"remote block_size 8 must divide local block_size 12"),
        (16, 0, r"remote block_size must be >= 1, got 0"),
    ],
)
def test_bad_block_size(local_bs, remote_bs, pattern):
    t = topo(0, 1, 8, block_size=local_bs)
    with pytest.raises(ConfigError, match=pattern):
        t.block_size_ratio(remote_bs)
    with pytest.raises(ConfigError, match=pattern):
        register(t, 1, remote_block_size=remote_bs)


@pytest.mark.parametrize(("local_bs", "remote_bs"), [(16, 16), (16, 8), (16, 4), (16, 1), (12, 3)])
def test_block_size_ratio(local_bs, remote_bs):
    t = topo(0, 2, 8, block_size=local_bs)
    assert t.block_size_ratio(remote_bs) == local_bs // remote_bs
    assert register(t, 2, remote_block_size=remote_bs).block_size_ratio == local_bs // remote_bs


@pytest.mark.parametrize("remote_bs", [8, 4, 1])
def test_mamba_needs_equal_block_sizes(remote_bs):
    t = topo(0, 1, 8, mamba=True, block_size=16)
    with pytest.raises(ConfigError, match=rf"local 16, remote {remote_bs} \(engine 'prefill-0'\)"):
        register(t, 1, remote_block_size=remote_bs)
    assert register(t, 1, remote_block_size=16).block_size_ratio == 1


@pytest.mark.parametrize(("remote", "local"), [(2, 1), (1, 2), (4, 2)])
def test_physical_blocks_per_logical_mismatch(remote, local):
    t = topo(0, 1, 8)
    with pytest.raises(
        ConfigError,
        match=rf"remote physical_blocks_per_logical {remote} != local {local} "
        r"\(engine 'prefill-0'\)",
    ):
        register(t, 1, remote_pbpl=remote, local_pbpl=local)
    assert register(t, 1, remote_pbpl=local, local_pbpl=local).remote_physical_blocks_per_logical


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(rank=2, tp=2), r"tp_rank must be in \[0, tp_size=2\), got 2"),
        (dict(rank=-1, tp=2), r"tp_rank must be in \[0, tp_size=2\), got -1"),
        (dict(rank=0, tp=1, block_size=0), r"block_size must be >= 1, got 0"),
        (dict(rank=0, tp=1, heads=0), r"total_num_kv_heads must be >= 1, got 0"),
        (dict(rank=0, tp=3, heads=8), r"local tp_size 3 does not divide total_num_kv_heads 8"),
        (dict(rank=0, tp=6, heads=4), r"local tp_size 6 is not a multiple of total_num_kv_heads 4"),
    ],
)
def test_bad_topology(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        topo(**kwargs)


def test_bad_remote_tp_and_lengths():
    t = topo(0, 2, 8)
    with pytest.raises(ConfigError, match=r"remote tp_size must be >= 1, got 0"):
        t.tp_ratio(0)
    with pytest.raises(ConfigError, match=r"local tp_size 2 does not divide remote tp_size 3"):
        t.tp_ratio(3)
    with pytest.raises(ConfigError, match=r"remote tp_size 3 does not divide local tp_size 4"):
        topo(0, 4, 8).tp_ratio(3)
    with pytest.raises(ConfigError, match=r"remote tp_size 6 does not divide total_num_kv_heads 8"):
        register(t, 6)
    with pytest.raises(ConfigError, match=r"remote tp_size 12 is not a multiple of .* 8\b"):
        register(t, 12)
    with pytest.raises(ConfigError, match=r"block lengths must be >= 1: local 0, remote 64"):
        register(t, 2, remote_block_len=64, local_block_len=0)
    with pytest.raises(ConfigError, match=r"remote tp_size must be >= 1, got 0"):
        check_heads_divisible(0, 8, "remote")


def test_split_handles_reject_indivisible_descriptors():
    t = topo(0, 1, 8)
    info = register(t, 2)
    with pytest.raises(ConfigError, match=r"attention descriptor of 201 bytes .* 2 head chunks"):
        t.compute_split_handle_data(info, [(0, 201)], num_fa_descs=1)
    m = topo(0, 1, 8, mamba=True)
    info = register(m, 4)
    with pytest.raises(ConfigError, match=r"Mamba descriptor of 402 bytes .* 4 rank chunks"):
        m.compute_split_handle_data(info, [(0, 400), (1000, 402)], num_fa_descs=1)


@pytest.mark.parametrize(
    ("tp", "k", "ranges"),
    [
        (2, 8, [(0, 4), (4, 8)]),
        (4, 2, [(0, 1), (0, 1), (1, 2), (1, 2)]),
        (1, 16, [(0, 16)]),
        (8, 1, [(0, 1)] * 8),
    ],
)
def test_physical_heads(tp, k, ranges):
    assert [physical_heads(p, tp, k) for p in range(tp)] == ranges


# ---- properties --------------------------------------------------------------------------------


def _valid_tps(k: int) -> list[int]:
    return [t for t in range(1, 4 * k + 1) if heads_ok(t, k)]


@st.composite
def valid_mapping(draw):
    k = draw(st.integers(1, 16))
    lt = draw(st.sampled_from(_valid_tps(k)))
    rts = [t for t in _valid_tps(k) if t % lt == 0 or lt % t == 0]
    rt = draw(st.sampled_from(rts))
    return lt, rt, k


@settings(max_examples=300, deadline=None)
@given(valid_mapping())
def test_prop_heads_read_exactly_once(m):
    lt, rt, k = m
    covered: list[int] = []
    for r in range(lt):
        t = topo(r, lt, k)
        info = register(t, rt)
        assert all(0 <= p < rt for p in info.handshake_ranks)
        assert all(0 <= p < rt for p in info.all_sources)
        mine = head_set(t.local_heads())
        read: list[int] = []
        for p in info.fa_sources:
            read += sorted(mine & head_set(t.remote_heads(p, rt)))
        assert len(read) == len(set(read)), f"rank {r} reads a head twice: {read}"
        assert set(read) == mine
        covered += read
    assert set(covered) == set(range(k))


@settings(max_examples=300, deadline=None)
@given(valid_mapping(), st.booleans(), st.integers(1, 64), st.integers(0, 3), st.integers(0, 2))
def test_prop_split_chunks_tile_descriptors(m, mamba, head_bytes, n_fa, n_mamba):
    lt, rt, k = m
    if lt >= rt:
        return
    for r in range(lt):
        t = topo(r, lt, k, mamba=mamba)
        info = register(t, rt)
        abs_tp = rt // lt
        fa_len = len(head_set(t.local_heads())) * head_bytes
        descs = [(10_000 * (j + 1), fa_len) for j in range(n_fa)]
        if mamba:
            descs += [(1_000_000 * (j + 1), abs_tp * head_bytes) for j in range(n_mamba)]
        split = t.compute_split_handle_data(info, descs, n_fa)
        assert list(split) == list(info.all_sources)
        for j, (addr, length) in enumerate(descs):
            if j < n_fa:
                chunks = sorted(split[p][j] for p in info.fa_sources)
            else:
                chunks = sorted(split[p][j] for p in info.mamba_range)  # type: ignore[attr-defined]
            pos = addr
            for a, n in chunks:
                assert a == pos and n > 0, (chunks, addr, length)
                pos += n
            assert pos == addr + length
            assert sum(n for _, n in chunks) == length
        # a non-FA source reuses an FA source's chunk and reads no attention blocks
        for p in info.all_sources:
            if p not in info.fa_sources:
                twin = info.fa_sources[t.fa_head_slot(info, p)]
                assert split[p][:n_fa] == split[twin][:n_fa]
                assert t.filter_block_ids_for_rank(info, p, [[1], [2]], [False, True]) == [
                    [],
                    [2],
                ]


@settings(max_examples=300, deadline=None)
@given(valid_mapping(), st.integers(1, 64))
def test_prop_rank_offset_within_remote_block(m, head_bytes):
    lt, rt, k = m
    if lt <= rt:
        return
    for r in range(lt):
        t = topo(r, lt, k)
        info = register(t, rt)
        assert info.tp_ratio == lt // rt > 0
        read_len = len(head_set(t.local_heads())) * head_bytes
        remote_len = len(head_set(physical_heads(info.fa_sources[0], rt, k))) * head_bytes
        off = t.fa_rank_offset(info, read_len)
        assert off % head_bytes == 0
        assert off >= 0 and off + read_len <= remote_len
        # the bytes at that offset are this rank's heads
        first = physical_heads(info.fa_sources[0], rt, k)[0] + off // head_bytes
        assert first == t.local_heads()[0]
