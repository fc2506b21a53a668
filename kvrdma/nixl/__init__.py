"""The transfer backend: the `TransferBackend` protocol and its NIXL implementation.

Modules:
- `protocol`: the typed interface (`TransferBackend`, `XferState`, `XferResult`,
  `BackendConfig`, `MemType`, descriptor and id array types); it never imports nixl.
- `agent`: `NixlBackend`, one NIXL agent behind that protocol.
- `handles`: the registrations, descriptor lists and transfers it hands out.
- `retire`: retiring an agent (parking it, the standby that takes over).
- `standby`: building agents off the caller's thread; watching an agent's copy threads.
- `create`: creating and destroying NIXL agents, the only module that imports nixl.
- `checks`: pure checks at the boundary (metadata envelope, descriptor and id arrays).
- `status`: a transfer's state read from NIXL's binding, as `check_xfer_state` reads it.
- `ucx`: `UCX_TLS` values kvrdma sets itself.
- `transport`: what UCX can use under its settings and the visible devices (logs, metrics).

`NixlBackend` is imported on first use, so the protocol stays cheap to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvrdma.nixl.protocol import (
    BackendConfig,
    DescList,
    MemType,
    RegisteredMemory,
    TransferBackend,
    Xfer,
    XferResult,
    XferState,
    XferTelemetry,
)

if TYPE_CHECKING:
    from kvrdma.nixl.agent import NixlBackend

__all__ = [
    "BackendConfig",
    "DescList",
    "MemType",
    "NixlBackend",
    "RegisteredMemory",
    "TransferBackend",
    "Xfer",
    "XferResult",
    "XferState",
    "XferTelemetry",
]


def __getattr__(name: str) -> Any:
    if name != "NixlBackend":
        raise AttributeError(f"module 'kvrdma.nixl' has no attribute {name!r}")
    value = importlib.import_module("kvrdma.nixl.agent").NixlBackend
    globals()[name] = value
    return value
