"""Stage-to-stage building blocks: mapping, keys, ports, (K, V) shards and payload packing."""

from __future__ import annotations

import contextlib
import itertools
import struct
import threading
import warnings
from collections.abc import Callable
from types import SimpleNamespace

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrdma.errors import ConfigError, KvrdmaError, ProtocolError, TransferError
from kvrdma.stages import (
    HeadSharder,
    HostPool,
    ShardKey,
    StageMapping,
    StagePayload,
    StageReceiver,
    companion_id,
    default_key,
    endpoint,
    extract,
    merge_heads,
    pack,
    pack_into,
    pack_tensor,
    packed_size,
    parse_key,
    receive_designated,
    slice_heads,
    split_kv,
    stage_port,
    unpack,
    unpack_tensor,
)
from kvrdma.stages import payload as payload_format
from kvrdma.stages.payload import MAGIC, Rows, plan_pack
from kvrdma.stages.shards import cached_blocks, write_blocks

# ---------------------------------------------------------------------------- mapping


@pytest.mark.parametrize(
    ("sender", "receiver", "sources", "targets"),
    [
        (1, 1, [[0]], [[0]]),
        (1, 2, [[0], [0]], [[0, 1]]),
        (2, 1, [[0, 1]], [[0], [0]]),
        (2, 4, [[0], [0], [1], [1]], [[0, 1], [2, 3]]),
        (4, 2, [[0, 1], [2, 3]], [[0], [0], [1], [1]]),
        (3, 6, [[0], [0], [1], [1], [2], [2]], [[0, 1], [2, 3], [4, 5]]),
    ],
)
def test_mapping_routes(sender, receiver, sources, targets):
    m = StageMapping(sender, receiver)
    assert [m.sources(r) for r in range(receiver)] == sources
    assert [m.targets(s) for s in range(sender)] == targets
    assert m.ratio == max(sender, receiver) // min(sender, receiver)
    assert m.heterogeneous == (sender != receiver)


@pytest.mark.parametrize(
    ("sender", "receiver"), [(3, 2), (2, 3), (4, 6), (0, 1), (1, 0), (-2, 2), (True, 1), (2.0, 1)]
)
def test_mapping_rejects_unroutable_sizes(sender, receiver):
    with pytest.raises(ConfigError, match=r"sender|receiver|routed"):
        StageMapping(sender, receiver)


def test_mapping_rejects_unknown_dimension_and_ranks():
    with pytest.raises(ConfigError, match="dimension"):
        StageMapping(1, 2, dimension="pp")
    m = StageMapping(2, 4, dimension="sp")
    with pytest.raises(ConfigError, match="receiver_rank"):
        m.sources(4)
    with pytest.raises(ConfigError, match="sender_rank"):
        m.targets(-1)


def test_mapping_validates_the_sharded_extent():
    StageMapping(2, 4).validate(8)
    with pytest.raises(ConfigError, match="6 heads cannot be sharded over 4 receiver"):
        StageMapping(2, 4).validate(6)


@given(small=st.integers(1, 8), ratio=st.integers(1, 8), sender_smaller=st.booleans())
def test_mapping_sources_and_targets_agree(small, ratio, sender_smaller):
    sender, receiver = (small, small * ratio) if sender_smaller else (small * ratio, small)
    m = StageMapping(sender, receiver)
    pairs = {(s, r) for r in range(receiver) for s in m.sources(r)}
    assert pairs == {(s, r) for s in range(sender) for r in m.targets(s)}
    # every sender rank reaches someone and every receiver hears from someone
    assert {s for s, _ in pairs} == set(range(sender))
    assert {r for _, r in pairs} == set(range(receiver))
    # a split hands each receiver a distinct piece of its sender's shard
    for s in range(sender):
        pieces = [m.piece(r) for r in m.targets(s)]
        assert sorted(i for i, _ in pieces) == list(range(len(pieces)))


# ---------------------------------------------------------------------------- keys, ports


def test_default_key_format_and_round_trip():
    key = ShardKey("chat_cmpl_7", 1, 3, 0, 2)
    assert default_key(key) == "chat_cmpl_7_1_3_0_2"
    assert parse_key(default_key(key)) == key


@given(
    request=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40),
    nums=st.tuples(*[st.integers(0, 10_000)] * 4),
)
def test_keys_round_trip_any_request_id(request, nums):
    key = ShardKey(request, *nums)
    assert parse_key(default_key(key)) == key


@pytest.mark.parametrize(
    "text",
    [
        "",
        "r_1_2_3",
        "_1_2_3_4",
        "r_1_2_x_4",
        "r_1_2_-3_4",
        "r_1_2_3_ 4",
        "r_\u0661_2_3_4",  # an Arabic-Indic 1, which int() reads
        "r_1_2_3_\uff14",  # a fullwidth 4
        "r_01_2_3_4",  # another spelling of r_1_2_3_4
    ],
)
def test_parse_key_rejects_malformed(text):
    with pytest.raises(ConfigError, match="transfer key"):
        parse_key(text)


def test_a_key_builder_is_any_callable():
    def builder(key: ShardKey) -> str:
        return f"{key.request_id}/{key.to_rank}"

    assert builder(ShardKey("r", 0, 0, 1, 2)) == "r/2"


def test_stage_port_keeps_the_single_sender_port():
    for stage in range(3):
        assert stage_port(5600, stage, num_stages=3) == 5600 + stage


@pytest.mark.parametrize(("stages", "replicas", "ranks"), [(1, 1, 4), (2, 3, 2), (3, 2, 4)])
def test_stage_ports_never_collide(stages, replicas, ranks):
    ports = [
        stage_port(5600, s, num_stages=stages, replica=rep, rank=r, ranks_per_replica=ranks)
        for s, rep, r in itertools.product(range(stages), range(replicas), range(ranks))
    ]
    assert len(set(ports)) == len(ports) == stages * replicas * ranks
    assert min(ports) == 5600


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"stage": 2, "num_stages": 2}, "stage"),
        ({"stage": 0, "num_stages": 0}, "num_stages"),
        ({"stage": 0, "num_stages": 1, "rank": 1}, "rank"),
        ({"stage": 0, "num_stages": 1, "replica": -1}, "replica"),
        ({"stage": 0, "num_stages": 1, "base": 65535, "replica": 1}, "port 65536"),
    ],
)
def test_stage_port_rejects_bad_values(kwargs, field):
    base = kwargs.pop("base", 5600)
    stage = kwargs.pop("stage")
    with pytest.raises(ConfigError, match=field):
        stage_port(base, stage, **kwargs)


# ---------------------------------------------------------------------------- shards


def test_split_kv_reads_every_backend_form():
    kv_first = torch.arange(2 * 3 * 4).reshape(2, 3, 4)
    k, v = split_kv(kv_first)
    assert torch.equal(k, kv_first[0]) and torch.equal(v, kv_first[1])
    blocks_first = kv_first.transpose(0, 1).contiguous()  # [3, 2, 4]
    k2, v2 = split_kv(blocks_first)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert split_kv((k, v)) == (k, v)
    assert split_kv([k, v])[1] is v


def test_split_kv_refuses_ambiguous_and_bad_input():
    square = torch.zeros(2, 2, 4)
    with pytest.raises(ConfigError, match="kv_axis"):
        split_kv(square)
    k, _ = split_kv(square, kv_axis=1)
    assert k.shape == (2, 4)
    with pytest.raises(ConfigError, match="kv_axis"):
        split_kv(torch.zeros(3, 3), kv_axis=0)
    with pytest.raises(ConfigError, match="differ"):
        split_kv((torch.zeros(2), torch.zeros(3)))
    with pytest.raises(ConfigError, match="pair"):
        split_kv((torch.zeros(2),))
    with pytest.raises(ConfigError, match="tensor"):
        split_kv("kv")  # type: ignore[arg-type]


@pytest.mark.parametrize("head_axis", [-2, 1])
@pytest.mark.parametrize("count", [1, 2, 4])
def test_slices_merge_back_to_the_whole(head_axis, count):
    t = torch.randn(5, 8, 16, 3)  # NHD blocks (head axis -2) or HND (head axis 1)
    pieces = [slice_heads(t, i, count, head_axis=head_axis) for i in range(count)]
    assert torch.equal(merge_heads(pieces, head_axis=head_axis), t)


def test_slice_heads_refuses_uneven_cuts():
    with pytest.raises(ConfigError, match="split evenly"):
        slice_heads(torch.zeros(2, 6, 4), 0, 4, head_axis=1)
    with pytest.raises(ConfigError, match="head_axis"):
        slice_heads(torch.zeros(2, 6), 0, 2, head_axis=3)
    with pytest.raises(ConfigError, match="no shards"):
        merge_heads([])


@pytest.mark.parametrize(("sender", "receiver"), [(1, 2), (2, 1), (2, 4), (4, 2), (2, 2)])
def test_head_sharder_moves_exactly_each_receivers_heads(sender, receiver):
    heads = 8
    full_k = torch.randn(4, 16, heads, 8)  # [blocks, tokens, heads, dim]
    full_v = torch.randn(4, 16, heads, 8)
    m = StageMapping(sender, receiver)
    sharder = HeadSharder(m)
    shard = heads // sender
    sent = {
        s: (full_k[:, :, s * shard : (s + 1) * shard], full_v[:, :, s * shard : (s + 1) * shard])
        for s in range(sender)
    }
    want = heads // receiver
    for r in range(receiver):
        got = sharder.merge([sharder.for_receiver(sent[s], r) for s in m.sources(r)])
        assert torch.equal(got[0], full_k[:, :, r * want : (r + 1) * want])
        assert torch.equal(got[1], full_v[:, :, r * want : (r + 1) * want])


def test_head_sharder_hooks_replace_slicing_and_merging():
    calls: list[str] = []

    def slicer(t, index, count):
        calls.append(f"slice {index}/{count}")
        return t[index::count]

    def merger(ts):
        calls.append(f"merge {len(ts)}")
        return torch.stack(list(ts))

    pair = (torch.arange(4), torch.arange(4))
    split = HeadSharder(StageMapping(1, 2), slicer=slicer)
    assert torch.equal(split.for_receiver(pair, 1)[0], torch.tensor([1, 3]))
    join = HeadSharder(StageMapping(2, 1), merger=merger)
    assert join.merge([pair, pair])[0].shape == (2, 4)
    assert calls == ["slice 1/2", "slice 1/2", "merge 2", "merge 2"]


@pytest.mark.parametrize("dimension", ["sp", "ring"])
@pytest.mark.parametrize(("sender", "receiver"), [(1, 2), (2, 1)])
def test_head_sharder_of_another_dimension_needs_its_axis_or_hooks(dimension, sender, receiver):
    """Cutting an sp or ring shard by heads would hand each receiver the wrong shard."""
    m = StageMapping(sender, receiver, dimension)
    with pytest.raises(ConfigError, match=rf"{dimension} mapping .*head_axis"):
        HeadSharder(m)
    HeadSharder(m, head_axis=0)  # the axis that dimension is sharded along, named
    hook = {"slicer": lambda t, i, n: t} if m.splits else {"merger": lambda ts: ts[0]}
    HeadSharder(m, **hook)
    HeadSharder(StageMapping(2, 2, dimension))  # nothing is cut or merged


# ---------------------------------------------------------------------------- payload

_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, _numel(shape)) * 16,), dtype=torch.uint8, generator=g)
    size = torch.empty((), dtype=dtype).element_size()
    t = raw[: _numel(shape) * size].view(dtype).reshape(shape).clone()
    return t if dtype is not torch.bool else t.view(torch.uint8).remainder(2).bool()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # compare bytes: NaN payloads and -0.0 must survive too
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(_DTYPES),
    shapes=st.lists(
        st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple), min_size=1, max_size=4
    ),
    block_ids=st.lists(st.integers(0, 2**40), max_size=8),
    seed=st.integers(0, 1000),
)
def test_payload_round_trips_losslessly(dtype, shapes, block_ids, seed):
    layers = [
        (_random(s, dtype, seed + i), _random(s, dtype, seed + i + 99))
        for i, s in enumerate(shapes)
    ]
    p = StagePayload("req-1", layers, block_ids, {"stage": "thinker", "n": 3, "x": [1.5, None]})
    for q in (unpack(bytes(pack(p))), unpack(pack(p), copy=False), unpack_tensor(pack_tensor(p))):
        assert (q.request_id, q.block_ids, q.metadata) == ("req-1", block_ids, p.metadata)
        assert len(q.layers) == len(layers)
        for got, want in zip(q.layers, layers, strict=True):
            assert all(_same(g, w) for g, w in zip(got, want, strict=True))


def test_payload_views_its_buffer_unless_copied():
    p = StagePayload("r", [(torch.ones(4),)])
    buf = pack_tensor(p)
    view = unpack_tensor(buf).layers[0][0]
    copied = unpack_tensor(buf, copy=True).layers[0][0]
    view.fill_(2.0)
    assert torch.equal(unpack_tensor(buf).layers[0][0], torch.full((4,), 2.0))
    assert torch.equal(copied, torch.ones(4))


def test_payload_mixes_dtypes_and_non_contiguous_inputs():
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()  # not contiguous
    p = StagePayload("r", [(t, torch.tensor([1, 2], dtype=torch.int64)), (torch.tensor(3.5),)])
    q = unpack(pack(p))
    assert torch.equal(q.layers[0][0], t) and q.layers[1][0].shape == ()


def test_payload_packs_lazy_conjugate_and_negative_views_by_value():
    """Such views share bytes with their base and flip values only when read: their values,
    not their bytes, are packed."""
    z = torch.complex(torch.arange(4.0), torch.ones(4))
    conj, neg = z.conj(), z.conj().imag
    assert conj.is_conj() and neg.is_neg()
    for q in (unpack(pack(StagePayload("r", [(conj, neg)]))), unpack_tensor(
        pack_tensor(StagePayload("r", [(conj, neg)])), copy=True
    )):  # fmt: skip
        got = q.layers[0]
        assert torch.equal(got[0], conj.resolve_conj()) and torch.equal(got[1], -torch.ones(4))


def _model_kv(layers: int, blocks: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randn(2, blocks, 16, 4, 8, generator=g).to(torch.bfloat16) for _ in range(layers)]
    return [(t[0], t[1]) for t in kv]


@pytest.mark.parametrize(
    ("copy", "one_clone"), [(False, None), (True, None), (True, 0)], ids=["view", "clone", "pool"]
)
def test_payload_of_many_equal_layers_round_trips_with_or_without_copying(
    copy, one_clone, monkeypatch
):
    """K and V of every layer share a dtype and shape: they are packed and unpacked as runs;
    an odd tensor and a head-sliced (non-contiguous) layer in between cut those runs. A copy
    is one clone up to `_ONE_CLONE_BYTES`, else one copy into pooled memory; every tensor
    views it."""
    if one_clone is not None:
        monkeypatch.setattr(payload_format, "_ONE_CLONE_BYTES", one_clone)
    layers = _model_kv(12, 3, seed=1)
    layers[5] = (torch.arange(7, dtype=torch.int16),)
    layers[8] = (layers[8][0][:, :, :2], layers[8][1][:, :, 2:])  # views of half the heads
    buf = pack_tensor(StagePayload("r", layers, [4, 5, 6]))
    got = unpack_tensor(buf, copy=copy).layers
    assert len(got) == len(layers)
    for g, w in zip(got, layers, strict=True):
        assert all(_same(a, b) for a, b in zip(g, w, strict=True))
    aliased = got[0][0].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert aliased is not copy
    buf.fill_(0)  # copies keep their values; views follow the buffer
    assert torch.equal(got[0][0], layers[0][0]) is copy
    storages = {t.untyped_storage().data_ptr() for layer in got for t in layer}
    assert len(storages) == 1


@pytest.mark.parametrize("one_clone", [None, 0], ids=["clone", "pool"])
def test_a_copy_from_a_strided_buffer_round_trips(one_clone, monkeypatch):
    if one_clone is not None:
        monkeypatch.setattr(payload_format, "_ONE_CLONE_BYTES", one_clone)
    p = StagePayload("r", _model_kv(3, 2, seed=4), [1])
    packed = pack_tensor(p)
    room = torch.zeros(2 * packed.numel(), dtype=torch.uint8)
    room[::2] = packed
    got = unpack_tensor(room[::2], copy=True)
    for g, w in zip(got.layers, p.layers, strict=True):
        assert all(_same(a, b) for a, b in zip(g, w, strict=True))


def test_a_large_payload_received_again_lands_in_the_memory_of_one_dropped():
    """Default settings: a payload over 4 MiB is copied into the process's pool, and the
    next one of its size reuses that memory once the first one's tensors are gone."""
    layer = torch.zeros(5 << 20, dtype=torch.uint8)
    buf = pack_tensor(StagePayload("r", [(layer,)]))
    first = unpack_tensor(buf, copy=True)
    ptr = first.layers[0][0].data_ptr()
    assert ptr != buf.data_ptr()
    kept = payload_format._POOL.free_bytes()
    del first
    assert payload_format._POOL.free_bytes() > kept  # its memory went back to the pool
    buf[-1] = 7
    second = unpack_tensor(buf, copy=True).layers[0][0]
    assert second.data_ptr() == ptr
    assert second[-1] == 7


def test_unpacked_copies_reuse_host_memory_once_every_tensor_is_gone(monkeypatch):
    """Past `_ONE_CLONE_BYTES` an unpack lands in an earlier one's memory only once that
    payload's last tensor (here a view of one of its tensors) is gone; a buffer over
    `keep_bytes` is not kept."""
    monkeypatch.setattr(payload_format, "_ONE_CLONE_BYTES", 0)
    pool = HostPool(keep_bytes=1 << 20)
    p = StagePayload("r", _model_kv(4, 2, seed=5))
    buf = pack_tensor(p)
    first = unpack_tensor(buf, copy=True, pool=pool)
    ptr = first.layers[0][0].data_ptr()
    assert ptr % 64 == 0
    kept = first.layers[3][1][1:]
    del first
    assert pool.free_bytes() == 0  # the view still uses it
    second = unpack_tensor(buf, copy=True, pool=pool)
    assert second.layers[0][0].data_ptr() != ptr
    del kept
    assert pool.free_bytes() > 0
    buf[-1] ^= 0xFF  # the reused memory gets the new bytes
    third = unpack_tensor(buf, copy=True, pool=pool)
    assert third.layers[0][0].data_ptr() == ptr
    assert not _same(third.layers[3][1], p.layers[3][1])
    assert all(_same(a, b) for a, b in zip(third.layers[0], p.layers[0], strict=True))
    del second, third
    kept_before = pool.free_bytes()
    big = pool.empty(2 << 20)
    del big
    assert pool.free_bytes() == kept_before  # over keep_bytes: let go


def test_the_default_pool_keeps_up_to_256_mib_of_dropped_memory():
    """The README's promise: at most 256 MiB of dropped unpack memory stays with the process."""
    pool = HostPool()
    bufs = [pool.empty(128 << 20) for _ in range(3)]  # never touched: no memory is used
    del bufs
    assert pool.free_bytes() == 256 << 20


def test_payload_packs_into_and_unpacks_from_unaligned_buffers():
    layers = _model_kv(4, 2, seed=2)
    layers[1] = (layers[1][0][:, :, :2], layers[1][1])  # a view of half the heads
    p = StagePayload("r", layers)
    room = torch.zeros(pack_tensor(p).numel() + 1, dtype=torch.uint8)
    n = pack_into(p, room[1:])  # a slice one byte into its storage
    got = unpack_tensor(room[1 : 1 + n], copy=True)
    for g, w in zip(got.layers, p.layers, strict=True):
        assert all(_same(a, b) for a, b in zip(g, w, strict=True))
    with pytest.raises(ConfigError, match="buf: starts 1 bytes into its storage"):
        unpack_tensor(room[1 : 1 + n])


@pytest.mark.parametrize(
    "tensor",
    [
        torch.complex(torch.arange(4.0), torch.ones(4)).conj(),
        torch.complex(torch.arange(4.0), torch.ones(4)).conj().imag,
        torch.arange(8.0)[::2],
    ],
    ids=["conj", "neg", "strided"],
)
def test_lazy_views_and_strided_tensors_pack_into_unaligned_buffers_by_value(tensor):
    """As into aligned ones: a byte view of such a tensor would not read its values."""
    p = StagePayload("r", [(tensor, tensor)])
    room = torch.zeros(pack_tensor(p).numel() + 1, dtype=torch.uint8)
    n = pack_into(p, room[1:])
    got = unpack_tensor(room[1 : 1 + n], copy=True).layers[0]
    want = tensor.resolve_conj().resolve_neg()
    assert torch.equal(got[0], want) and torch.equal(got[1], want)


@pytest.mark.parametrize("lazy", ["conj", "neg", "strided"])
@pytest.mark.parametrize(
    "numel", [64, payload_format._SERIAL_NUMEL + 16], ids=["stacked", "memcpy"]
)
def test_a_run_mixing_lazy_views_with_plain_tensors_packs_by_value(lazy, numel):
    """A run of small tensors is stacked in one call and a run of larger ones copied tensor by
    tensor; either way a lazy view among plain tensors lands as its values."""
    z = torch.complex(torch.arange(float(numel)), torch.ones(numel))
    views = {"conj": z.conj(), "neg": z.conj().imag, "strided": torch.arange(2.0 * numel)[::2]}
    odd = views[lazy]
    plain = odd.resolve_conj().resolve_neg().contiguous() + 1
    p = StagePayload("r", [(plain, odd), (plain, odd)])
    assert [r.count for r in plan_pack(p).runs] == [4]  # one run: the case under test
    got = unpack(pack(p)).layers
    want = odd.resolve_conj().resolve_neg()
    assert all(torch.equal(a, plain) and torch.equal(b, want) for a, b in got)


@pytest.mark.parametrize("source", ["plain", "head_slice", "conj", "neg"])
@pytest.mark.parametrize("rows", [2, payload_format._SERIAL_NUMEL // 64 + 8], ids=["few", "many"])
@pytest.mark.parametrize("aligned", [True, False])
def test_rows_pack_exactly_as_the_tensors_they_gather(source, rows, aligned):
    """`Rows` of a cache (what `StageSender.send_blocks` packs) lands byte for byte as the
    gathered tensor would, whatever the cache is a view of and wherever the buffer starts."""
    g = torch.Generator().manual_seed(rows)
    base = torch.randn(rows * 2, 4, 16, generator=g)
    caches = {
        "plain": base,
        "head_slice": base[:, 1:3],  # a sender's heads for one receiver: not contiguous
        "conj": torch.complex(base, -base).conj(),
        "neg": torch.complex(base, -base).conj().imag,
    }
    cache = caches[source]
    index = torch.arange(rows * 2 - 1, 0, -2)  # every other block, last first
    lazy = StagePayload("r", [(Rows(cache, index), Rows(cache, index))], [1, 2])
    eager = StagePayload("r", [(cache[index], cache[index])], [1, 2])
    want = torch.zeros(packed_size(eager), dtype=torch.uint8)  # the gaps between tensors too
    pack_into(eager, want)
    room = torch.zeros(want.numel() + 1, dtype=torch.uint8)
    out = room[: want.numel()] if aligned else room[1:]
    assert pack_into(lazy, out) == want.numel()
    assert torch.equal(out, want)


@pytest.mark.parametrize("numel", [64, payload_format._SERIAL_NUMEL + 1], ids=["small", "large"])
@pytest.mark.parametrize("rows", [False, True], ids=["tensors", "rows"])
def test_tensors_that_require_grad_pack_as_their_values(numel, rows):
    """Packing copies bytes, whatever autograd records of its inputs: a run of small tensors
    (one stack) packs like a run of large ones (a memcpy each)."""
    source = torch.randn(3, numel, requires_grad=True)
    index = torch.tensor([2, 0])
    layer = (Rows(source, index),) * 2 if rows else (source[0], source[1])
    p = StagePayload("r", [layer])  # type: ignore[list-item]
    out = torch.zeros(packed_size(p), dtype=torch.uint8)
    assert pack_into(p, out) == out.numel()
    got = unpack(out).layers[0]
    want = (source[[2, 0]], source[[2, 0]]) if rows else (source[0], source[1])
    assert all(torch.equal(g, w.detach()) for g, w in zip(got, want, strict=True))


def test_payload_refuses_bad_inputs():
    with pytest.raises(ConfigError, match="request_id"):
        pack(StagePayload("", []))
    with pytest.raises(ConfigError, match=r"layers\[0\]\[1\]"):
        pack(StagePayload("r", [(torch.zeros(1), "x")]))  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="metadata"):
        pack(StagePayload("r", [], metadata={"obj": object()}))
    with warnings.catch_warnings():  # torch deprecates making quantized tensors
        warnings.simplefilter("ignore")
        quantized = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    sparse = torch.eye(3).to_sparse()
    for bad in (quantized, sparse):
        with pytest.raises(ConfigError, match=r"layers\[1\]\[0\]: expected a dense tensor"):
            pack(StagePayload("r", [(torch.zeros(2),), (bad,)]))


@pytest.mark.parametrize(
    "fields", [{"block_ids": [2**70]}, {"metadata": {"n": 2**70}}], ids=["block_ids", "metadata"]
)
def test_ints_msgpack_cannot_hold_are_refused_as_config_errors(fields):
    with pytest.raises(
        ConfigError, match="block_ids or metadata cannot be packed: can't serialize"
    ):
        pack(StagePayload("r", [(torch.zeros(2),)], **fields))


def test_corrupted_payloads_raise_protocol_errors():
    good = pack(StagePayload("r", [(torch.arange(16),)], [1], {}))
    with pytest.raises(ProtocolError, match="too short"):
        unpack(good[:5])
    with pytest.raises(ProtocolError, match="magic"):
        unpack(b"XXXX" + bytes(good[4:]))
    bad_version = bytearray(good)
    struct.pack_into("<I", bad_version, 4, 99)
    with pytest.raises(ProtocolError, match="version"):
        unpack(bad_version)
    with pytest.raises(ProtocolError, match="does not fit"):
        unpack(good[: len(good) - 8])
    assert bytes(good[:4]) == MAGIC


def _forged(
    layers: list[int], runs: list[tuple[str, list[int], int, int]], metadata: object = None
) -> bytes:
    """A payload whose header says what the arguments say, followed by 64 zero bytes."""
    f = payload_format
    specs = [f._RunSpec(*r) for r in runs]
    fields = {"request_id": "r", "block_ids": [], "metadata": metadata or {}}
    header = f._ENCODER.encode({**fields, "layers": layers, "runs": specs})
    head = f._PREFIX.pack(MAGIC, f.VERSION, len(header)) + header
    return head + bytes(-len(head) % 64 + 64)


def test_headers_that_misstate_their_tensors_are_refused():
    assert len(unpack(_forged([2], [("int8", [4], 0, 2)])).layers[0]) == 2  # the forger works
    with pytest.raises(ProtocolError, match="the layers name 3 tensors, the runs hold 2"):
        unpack(_forged([3], [("int8", [4], 0, 2)]))
    with pytest.raises(ProtocolError, match="does not fit"):  # a few bytes, a million tensors
        unpack(_forged([1 << 20], [("int8", [0], 0, 1 << 20)]))
    with pytest.raises(ProtocolError, match="does not fit"):
        unpack(_forged([1], [("int8", [4], 0, 0)]))
    with pytest.raises(ConfigError, match="at most"):
        pack(StagePayload("r", [(torch.zeros(0),) * 1000] * 100))


def test_a_header_with_a_string_that_is_not_utf8_is_a_protocol_error():
    forged = _forged([], [], {"k": "\u00e9\u00e9"})
    with pytest.raises(ProtocolError, match="bad header"):
        unpack(forged.replace("\u00e9\u00e9".encode(), b"\xff\xfe\xfd\xfc"))


def test_a_header_nested_too_deeply_is_a_protocol_error():
    nested = {"a": msgspec.Raw(b"\x91" * 10_000 + b"\xc0")}  # [[[...]]], 10 KB of header
    with pytest.raises(ProtocolError, match="bad header: nested too deeply"):
        unpack(_forged([], [], nested))


@pytest.mark.parametrize("shape", [[0, 2**63], [0, 2**64 - 1], [2**64 - 1, 0]])
def test_a_dimension_no_tensor_can_have_is_refused(shape):
    """Next to a 0 it passes the size check (the run holds no bytes); torch sizes are int64."""
    with pytest.raises(ProtocolError, match=r"expected dimensions in \[0, 2\*\*63\)"):
        unpack(_forged([1], [("int8", shape, 0, 1)]))


@pytest.mark.parametrize("dtype", ["qint8", "quint8", "qint32", "quint4x2", "quint2x4"])
def test_a_dtype_pack_never_writes_is_refused_on_unpack(dtype):
    """`pack` refuses quantized tensors; one built from a header's bytes has no scale."""
    assert len(unpack(_forged([1], [("int8", [4], 0, 1)])).layers[0]) == 1  # the forger works
    with pytest.raises(ProtocolError, match=f"expected a dtype a payload carries, got '{dtype}'"):
        unpack(_forged([1], [(dtype, [4], 0, 1)]))


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200), keep_prefix=st.booleans())
def test_random_bytes_never_escape_as_anything_but_kvrdma_errors(data, keep_prefix):
    good = pack(StagePayload("r", [(torch.arange(4),)]))
    blob = bytes(good[:12]) + data if keep_prefix else data
    with contextlib.suppress(KvrdmaError):
        unpack(blob)


# ---------------------------------------------------------------------------- extraction


@pytest.mark.parametrize("form", ["kv_first", "blocks_first", "pair"])
def test_extract_takes_the_requests_blocks_in_order(form: str) -> None:
    cache = torch.randn(2, 10, 4, 2, 8)  # [2, blocks, tokens, heads, dim]
    layer = {
        "kv_first": cache,
        "blocks_first": cache.transpose(0, 1),
        "pair": (cache[0], cache[1]),
    }[form]
    (k, v), *_ = extract([layer], [7, 2, 9])
    assert torch.equal(k, cache[0][[7, 2, 9]]) and torch.equal(v, cache[1][[7, 2, 9]])
    k.zero_()  # a copy: the cache is untouched
    assert cache[0][7].abs().sum() > 0


def test_extract_refuses_bad_block_ids() -> None:
    layer = torch.zeros(2, 4, 3)
    with pytest.raises(ConfigError, match=r"outside layer 0's 4 blocks"):
        extract([layer], [1, 4])
    with pytest.raises(ConfigError, match="block_ids"):
        extract([layer], [1.0])  # type: ignore[list-item]


@pytest.mark.parametrize("form", ["kv_first", "blocks_first", "pair"])
@pytest.mark.parametrize(("index", "count"), [(1, 3), (0, 1)], ids=["some_heads", "all_heads"])
def test_write_blocks_fills_its_heads_of_the_named_blocks_only(form, index, count) -> None:
    """Some heads of a block are strided (`index_copy_`), all of a large block are one run of
    bytes (a memcpy per block): either way exactly those heads of those blocks are written."""
    cache = torch.randn(2, 10, 16, 6, 32)  # [2, blocks, tokens, heads, dim]; 12 KiB blocks
    layer = {
        "kv_first": cache,
        "blocks_first": cache.transpose(0, 1),
        "pair": (cache[0], cache[1]),
    }[form]
    want, heads = cache.clone(), 6 // count
    shard = torch.randn(2, 3, 16, heads, 32)
    want[:, [7, 2, 9], :, index * heads : (index + 1) * heads] = shard
    cached = cached_blocks([layer], [7, 2, 9])
    write_blocks(cached, [(shard[0], shard[1])], piece=(index, count), head_axis=-2, what="shard")
    assert torch.equal(cache, want)


@pytest.mark.parametrize(
    ("k", "piece", "why"),
    [
        (torch.zeros(3, 4, 2, 8), (0, 1), r"\(3, 4, 6, 8\), piece 0 of 1 of the 6 heads"),  # some
        (torch.zeros(3, 4, 2, 8), (0, 4), "piece 0 of 4 of the 6 heads"),  # cannot split
        (torch.zeros(8), (2, 3), r"is torch.float32 \(8,\)"),  # not a layer's KV at all
        (torch.zeros(3, 4, 2, 8, dtype=torch.float16), (0, 3), "torch.float16"),
        (torch.zeros(2, 4, 2, 8), (0, 3), r"take torch.float32 \(3, 4, 2, 8\)"),  # blocks
        (torch.zeros(3, 4, 2, 4), (0, 3), r"\(3, 4, 2, 4\)"),  # head size
    ],
)
def test_write_blocks_refuses_a_shard_that_does_not_fit_naming_it(k, piece, why) -> None:
    """A shard must be exactly its piece of the cache's heads: one covering fewer heads would
    leave the rest of the blocks holding another request's values."""
    cache = torch.zeros(2, 10, 4, 6, 8)
    cached = cached_blocks([cache], [7, 2, 9])
    with pytest.raises(TransferError, match=rf"shard 'x': layer 0 .*{why}"):
        write_blocks(cached, [(k, k)], piece=piece, head_axis=-2, what="shard 'x'")
    with pytest.raises(TransferError, match="shard 'x': 2 layers for a cache of 1"):
        write_blocks(cached, [(k, k)] * 2, piece=(0, 3), head_axis=-2, what="shard 'x'")
    assert not cache.any()  # nothing written


def test_companion_ids_and_designated_receiving() -> None:
    assert companion_id("req-1", "cfg") == "req-1#cfg"
    with pytest.raises(ConfigError, match="companion name"):
        companion_id("req-1", "a#b")

    class OneReceiver:
        def receive(self, request_id: str, *, timeout: float) -> StagePayload:
            return StagePayload(request_id, [(torch.ones(2),)])

    shared: list[StagePayload | None] = []

    def broadcast(payload: StagePayload | None) -> StagePayload:
        if payload is not None:
            shared.append(payload)
        return shared[0]

    got = receive_designated(OneReceiver(), "r", broadcast)  # type: ignore[arg-type]
    other = receive_designated(None, "r", broadcast)
    assert got is other and got.request_id == "r"


def test_a_designated_receive_that_fails_fails_every_rank_instead_of_hanging_them() -> None:
    """The designated rank's receive fails (a dead sender): it still takes part in the
    broadcast the other ranks wait in, so each of them raises too, naming the request."""

    class DeadSender:
        def receive(self, request_id: str, *, timeout: float) -> StagePayload:
            raise TransferError(f"request {request_id!r}: sender rank 0 is gone")

    box: list[StagePayload | None] = [None]
    barrier = threading.Barrier(2, timeout=5.0)  # a collective both ranks must enter

    def broadcast(rank: int) -> Callable[[StagePayload | None], StagePayload | None]:
        def run(payload: StagePayload | None) -> StagePayload | None:
            if rank == 0:
                box[0] = payload
            barrier.wait()
            return box[0]

        return run

    errors: list[BaseException] = []

    def other_rank() -> None:
        try:
            receive_designated(None, "r", broadcast(1))  # type: ignore[arg-type]
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=other_rank)
    thread.start()
    with pytest.raises(TransferError, match="sender rank 0 is gone"):
        receive_designated(DeadSender(), "r", broadcast(0))  # type: ignore[arg-type]
    thread.join(timeout=10)
    assert len(errors) == 1 and isinstance(errors[0], TransferError), errors
    assert "request 'r': the designated rank did not receive it" in str(errors[0])


def test_a_tensor_moved_after_planning_is_packed_from_where_it_is():
    """`plan_pack(...).into(out)` reads a tensor that got new storage in between from its
    new place, not from the memory it left."""
    t = torch.arange(16, dtype=torch.float32)
    p = StagePayload("r", [(t,)])
    plan = plan_pack(p)
    t.set_(torch.full((16,), 7.0))
    out = torch.zeros(plan.nbytes, dtype=torch.uint8)
    plan.into(out)
    assert torch.equal(unpack_tensor(out).layers[0][0], torch.full((16,), 7.0))


@pytest.mark.parametrize(
    "other",
    [torch.zeros(16, dtype=torch.int32), torch.zeros(4, 4), torch.zeros(1)],
    ids=["dtype", "shape", "broadcastable"],
)
@pytest.mark.parametrize("aligned", [True, False])
def test_a_tensor_whose_dtype_or_shape_changed_after_planning_is_refused(other, aligned):
    """The header states each tensor's dtype and shape: a kept plan whose tensor changed
    since (same bytes or not) is refused, not packed under the wrong description."""
    t = torch.arange(16, dtype=torch.float32)
    plan = plan_pack(StagePayload("r", [(t,)]))
    t.data = other
    out = torch.zeros(plan.nbytes + 1, dtype=torch.uint8)
    with pytest.raises(ConfigError, match=r"planned as torch.float32 \(16,\) is now"):
        plan.into(out[0 if aligned else 1 :])


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"slot": -1}, "slot"),
        ({"slots": 0}, "slots"),
        ({"nbytes": 0}, "nbytes"),
        ({"expires_at": float("inf")}, "expires_at"),
        ({"expires_at": float("nan")}, "expires_at"),
        ({"key": ""}, "key"),
        ({"key": "k" * (endpoint.MAX_KEY_CHARS + 1)}, "key"),
        ({"incarnation": "f" * (endpoint.INCARNATION_CHARS + 1)}, "incarnation"),
        ({"offer_id": -1}, "offer_id"),
    ],
)
def test_an_offer_out_of_bounds_is_refused_naming_its_field(fields: dict, named: str) -> None:
    """A peer's offer is checked as it is decoded: no negative slot, empty run, endless
    lease or unbounded key reaches the receiver's bookkeeping."""
    good = {"key": "r_0_0_0_0", "slot": 0, "slots": 1, "nbytes": 8, "expires_at": 5.0}
    raw = endpoint.NOTIF_PREFIX + msgspec.msgpack.encode({"type": "offer", **good, **fields})
    with pytest.raises(ProtocolError, match=rf"\$\.{named}"):
        endpoint.decode(raw, "peer-a")
    assert endpoint.decode(endpoint.encode(endpoint.Offer(**good)), "peer-a") == endpoint.Offer(
        **good
    )
    long_reason = endpoint.NOTIF_PREFIX + msgspec.msgpack.encode(
        {"type": "done", "key": "r", "ok": False, "reason": "x" * 5000}
    )
    with pytest.raises(ProtocolError, match=r"\$\.reason"):
        endpoint.decode(long_reason, "peer-a")


def test_offer_ids_are_optional_on_the_wire_both_ways() -> None:
    """A peer that names no offers still talks to one that does: its offers and Dones decode
    with `offer_id` 0, and it decodes theirs by skipping the field it does not know."""
    for old in (
        {"type": "offer", "key": "r", "slot": 0, "slots": 1, "nbytes": 8},
        {"type": "done", "key": "r"},
    ):
        raw = endpoint.NOTIF_PREFIX + msgspec.msgpack.encode(old)
        assert endpoint.decode(raw, "peer-a").offer_id == 0

    class OldDone(msgspec.Struct, tag="done"):
        key: str
        ok: bool = True
        reason: str = ""

    new = endpoint.encode(endpoint.Done("r", False, "gone", offer_id=7))
    got = msgspec.msgpack.decode(new[len(endpoint.NOTIF_PREFIX) :], type=OldDone)
    assert got == OldDone("r", False, "gone")


def test_a_notification_with_a_key_that_is_not_utf8_is_a_protocol_error() -> None:
    raw = endpoint.NOTIF_PREFIX + msgspec.msgpack.encode({"type": "done", "key": "r\u00e9"})
    with pytest.raises(ProtocolError, match="from 'peer-a'"):
        endpoint.decode(raw.replace("\u00e9".encode(), b"\xff\xfe"), "peer-a")


def test_a_notification_nested_too_deeply_is_a_protocol_error() -> None:
    """A peer's few KB of nested arrays is refused like any other malformed notification."""
    junk = msgspec.Raw(b"\x91" * 10_000 + b"\xc0")
    raw = endpoint.NOTIF_PREFIX + msgspec.msgpack.encode({"type": "done", "key": "r", "x": junk})
    with pytest.raises(ProtocolError, match="from 'peer-a': nested too deeply"):
        endpoint.decode(raw, "peer-a")


def test_senders_shards_that_do_not_match_fail_the_receive_naming_them() -> None:
    """A receiver merging 2 senders' shards: same layout merges along the heads; a shard
    with another layer count, heads that do not join or another dtype is a `TransferError`."""
    from kvrdma.errors import TransferError
    from kvrdma.stages.receiver import _merged

    sharder = HeadSharder(StageMapping(2, 1))
    kv = [torch.randn(2, 16, 4, 8) for _ in range(4)]
    a = StagePayload("r", [(kv[0], kv[1])], [1], {}, "r_0_0_0_0")
    b = StagePayload("r", [(kv[2], kv[3])], [1], {}, "r_0_0_1_0")
    got = _merged(sharder, [a, b])
    assert torch.equal(got.layers[0][0], torch.cat([kv[0], kv[2]], dim=-2))
    longer = StagePayload("r", [(kv[2], kv[3])] * 2, [1], {}, "r_0_0_1_0")
    with pytest.raises(TransferError, match=r"r_0_0_0_0.*do not match.*\(2,\), 'r'\], \[\(2, 2\)"):
        _merged(sharder, [a, longer])
    odd = StagePayload("r", [(torch.randn(3, 16, 4, 8), kv[3])], [1], {}, "r_0_0_1_0")
    with pytest.raises(TransferError, match="layer 0 does not merge"):
        _merged(sharder, [a, odd])
    flat = [
        StagePayload("r", [(torch.randn(8), torch.randn(8))], [1], {}, f"r_0_0_{i}_0")
        for i in (0, 1)
    ]
    with pytest.raises(TransferError, match="layer 0 does not merge: head_axis -2 is outside"):
        _merged(sharder, flat)  # no head axis to merge along
    half = StagePayload("r", [(kv[2].half(), kv[3])], [1], {}, "r_0_0_1_0")
    with pytest.raises(TransferError, match=r"layer 0 has other dtypes.*'float16', 'float32'"):
        _merged(sharder, [a, half])  # not promoted to float32


def test_receive_blocks_with_a_custom_merger_writes_the_merged_payload(monkeypatch) -> None:
    """A custom merger's result cannot be written sender by sender: the merged payload is."""
    mapping = StageMapping(2, 1)
    sharder = HeadSharder(mapping, merger=lambda ts: torch.cat(list(ts), dim=-2))
    endpoint = SimpleNamespace(size=1, rank=0)
    rx = StageReceiver(endpoint, mapping, from_stage_index=0, sharder=sharder)  # type: ignore[arg-type]
    k = torch.randn(2, 4, 6, 8)
    merged = StagePayload("r", [(k, k + 1)], [4, 5], {"m": 1}, "key")
    monkeypatch.setattr(rx, "receive", lambda rid, **_: merged)
    cache = torch.zeros(2, 6, 4, 6, 8)
    got = rx.receive_blocks("r", [cache], [1, 3])
    assert torch.equal(cache[0, [1, 3]], k) and torch.equal(cache[1, [1, 3]], k + 1)
    assert not cache[:, [0, 2, 4, 5]].any()
    assert (got.request_id, got.layers, got.block_ids, got.metadata) == ("r", [], [4, 5], {"m": 1})


def test_receive_blocks_refuses_a_block_named_twice(monkeypatch) -> None:
    """Two shard rows written into one block would leave whichever landed last."""
    mapping = StageMapping(1, 1)
    rx = StageReceiver(SimpleNamespace(size=1, rank=0), mapping, from_stage_index=0)  # type: ignore[arg-type]
    monkeypatch.setattr(rx, "_receive", lambda *_: pytest.fail("received with bad block ids"))
    cache = torch.zeros(2, 4, 16, 4, 8)
    with pytest.raises(ConfigError, match=r"block_ids: \[3\] named more than once"):
        rx.receive_blocks("r", [cache], [3, 1, 3])


@pytest.mark.parametrize(
    "timeout", [0, -1.0, float("inf"), float("nan"), None, "5", True, 10**400], ids=repr
)
def test_receive_blocks_refuses_a_timeout_that_is_not_a_positive_finite_number(timeout) -> None:
    """A NaN or infinite deadline is never reached: such a receive would wait forever; None
    (no deadline), a string or a bool is not a number of seconds, nor an int past any float."""
    mapping = StageMapping(1, 1)
    endpoint = SimpleNamespace(size=1, rank=0)
    rx = StageReceiver(endpoint, mapping, from_stage_index=0)  # type: ignore[arg-type]
    cache = torch.zeros(2, 4, 16, 4, 8)
    with pytest.raises(ConfigError, match="timeout: expected a positive number of seconds"):
        rx.receive_blocks("r", [cache], [1], timeout=timeout)
    assert not cache.any()


@pytest.mark.parametrize("slot_bytes", [1000, (1 << 16) + 32])
def test_an_endpoint_refuses_slots_that_would_misalign_landed_tensors(slot_bytes) -> None:
    """`receive_blocks` views a landed shard's tensors where they lie, at offsets the payload
    aligns to 64 bytes from its first slot: a slot size off that grain fails every shard not
    landing at slot 0."""
    with pytest.raises(
        ConfigError, match=rf"slot_bytes: expected a multiple of 64, got {slot_bytes}"
    ):
        endpoint.StageEndpoint(
            pipeline="t",
            stage="s",
            rank=0,
            size=1,
            slot_bytes=slot_bytes,
            backend=SimpleNamespace(),  # type: ignore[arg-type]
        )
