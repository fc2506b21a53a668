"""KV tensors → registration regions (SPEC §1), layout detection, and every RegistrationError."""

from __future__ import annotations

import pytest
import torch

from kvrdma.errors import RegistrationError
from kvrdma.layout import build_regions, dense_in_order, normalize_kv
from kvrdma.testing.synthetic import CacheSpec, ModelShape, make_caches

N, B, H, D = 5, 4, 2, 8  # blocks, block size, heads, head dim
ES = 2  # float16
SHAPE = ModelShape(
    num_layers=3,
    num_kv_heads=H,
    head_dim=D,
    latent_dim=12,
    mamba_layers=2,
    mamba_state=64,
    mamba_conv=16,
)


def caches(layout: str, kvl: str = "NHD"):
    spec = CacheSpec(SHAPE, layout, kvl, 0, 1, B, N)  # type: ignore[arg-type]
    return make_caches(spec)


def build(kv, layout, mamba=(), block_size=B):
    return build_regions(kv, cache_layout=layout, block_size=block_size, mamba_layers=mamba)


def addr(t: torch.Tensor) -> int:
    return t.data_ptr()


# ---- one test per layout -----------------------------------------------------------------------


@pytest.mark.parametrize("kvl", ["NHD", "HND"])
def test_split_kv(kvl):
    kv, _ = caches("split_kv", kvl)
    info = build(kv, "split_kv")
    names = list(kv)
    assert [r.name for r in info.regions] == [f"{n}.{p}" for n in names for p in ("K", "V")]
    expected = [addr(kv[n][i]) for n in names for i in (0, 1)]  # type: ignore[index]
    assert [r.meta.base_addr for r in info.regions] == expected
    for r in info.regions:
        m = r.meta
        assert (m.num_blocks, m.block_len, m.kind, m.fragments) == (N, B * H * D * ES, "attn", 1)
        assert m.device_id == 0
        assert tuple(r.data.shape) == (N, m.block_len) and r.data.dtype == torch.uint8
        assert r.data.data_ptr() == m.base_addr
    assert info.kv_layout == kvl
    assert (info.num_blocks, info.block_size, info.num_heads, info.head_dim) == (N, B, H, D)
    assert (info.dtype, info.element_size, info.num_layers) == ("float16", ES, 3)
    assert info.registered_bytes == 6 * N * B * H * D * ES
    assert info.attention_regions == info.regions


@pytest.mark.parametrize("kvl", ["NHD", "HND"])
def test_blocks_first(kvl):
    kv, _ = caches("blocks_first", kvl)
    info = build(kv, "blocks_first")
    assert [r.name for r in info.regions] == list(kv)
    assert [r.meta.base_addr for r in info.regions] == [addr(t) for t in kv.values()]  # type: ignore[arg-type]
    for r in info.regions:
        assert (r.meta.num_blocks, r.meta.block_len) == (N, 2 * B * H * D * ES)
        assert (r.meta.kind, r.meta.fragments) == ("attn", 2)
    assert info.kv_layout == kvl
    assert info.num_layers == 3


def test_mla():
    kv, _ = caches("mla")
    info = build(kv, "mla")
    assert [r.meta.base_addr for r in info.regions] == [addr(t) for t in kv.values()]  # type: ignore[arg-type]
    for r in info.regions:
        assert (r.meta.num_blocks, r.meta.block_len) == (N, B * 12 * ES)
        assert (r.meta.kind, r.meta.fragments) == ("mla", 1)
    assert (info.num_heads, info.head_dim, info.kv_layout) == (0, 12, "NHD")


@pytest.mark.parametrize("kvl", ["NHD", "HND"])
def test_cross_layer(kvl):
    kv, _ = caches("cross_layer", kvl)
    (t,) = kv.values()
    info = build(kv, "cross_layer")
    assert len(info.regions) == 1
    m = info.regions[0].meta
    assert m.base_addr == addr(t)  # type: ignore[arg-type]
    assert (m.num_blocks, m.block_len) == (N, 3 * 2 * B * H * D * ES)
    assert (m.kind, m.fragments) == ("attn", 6)
    assert (info.num_layers, info.kv_layout) == (3, kvl)


@pytest.mark.parametrize("kvl", ["NHD", "HND"])
def test_mamba_hybrid(kvl):
    kv, mamba = caches("mamba", kvl)
    # put a Mamba layer first: its region must still follow the attention ones
    kv = {mamba[0]: kv.pop(mamba[0]), **kv}
    info = build(kv, "mamba", mamba)
    attn = [n for n in kv if n not in mamba]
    assert [r.name for r in info.regions] == [*attn, *mamba]
    for r, name in zip(info.regions[:3], attn, strict=True):
        t = kv[name]
        assert isinstance(t, torch.Tensor) and t.shape[0] == 2  # a [2, N, ...] view
        assert r.meta.base_addr == addr(t)
        assert (r.meta.block_len, r.meta.kind, r.meta.fragments) == (2 * B * H * D * ES, "attn", 2)
    for r, name in zip(info.regions[3:], mamba, strict=True):
        conv, ssm = kv[name]  # type: ignore[misc]
        assert r.meta.base_addr == addr(conv)
        assert addr(ssm) == addr(conv) + 16 * ES
        assert (r.meta.num_blocks, r.meta.block_len) == (N, 64 * ES)
        assert (r.meta.kind, r.meta.fragments) == ("mamba", 1)
    assert len(info.attention_regions) == 3
    assert (info.num_layers, info.kv_layout, info.num_heads) == (5, kvl, H)


def test_mamba_accepts_blocks_first_tensor_and_single_state():
    att = torch.zeros(N, 2, B, H, D, dtype=torch.float16)
    state = torch.zeros(N, 10, dtype=torch.float32)
    info = build({"a": att, "m": state}, "mamba", ["m"])
    assert [r.meta.base_addr for r in info.regions] == [addr(att), addr(state)]
    assert info.regions[1].meta.block_len == 40


def test_pure_mamba_layers_only_need_the_mamba_layout():
    page = torch.zeros(N, 8, dtype=torch.float32)
    info = build({"m": (page[:, :3], page[:, 3:])}, "mamba", ["m"])
    assert [(r.meta.kind, r.meta.block_len) for r in info.regions] == [("mamba", 32)]
    assert info.num_heads == 0


# ---- NHD / HND, tuples, duplicates --------------------------------------------------------------


def test_layout_detected_from_permuted_view():
    hnd = torch.zeros(N, H, B, D).permute(0, 2, 1, 3)  # logical [N, B, H, D], memory HND
    nhd = torch.zeros(N, B, H, D)
    assert dense_in_order(hnd, (0, 2, 1, 3)) and not dense_in_order(hnd, range(4))
    v_hnd = torch.zeros(N, H, B, D).permute(0, 2, 1, 3)
    assert build({"l": (hnd, v_hnd)}, "split_kv").kv_layout == "HND"
    assert build({"l": (nhd, nhd.clone())}, "split_kv").kv_layout == "NHD"


def test_mixed_layouts_across_k_and_v_rejected():
    hnd = torch.zeros(N, H, B, D).permute(0, 2, 1, 3)
    nhd = torch.zeros(N, B, H, D)
    with pytest.raises(RegistrationError, match=r"layer 'l'.*'HND'.*earlier layers have.*'NHD'"):
        build({"l": (nhd, hnd)}, "split_kv")


def test_single_head_or_single_token_is_both_layouts():
    """With H == 1 the two orders coincide; detection must not reject it."""
    t = torch.zeros(2, N, B, 1, D)
    assert build({"l": t}, "split_kv").kv_layout == "NHD"


def test_tuple_input():
    k = torch.zeros(N, B, H, D, dtype=torch.bfloat16)
    v = torch.zeros(N, B, H, D, dtype=torch.bfloat16)
    info = build({"l0": (k, v), "l1": [k.clone(), v.clone()]}, "split_kv")
    assert [r.name for r in info.regions] == ["l0.K", "l0.V", "l1.K", "l1.V"]
    assert info.regions[0].meta.base_addr == addr(k)
    assert info.regions[1].meta.base_addr == addr(v)
    assert info.dtype == "bfloat16"
    assert normalize_kv((k, v), "l0") == (k, v)
    stacked = torch.zeros(2, N, B, H, D)
    nk, nv = normalize_kv(stacked, "s")
    assert (addr(nk), addr(nv)) == (addr(stacked[0]), addr(stacked[1]))


def test_duplicate_tensors_registered_once():
    shared = torch.zeros(2, N, B, H, D)
    other = torch.zeros(2, N, B, H, D)
    info = build({"l0": shared, "l1": shared, "l2": other}, "split_kv")
    assert [r.name for r in info.regions] == ["l0.K", "l0.V", "l2.K", "l2.V"]
    assert info.registered_bytes == 4 * N * B * H * D * 4
    bf = torch.zeros(N, 2, B, H, D)
    assert len(build({"a": bf, "b": bf}, "blocks_first").regions) == 1


# ---- every RegistrationError ---------------------------------------------------------------------


def _f16(*shape):
    return torch.zeros(*shape, dtype=torch.float16)


@pytest.mark.parametrize(
    ("layout", "value", "pattern"),
    [
        (
            "split_kv",
            _f16(N, B, H, D),
            r"layer 'x': expected \[2, num_blocks, .*got \(5, 4, 2, 8\)",
        ),
        ("split_kv", _f16(3, N, B, H, D), r"layer 'x': expected \[2, num_blocks"),
        ("split_kv", "nope", r"layer 'x': expected \[2, .* got str"),
        ("split_kv", (_f16(N, B, H, D),) * 3, r"layer 'x': expected a \(K, V\) pair, got 3"),
        (
            "split_kv",
            (_f16(N, B, H * D), _f16(N, B, H * D)),
            r"layer 'x': K must be \[num_blocks, block_size, heads, head_dim\], got \(5, 4, 16\)",
        ),
        (
            "split_kv",
            (_f16(N, B, H, D), _f16(N, B, H, D + 1)),
            r"layer 'x': K \(5, 4, 2, 8\) torch.float16 and V \(5, 4, 2, 9\) .* differ",
        ),
        (
            "split_kv",
            (_f16(N, B, H, D), torch.zeros(N, B, H, D)),
            r"layer 'x': K .*torch.float16 and V .*torch.float32 differ",
        ),
        (
            "blocks_first",
            _f16(2, N, B, H, D),
            r"layer 'x': blocks-first cache must be \[num_blocks, 2, .*got \(2, 5, 4, 2, 8\)",
        ),
        ("blocks_first", _f16(N, 2, B, H), r"layer 'x': blocks-first cache must be"),
        (
            "blocks_first",
            (_f16(N, B, H, D), _f16(N, B, H, D)),
            r"layer 'x': expected one tensor for this layout, got tuple",
        ),
        (
            "mla",
            _f16(N, B, H, D),
            r"layer 'x': MLA cache must be a contiguous \[num_blocks, block_size, latent_dim\] "
            r"tensor, got shape \(5, 4, 2, 8\) contiguous=True",
        ),
        ("mla", _f16(N, 12, B).transpose(1, 2), r"layer 'x': MLA .*contiguous=False"),
        (
            "cross_layer",
            _f16(N, 2, B, H, D),
            r"layer 'x': cross-layer cache must be \[num_blocks, num_layers, 2, .*got \(5, 2, 4",
        ),
        ("cross_layer", _f16(N, 3, 3, B, H, D), r"layer 'x': cross-layer cache must be"),
        ("mamba", _f16(2, 3, B, H, D), r"layer 'x': blocks-first cache must be"),
    ],
)
def test_wrong_shapes(layout, value, pattern):
    kv = {"x": value}
    mamba = ["m"] if layout == "mamba" else []
    if mamba:
        kv["m"] = torch.zeros(N, 4)
    with pytest.raises(RegistrationError, match=pattern):
        build(kv, layout, mamba)


@pytest.mark.parametrize(
    ("layout", "value", "name"),
    [
        ("split_kv", _f16(2, N, B, D, H).transpose(3, 4), "x.K"),  # [.., D, H] memory
        ("split_kv", _f16(2, N, B, H, 2 * D)[..., ::2], "x.K"),  # gaps
        ("split_kv", _f16(2, B, N, H, D).transpose(1, 2), "x.K"),  # tokens outermost
        ("blocks_first", _f16(N, 2, B, H, 2 * D)[..., :D], "x"),
        ("cross_layer", _f16(N, 2, 2, B, D, H).transpose(4, 5), "x"),
        ("mamba", _f16(N, 2, B, D, H).transpose(3, 4).transpose(0, 1), "x"),
    ],
)
def test_non_dense_strides(layout, value, name):
    kv = {"x": value}
    mamba = ["m"] if layout == "mamba" else []
    if mamba:
        kv["m"] = torch.zeros(N, 4)
    with pytest.raises(
        RegistrationError,
        match=rf"layer '{name}': tensor of shape .* strides .* is not dense in NHD .* or HND",
    ):
        build(kv, layout, mamba)


@pytest.mark.parametrize(
    ("layout", "value"),
    [
        ("split_kv", _f16(2, N, 8, H, D)),
        ("blocks_first", _f16(N, 2, 8, H, D)),
        ("mla", _f16(N, 8, 12)),
        ("cross_layer", _f16(N, 2, 2, 8, H, D)),
    ],
)
def test_block_size_mismatch(layout, value):
    with pytest.raises(
        RegistrationError,
        match=r"layer 'x': block_size dimension is 8, configured block_size is 4",
    ):
        build({"x": value}, layout)


@pytest.mark.parametrize(
    ("second", "pattern"),
    [
        (_f16(2, N, B, 2 * H, D), r"layer 'l1': \(heads, head_dim, dtype, layout, device\) = \(4,"),
        (_f16(2, N, B, H, 2 * D), r"layer 'l1': .* = \(2, 16, torch.float16"),
        (
            torch.zeros(2, N, B, H, D),
            r"layer 'l1': .* = \(2, 8, torch.float32.*earlier layers have \(2, 8, torch.float16",
        ),
        (_f16(2, N + 1, B, H, D), r"layer 'l1': 6 blocks, earlier layers have 5"),
    ],
    ids=["heads", "head_dim", "dtype", "num_blocks"],
)
def test_inconsistent_layers(second, pattern):
    with pytest.raises(RegistrationError, match=pattern):
        build({"l0": _f16(2, N, B, H, D), "l1": second}, "split_kv")


def _page(n=N, width=16):
    return torch.zeros(n, width, dtype=torch.float32)


@pytest.mark.parametrize(
    ("state", "pattern"),
    [
        (
            (_page()[:, :4], _page()[:, 4:12]),
            r"Mamba layer 'm': state 1 must start 16 bytes into the page",
        ),
        (
            (lambda p: (p[:, :4], p[:, 4:12]))(_page()),
            r"Mamba layer 'm': states cover 48 bytes of a 64-byte page; they must fill it",
        ),
        (
            (lambda p: (p[:, :4], p[:, 8:]))(_page()),
            r"Mamba layer 'm': state 1 must start 16 bytes into the page",
        ),
        (
            (lambda p: (p[:, :4], p[:-1, 4:]))(_page()),
            r"Mamba layer 'm': state 1 has 4 blocks with a 64-byte block stride; expected 5 "
            r"blocks with a 64-byte stride",
        ),
        (
            (lambda p: (p[:, :4], p[:, 4:].reshape(N, 4, 3)[:, :, :2]))(_page(width=16)),
            r"Mamba layer 'm': state 1 must start 16 bytes into the page and be contiguous",
        ),
        (
            (_page()[:, :4], torch.zeros(N, 24)),
            r"Mamba layer 'm': state 1 has 5 blocks with a 96-byte block stride; expected 5 "
            r"blocks with a 64-byte stride",
        ),
        ((), r"Mamba layer 'm': expected a state tensor or \(conv, ssm\)"),
        (("conv", "ssm"), r"Mamba layer 'm': expected a state tensor or \(conv, ssm\)"),
        (_page(n=N + 1), r"layer 'm': 6 blocks, earlier layers have 5"),
    ],
    ids=[
        "separate-buffers",
        "not-filling",
        "gap",
        "block-count",
        "not-contiguous",
        "stride",
        "empty",
        "not-tensors",
        "num-blocks",
    ],
)
def test_bad_mamba_state(state, pattern):
    kv = {"a": _f16(2, N, B, H, D).transpose(0, 1).contiguous().transpose(0, 1), "m": state}
    with pytest.raises(RegistrationError, match=pattern):
        build(kv, "mamba", ["m"])


def test_empty_and_unknown_layouts():
    with pytest.raises(RegistrationError, match="kv_caches is empty: nothing to register"):
        build({}, "split_kv")
    with pytest.raises(
        RegistrationError,
        match=r"cache_layout must be one of split_kv, blocks_first, mla, cross_layer, mamba, "
        r"unified, got 'paged'",
    ):
        build({"x": _f16(2, N, B, H, D)}, "paged")


def test_mamba_layer_names_checked():
    kv = {"a": _f16(N, 2, B, H, D), "m": _page()}
    with pytest.raises(RegistrationError, match=r"mamba_layers name unknown layers: \['n', 'z'\]"):
        build(kv, "mamba", ["z", "m", "n"])
    with pytest.raises(
        RegistrationError,
        match=r"mamba_layers given but cache_layout is 'blocks_first'; use 'mamba' or 'unified'",
    ):
        build(kv, "blocks_first", ["m"])
    with pytest.raises(RegistrationError, match=r"cache_layout 'mamba' needs at least one layer"):
        build({"a": _f16(N, 2, B, H, D)}, "mamba")
