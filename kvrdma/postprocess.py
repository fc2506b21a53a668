"""On-receive fix-ups (SPEC §5): block permutes and host-buffer staging copies.

After a READ, a local attention block holds its bytes in *landing order*
`[R sub-blocks][F fragments][C source chunks][chunk in the remote layout]`. A `BlockPermute`
reorders the received blocks in place into the local layout (HND or NHD).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

# dimension labels: R sub-blocks, F fragments, C chunks, H heads/chunk, L layers inside a
# head (vLLM's BHLNC order; 1 otherwise), B tokens, X head bytes
_SRC = {"HND": "RFCHLBX", "NHD": "RFCLBHX"}
_DST = {"HND": "FCHLRBX", "NHD": "FLRBCHX"}


@dataclass(frozen=True)
class BlockPermute:
    """How to reorder one attention region's received blocks into the local layout."""

    region: int
    ratio: int  # R: remote blocks per local block
    fragments: int  # F
    chunks: int  # C: source chunks per fragment
    chunk_heads: int  # H: heads per chunk
    remote_block_size: int  # B: tokens per remote block
    head_bytes: int  # X: head_dim * element size
    remote_layout: str
    local_layout: str
    layers: int = 1  # L: layers inside each head's bytes (BHLNC)

    def _sizes(self) -> dict[str, int]:
        return {
            "R": self.ratio,
            "F": self.fragments,
            "C": self.chunks,
            "H": self.chunk_heads,
            "L": self.layers,
            "B": self.remote_block_size,
            "X": self.head_bytes,
        }

    @property
    def src_shape(self) -> tuple[int, ...]:
        sizes = self._sizes()
        return tuple(sizes[c] for c in _SRC[self.remote_layout])

    @property
    def perm(self) -> tuple[int, ...]:
        src = _SRC[self.remote_layout]
        return tuple(src.index(c) for c in _DST[self.local_layout])

    @property
    def is_identity(self) -> bool:
        """True when the bytes already sit in the local layout (only size-1 dims move)."""
        sizes = self._sizes()
        src = [c for c in _SRC[self.remote_layout] if sizes[c] > 1]
        dst = [c for c in _DST[self.local_layout] if sizes[c] > 1]
        return src == dst

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.src_shape))

    def apply(self, region: torch.Tensor, block_ids: npt.ArrayLike) -> None:
        """Permute `block_ids` of `region` (a uint8 tensor [num_blocks, block_len]) in place."""
        ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=region.device)
        if ids.numel() == 0 or self.is_identity:
            return
        if region.shape[1] != self.block_bytes:
            raise ValueError(
                f"region {self.region}: block of {region.shape[1]} bytes, permute expects "
                f"{self.block_bytes} ({self.src_shape})"
            )
        blocks = region.index_select(0, ids).view(-1, *self.src_shape)
        perm = (0, *(d + 1 for d in self.perm))
        fixed = blocks.permute(perm).contiguous().view(ids.numel(), -1)
        region.index_copy_(0, ids, fixed)


def apply_permutes(
    regions: Sequence[torch.Tensor], permutes: Sequence[BlockPermute], block_ids: npt.ArrayLike
) -> None:
    """Apply every region's permute to the received local blocks."""
    for p in permutes:
        p.apply(regions[p.region], block_ids)


class HostStager:
    """`kv_buffer_device=cpu`: device blocks staged through registered host blocks.

    The producer copies device → host before peers read (`stage_out`); the consumer copies
    host → device after its READ completed (`stage_in`). Regions pair one to one.
    """

    def __init__(
        self, device_regions: Sequence[torch.Tensor], host_regions: Sequence[torch.Tensor]
    ):
        if len(device_regions) != len(host_regions):
            raise ValueError(
                f"{len(device_regions)} device regions but {len(host_regions)} host regions"
            )
        for i, (d, h) in enumerate(zip(device_regions, host_regions, strict=True)):
            if d.shape != h.shape or d.dtype != h.dtype:
                raise ValueError(
                    f"region {i}: device {tuple(d.shape)} {d.dtype} != "
                    f"host {tuple(h.shape)} {h.dtype}"
                )
        self.device_regions = list(device_regions)
        self.host_regions = list(host_regions)

    def _copy(
        self, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], ids: npt.ArrayLike
    ) -> None:
        idx = np.asarray(ids, dtype=np.int64)
        if idx.size == 0:
            return
        for s, d in zip(src, dst, strict=True):
            t = torch.as_tensor(idx, device=s.device)
            d.index_copy_(0, t.to(d.device), s.index_select(0, t).to(d.device, non_blocking=False))

    def stage_out(self, block_ids: npt.ArrayLike) -> None:
        """Device → host (producer, before the blocks are read)."""
        self._copy(self.device_regions, self.host_regions, block_ids)

    def stage_in(self, block_ids: npt.ArrayLike) -> None:
        """Host → device (consumer, after the READ completed)."""
        self._copy(self.host_regions, self.device_regions, block_ids)
