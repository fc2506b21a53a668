"""What a producer rank writes into one decoder rank: the decoder's own read plan cut down to
this rank (so push lands every byte where pull would), and its entries grouped by layer.

Segment `i` holds the entries of the producer's `i`-th layer; the last segment holds regions
that carry every layer (one block row of all layers), which can only be sent whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvrdma.descriptors import ReadPlan, SourcePlan
from kvrdma.errors import ConfigError
from kvrdma.layout import KVLayoutInfo
from kvrdma.metadata import WorkerMetadata
from kvrdma.plan import build_source_plan
from kvrdma.topology import TransferTopology

Ids = npt.NDArray[np.int32]


@dataclass(frozen=True)
class WritePlan:
    """The decoder rank's plan with this producer rank as its only source."""

    decoder: WorkerMetadata
    plan: ReadPlan
    # entry indices of the source, per segment (layers in order, then the all-layer rest)
    segments: tuple[npt.NDArray[np.intp], ...]

    @property
    def source(self) -> SourcePlan:
        return self.plan.sources[0]

    def descriptor_ids(
        self, segment: int | None, decoder_block_ids: list[int], producer_block_ids: list[int]
    ) -> tuple[Ids, Ids]:
        """(producer ids, decoder ids) of one segment (None: all of it) for a request."""
        _, dsub, pids = self.plan.checked_block_ids(decoder_block_ids, producer_block_ids)
        src = self.source
        sel = slice(None) if segment is None else self.segments[segment]
        d = np.add.outer(src.local_starts[sel], np.asarray(dsub, dtype=np.int32))
        p = np.add.outer(src.remote_starts[sel], np.asarray(pids, dtype=np.int32))
        return p.astype(np.int32).ravel(), d.astype(np.int32).ravel()


def segment_count(layout: KVLayoutInfo) -> int:
    """Segments of a layer-wise push from this layout: one per layer, plus the rest."""
    return len(layout.layer_index) + 1


def build_write_plan(
    producer: WorkerMetadata, layout: KVLayoutInfo, decoder: WorkerMetadata
) -> WritePlan | None:
    """The plan of `producer` (whose registered layout this is) writing into `decoder`, or
    None when the decoder reads nothing from this rank. Raises `ConfigError` naming the
    decoder when the two cannot be paired."""
    topo = TransferTopology.for_worker(decoder)
    plan = build_source_plan(topo, decoder, producer, mamba_states=layout.mamba_states)
    if plan is None:
        return None
    src = plan.sources[0]
    regions, index = layout.regions, layout.layer_index
    starts = np.array([r.meta.base_addr for r in regions], dtype=np.uint64)
    ends = starts + np.array([r.meta.num_blocks * r.meta.block_len for r in regions], np.uint64)
    order = np.argsort(starts)
    addrs = src.remote_rows[:, 0]
    pos = np.searchsorted(starts[order], addrs, side="right") - 1
    region_of = order[np.clip(pos, 0, None)]
    outside = (pos < 0) | (addrs >= ends[region_of])
    if outside.any():
        raise ConfigError(
            f"decoder {decoder.engine_id!r} rank {decoder.tp_rank}: the plan names producer "
            f"memory outside its regions at {[hex(int(a)) for a in addrs[outside][:4]]}"
        )
    # a region of every layer (layer None) falls in the last segment
    seg_of = np.array(
        [index.get(regions[i].layer or "", len(index)) for i in region_of.tolist()],
        dtype=np.intp,
    ).reshape(-1)
    segments = tuple(np.flatnonzero(seg_of == k) for k in range(len(index) + 1))
    return WritePlan(decoder, plan, segments)
