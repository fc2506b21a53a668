"""Synthetic KV caches with a verifiable pattern, for the demo, the tests and the benchmarks.

Every element's value is a function of (content id, layer, K/V, *global* head, token, dim),
so a decode rank can check that each byte it received came from the right remote block,
layer, head and token — whatever the TP mix, block-size ratio or NHD/HND layouts.
The content id of a producer block is its block id.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvrdma.errors import ConfigError, RegistrationError
from kvrdma.layout import CACHE_LAYOUTS, KVInput
from kvrdma.metadata import CacheLayout, KvLayout
from kvrdma.topology import check_heads_divisible, physical_heads

_MOD = 251  # values 1..251 are exact in float16 and bfloat16


@dataclass(frozen=True)
class ModelShape:
    """A small llama-like model (GQA by default)."""

    num_layers: int = 4
    num_kv_heads: int = 8
    head_dim: int = 64
    dtype: str = "float16"
    latent_dim: int = 96  # MLA
    mamba_layers: int = 2  # hybrid: Mamba layers after the attention ones
    mamba_state: int = 512  # elements of (conv + ssm) state per block, whole model width
    mamba_conv: int = 128  # of which conv state

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ConfigError(f"model dtype {self.dtype!r} is not a torch dtype")
        return dt

    @classmethod
    def parse(cls, text: str) -> ModelShape:
        """`layers=4,heads=8,head_dim=64,dtype=float16` (any subset)."""
        names = {
            "layers": "num_layers",
            "heads": "num_kv_heads",
            "head_dim": "head_dim",
            "dtype": "dtype",
            "latent": "latent_dim",
            "mamba_layers": "mamba_layers",
            "mamba_state": "mamba_state",
        }
        kw: dict[str, object] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, val = part.partition("=")
            if key not in names or not val:
                raise ConfigError(
                    f"--model-shape item {part!r}: expected one of "
                    f"{', '.join(k + '=…' for k in names)}"
                )
            if key == "dtype":
                kw[names[key]] = val
            else:
                try:
                    kw[names[key]] = int(val)
                except ValueError:
                    raise ConfigError(
                        f"--model-shape {key} must be an integer, got {val!r}"
                    ) from None
        return cls(**kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class CacheSpec:
    """One rank's caches: the model cut by TP, in a cache layout."""

    shape: ModelShape
    cache_layout: CacheLayout
    kv_layout: KvLayout
    tp_rank: int
    tp_size: int
    block_size: int
    num_blocks: int
    device: str = "cpu"  # where the caches live: "cpu" or "cuda[:N]"
    # cache_layout "unified": the physical order of [L, B, H, N, C] (content C = K|V per
    # token, as FlashAttention lays it out) and whether Mamba layers follow (a hybrid)
    kv_cache_order: str = "LBHNC"
    hybrid: bool = False

    @property
    def layout_args(self) -> dict[str, object]:
        """`build_regions` / `register_kv_caches` keywords for these caches (not the names
        of the Mamba layers, which `make_caches` returns)."""
        unified = self.cache_layout == "unified"
        return {
            "cache_layout": self.cache_layout,
            "block_size": self.block_size,
            "kv_cache_order": self.kv_cache_order if unified else None,
        }

    @property
    def has_mamba(self) -> bool:
        return self.cache_layout == "mamba" or (self.cache_layout == "unified" and self.hybrid)

    @property
    def heads(self) -> tuple[int, int]:
        return physical_heads(self.tp_rank, self.tp_size, self.shape.num_kv_heads)

    @property
    def num_heads(self) -> int:
        lo, hi = self.heads
        return hi - lo

    @property
    def mamba_len(self) -> int:
        return self.shape.mamba_state // self.tp_size

    @property
    def mamba_index(self) -> torch.Tensor:
        """The model-wide element index of each element of this rank's Mamba page.

        cache_layout "mamba" pages hold (conv, ssm), each split over TP on its own: rank r's
        page is [conv part r | ssm part r]. The unified hybrid's page is one state.
        """
        s, r, tp = self.shape, self.tp_rank, self.tp_size
        if self.cache_layout != "mamba":
            return torch.arange(self.mamba_len) + r * self.mamba_len
        conv, ssm = s.mamba_conv // tp, (s.mamba_state - s.mamba_conv) // tp
        return torch.cat(
            (torch.arange(conv) + r * conv, s.mamba_conv + torch.arange(ssm) + r * ssm)
        )

    def validate(self) -> None:
        if self.cache_layout != "mla":
            check_heads_divisible(self.tp_size, self.shape.num_kv_heads, "model")
        s, tp = self.shape, self.tp_size
        if self.has_mamba and s.mamba_state % tp:
            raise ConfigError(f"mamba_state {s.mamba_state} not divisible by tp_size {tp}")
        if self.cache_layout == "mamba" and s.mamba_conv % tp:
            raise ConfigError(f"mamba_conv {s.mamba_conv} not divisible by tp_size {tp}")


def split_layout(name: str) -> tuple[CacheLayout, str]:
    """A layout argument (`split_kv`, …, `unified`, `unified:BHLNC`) as (cache_layout, order);
    the order is the unified layout's (LBHNC unless named) and ignored by the others."""
    from kvrdma.unified import normalize_order

    layout, _, order = name.partition(":")
    if layout not in CACHE_LAYOUTS:
        raise ConfigError(f"layout must be one of {', '.join(CACHE_LAYOUTS)}, got {layout!r}")
    if order and layout != "unified":
        raise ConfigError(f"layout {name!r}: only 'unified' takes an order (unified:ORDER)")
    try:
        return layout, normalize_order(order or None)
    except RegistrationError as exc:
        raise ConfigError(f"layout {name!r}: {exc}") from None


def _alloc(
    spec: CacheSpec, logical: Sequence[int], physical_order: Sequence[int], zeroed: bool = True
) -> torch.Tensor:
    """A tensor with `logical` shape whose memory is dense in `physical_order`."""
    phys = [logical[d] for d in physical_order]
    new = torch.zeros if zeroed else torch.empty
    t = new(phys, dtype=spec.shape.torch_dtype, device=spec.device)
    inverse = [physical_order.index(d) for d in range(len(logical))]
    return t.permute(inverse)


def make_caches(spec: CacheSpec, *, zeroed: bool = True) -> tuple[dict[str, KVInput], list[str]]:
    """Allocate zeroed caches for `spec`; returns (kv_caches, mamba layer names).

    `zeroed=False` leaves the split K/V, blocks-first and cross-layer caches as `torch.empty`
    gives them: no page is touched, so a benchmark can register a large model's address space.
    """
    spec.validate()
    s, n, b, h, d = (
        spec.shape,
        spec.num_blocks,
        spec.block_size,
        spec.num_heads,
        spec.shape.head_dim,
    )
    hnd = spec.kv_layout == "HND"
    caches: dict[str, KVInput] = {}
    mamba: list[str] = []
    if spec.cache_layout == "cross_layer":
        order = (0, 1, 2, 4, 3, 5) if hnd else tuple(range(6))
        caches["all_layers"] = _alloc(spec, (n, s.num_layers, 2, b, h, d), order, zeroed)
        return caches, mamba
    if spec.cache_layout == "unified":
        # one buffer, logical [L, B, H, N, C], dense in the order; one [B, H, N, C] view a layer
        phys = tuple("LBHNC".index(dim) for dim in spec.kv_cache_order)
        buf = _alloc(spec, (s.num_layers, n, h, b, 2 * d), phys)
        for layer in range(s.num_layers):
            caches[f"model.layers.{layer}.attn"] = buf[layer]
        if spec.hybrid:
            for layer in range(s.mamba_layers):
                name = f"model.layers.{s.num_layers + layer}.mamba"
                page = torch.zeros(n, spec.mamba_len, dtype=s.torch_dtype, device=spec.device)
                caches[name] = page.view(torch.int8).view(n, 1, 1, -1)  # vLLM's Mamba view
                mamba.append(name)
        return caches, mamba
    for layer in range(s.num_layers):
        name = f"model.layers.{layer}.attn"
        if spec.cache_layout == "split_kv":
            order = (0, 1, 3, 2, 4) if hnd else tuple(range(5))
            caches[name] = _alloc(spec, (2, n, b, h, d), order, zeroed)
        elif spec.cache_layout == "mla":
            caches[name] = torch.zeros(n, b, s.latent_dim, dtype=s.torch_dtype, device=spec.device)
        else:  # blocks_first, mamba: [N, 2, B, H, D] memory
            order = (0, 1, 3, 2, 4) if hnd else tuple(range(5))
            t = _alloc(spec, (n, 2, b, h, d), order, zeroed)
            caches[name] = t.transpose(0, 1) if spec.cache_layout == "mamba" else t
    if spec.cache_layout == "mamba":
        conv = s.mamba_conv // spec.tp_size
        for layer in range(s.mamba_layers):
            name = f"model.layers.{s.num_layers + layer}.mamba"
            page = torch.zeros(n, spec.mamba_len, dtype=s.torch_dtype, device=spec.device)
            caches[name] = (page[:, :conv], page[:, conv:])
            mamba.append(name)
    return caches, mamba


def attention_views(
    spec: CacheSpec, caches: dict[str, KVInput]
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(layer, kv, logical [N, B, H, D] view) for every attention layer and K/V."""
    if spec.cache_layout == "cross_layer":
        t = caches["all_layers"]
        assert isinstance(t, torch.Tensor)
        for layer in range(spec.shape.num_layers):
            for kv in (0, 1):
                yield layer, kv, t[:, layer, kv]
        return
    d = spec.shape.head_dim
    for layer in range(spec.shape.num_layers):
        t = caches[f"model.layers.{layer}.attn"]
        assert isinstance(t, torch.Tensor)
        if spec.cache_layout == "unified":
            x = t.permute(0, 2, 1, 3)  # [B, H, N, C] -> [B, N, H, C]
            yield layer, 0, x[..., :d]
            yield layer, 1, x[..., d:]
        elif spec.cache_layout in ("split_kv", "mamba"):
            yield layer, 0, t[0]
            yield layer, 1, t[1]
        elif spec.cache_layout == "blocks_first":
            yield layer, 0, t[:, 0]
            yield layer, 1, t[:, 1]


def _pattern(
    content: torch.Tensor, layer: int, kv: int, heads: torch.Tensor, tokens: torch.Tensor, dims: int
) -> torch.Tensor:
    """Values for content ids [n, B] (per token), heads [H], tokens [B]: → [n, B, H, D]."""
    c = content[:, :, None, None]
    h = heads[None, None, :, None]
    t = tokens[None, :, None, None]
    d = torch.arange(dims)[None, None, None, :]
    return ((c * 97 + layer * 31 + kv * 17 + h * 13 + t * 5 + d) % _MOD + 1).float()


def _mla_pattern(
    content: torch.Tensor, layer: int, tokens: torch.Tensor, dims: int
) -> torch.Tensor:
    c = content[:, :, None]
    t = tokens[None, :, None]
    d = torch.arange(dims)[None, None, :]
    return ((c * 89 + layer * 29 + t * 7 + d) % _MOD + 1).float()


def _mamba_pattern(content: torch.Tensor, layer: int, index: torch.Tensor) -> torch.Tensor:
    return ((content[:, None] * 83 + layer * 19 + index[None, :] * 3) % _MOD + 1).float()


def fill(spec: CacheSpec, caches: dict[str, KVInput]) -> None:
    """Producer: every block's content id is its block id."""
    n, b = spec.num_blocks, spec.block_size
    ids = torch.arange(n)[:, None].expand(n, b)
    tokens = torch.arange(b)
    heads = torch.arange(*spec.heads)
    dt = spec.shape.torch_dtype
    if spec.cache_layout == "mla":
        for layer in range(spec.shape.num_layers):
            t = caches[f"model.layers.{layer}.attn"]
            assert isinstance(t, torch.Tensor)
            t.copy_(_mla_pattern(ids, layer, tokens, spec.shape.latent_dim).to(dt))
    else:
        for layer, kv, view in attention_views(spec, caches):
            view.copy_(_pattern(ids, layer, kv, heads, tokens, spec.shape.head_dim).to(dt))
    for i, name in enumerate(_mamba_names(spec, caches)):
        page = _mamba_page(caches[name], dt)
        layer = spec.shape.num_layers + i
        page.copy_(_mamba_pattern(torch.arange(n), layer, spec.mamba_index).to(dt))
    _settle(spec)


def _settle(spec: CacheSpec) -> None:
    """Device caches: the copies above are queued on a stream; a reader must see them done."""
    if torch.device(spec.device).type == "cuda":
        torch.cuda.synchronize(spec.device)


def _mamba_names(spec: CacheSpec, caches: dict[str, KVInput]) -> list[str]:
    return [k for k in caches if k.endswith(".mamba")] if spec.has_mamba else []


def _mamba_page(value: KVInput, dtype: torch.dtype) -> torch.Tensor:
    conv = value[0] if isinstance(value, (tuple, list)) else value
    n = conv.shape[0]
    if conv.dtype == torch.int8:  # vLLM's [B, 1, 1, page_bytes] byte view of the state
        return conv.reshape(n, -1).view(dtype)
    width = conv.stride(0)
    return torch.as_strided(conv, (n, width), (width, 1))


def verify(
    spec: CacheSpec,
    caches: dict[str, KVInput],
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
    remote_block_size: int,
) -> int:
    """Consumer: count wrong elements in `local_block_ids` after reading `remote_block_ids`.

    Local token `t` of the k-th local block came from remote block
    `remote_block_ids[k*R + t // remote_block_size]`, token `t % remote_block_size`.
    Tokens past the last remote block are not checked.
    """
    lb = torch.as_tensor(np.asarray(local_block_ids, dtype=np.int64))
    rb = np.asarray(remote_block_ids, dtype=np.int64)
    r = spec.block_size // remote_block_size
    padded = np.full(len(lb) * r, -1, dtype=np.int64)
    padded[: len(rb)] = rb
    per_sub = torch.as_tensor(padded.reshape(len(lb), r))
    tok = torch.arange(spec.block_size)
    content = per_sub[:, tok // remote_block_size]  # [n, B]
    rtok = tok % remote_block_size
    valid = content >= 0
    bad = 0
    dt = spec.shape.torch_dtype
    _settle(spec)
    on_dev = lb.to(spec.device)
    if spec.cache_layout == "mla":
        for layer in range(spec.shape.num_layers):
            t = caches[f"model.layers.{layer}.attn"]
            assert isinstance(t, torch.Tensor)
            exp = _mla_pattern(content, layer, rtok, spec.shape.latent_dim).to(dt)
            got = t.index_select(0, on_dev).cpu()
            bad += int(((got != exp) & valid[:, :, None]).sum())
    else:
        heads = torch.arange(*spec.heads)
        for layer, kv, view in attention_views(spec, caches):
            exp = _pattern(content, layer, kv, heads, rtok, spec.shape.head_dim).to(dt)
            got = view.index_select(0, on_dev).cpu()
            bad += int(((got != exp) & valid[:, :, None, None]).sum())
    if spec.has_mamba:
        # one state per block: a local block's state comes from its first remote block
        src = per_sub[:, 0]
        for i, name in enumerate(_mamba_names(spec, caches)):
            page = _mamba_page(caches[name], dt).index_select(0, on_dev).cpu()
            exp = _mamba_pattern(src, spec.shape.num_layers + i, spec.mamba_index).to(dt)
            bad += int(((page != exp) & (src >= 0)[:, None]).sum())
    return bad
