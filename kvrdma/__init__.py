"""kvrdma: KV-cache transfer for disaggregated LLM serving over NIXL one-sided READs.

The public API is what `__all__` lists. `Worker`, `ProgressLoop` and
`load_kv_transfer_config` are imported on first use, so `import kvrdma` stays cheap (no
torch, NIXL or ZMQ until a worker is built).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvrdma.errors import (
    ConfigError,
    HandshakeError,
    HandshakeIncompatible,
    HandshakeRefused,
    HandshakeTimeout,
    KvrdmaError,
    PeerUnreachable,
    ProtocolError,
    RegistrationError,
    TransferError,
)
from kvrdma.types import FailureReason, FinishedOutput, Outcome

if TYPE_CHECKING:
    from kvrdma.config import load_kv_transfer_config
    from kvrdma.progress import ProgressLoop
    from kvrdma.worker import Worker

__version__ = "0.1.0"

_LAZY = {
    "Worker": "kvrdma.worker",
    "ProgressLoop": "kvrdma.progress",
    "load_kv_transfer_config": "kvrdma.config",
}

__all__ = [
    "ConfigError",
    "FailureReason",
    "FinishedOutput",
    "HandshakeError",
    "HandshakeIncompatible",
    "HandshakeRefused",
    "HandshakeTimeout",
    "KvrdmaError",
    "Outcome",
    "PeerUnreachable",
    "ProgressLoop",
    "ProtocolError",
    "RegistrationError",
    "TransferError",
    "Worker",
    "__version__",
    "load_kv_transfer_config",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvrdma' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
