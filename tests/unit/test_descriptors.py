"""Descriptor ids (SPEC §2), block-size-ratio expansion, strided tables and real READ plans."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrdma import descriptors
from kvrdma.descriptors import (
    ReadPlan,
    _starts,
    block_ids_to_descriptor_ids,
    expand_block_ids,
    expand_strided,
    repeated_block_ids,
)
from kvrdma.errors import ConfigError
from kvrdma.plan import build_read_plan
from kvrdma.testing.synthetic import CacheSpec, ModelShape

from .plan_sim import SimWorker


def test_spec_reference_case():
    ids = block_ids_to_descriptor_ids(4, 10, [1, 3])
    assert ids.tolist() == [1, 3, 11, 13, 21, 23, 31, 33]
    assert ids.dtype == np.int64


def test_empty_block_ids():
    assert block_ids_to_descriptor_ids(3, 10, []).tolist() == []
    assert expand_block_ids([], 4).tolist() == []
    assert expand_strided(np.zeros((0, 5), dtype=np.uint64)).shape == (0, 3)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 12),
    st.integers(1, 64).flatmap(
        lambda n: st.tuples(st.just(n), st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    ),
)
def test_prop_descriptor_ids_in_range_and_unique(num_regions, blocks):
    num_blocks, block_ids = blocks
    ids = block_ids_to_descriptor_ids(num_regions, num_blocks, block_ids)
    assert len(ids) == num_regions * len(block_ids)
    assert ((ids >= 0) & (ids < num_regions * num_blocks)).all()
    assert len(np.unique(ids)) == len(ids)
    # region-major: region r's ids are r * num_blocks + each block, in request order
    naive = [r * num_blocks + b for r in range(num_regions) for b in block_ids]
    assert ids.tolist() == naive


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 500), unique=True, max_size=40), st.integers(1, 8), st.data())
def test_prop_expand_block_ids_is_a_bijection(block_ids, ratio, data):
    out = expand_block_ids(block_ids, ratio)
    pairs = [(b, i) for b in block_ids for i in range(ratio)]
    assert len(out) == len(pairs)
    # (block, i) ↦ b*ratio + i, onto exactly the expanded range, with inverse (÷, %)
    assert out.tolist() == [b * ratio + i for b, i in pairs]
    assert set(out.tolist()) == {b * ratio + i for b in block_ids for i in range(ratio)}
    assert len(set(out.tolist())) == len(out)
    assert list(zip((out // ratio).tolist(), (out % ratio).tolist(), strict=True)) == pairs
    count = data.draw(st.integers(0, len(out)))
    assert expand_block_ids(block_ids, ratio, count).tolist() == out[:count].tolist()


@st.composite
def strided_rows(draw):
    n = draw(st.integers(0, 6))
    rows = [
        (
            draw(st.integers(0, 2**40)),
            draw(st.integers(1, 4096)),
            draw(st.integers(0, 7)),
            draw(st.integers(0, 1 << 20)),
            draw(st.integers(0, 9)),
        )
        for _ in range(n)
    ]
    return np.array(rows, dtype=np.uint64).reshape(-1, 5)


@settings(max_examples=200, deadline=None)
@given(strided_rows())
def test_prop_expand_strided_matches_naive(rows):
    naive = [
        (int(a) + k * int(s), int(ln), int(dev))
        for a, ln, dev, s, c in rows.tolist()
        for k in range(int(c))
    ]
    out = expand_strided(rows)
    assert out.dtype == np.uint64
    assert out.shape == (len(naive), 3)
    assert [tuple(r) for r in out.tolist()] == naive


# ---- ReadPlan.checked_block_ids ------------------------------------------------------------------


@pytest.fixture(params=["lists", "numpy"])
def path(request, monkeypatch):
    """Both ways a request is planned: small ones with lists, larger ones with NumPy."""
    if request.param == "numpy":
        monkeypatch.setattr(descriptors, "SMALL_REQUEST", 0)
    return request.param


def _as_list(ids) -> list[int]:
    return np.asarray(ids, dtype=np.int64).tolist()


def _plan(ratio: int, local_n: int = 10, remote_n: int = 20) -> ReadPlan:
    return ReadPlan(
        remote_engine_id="prefill-7",
        block_ratio=ratio,
        remote_num_blocks=remote_n,
        local_num_blocks=local_n,
        sources=(),
        permutes=(),
        notify_ranks=(0,),
        notify_expected=1,
    )


@pytest.mark.parametrize(
    ("ratio", "remote", "local", "sub"),
    [
        (1, [3, 0, 19], [9, 2, 0], [9, 2, 0]),
        (2, [3, 0, 19], [4, 1], [8, 9, 2]),
        (4, [5, 6, 7, 8], [9], [36, 37, 38, 39]),
        (4, [], [], []),
        (1, [7, 7, 3], [0, 1, 2], [0, 1, 2]),  # a remote block read twice lands in two
        (2, [7, 7, 7], [4, 5], [8, 9, 10]),
    ],
)
def test_checked_block_ids(ratio, remote, local, sub, path):
    lb, lsub, rids = _plan(ratio).checked_block_ids(local, remote)
    assert isinstance(rids, list) == (path == "lists" or not remote)
    assert _as_list(lb) == local
    assert _as_list(lsub) == sub
    assert _as_list(rids) == remote
    # arrays of any integer type take the same path as lists
    lb2, lsub2, rids2 = _plan(ratio).checked_block_ids(
        np.array(local, dtype=np.int32), np.array(remote, dtype=np.uint16)
    )
    assert isinstance(rids2, list) == (path == "lists" or not remote)
    assert (_as_list(lb2), _as_list(lsub2), _as_list(rids2)) == (local, sub, remote)


@pytest.mark.parametrize(
    ("ratio", "local", "remote", "pattern"),
    [
        (1, [0, 1], [1], r"1 remote blocks at block_size_ratio 1 need 1 local blocks, got 2"),
        (2, [0], [1, 2, 3], r"3 remote blocks at block_size_ratio 2 need 2 local blocks, got 1"),
        (1, [0, 10, 12], [1, 2, 3], r"local block ids out of range \[0, 10\) .*: \[10, 12\]"),
        (1, [-1, 3], [1, 2], r"local block ids out of range \[0, 10\) .*: \[-1\]"),
        (1, [0, 1], [20, -3], r"remote block ids out of range \[0, 20\) .*: \[20, -3\]"),
        (1, [3, 3], [1, 2], r"^local_block_ids: expected each local block once .*got \[3\] more"),
        (2, [4, 1, 4, 1], [0, 1, 2, 3, 4, 5, 6, 7], r"local_block_ids: .*got \[1, 4\] more than"),
    ],
)
def test_checked_block_ids_rejects(ratio, local, remote, pattern, path):
    with pytest.raises(ConfigError, match=pattern) as exc:
        _plan(ratio).checked_block_ids(local, remote)
    assert "'prefill-7'" in str(exc.value)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 4),
    st.lists(st.integers(-3, 25), max_size=12),
    st.lists(st.integers(-3, 12), max_size=6),
)
def test_prop_checked_block_ids_validates(ratio, remote, local):
    """Lists (small requests) and NumPy (larger ones) agree, on ids and on errors."""
    for small in (512, 0):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(descriptors, "SMALL_REQUEST", small)
            _check_validates(_plan(ratio), ratio, remote, local)


def _check_validates(plan, ratio, remote, local):
    ok_count = len(local) == -(-len(remote) // ratio)
    ok_range = all(0 <= b < 10 for b in local) and all(0 <= b < 20 for b in remote)
    ok_unique = len(set(local)) == len(local)
    if ok_count and ok_range and ok_unique:
        _, lsub, rids = plan.checked_block_ids(local, remote)
        assert len(lsub) == len(rids) == len(remote)
        assert _as_list(lsub) == [b * ratio + i for b in local for i in range(ratio)][: len(remote)]
        return
    with pytest.raises(ConfigError) as exc:
        plan.checked_block_ids(local, remote)
    msg = str(exc.value)
    assert "'prefill-7'" in msg
    if not ok_count:
        assert f"got {len(local)}" in msg
    elif ok_range:
        repeated = sorted({b for b in local if local.count(b) > 1})
        assert msg.startswith("local_block_ids: expected each local block once (")
        assert f"got {repeated[:8]} more than once" in msg
    else:
        bad = [b for b in local if not 0 <= b < 10] or [b for b in remote if not 0 <= b < 20]
        assert msg.endswith(f": {bad[:8]}")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=30), st.sampled_from([41, 1 << 20]))
def test_prop_repeated_block_ids(ids, num_blocks):
    """Lists and arrays, found by a bitmap (ids many for the blocks) or a sort (few)."""
    want = sorted({b for b in ids if ids.count(b) > 1})[:8]
    assert repeated_block_ids(ids, num_blocks) == want
    assert repeated_block_ids(np.array(ids, dtype=np.int64), num_blocks) == want


# ---- real plans --------------------------------------------------------------------------------


SHAPE = ModelShape(
    num_layers=2,
    num_kv_heads=4,
    head_dim=8,
    latent_dim=12,
    mamba_layers=1,
    mamba_state=64,
    mamba_conv=16,
)


def _worker(layout, rank, tp, block, role, n):
    spec = CacheSpec(SHAPE, layout, "HND", rank, tp, block, n)
    return SimWorker(spec, role, producer=False)


@pytest.mark.parametrize(
    ("layout", "p_tp", "d_tp", "ratio"),
    [
        ("split_kv", 1, 1, 1),
        ("split_kv", 4, 1, 2),
        ("split_kv", 1, 2, 4),
        ("blocks_first", 2, 4, 1),
        ("cross_layer", 2, 1, 2),
        ("mla", 2, 1, 2),
        ("mamba", 4, 2, 1),
        ("mamba", 1, 2, 1),
        ("mamba", 8, 1, 1),
    ],
)
def test_real_plan_descriptor_ids(layout, p_tp, d_tp, ratio, monkeypatch):
    # every case is a small request (8 sources of (conv, ssm) pages have too many entries)
    monkeypatch.setattr(descriptors, "SMALL_REQUEST", 256)
    d_block, p_block = 8, 8 // ratio
    remote_n, local_n = 12, 7
    producers = {r: _worker(layout, r, p_tp, p_block, "P", remote_n) for r in range(p_tp)}
    remote_ids = [11, 0, 5, 6, 3]
    local_ids = [6, 0, 2, 4, 1][: -(-len(remote_ids) // ratio)]
    for rank in range(d_tp):
        d = _worker(layout, rank, d_tp, d_block, "D", local_n)
        metas = {p: w.meta for p, w in producers.items()}
        plan = build_read_plan(d.topology(), d.meta, metas, mamba_states=d.info.mamba_states)
        assert plan.block_ratio == ratio
        _, lsub, rids = plan.checked_block_ids(local_ids, remote_ids)
        assert isinstance(lsub, list) and isinstance(rids, list)  # a small request
        _, lsub_a, rids_a = plan.checked_block_ids(np.array(local_ids), np.array(remote_ids))
        assert plan.sources
        spans: list[tuple[int, int]] = []
        for src in plan.sources:
            ltab, rtab = expand_strided(src.local_rows), expand_strided(src.remote_rows)
            lids_l, r_ids_l = src.descriptor_ids(lsub, rids)
            with pytest.MonkeyPatch.context() as mp:  # the NumPy path agrees, as int32
                mp.setattr(descriptors, "SMALL_REQUEST", 0)
                _, lsub_n, rids_n = plan.checked_block_ids(local_ids, remote_ids)
                lids, r_ids = src.descriptor_ids(lsub_n, rids_n)
            assert lids.dtype == r_ids.dtype == np.int32  # what NIXL takes, no cast inside
            assert (lids.tolist(), r_ids.tolist()) == (lids_l, r_ids_l)
            assert src.descriptor_ids(lsub_a, rids_a) == (lids_l, r_ids_l)
            assert len(lids) == len(r_ids) == src.num_entries * len(remote_ids)
            assert ((lids >= 0) & (lids < len(ltab))).all()
            assert ((r_ids >= 0) & (r_ids < len(rtab))).all()
            assert len(np.unique(lids)) == len(lids)
            assert (ltab[lids, 1] == rtab[r_ids, 1]).all(), "local and remote lengths differ"
            spans += [(int(a), int(a + n)) for a, n, _ in ltab[lids].tolist()]
            # every landing span lies inside a local region
            for a, n, _ in ltab[lids].tolist():
                assert any(
                    r.base_addr <= a and a + n <= r.base_addr + r.num_blocks * r.block_len
                    for r in d.meta.regions
                )
            m_l, m_r = src.descriptor_ids(lsub, rids, mamba_only=True)
            assert (m_l, m_r) == tuple(
                a.tolist() for a in src.descriptor_ids(lsub_n, rids_n, mamba_only=True)
            )
            assert len(m_l) == int(src.is_mamba_entry.sum()) * len(remote_ids)
            assert set(m_l) <= set(lids.tolist())
            assert set(m_r) <= set(r_ids.tolist())
        # no two reads of this rank (from any source) land on the same bytes
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "two reads overlap in local memory"


def test_descriptor_lists_past_int32_are_refused():
    """NIXL's descriptor indices are int32: a plan whose list would be longer is a config
    error at planning time, not a silent wrap at post time."""
    fits = np.array([[0, 1, 0, 1, 2**31 - 2], [0, 1, 0, 1, 1]], dtype=np.uint64)
    assert _starts(fits).tolist() == [0, 2**31 - 2]
    with pytest.raises(ConfigError, match=r"needs 2147483648 descriptors; NIXL indexes at most"):
        _starts(np.array([[0, 1, 0, 1, 2**31 - 1], [0, 1, 0, 1, 1]], dtype=np.uint64))


@pytest.mark.parametrize(
    ("bad", "shown"),
    [
        ([5.5], "[5.5]"),
        (np.array([7.9]), "array([7.9])"),
        ([True], "[True]"),
        ([1, True], "[1, True]"),
        (np.array([True]), "array([ True])"),
        (["8"], "['8']"),
        (["x"], "['x']"),
        ([[1, 2]], "[[1, 2]]"),
        ([[1], [2, 3]], "[[1], [2, 3]]"),
        (None, "None"),
        ([None], "[None]"),
        (np.array([[1, 2]]), "array([[1, 2]])"),
        (3, "3"),
    ],
)
@pytest.mark.parametrize("which", ["local_block_ids", "remote_block_ids"])
def test_checked_block_ids_rejects_non_integer_ids(bad, shown, which, path):
    """Floats, bools, strings, nested lists and None name the argument and the value instead
    of being truncated or parsed into other block ids."""
    good = [1]
    local, remote = (bad, good) if which == "local_block_ids" else (good, bad)
    with pytest.raises(ConfigError) as exc:
        _plan(1).checked_block_ids(local, remote)
    msg = str(exc.value)
    assert msg.startswith(f"{which}: expected a sequence of integer block ids")
    assert shown in msg


def test_checked_block_ids_accepts_integer_sequences(path):
    plan = _plan(1)
    for local, remote in (
        ((1, 2), range(3, 5)),
        ([np.int64(1), np.int32(2)], [np.uint8(3), 4]),
        (np.array([], dtype=np.int64), []),
    ):
        lb, _, rids = plan.checked_block_ids(local, remote)
        assert (_as_list(lb), _as_list(rids)) == (_as_list(local), _as_list(remote))
