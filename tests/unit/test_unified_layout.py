"""vLLM's unified layout → registration regions, for every physical order, and its errors."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kvrdma.config import load_kv_transfer_config
from kvrdma.errors import RegistrationError
from kvrdma.layout import build_regions, worker_metadata
from kvrdma.testing.synthetic import CacheSpec, ModelShape, make_caches
from kvrdma.unified import expected_strides, normalize_order
from kvrdma.worker import Worker

L, N, H, B, D = 3, 5, 2, 4, 8  # layers, blocks, heads, block size, head dim
C = 2 * D  # content: K and V of a token
ES = 2  # float16
PAGE = H * B * C * ES
ORDERS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]
SHAPE = ModelShape(
    num_layers=L, num_kv_heads=H, head_dim=D, mamba_layers=2, mamba_state=64, mamba_conv=16
)


def caches(order: str, hybrid: bool = False, heads: int = H):
    spec = CacheSpec(dataclasses.replace(SHAPE, num_kv_heads=heads), "unified", "HND", 0, 1, B, N)
    return make_caches(dataclasses.replace(spec, kv_cache_order=order, hybrid=hybrid))


def build(kv, order, mamba=(), block_size=B):
    return build_regions(
        kv, cache_layout="unified", kv_cache_order=order, block_size=block_size, mamba_layers=mamba
    )


def ptr(kv, layer: int) -> int:
    return kv[f"model.layers.{layer}.attn"].data_ptr()


# (regions, block_len, fragments, kv_layout) per order
EXPECTED = {
    "LBHNC": (L, PAGE, 1, "HND"),
    "LBNHC": (L, PAGE, 1, "NHD"),
    "LHBNC": (L * H, B * C * ES, 1, "HND"),
    "BLHNC": (1, L * PAGE, L, "HND"),
    "BLNHC": (1, L * PAGE, L, "NHD"),
    "BHLNC": (1, L * PAGE, 1, "HND"),
}


@pytest.mark.parametrize("order", ORDERS)
def test_regions_per_order(order):
    kv, mamba = caches(order)
    assert mamba == []
    info = build(kv, order)
    count, block_len, frags, kvl = EXPECTED[order]
    assert len(info.regions) == count
    for r in info.regions:
        assert (r.meta.num_blocks, r.meta.block_len, r.meta.fragments) == (N, block_len, frags)
        assert r.meta.kind == "attn" and tuple(r.data.shape) == (N, block_len)
    assert info.kv_layout == kvl and info.kv_cache_order == order
    assert (info.num_heads, info.head_dim, info.block_size, info.num_layers) == (H, C, B, L)
    assert info.registered_bytes == L * N * PAGE  # every byte once, whatever the cut
    if order in ("LBHNC", "LBNHC"):
        assert [r.meta.base_addr for r in info.regions] == [ptr(kv, i) for i in range(L)]
    elif order == "LHBNC":
        t = kv["model.layers.1.attn"]
        assert info.regions[H + 1].meta.base_addr == t[:, 1].data_ptr()
        assert info.regions[H + 1].name == "model.layers.1.attn.h1"
    else:
        assert info.regions[0].meta.base_addr == ptr(kv, 0)
    meta = worker_metadata(
        info,
        engine_id="e",
        agent_name="a",
        agent_metadata=b"",
        tp_rank=0,
        tp_size=1,
        total_num_kv_heads=H,
    )
    assert (meta.cache_layout, meta.kv_cache_order, meta.is_mamba) == ("unified", order, False)


@pytest.mark.parametrize("order", ORDERS)
def test_block_bytes_are_the_blocks_pages(order):
    """Block b of the regions holds exactly every layer's page b (no other block's bytes)."""
    kv, _ = caches(order)
    for layer in range(L):
        kv[f"model.layers.{layer}.attn"][2].fill_(layer + 1)
    info = build(kv, order)
    for r in info.regions:
        assert int(r.data[[0, 1, 3, 4]].count_nonzero()) == 0
        assert int(r.data[2].count_nonzero()) > 0


@pytest.mark.parametrize("order", ORDERS)
def test_hybrid_mamba_regions_follow(order):
    kv, mamba = caches(order, hybrid=True)
    assert len(mamba) == 2 and kv[mamba[0]].dtype == torch.int8
    info = build(kv, order, mamba)
    m = [r for r in info.regions if r.meta.kind == "mamba"]
    assert [r.name for r in m] == mamba
    assert all((r.meta.num_blocks, r.meta.block_len) == (N, 64 * ES) for r in m)
    assert info.regions[-2:] == m and info.num_layers == L + 2


def test_mla_is_one_head():
    kv, _ = caches("LBHNC", heads=1)
    info = build(kv, "LBHNC")
    assert info.num_heads == 1 and len(info.regions) == L


def test_kv_sharing_layers_registered_once():
    kv, _ = caches("LBHNC")
    kv["model.layers.3.attn"] = kv["model.layers.0.attn"]  # a layer reusing layer 0's cache
    info = build(kv, "LBHNC")
    assert len(info.regions) == L and info.num_layers == L + 1


def test_aliases_and_default_order():
    assert normalize_order(None) == "LBHNC"
    assert (normalize_order("HND"), normalize_order("nhd")) == ("LBHNC", "LBNHC")
    kv, _ = caches("LBHNC")
    info = build_regions(kv, cache_layout="unified", block_size=B)
    assert info.kv_cache_order == "LBHNC"


def test_strides_derived_from_order():
    assert expected_strides("LBHNC", (N, H, B, C), L) == (H * B * C, B * C, C, 1)
    assert expected_strides("BHLNC", (N, H, B, C), L) == (H * L * B * C, L * B * C, C, 1)
    assert expected_strides("LHBNC", (N, H, B, C), L) == (B * C, N * B * C, C, 1)


# ---- errors name the layer, the order and what was expected ----------------------------------
@pytest.mark.parametrize(
    ("made", "declared"),
    [("LBHNC", "LBNHC"), ("LBNHC", "LHBNC"), ("BLHNC", "BHLNC"), ("BHLNC", "BLNHC")],
)
def test_views_not_in_the_declared_order(made, declared):
    kv, _ = caches(made)
    with pytest.raises(
        RegistrationError,
        match=rf"layer 'model.layers.0.attn': strides .* do not match kv_cache_order "
        rf"'{declared}' over {L} layers: expected",
    ):
        build(kv, declared)


def test_b_outer_layers_must_fill_one_row():
    kv, _ = caches("BLHNC")
    del kv["model.layers.1.attn"]  # a hole: layer 2 sits two slots after layer 0
    with pytest.raises(RegistrationError, match=r"kv_cache_order 'BLHNC' .*over 2 layers"):
        build(kv, "BLHNC")


def test_b_outer_layer_in_a_wrong_slot():
    kv, _ = caches("BLHNC")
    other, _ = caches("BLHNC")
    kv["model.layers.2.attn"] = other["model.layers.2.attn"]  # another buffer's layer
    with pytest.raises(RegistrationError, match=r"puts layer \d of 3 .* bytes after"):
        build(kv, "BLHNC")


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        (torch.zeros(N, B, C), r"expects one \[num_blocks, heads, block_size, content\] view"),
        ((torch.zeros(N, H, B, C),), r"got tuple"),
        (torch.zeros(N, H, B + 1, C), r"block_size dimension .* is 5, configured block_size is 4"),
    ],
)
def test_bad_views(value, pattern):
    with pytest.raises(RegistrationError, match=pattern):
        build({"x": value}, "LBHNC")


def test_geometry_must_match_across_layers():
    kv, _ = caches("LBHNC")
    kv["odd"] = torch.zeros(N, H, B, C + 2, dtype=torch.float16)
    with pytest.raises(RegistrationError, match=r"layer 'odd': view .* same geometry"):
        build(kv, "LBHNC")


def test_unknown_order_and_order_without_unified():
    kv, _ = caches("LBHNC")
    with pytest.raises(RegistrationError, match=r"kv_cache_order must be one of LBHNC, .*'HLBNC'"):
        build(kv, "HLBNC")
    with pytest.raises(RegistrationError, match="is for cache_layout 'unified', not 'split_kv'"):
        build_regions(kv, cache_layout="split_kv", block_size=B, kv_cache_order="LBHNC")


def _shared_pages(order: str, tp_rank: int = 0, tp_size: int = 1, block: int = B):
    """vLLM's HMA: Mamba layers' int8 views over attention layers' pages of one buffer."""
    spec = CacheSpec(SHAPE, "unified", "HND", tp_rank, tp_size, block, N)
    kv, _ = make_caches(dataclasses.replace(spec, kv_cache_order=order))
    for i in range(2):
        t = kv[f"model.layers.{i}.attn"]
        kv[f"m{i}"] = t.view(torch.int8).reshape(N, 1, 1, -1)
    return kv


def test_mamba_overlaying_attention_pages_is_registered_once():
    kv = _shared_pages("LBHNC")
    info = build(kv, "LBHNC", ["m0", "m1"])
    assert len(info.regions) == L and all(r.meta.kind == "attn" for r in info.regions)
    assert info.shared_pages and info.num_layers == L + 2
    meta = worker_metadata(
        info, engine_id="e", agent_name="a", agent_metadata=b"", tp_rank=0, tp_size=1,
        total_num_kv_heads=H,
    )  # fmt: skip
    assert meta.shared_pages and not meta.is_mamba


@pytest.mark.parametrize("how", ["offset", "order"])
def test_mamba_overlay_that_is_not_whole_pages_refused(how):
    kv = _shared_pages("BLHNC" if how == "order" else "LBHNC")
    if how == "offset":
        kv["m1"] = kv["model.layers.1.attn"].view(torch.int8).reshape(N, -1)[:, 2:]
    with pytest.raises(RegistrationError, match=r"Mamba layer 'm.' overlays attention memory"):
        build(kv, "BLHNC" if how == "order" else "LBHNC", ["m0", "m1"])


# ---- Worker.register_kv_caches takes it (a fake backend: pure logic) -------------------------
class _Backend:
    agent_name = "fake"

    def __init__(self) -> None:
        self.tables: list[Any] = []

    def register(self, table: Any, mem_type: Any) -> Any:
        self.tables.append(table)
        return self

    def prep_local(self, descs: Any, mem_type: Any, scratch: bool = False) -> Any:
        return self

    def metadata(self) -> bytes:
        return b"md"

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


def _worker(tp_rank: int = 0, tp_size: int = 1) -> tuple[Worker, _Backend]:
    cfg = load_kv_transfer_config(
        {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "engine_id": "D"}, environ={}
    )
    b = _Backend()
    w = Worker(cfg, b, tp_rank=tp_rank, tp_size=tp_size, total_num_kv_heads=H)  # type: ignore[arg-type]
    return w, b


@pytest.mark.parametrize("order", ORDERS)
def test_worker_registers_unified_views(order):
    kv, mamba = caches(order, hybrid=True)
    w, b = _worker()
    meta = w.register_kv_caches(
        kv,
        cache_layout="unified",
        kv_cache_order=order,
        block_size=B,
        mamba_layers=mamba,
        physical_blocks_per_logical=2,
    )
    count = EXPECTED[order][0] + len(mamba)
    assert len(meta.regions) == count and len(b.tables[0]) == count
    assert (meta.kv_cache_order, meta.physical_blocks_per_logical) == (order, 2)
    assert w.topology.is_mamba and not w.topology.is_mla


def test_worker_refuses_views_in_another_order():
    kv, _ = caches("BHLNC")
    w, b = _worker()
    with pytest.raises(RegistrationError, match="do not match kv_cache_order 'BLHNC'"):
        w.register_kv_caches(kv, cache_layout="unified", kv_cache_order="BLHNC", block_size=B)
    assert b.tables == []
