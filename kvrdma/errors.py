"""The exception tree. Every message says what was expected, what arrived, and from whom."""

from __future__ import annotations

import msgspec

from kvrdma.types import HandshakeOutcome

# what msgspec raises for bytes a peer sent that are no valid message: besides its own errors,
# nesting past its depth limit, invalid UTF-8 in a string (a ValueError) and absurd lengths
MALFORMED = (msgspec.DecodeError, RecursionError, ValueError, MemoryError)


class KvrdmaError(Exception):
    """Root of every error kvrdma raises on purpose."""


class ConfigError(KvrdmaError, ValueError):
    """A configuration value (user input, or an impossible TP/block-size mapping) is invalid."""


class ProtocolError(KvrdmaError):
    """A peer sent bytes that do not decode to a valid message of our wire protocol."""


class HandshakeError(KvrdmaError):
    """Metadata exchange with a peer failed; `outcome` is its `kvrdma_handshakes_total` label
    (a subclass names a more specific one than `error`)."""

    outcome: HandshakeOutcome = HandshakeOutcome.ERROR


class HandshakeTimeout(HandshakeError, TimeoutError):
    """Metadata exchange with a peer did not complete before its deadline."""

    outcome = HandshakeOutcome.TIMEOUT


class HandshakeRefused(HandshakeError):
    """The peer answered with an error reply whose `code` (`kvrdma.handshake.wire.ErrorCode`)
    says why it would not serve the request."""

    outcome = HandshakeOutcome.REFUSED

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class HandshakeIncompatible(HandshakeError):
    """The two sides can never work together as configured (compatibility hash, protocol
    version, TP or block sizes, or a peer that is no kvrdma agent)."""

    outcome = HandshakeOutcome.INCOMPATIBLE


class PeerUnreachable(HandshakeError):
    """NIXL cannot connect to the agent a peer published: its process exited (a restart not
    yet published) or its address cannot be reached from here. `agent` names it."""

    outcome = HandshakeOutcome.UNREACHABLE

    def __init__(self, message: str, agent: str | None = None) -> None:
        super().__init__(message)
        self.agent = agent


class RegistrationError(KvrdmaError):
    """KV tensors cannot be registered as given (shape, dtype, contiguity, device)."""


class TransferError(KvrdmaError):
    """A transfer could not be prepared, posted, or completed."""
