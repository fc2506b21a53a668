"""On-receive fix-ups (SPEC §5): block permutes executed with torch, and host-buffer staging.

The planner describes each permute as a torch-free `BlockPermute` (`kvrdma.permute`); this
module reorders the received blocks in place into the local layout (HND or NHD).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvrdma.permute import BlockPermute

__all__ = ["BlockPermute", "HostStager", "apply_permute", "apply_permutes"]


def apply_permute(p: BlockPermute, region: torch.Tensor, block_ids: npt.ArrayLike) -> None:
    """Permute `block_ids` of `region` (a uint8 tensor [num_blocks, block_len]) in place."""
    ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=region.device)
    if ids.numel() == 0 or p.is_identity:
        return
    if region.shape[1] != p.block_bytes:
        raise ValueError(
            f"region {p.region}: block of {region.shape[1]} bytes, permute expects "
            f"{p.block_bytes} ({p.src_shape})"
        )
    blocks = region.index_select(0, ids).view(-1, *p.src_shape)
    perm = (0, *(d + 1 for d in p.perm))
    fixed = blocks.permute(perm).contiguous().view(ids.numel(), -1)
    region.index_copy_(0, ids, fixed)


def apply_permutes(
    regions: Sequence[torch.Tensor], permutes: Sequence[BlockPermute], block_ids: npt.ArrayLike
) -> None:
    """Apply every region's permute to the received local blocks."""
    for p in permutes:
        apply_permute(p, regions[p.region], block_ids)


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
