"""vLLM 0.32's per-layer KV views → tensors kvrdma's `Worker.register_kv_caches` accepts.

vLLM hands one `[B, H, N, C]` view per layer, strided over a shared buffer in one of six
unified orders (`LBHNC`, `LBNHC`, `LHBNC`, `BLHNC`, `BLNHC`, `BHLNC`). Until the library
models that layout itself, each contiguous run of a block's bytes is re-viewed as a dense
blocks-first (or, for the `B..` orders, cross-layer) tensor over the same memory. Peers
with the same order and TP size then cut their caches into identical regions and move
whole blocks byte for byte; reading a head slice needs the library's unified layout, so
`check_tp` refuses a TP mix under this mapping with an error saying so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvrdma.errors import ConfigError, RegistrationError
from kvrdma.metadata import CacheLayout

ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


@dataclass
class Registration:
    """What to pass to `Worker.register_kv_caches`."""

    caches: dict[str, torch.Tensor]
    cache_layout: CacheLayout
    block_size: int


def _dense(t: torch.Tensor, start: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A dense tensor of `shape` over `t`'s storage from element offset `start`."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    stride = []
    acc = 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return out.set_(t.untyped_storage(), start, shape, tuple(reversed(stride)))


def _blocks_first(t: torch.Tensor, start: int, nb: int, page: int, n: int) -> torch.Tensor:
    """`[nb, 2, n, 1, page/(2n)]` over `nb` pages of `page` elements from `start`."""
    if page % (2 * n):
        raise RegistrationError(
            f"a KV page of {page} elements does not split into 2 x {n} tokens; "
            "kvrdma cannot register this cache"
        )
    return _dense(t, start, (nb, 2, n, 1, page // (2 * n)))


def unique_views(kv_caches: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layers that share a cache (same data pointer) are registered once."""
    seen: set[int] = set()
    out = {}
    for name, t in kv_caches.items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = t
    return out


def registration(
    kv_caches: Mapping[str, torch.Tensor], *, order: str, use_mla: bool
) -> Registration:
    """Cut vLLM's views into kvrdma inputs for `order` (one of `ORDERS`)."""
    if order not in ORDERS:
        raise RegistrationError(
            f"kv_cache_layout: expected one of {', '.join(ORDERS)}, got {order!r}"
        )
    views = unique_views(kv_caches)
    if not views:
        raise RegistrationError("register_kv_caches got no KV caches")
    first = next(iter(views.values()))
    if first.dim() != 4:
        raise RegistrationError(
            f"layer {next(iter(views))!r}: expected vLLM's [B, H, N, C] view, got shape "
            f"{tuple(first.shape)}"
        )
    nb, heads, n, c = (int(x) for x in first.shape)
    if use_mla:
        return Registration(
            {k: _dense(v, int(v.storage_offset()), (nb, n, heads * c)) for k, v in views.items()},
            "mla",
            n,
        )
    if order.startswith("B"):
        row = int(first.stride(0))
        start = min(int(v.storage_offset()) for v in views.values())
        return Registration(
            {"kv_rows": _blocks_first(first, start, nb, row, n).unsqueeze(1)}, "cross_layer", n
        )
    caches: dict[str, torch.Tensor] = {}
    for name, v in views.items():
        if order == "LHBNC":
            for h in range(heads):
                start = int(v.storage_offset()) + h * int(v.stride(1))
                caches[f"{name}.h{h}"] = _blocks_first(v, start, nb, n * c, n)
        else:
            caches[name] = _blocks_first(v, int(v.storage_offset()), nb, heads * n * c, n)
    return Registration(caches, "blocks_first", n)


def check_tp(order: str, local_tp: int, remote_tp: int, remote_engine: str, use_mla: bool) -> None:
    """Whole-block reads need equal TP sizes (MLA blocks are replicated: any mix)."""
    if not use_mla and local_tp != remote_tp:
        raise ConfigError(
            f"engine {remote_engine!r}: kv_cache_layout {order} with producer TP {remote_tp} "
            f"and consumer TP {local_tp}: reading head slices of vLLM's unified layout is not "
            "supported yet; use equal TP sizes"
        )
