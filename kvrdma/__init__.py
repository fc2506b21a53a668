"""kvrdma: KV-cache transfer for disaggregated LLM serving over NIXL one-sided READs."""

from kvrdma.errors import (
    ConfigError,
    HandshakeError,
    HandshakeTimeout,
    KvrdmaError,
    ProtocolError,
    RegistrationError,
    TransferError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "HandshakeError",
    "HandshakeTimeout",
    "KvrdmaError",
    "ProtocolError",
    "RegistrationError",
    "TransferError",
    "__version__",
]
