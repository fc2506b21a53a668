"""Registering a worker's KV caches: its regions cut and registered with NIXL, host copies
to stage device caches through, and the terms its producer side publishes (lease, integrity
checksum table)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

import msgspec
import numpy as np
import torch

from kvrdma import hugepages
from kvrdma.descriptors import region_table
from kvrdma.errors import RegistrationError
from kvrdma.integrity import ChecksumTable
from kvrdma.layout import KVInput, KVLayoutInfo, build_regions, worker_metadata
from kvrdma.metadata import CacheLayout, WorkerMetadata, sha256_hex
from kvrdma.nixl.protocol import MemType
from kvrdma.postprocess import HostStager
from kvrdma.state import WorkerState
from kvrdma.topology import TransferTopology


def register(
    s: WorkerState,
    kv_caches: Mapping[str, KVInput],
    *,
    cache_layout: CacheLayout,
    block_size: int,
    mamba_layers: Collection[str],
    host_staging: bool | None,
    kv_cache_order: str | None,
    physical_blocks_per_logical: int,
) -> WorkerMetadata:
    """`Worker.register_kv_caches` (which documents the arguments) on its state `s`."""
    if s.layout is not None:
        raise RegistrationError("register_kv_caches() was already called for this worker")
    if physical_blocks_per_logical < 1:
        raise RegistrationError(
            f"physical_blocks_per_logical must be >= 1, got {physical_blocks_per_logical}"
        )
    info = build_regions(
        kv_caches,
        cache_layout=cache_layout,
        block_size=block_size,
        mamba_layers=mamba_layers,
        kv_cache_order=kv_cache_order,
    )
    if host_staging is None:
        host_staging = s.config.kv_buffer_device == "cpu" and info.device.type != "cpu"
    if host_staging:
        info = host_mirror(info, s)
    mem = MemType.VRAM if info.device.type == "cuda" else MemType.DRAM
    table = region_table([r.meta for r in info.regions])
    if mem is MemType.DRAM and not host_staging:  # the mirror was advised when allocated
        hugepages.apply(table[:, :2].tolist(), s.config.extra.hugepages)
    hugepages.hint_malloc_hugepages()
    s.registered = s.backend.register(table, mem)
    if s.reader is not s.backend:
        s.reader_registered = s.reader.register(table, mem)
    ptr, n = s.scratch.data_ptr(), s.scratch.numel()
    s.scratch_reg = s.reader.register(np.array([[ptr, n, 0]], dtype=np.uint64), MemType.DRAM)
    one = np.array([[ptr, 1, 0]], dtype=np.uint64)
    s.ack_local = s.reader.prep_local(one, MemType.DRAM, scratch=True)  # ack READs land here
    s.layout = info
    s.metadata = worker_metadata(
        info,
        engine_id=s.config.engine_id,
        agent_name=s.backend.agent_name,
        agent_metadata=s.backend.metadata(),
        tp_rank=s.tp_rank,
        tp_size=s.tp_size,
        total_num_kv_heads=s.total_num_kv_heads,
        dp_index=s.dp_index,
        compat_hash=s.compat_hash,
        physical_blocks_per_logical=physical_blocks_per_logical,
    )
    add_producer_terms(s, info, mem)
    s.topology = TransferTopology.for_worker(s.metadata)
    if s.metrics:
        s.metrics.set_registered(nbytes=info.registered_bytes, regions=len(info.regions))
    return s.metadata


def host_mirror(info: KVLayoutInfo, s: WorkerState) -> KVLayoutInfo:
    """Replace device regions by host copies; the stager copies between them."""
    host_regions = []
    for r in info.regions:
        # untouched, advised, then zeroed: the pages fault in as huge pages
        buf = torch.empty(r.meta.num_blocks, r.meta.block_len, dtype=torch.uint8)
        hugepages.apply_to_tensors([buf], s.config.extra.hugepages)
        buf.zero_()
        meta = msgspec.structs.replace(r.meta, base_addr=buf.data_ptr(), device_id=0)
        host_regions.append(replace(r, name=f"{r.name}@host", data=buf, meta=meta))
    s.stager = HostStager([r.data for r in info.regions], [r.data for r in host_regions])
    return replace(info, regions=host_regions, device=torch.device("cpu"))


def add_producer_terms(s: WorkerState, info: KVLayoutInfo, mem: MemType) -> None:
    """What readers learn of this worker's producer side: its lease and (integrity mode) the
    checksum table it keeps of the blocks it holds, registered here."""
    meta = s.metadata
    if meta is None:
        raise RegistrationError("register_kv_caches() has not built the metadata")
    meta = msgspec.structs.replace(meta, kv_lease_duration=s.config.extra.kv_lease_duration)
    if s.config.extra.integrity_checksums and s.config.is_producer:
        s.checksums = ChecksumTable(info.regions, meta)
        s.checksums_reg = s.backend.register(s.checksums.row(), mem)
        md = s.backend.metadata()  # peers may READ only memory registered before this blob
        meta = msgspec.structs.replace(
            s.checksums.publish(meta), agent_metadata=md, agent_metadata_sha256=sha256_hex(md)
        )
    s.metadata = meta
