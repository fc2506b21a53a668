"""KV tensors → registration regions (SPEC §1).

Accepted layouts (shapes are the *logical* shapes; HND is detected from the strides when the
memory is dense in heads-before-tokens order):
- split K/V      `[2, N, B, H, D]` per layer, or a `(K, V)` tuple of `[N, B, H, D]`;
- blocks-first   `[N, 2, B, H, D]` per layer;
- MLA            `[N, B, latent]` per layer;
- cross-layer    one `[N, L, 2, B, H, D]` tensor for all layers;
- Mamba hybrid   attention layers `[2, N, B, H, D]` whose memory is blocks-first (or
                 `[N, 2, B, H, D]`), Mamba layers one `[N, ...]` state tensor or a
                 `(conv, ssm)` tuple of views into one per-block page;
- unified        vLLM's per-layer `[num_blocks, heads, block_size, content]` views in one of
                 six physical orders
                 (`kv_cache_order`, see `kvrdma.unified`), Mamba layers as for the hybrid.
Regions are layer-major (K then V for split K/V); Mamba regions follow the attention ones.
A tensor seen twice (same data pointer, e.g. layers sharing a cache) is registered once.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from kvrdma.errors import RegistrationError
from kvrdma.metadata import (
    CacheLayout,
    KVCacheOrder,
    KvLayout,
    RegionKind,
    RegionMeta,
    WorkerMetadata,
    sha256_hex,
)
from kvrdma.unified import (
    attention_views,
    check_shared_page,
    kv_layout_of,
    normalize_order,
    starts_inside,
)

KVInput = torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]
CACHE_LAYOUTS: tuple[CacheLayout, ...] = (
    "split_kv",
    "blocks_first",
    "mla",
    "cross_layer",
    "mamba",
    "unified",
)


@dataclass
class Region:
    """One registered region and a byte view `[num_blocks, block_len]` of its memory."""

    name: str
    data: torch.Tensor
    meta: RegionMeta
    # the layer whose KV this region holds; None when it holds every layer's (one block row
    # of all layers: cross-layer, vLLM's B-outer orders)
    layer: str | None = None
    # Mamba: the bytes of each state filling one page, in page order (TP splits each state on
    # its own, so a reader of another TP size must cut the page state by state)
    states: tuple[int, ...] = ()


@dataclass
class KVLayoutInfo:
    """What `build_regions` found: regions plus the geometry peers need."""

    cache_layout: CacheLayout
    kv_layout: KvLayout
    num_blocks: int
    block_size: int
    num_heads: int  # KV heads held by this rank (0 for MLA / pure Mamba)
    head_dim: int  # head dim, or the latent dim for MLA
    dtype: str
    element_size: int
    num_layers: int
    device: torch.device
    regions: list[Region] = field(default_factory=list)
    kv_cache_order: KVCacheOrder | None = None  # unified layout only
    shared_pages: bool = False  # unified: Mamba state overlays attention pages (vLLM's HMA)

    @property
    def attention_regions(self) -> list[Region]:
        return [r for r in self.regions if r.meta.kind != "mamba"]

    @property
    def mamba_states(self) -> list[tuple[int, ...]]:
        """The state sizes of each Mamba region's page, in region order (what the planner
        needs to split pages of several states across TP sizes)."""
        return [r.states for r in self.regions if r.meta.kind == "mamba"]

    @cached_property
    def layer_index(self) -> dict[str, int]:
        """Each layer that owns regions -> its place in registration order (push sends them
        one by one, in this order)."""
        owners = (r.layer for r in self.regions if r.layer is not None)
        return {name: i for i, name in enumerate(dict.fromkeys(owners))}

    @property
    def registered_bytes(self) -> int:
        return sum(r.meta.num_blocks * r.meta.block_len for r in self.regions)


def dense_in_order(t: torch.Tensor, order: Sequence[int]) -> bool:
    """True if `t`'s memory is densely packed when its dims are walked in `order`."""
    expected = 1
    for d in reversed(order):
        if t.shape[d] != 1 and t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def byte_view(t: torch.Tensor, num_blocks: int, block_len: int) -> torch.Tensor:
    """uint8 `[num_blocks, block_len]` over the memory starting at `t.data_ptr()`."""
    storage = t.untyped_storage()
    offset = t.data_ptr() - storage.data_ptr()
    if offset + num_blocks * block_len > storage.nbytes():
        raise RegistrationError(
            f"region of {num_blocks}×{block_len} bytes runs past its storage "
            f"({storage.nbytes()} bytes)"
        )
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    return out.set_(storage, offset, (num_blocks, block_len), (block_len, 1))


def _device_id(t: torch.Tensor) -> int:
    return (t.device.index or 0) if t.device.type == "cuda" else 0


def _layout_of(t: torch.Tensor, name: str, nhd: Sequence[int], hnd: Sequence[int]) -> KvLayout:
    if dense_in_order(t, nhd):
        return "NHD"
    if dense_in_order(t, hnd):
        return "HND"
    raise RegistrationError(
        f"layer {name!r}: tensor of shape {tuple(t.shape)} strides {t.stride()} is not dense "
        "in NHD (tokens, heads, dim) or HND (heads, tokens, dim) order; pass contiguous "
        "caches (or a permuted view of contiguous memory)"
    )


def normalize_kv(value: KVInput, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's KV as (K, V), each `[N, B, H, D]`, from a `[2, N, ...]` stack or a tuple."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise RegistrationError(
                f"layer {name!r}: expected a (K, V) pair, got {len(value)} tensors"
            )
        k, v = value
    elif isinstance(value, torch.Tensor) and value.dim() == 5 and value.shape[0] == 2:
        k, v = value[0], value[1]
    else:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise RegistrationError(
            f"layer {name!r}: expected [2, num_blocks, block_size, heads, head_dim] or a (K, V) "
            f"tuple, got {shape}"
        )
    for part, t in (("K", k), ("V", v)):
        if t.dim() != 4:
            raise RegistrationError(
                f"layer {name!r}: {part} must be [num_blocks, block_size, heads, head_dim], "
                f"got {tuple(t.shape)}"
            )
    if k.shape != v.shape or k.dtype != v.dtype:
        raise RegistrationError(
            f"layer {name!r}: K {tuple(k.shape)} {k.dtype} and V {tuple(v.shape)} {v.dtype} differ"
        )
    return k, v


class _Builder:
    def __init__(self, cache_layout: CacheLayout, block_size: int) -> None:
        self.cache_layout = cache_layout
        self.block_size = block_size
        self.regions: list[Region] = []
        self.seen: set[int] = set()
        self.geometry: tuple[int, int, torch.dtype, KvLayout, torch.device] | None = None
        self.num_blocks: int | None = None
        self.layers = 0

    def set_blocks(self, n: int, name: str) -> None:
        if self.num_blocks is None:
            self.num_blocks = n
        elif n != self.num_blocks:
            raise RegistrationError(
                f"layer {name!r}: {n} blocks, earlier layers have {self.num_blocks}"
            )

    def set_geometry(
        self, name: str, heads: int, dim: int, dtype: torch.dtype, kvl: KvLayout, dev: torch.device
    ) -> None:
        g = (heads, dim, dtype, kvl, dev)
        if self.geometry is None:
            self.geometry = g
        elif g != self.geometry:
            raise RegistrationError(
                f"layer {name!r}: (heads, head_dim, dtype, layout, device) = {g}, "
                f"earlier layers have {self.geometry}"
            )

    def check_block_size(self, name: str, b: int) -> None:
        if b != self.block_size:
            raise RegistrationError(
                f"layer {name!r}: block_size dimension is {b}, configured block_size is "
                f"{self.block_size}"
            )

    def add(
        self,
        name: str,
        t: torch.Tensor,
        n: int,
        block_len: int,
        kind: RegionKind,
        frags: int,
        *,
        layer: str | None = "",
        states: tuple[int, ...] = (),
    ) -> None:
        """Register `t`'s blocks as region `name` of `layer` (default: the region's name)."""
        if t.data_ptr() in self.seen:
            return
        self.seen.add(t.data_ptr())
        data = byte_view(t, n, block_len)
        meta = RegionMeta(
            base_addr=t.data_ptr(),
            num_blocks=n,
            block_len=block_len,
            kind=kind,
            fragments=frags,
            device_id=_device_id(t),
        )
        self.regions.append(Region(name, data, meta, name if layer == "" else layer, states))

    def attention(self, name: str, t: torch.Tensor, blocks_first: bool) -> None:
        """A `[N, 2, B, H, D]` blocks-first tensor, or a split K/V pair."""
        if blocks_first:
            if t.dim() != 5 or t.shape[1] != 2:
                raise RegistrationError(
                    f"layer {name!r}: blocks-first cache must be [num_blocks, 2, block_size, "
                    f"heads, head_dim], got {tuple(t.shape)}"
                )
            n, _, b, h, d = t.shape
            kvl = _layout_of(t, name, (0, 1, 2, 3, 4), (0, 1, 3, 2, 4))
            self.check_block_size(name, b)
            self.set_blocks(n, name)
            self.set_geometry(name, h, d, t.dtype, kvl, t.device)
            self.add(name, t, n, 2 * b * h * d * t.element_size(), "attn", 2)
            return
        k, v = normalize_kv(t, name)
        for part, x in (("K", k), ("V", v)):
            n, b, h, d = x.shape
            kvl = _layout_of(x, f"{name}.{part}", (0, 1, 2, 3), (0, 2, 1, 3))
            self.check_block_size(name, b)
            self.set_blocks(n, name)
            self.set_geometry(name, h, d, x.dtype, kvl, x.device)
            self.add(f"{name}.{part}", x, n, b * h * d * x.element_size(), "attn", 1, layer=name)


def _mamba_region(b: _Builder, name: str, value: KVInput) -> None:
    parts = list(value) if isinstance(value, (tuple, list)) else [value]
    if not parts or any(not isinstance(p, torch.Tensor) or p.dim() < 1 for p in parts):
        raise RegistrationError(f"Mamba layer {name!r}: expected a state tensor or (conv, ssm)")
    first = parts[0]
    n = first.shape[0]
    page = first.stride(0) * first.element_size()
    states = tuple(p[0].numel() * p.element_size() for p in parts)
    for i, p in enumerate(parts):
        offset = sum(states[:i])
        if p.shape[0] != n or p.stride(0) * p.element_size() != page:
            raise RegistrationError(
                f"Mamba layer {name!r}: state {i} has {p.shape[0]} blocks with a "
                f"{p.stride(0) * p.element_size()}-byte block stride; expected {n} blocks with "
                f"a {page}-byte stride (all states must be views into one per-block page)"
            )
        if p.data_ptr() != first.data_ptr() + offset or not p[0].is_contiguous():
            raise RegistrationError(
                f"Mamba layer {name!r}: state {i} must start {offset} bytes into the page and "
                "be contiguous within a block"
            )
    if sum(states) != page:
        raise RegistrationError(
            f"Mamba layer {name!r}: states cover {sum(states)} bytes of a {page}-byte page; "
            "they must fill it exactly"
        )
    b.set_blocks(n, name)
    b.add(name, first, n, page, "mamba", 1, states=states)


def build_regions(
    kv_caches: Mapping[str, KVInput],
    *,
    cache_layout: CacheLayout,
    block_size: int,
    mamba_layers: Collection[str] = (),
    kv_cache_order: str | None = None,
) -> KVLayoutInfo:
    """Cut `kv_caches` into registration regions the way `cache_layout` demands
    (`kv_cache_order`: the unified layout's physical order, default LBHNC)."""
    if cache_layout not in CACHE_LAYOUTS:
        raise RegistrationError(
            f"cache_layout must be one of {', '.join(CACHE_LAYOUTS)}, got {cache_layout!r}"
        )
    if kv_cache_order is not None and cache_layout != "unified":
        raise RegistrationError(
            f"kv_cache_order {kv_cache_order!r} is for cache_layout 'unified', not {cache_layout!r}"
        )
    if not kv_caches:
        raise RegistrationError("kv_caches is empty: nothing to register")
    unknown = set(mamba_layers) - set(kv_caches)
    if unknown:
        raise RegistrationError(f"mamba_layers name unknown layers: {sorted(unknown)}")
    if mamba_layers and cache_layout not in ("mamba", "unified"):
        raise RegistrationError(
            f"mamba_layers given but cache_layout is {cache_layout!r}; use 'mamba' or 'unified'"
        )
    b = _Builder(cache_layout, block_size)
    if cache_layout == "unified":
        return _unified(b, kv_caches, normalize_order(kv_cache_order), mamba_layers)
    mamba: list[tuple[str, KVInput]] = []
    for name, value in kv_caches.items():
        if name in mamba_layers:
            mamba.append((name, value))
            continue
        b.layers += 1
        if cache_layout == "split_kv":
            b.attention(name, value, blocks_first=False)  # type: ignore[arg-type]
        elif cache_layout == "blocks_first":
            b.attention(name, _tensor(value, name), blocks_first=True)
        elif cache_layout == "mamba":
            t = _tensor(value, name)
            if t.dim() == 5 and t.shape[0] == 2 and not dense_in_order(t, range(5)):
                t = t.transpose(0, 1)  # [2, N, ...] view over blocks-first memory
            b.attention(name, t, blocks_first=True)
        elif cache_layout == "mla":
            t = _tensor(value, name)
            if t.dim() != 3 or not t.is_contiguous():
                raise RegistrationError(
                    f"layer {name!r}: MLA cache must be a contiguous [num_blocks, block_size, "
                    f"latent_dim] tensor, got shape {tuple(t.shape)} contiguous={t.is_contiguous()}"
                )
            n, bs, lat = t.shape
            b.check_block_size(name, bs)
            b.set_blocks(n, name)
            b.set_geometry(name, 0, lat, t.dtype, "NHD", t.device)
            b.add(name, t, n, bs * lat * t.element_size(), "mla", 1)
        else:  # cross_layer
            t = _tensor(value, name)
            if t.dim() != 6 or t.shape[2] != 2:
                raise RegistrationError(
                    f"layer {name!r}: cross-layer cache must be [num_blocks, num_layers, 2, "
                    f"block_size, heads, head_dim], got {tuple(t.shape)}"
                )
            n, nl, _, bs, h, d = t.shape
            kvl = _layout_of(t, name, range(6), (0, 1, 2, 4, 3, 5))
            b.check_block_size(name, bs)
            b.set_blocks(n, name)
            b.set_geometry(name, h, d, t.dtype, kvl, t.device)
            b.layers += nl - 1
            b.add(name, t, n, nl * 2 * bs * h * d * t.element_size(), "attn", 2 * nl, layer=None)
    for name, value in mamba:
        _mamba_region(b, name, value)
    if cache_layout == "mamba" and not mamba:
        raise RegistrationError("cache_layout 'mamba' needs at least one layer in mamba_layers")
    return _info(b, len(mamba))


def _info(b: _Builder, num_mamba: int, order: KVCacheOrder | None = None) -> KVLayoutInfo:
    heads, dim, dtype, kvl, _dev = b.geometry or (0, 0, torch.uint8, "NHD", torch.device("cpu"))
    first = b.regions[0].data
    return KVLayoutInfo(
        cache_layout=b.cache_layout,
        kv_layout=kvl,
        num_blocks=b.num_blocks or 0,
        block_size=b.block_size,
        num_heads=heads,
        head_dim=dim,
        dtype=str(dtype).removeprefix("torch."),
        element_size=torch.empty(0, dtype=dtype).element_size(),
        num_layers=b.layers + num_mamba,
        device=first.device,
        regions=b.regions,
        kv_cache_order=order,
    )


def _unified(
    b: _Builder,
    kv_caches: Mapping[str, KVInput],
    order: KVCacheOrder,
    mamba_layers: Collection[str],
) -> KVLayoutInfo:
    """Regions of vLLM's unified layout (see `kvrdma.unified` for the cut per order)."""
    views = attention_views(kv_caches, order, b.block_size, mamba_layers)
    b.layers = len(kv_caches) - len(mamba_layers)
    if views:
        n, h, bs, c = views[0][1].shape
        t0 = views[0][1]
        es = t0.element_size()
        page = h * bs * c * es
        b.set_blocks(n, views[0][0])
        b.set_geometry(views[0][0], h, c, t0.dtype, kv_layout_of(order), t0.device)
        if order in ("LBHNC", "LBNHC"):
            for name, t in views:
                b.add(name, t, n, page, "attn", 1)
        elif order == "LHBNC":
            for name, t in views:
                for head in range(h):
                    b.add(f"{name}.h{head}", t[:, head], n, bs * c * es, "attn", 1, layer=name)
        else:  # B-outer: one block row holds every layer
            frags = len(views) if order in ("BLHNC", "BLNHC") else 1
            b.add("unified", t0, n, len(views) * page, "attn", frags, layer=None)
    mamba = [name for name in kv_caches if name in mamba_layers]
    shared = False
    for name in mamba:
        value = kv_caches[name]
        first = value[0] if isinstance(value, (tuple, list)) else value
        if isinstance(first, torch.Tensor) and starts_inside(first, views):
            check_shared_page(name, first, views, order)
            shared = True  # vLLM's HMA: the attention region already holds these pages
            continue
        _mamba_region(b, name, value)
    if not b.regions:
        raise RegistrationError("unified layout: no attention or Mamba layer to register")
    info = _info(b, len(mamba), order)
    info.shared_pages = shared
    return info


def _tensor(value: KVInput, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise RegistrationError(
            f"layer {name!r}: expected one tensor for this layout, got {type(value).__name__}"
        )
    return value


def worker_metadata(
    info: KVLayoutInfo,
    *,
    engine_id: str,
    agent_name: str,
    agent_metadata: bytes,
    tp_rank: int,
    tp_size: int,
    total_num_kv_heads: int,
    dp_index: int = 0,
    compat_hash: str = "",
    physical_blocks_per_logical: int = 1,
) -> WorkerMetadata:
    """The handshake payload describing these regions."""
    return WorkerMetadata(
        engine_id=engine_id,
        agent_name=agent_name,
        agent_metadata=agent_metadata,
        agent_metadata_sha256=sha256_hex(agent_metadata),
        tp_rank=tp_rank,
        tp_size=tp_size,
        dp_index=dp_index,
        block_size=info.block_size,
        num_blocks=info.num_blocks,
        cache_layout=info.cache_layout,
        kv_layout=info.kv_layout,
        total_num_kv_heads=total_num_kv_heads,
        head_dim=info.head_dim,
        dtype=info.dtype,
        element_size=info.element_size,
        physical_blocks_per_logical=physical_blocks_per_logical,
        mem_type="VRAM" if info.device.type == "cuda" else "DRAM",
        regions=[r.meta for r in info.regions],
        compat_hash=compat_hash,
        kv_cache_order=info.kv_cache_order or "",
        shared_pages=info.shared_pages,
    )
