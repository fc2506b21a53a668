"""One layer's KV in a backend-neutral form, cut by heads for receivers or merged from senders.

Backends hand a layer's cache as `[2, N, ...]` (K and V first), `[N, 2, ...]` (blocks first)
or a `(K, V)` pair; stages exchange `(K, V)` pairs so neither side needs the other's layout.
When the receiving stage has more ranks than the sending one, each receiver takes a
contiguous range of the sender's heads; when it has fewer, it concatenates its senders'
shards in rank order. Both steps are hooks, for models whose heads are not simply split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvrdma.descriptors import repeated_block_ids
from kvrdma.errors import ConfigError, TransferError
from kvrdma.stages.mapping import StageMapping
from kvrdma.stages.memcpy import Job, copy_all

KVPair = tuple[torch.Tensor, torch.Tensor]
LayerKV = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | list[torch.Tensor]
Slicer = Callable[[torch.Tensor, int, int], torch.Tensor]  # (tensor, index, count) -> piece
Merger = Callable[[Sequence[torch.Tensor]], torch.Tensor]  # shards in rank order -> whole
# a block's bytes from which `write_blocks` copies block by block (torch's `index_copy_` is
# slower than a memcpy per block for blocks this large, and faster for smaller ones)
_MIN_ROW_BYTES = 2048


def split_kv(layer: LayerKV, *, kv_axis: int | None = None) -> KVPair:
    """`(K, V)` views of one layer's cache, whichever of the three forms it comes in.

    `kv_axis` (0 or 1) says where the K/V axis of a tensor is; without it the axis of size 2
    is found, and a tensor with size 2 on both leading axes is refused as ambiguous."""
    if isinstance(layer, (tuple, list)):
        if len(layer) != 2 or not all(isinstance(t, torch.Tensor) for t in layer):
            raise ConfigError(
                f"layer KV: expected a (K, V) pair of tensors, got {type(layer).__name__} "
                f"of {len(layer)} items"
            )
        k, v = layer
        if k.shape != v.shape or k.dtype != v.dtype:
            raise ConfigError(
                f"layer KV: K {tuple(k.shape)} {k.dtype} and V {tuple(v.shape)} {v.dtype} differ"
            )
        return k, v
    if not isinstance(layer, torch.Tensor):
        raise ConfigError(f"layer KV: expected a tensor or a (K, V) pair, got {layer!r:.80}")
    if kv_axis is None:
        candidates = [a for a in (0, 1) if layer.dim() > a and layer.shape[a] == 2]
        if len(candidates) != 1:
            raise ConfigError(
                f"layer KV of shape {tuple(layer.shape)}: cannot tell where K and V are "
                "(expected exactly one of the first two axes to have size 2); pass kv_axis"
            )
        kv_axis = candidates[0]
    if kv_axis not in (0, 1) or layer.dim() <= kv_axis or layer.shape[kv_axis] != 2:
        raise ConfigError(
            f"kv_axis: expected 0 or 1 naming an axis of size 2 in {tuple(layer.shape)}, "
            f"got {kv_axis!r}"
        )
    return layer.select(kv_axis, 0), layer.select(kv_axis, 1)


def _axis(t: torch.Tensor, head_axis: int) -> int:
    if not -t.dim() <= head_axis < t.dim():
        raise ConfigError(f"head_axis {head_axis} is outside a tensor of shape {tuple(t.shape)}")
    return head_axis % t.dim()


def slice_heads(t: torch.Tensor, index: int, count: int, *, head_axis: int = -2) -> torch.Tensor:
    """The `index`-th of `count` equal contiguous head ranges of `t` (a view)."""
    axis = _axis(t, head_axis)
    heads = t.shape[axis]
    if count < 1 or heads % count or not 0 <= index < count:
        raise ConfigError(
            f"cannot take piece {index} of {count} from {heads} heads (axis {axis} of "
            f"{tuple(t.shape)}): the heads must split evenly"
        )
    step = heads // count
    return t.narrow(axis, index * step, step)


def merge_heads(shards: Sequence[torch.Tensor], *, head_axis: int = -2) -> torch.Tensor:
    """Concatenate shards (in sender rank order) along the head axis."""
    if not shards:
        raise ConfigError("merge_heads: no shards to merge")
    axis = _axis(shards[0], head_axis)
    return torch.cat(list(shards), dim=axis)


@dataclass(frozen=True)
class HeadSharder:
    """Cuts and joins `(K, V)` pairs by heads between two stages (hooks injectable).

    `head_axis` (by default -2, the heads of `[blocks, tokens, heads, dim]`) is the axis cut
    and joined; a mapping along another dimension than "tp" that cuts or joins must name its
    axis or pass the hook it needs: cut by heads, each receiver would get the wrong shard."""

    mapping: StageMapping
    head_axis: int | None = None
    slicer: Slicer | None = None
    merger: Merger | None = None

    def __post_init__(self) -> None:
        m = self.mapping
        hook = self.slicer if m.splits else self.merger
        if m.heterogeneous and m.dimension != "tp" and self.head_axis is None and hook is None:
            raise ConfigError(
                f"a {m.dimension} mapping of {m.sender_size} sender and {m.receiver_size} "
                f"receiver ranks {'cuts' if m.splits else 'joins'} shards along that dimension: "
                f"pass head_axis (the axis it shards) or a {'slicer' if m.splits else 'merger'}"
            )

    @property
    def axis(self) -> int:
        """The axis cut and joined."""
        return -2 if self.head_axis is None else self.head_axis

    def for_receiver(self, pair: KVPair, receiver_rank: int) -> KVPair:
        """What one sender rank sends to `receiver_rank` (one of `mapping.targets`)."""
        index, count = self.mapping.piece(receiver_rank)
        if count == 1:
            return pair
        cut = self.slicer or (lambda t, i, n: slice_heads(t, i, n, head_axis=self.axis))
        return cut(pair[0], index, count), cut(pair[1], index, count)

    def merge(self, pairs: Sequence[KVPair]) -> KVPair:
        """Join the pairs a receiver got from its sources, in `mapping.sources` order."""
        if len(pairs) == 1:
            return pairs[0]
        join = self.merger or (lambda ts: merge_heads(ts, head_axis=self.axis))
        return join([p[0] for p in pairs]), join([p[1] for p in pairs])


def extract(
    kv_caches: Sequence[LayerKV], block_ids: Sequence[int], *, kv_axis: int | None = None
) -> list[KVPair]:
    """A request's blocks, in `block_ids` order, out of each layer's paged cache (any of the
    three forms): copies, so the cache's blocks can be reused once this returns."""
    return [
        (k.index_select(0, index), v.index_select(0, index))
        for (k, v), index in cached_blocks(kv_caches, block_ids, kv_axis=kv_axis)
    ]


def cached_blocks(
    kv_caches: Sequence[LayerKV],
    block_ids: Sequence[int],
    *,
    kv_axis: int | None = None,
    distinct: bool = False,
) -> list[tuple[KVPair, torch.Tensor]]:
    """Each layer's `(K, V)` cache views with the index of `block_ids` in them (checked to
    be integers within every layer's blocks, and each named once if `distinct`: blocks to
    be written), nothing copied."""
    ids = list(block_ids)
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in ids):
        raise ConfigError(f"block_ids: expected integers, got {ids!r:.80}")
    if distinct and (twice := repeated_block_ids(ids, len(ids))):  # a list: no bitmap needed
        raise ConfigError(
            f"block_ids: {twice} named more than once; a block is written with one row"
        )
    out, index = [], {}  # one index per device the layers are on
    for i, layer in enumerate(kv_caches):
        k, v = split_kv(layer, kv_axis=kv_axis)
        bad = [b for b in ids if not 0 <= b < k.shape[0]]
        if bad:
            raise ConfigError(f"block_ids {bad[:8]} are outside layer {i}'s {k.shape[0]} blocks")
        if k.device not in index:
            index[k.device] = torch.tensor(ids, dtype=torch.long, device=k.device)
        out.append(((k, v), index[k.device]))
    return out


def write_blocks(
    cached: Sequence[tuple[KVPair, torch.Tensor]],
    layers: Sequence[tuple[torch.Tensor, ...]],
    *,
    piece: tuple[int, int],
    head_axis: int,
    what: str,
) -> None:
    """Write each layer's `(K, V)` of a shard into the cache blocks `cached` names (as
    `cached_blocks` gives them): the shard is the `index`-th of `count` equal head ranges of
    the cache (`piece`), all of its heads when `count` is 1; a shard that is not exactly that
    raises a `TransferError` naming `what`."""
    if len(layers) != len(cached):
        raise TransferError(f"{what}: {len(layers)} layers for a cache of {len(cached)}")
    index_of, count = piece
    jobs: list[Job] = []
    ids = cached[0][1].tolist() if cached else []
    for i, (((k, v), index), pair) in enumerate(zip(cached, layers, strict=True)):
        if len(pair) != 2:
            raise TransferError(f"{what}: layer {i} holds {len(pair)} tensors, expected (K, V)")
        for cache, t in zip((k, v), pair, strict=True):
            axis = _axis(cache, head_axis)
            heads, first = cache.shape[axis] // count, index_of * (cache.shape[axis] // count)
            want = [index.numel(), *cache.shape[1:]]
            want[axis] = heads
            fits = heads > 0 and cache.shape[axis] % count == 0
            if not fits or t.dtype != cache.dtype or list(t.shape) != want:
                raise TransferError(
                    f"{what}: layer {i} is {t.dtype} {tuple(t.shape)}; its blocks of the cache "
                    f"take {cache.dtype} {tuple(want)}, piece {index_of} of {count} of the "
                    f"{cache.shape[axis]} heads"
                )
            target = cache.narrow(axis, first, heads)
            if _host_rows(target, t):
                jobs += _row_jobs(target, t, ids)
            else:
                target.index_copy_(0, index, t.to(cache.device))
    copy_all(jobs)


def _host_rows(target: torch.Tensor, t: torch.Tensor) -> bool:
    """Both are host memory laid out block by block, each block's bytes its values in order
    and at least `_MIN_ROW_BYTES` of them: then a memcpy per block beats `index_copy_`."""
    plain = all(x.is_cpu and not x.is_neg() and not x.is_conj() for x in (target, t))
    return (
        plain
        and t.is_contiguous()
        and target[0].is_contiguous()
        and target[0].numel() * target.element_size() >= _MIN_ROW_BYTES
    )


def _row_jobs(target: torch.Tensor, t: torch.Tensor, ids: list[int]) -> list[Job]:
    """Memcpys of `t`'s blocks into the blocks `ids` of `target`."""
    n = target[0].numel() * target.element_size()
    dst, step, src = target.data_ptr(), target.stride(0) * target.element_size(), t.data_ptr()
    return [(dst + i * step, src + j * n, n) for j, i in enumerate(ids)]
