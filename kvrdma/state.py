"""The state both roles of one worker share: config, agents, the registered layout, metadata.

`Worker` builds it; `ProducerSide` and `ConsumerSide` read it, and the consumer updates the
published metadata when a retirement replaces the agent peers read from.
"""

from __future__ import annotations

from typing import Any

import torch

from kvrdma.config import KVTransferConfig
from kvrdma.errors import RegistrationError
from kvrdma.integrity import ChecksumTable
from kvrdma.layout import KVLayoutInfo
from kvrdma.metadata import WorkerMetadata
from kvrdma.nixl.protocol import TransferBackend
from kvrdma.postprocess import HostStager
from kvrdma.topology import TransferTopology
from kvrdma.transfer import Clock


class WorkerState:
    """State both roles use: the backend, the registered layout, the metadata."""

    def __init__(
        self,
        config: KVTransferConfig,
        backend: TransferBackend,
        *,
        reader: TransferBackend | None,
        tp_rank: int,
        tp_size: int,
        total_num_kv_heads: int,
        dp_index: int,
        compat_hash: str,
        metrics: Any,
        clock: Clock,
    ) -> None:
        self.config = config
        self.backend = backend  # the published agent (producer side)
        # reads go through `reader`: the same agent, or (kv_both) a second one, because a
        # read past its deadline retires the reading agent (see ConsumerSide._abandon)
        self.reader = reader or backend
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.total_num_kv_heads = total_num_kv_heads
        self.dp_index = dp_index
        self.compat_hash = compat_hash
        self.metrics = metrics
        self.clock = clock
        self.layout: KVLayoutInfo | None = None
        self.metadata: WorkerMetadata | None = None
        self.topology: TransferTopology | None = None
        self.stager: HostStager | None = None
        self.registered: Any = None
        # a few registered host bytes that ack READs land in (see Remote.ack_lists)
        self.scratch = torch.zeros(64, dtype=torch.uint8)
        self.scratch_reg: Any = None
        self.ack_local: Any = None
        self.reader_registered: Any = None  # kv_both: the regions registered with `reader`
        self.retirements = 0
        # integrity mode, producers: the checksum table readers READ, and its registration
        self.checksums: ChecksumTable | None = None
        self.checksums_reg: Any = None

    @property
    def regions(self) -> list[torch.Tensor]:
        """Byte views of the registered (possibly host-staging) regions."""
        if self.layout is None:
            raise RegistrationError("register_kv_caches() has not been called")
        return [r.data for r in self.layout.regions]
