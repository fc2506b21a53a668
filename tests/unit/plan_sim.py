"""In-process stand-in for NIXL READs: executes a ReadPlan with memmove (pure-logic tests)."""

from __future__ import annotations

import ctypes

import numpy as np

from kvrdma.descriptors import ReadPlan, expand_strided
from kvrdma.layout import build_regions, worker_metadata
from kvrdma.metadata import WorkerMetadata
from kvrdma.postprocess import apply_permutes
from kvrdma.testing.synthetic import CacheSpec, fill, make_caches
from kvrdma.topology import TransferTopology


class SimWorker:
    def __init__(self, spec: CacheSpec, engine: str, *, producer: bool) -> None:
        self.spec = spec
        self.caches, mamba = make_caches(spec)
        self.info = build_regions(self.caches, mamba_layers=mamba, **spec.layout_args)  # type: ignore[arg-type]
        if producer:
            fill(spec, self.caches)
        self.meta: WorkerMetadata = worker_metadata(
            self.info,
            engine_id=engine,
            agent_name=f"{engine}-{spec.tp_rank}",
            agent_metadata=b"",
            tp_rank=spec.tp_rank,
            tp_size=spec.tp_size,
            total_num_kv_heads=spec.shape.num_kv_heads,
        )

    def topology(self) -> TransferTopology:
        return TransferTopology.for_worker(self.meta)


def execute(plan: ReadPlan, local_ids: list[int], remote_ids: list[int]) -> int:
    """Copy what the plan says; returns the number of descriptors moved."""
    _, lsub, rids = plan.checked_block_ids(local_ids, remote_ids)
    moved = 0
    for src in plan.sources:
        ltab = expand_strided(src.local_rows)
        rtab = expand_strided(src.remote_rows)
        li, ri = src.descriptor_ids(lsub, rids)
        assert len(np.unique(li)) == len(li), "a local descriptor is written twice"
        for a, b in zip(li, ri, strict=True):
            dst, n, _ = ltab[a]
            s, m, _ = rtab[b]
            assert n == m, (n, m)
            ctypes.memmove(int(dst), int(s), int(n))
        moved += len(li)
    return moved


def read_and_permute(
    worker: SimWorker, plan: ReadPlan, local_ids: list[int], remote_ids: list[int]
) -> int:
    moved = execute(plan, local_ids, remote_ids)
    apply_permutes([r.data for r in worker.info.regions], plan.permutes, local_ids)
    return moved
