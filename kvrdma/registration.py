"""What registration adds around a worker's regions: host copies to stage device caches
through, and the terms its producer side publishes (lease, integrity checksum table)."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import torch

from kvrdma import hugepages
from kvrdma.errors import RegistrationError
from kvrdma.integrity import ChecksumTable
from kvrdma.layout import KVLayoutInfo
from kvrdma.metadata import sha256_hex
from kvrdma.nixl.protocol import MemType
from kvrdma.postprocess import HostStager
from kvrdma.state import WorkerState


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
