"""vLLM's unified KV layout → registration regions.

vLLM hands one view per attention layer, always logical `[B, H, N, C]` (blocks, KV heads of
this rank, tokens per block, content elements: K and V share C, their split inside C is the
attention backend's), strided over one buffer in one of six physical orders of the logical
`[L, B, H, N, C]` (`kv_cache_order`). Regions, by order:
- `LBHNC`, `LBNHC`: one region per layer, a block is one layer's page (HND / NHD);
- `LHBNC`: one region per (layer, head), a block is one head's `[N, C]`;
- `BLHNC`, `BLNHC`: one region, a block is the row of every layer's page (one fragment each);
- `BHLNC`: one region, a block is `[H, L, N, C]` (a head range covers every layer).
MLA is `H = 1` with `C` the latent: pass `total_num_kv_heads=1` (replicated on every rank).
Mamba layers (`mamba_layers`) are per-block state pages (`[B, 1, 1, page_bytes]` int8 or a
`(conv, ssm)` pair) in memory of their own, one region each, after the attention regions.
Mamba views overlaying attention pages (vLLM's HMA groups sharing one buffer) add no region:
the pages are then opaque and move whole, between equal TP and block sizes only.
Views sharing a data pointer (KV-sharing layers) are registered once.
Each (head, token)'s C elements move as one unit, so head slicing and TP merging are exact
for any backend; a block-size ratio (P block smaller) and HND <-> NHD conversion assume a
token's C elements are its own (FlashAttention's `[K|V]` per token, not CPU_ATTN's `[2N, D]`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from kvrdma.errors import RegistrationError
from kvrdma.metadata import KV_CACHE_ORDERS, KVCacheOrder, KvLayout

ORDER_ALIASES: dict[str, KVCacheOrder] = {"HND": "LBHNC", "NHD": "LBNHC"}
DEFAULT_ORDER: KVCacheOrder = "LBHNC"
# orders whose head range inside one block of a region is contiguous (head-sliceable)
HEAD_SLICEABLE: tuple[KVCacheOrder, ...] = ("LBHNC", "LHBNC", "BLHNC", "BHLNC")


def normalize_order(order: str | None) -> KVCacheOrder:
    """`order` (an order name or the HND/NHD alias; None: the default) as an order name."""
    if order is None:
        return DEFAULT_ORDER
    name = ORDER_ALIASES.get(str(order).upper(), str(order).upper())
    for o in KV_CACHE_ORDERS:
        if o == name:
            return o
    raise RegistrationError(
        f"kv_cache_order must be one of {', '.join(KV_CACHE_ORDERS)} (or HND/NHD), got {order!r}"
    )


def kv_layout_of(order: KVCacheOrder) -> KvLayout:
    """Within a page, heads before tokens (HND) or tokens before heads (NHD)."""
    return "NHD" if order.endswith("NHC") else "HND"


def expected_strides(order: KVCacheOrder, shape: tuple[int, ...], layers: int) -> tuple[int, ...]:
    """Element strides of a `[B, H, N, C]` view of `layers` layers dense in `order`."""
    b, h, n, c = shape
    sizes = {"L": layers, "B": b, "H": h, "N": n, "C": c}
    stride, out = 1, {}
    for dim in reversed(order):
        out[dim] = stride
        stride *= sizes[dim]
    return (out["B"], out["H"], out["N"], out["C"])


def layer_step(order: KVCacheOrder, shape: tuple[int, ...], layers: int) -> int:
    """Elements between two consecutive layers' views in a shared buffer."""
    b, h, n, c = shape
    sizes = {"L": layers, "B": b, "H": h, "N": n, "C": c}
    step = 1
    for dim in reversed(order):
        if dim == "L":
            return step
        step *= sizes[dim]
    raise AssertionError(order)  # every order names L


def _check_view(name: str, t: object, block_size: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise RegistrationError(
            f"layer {name!r}: unified layout expects one [num_blocks, heads, block_size, "
            f"content] view per attention layer, got {shape}"
        )
    if t.shape[2] != block_size:
        raise RegistrationError(
            f"layer {name!r}: block_size dimension (dim 2 of [B, H, N, C]) is {t.shape[2]}, "
            f"configured block_size is {block_size}"
        )
    return t


def _strides_match(t: torch.Tensor, expected: tuple[int, ...]) -> bool:
    # torch reports arbitrary strides for size-1 dims: only the others are checked
    return all(t.shape[d] == 1 or t.stride(d) == expected[d] for d in range(4))


def attention_views(
    kv_caches: Mapping[str, object],
    order: KVCacheOrder,
    block_size: int,
    mamba_layers: Collection[str],
) -> list[tuple[str, torch.Tensor]]:
    """The distinct attention views (one per data pointer), checked against `order`,
    in memory order; raises `RegistrationError` naming the layer and what was expected."""
    views: dict[int, tuple[str, torch.Tensor]] = {}
    first: tuple[str, torch.Tensor] | None = None
    for name, value in kv_caches.items():
        if name in mamba_layers:
            continue
        t = _check_view(name, value, block_size)
        if first is None:
            first = (name, t)
        fname, ft = first
        if (t.shape, t.dtype, t.device) != (ft.shape, ft.dtype, ft.device):
            raise RegistrationError(
                f"layer {name!r}: view {tuple(t.shape)} {t.dtype} on {t.device}, layer "
                f"{fname!r} has {tuple(ft.shape)} {ft.dtype} on {ft.device}; every attention "
                "layer of the unified layout must have the same geometry"
            )
        seen = views.get(t.data_ptr())
        if seen is not None and seen[1].stride() != t.stride():
            raise RegistrationError(
                f"layer {name!r} shares its data pointer with layer {seen[0]!r} but has strides "
                f"{t.stride()}, not {seen[1].stride()}"
            )
        views.setdefault(t.data_ptr(), (name, t))
    ordered = [views[p] for p in sorted(views)]
    if not ordered:
        return ordered
    layers = len(ordered)
    shape = tuple(ordered[0][1].shape)
    es = ordered[0][1].element_size()
    expect = expected_strides(order, shape, layers)
    step = layer_step(order, shape, layers) * es
    base = ordered[0][1].data_ptr()
    for i, (name, t) in enumerate(ordered):
        if not _strides_match(t, expect):
            raise RegistrationError(
                f"layer {name!r}: strides {t.stride()} of its [B, H, N, C] view {tuple(t.shape)} "
                f"do not match kv_cache_order {order!r} over {layers} layers: expected {expect}"
            )
        # B-outer orders: every layer lives in one block row of one buffer
        if order[0] != "L" and t.data_ptr() != base + i * step:
            raise RegistrationError(
                f"layer {name!r}: kv_cache_order {order!r} puts layer {i} of {layers} "
                f"{i * step} bytes after the first layer's view, found {t.data_ptr() - base} "
                "(every attention layer must be a view of one buffer, one slot per layer)"
            )
    return ordered


def check_shared_page(
    name: str, state: torch.Tensor, views: Sequence[tuple[str, torch.Tensor]], order: str
) -> None:
    """A Mamba view overlaying attention memory must be whole pages of one layer's region."""
    page = views[0][1][0].numel() * views[0][1].element_size()
    owner = next((n for n, v in views if v.data_ptr() == state.data_ptr()), None)
    stride = state.stride(0) * state.element_size()
    size = state[0].numel() * state.element_size()
    if order not in ("LBHNC", "LBNHC") or owner is None or stride != page or size > page:
        raise RegistrationError(
            f"Mamba layer {name!r} overlays attention memory (vLLM's HMA) but is not whole "
            f"pages of one layer: kv_cache_order {order!r}, state starts at layer "
            f"{owner!r}, block stride {stride} bytes, state {size} bytes; expected an "
            f"LBHNC/LBNHC layer's data pointer, a {page}-byte stride and at most {page} bytes"
        )


def starts_inside(t: torch.Tensor, views: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """True if `t` starts inside the memory spanned by the attention views."""
    if not views:
        return False
    p = t.data_ptr()
    for _, v in views:
        span = sum((v.shape[d] - 1) * v.stride(d) for d in range(v.dim())) + 1
        if v.data_ptr() <= p < v.data_ptr() + span * v.element_size():
            return True
    return False
