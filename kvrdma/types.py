"""The values a worker reports: how a transfer ended (`Outcome`), why a request's KV load
failed (`FailureReason`) and one step's report (`FinishedOutput`).

The metrics label transfers with `Outcome` and `TransferMode` values, handshakes with
`HandshakeOutcome` values and the connections a handshake server drops with `ServerSocket` and
`ConnectionDrop` values, so a dashboard and `get_finished()` speak the same words.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TypeAlias

__all__ = [
    "ConnectionDrop",
    "FailureReason",
    "FinishedOutput",
    "HandshakeOutcome",
    "Outcome",
    "ServerSocket",
    "StatValue",
    "TransferMode",
]

Number: TypeAlias = int | float
StatValue: TypeAlias = int | float | tuple[Number, ...]


class _Label(str, enum.Enum):
    """A metric label value: compares and formats as its string."""

    def __str__(self) -> str:
        return self.value


class Outcome(_Label):
    """How one read (all its source ranks) ended."""

    SUCCESS = "success"
    FAILED = "failed"  # the transfer or its posting failed
    TIMEOUT = "timeout"  # not done by its deadline
    PEER_LOST = "peer_lost"  # the remote agent went away: connect() again before reuse
    CANCELLED = "cancelled"  # ended by this worker (its reading agent was retired)
    # the producer's lease ends (or would before the read could end): its blocks may already
    # hold another request's KV, so nothing read from them is used
    EXPIRED = "expired"
    # integrity mode: the landed bytes of some blocks do not match the producer's checksums
    CORRUPT = "corrupt"


class TransferMode(_Label):
    """How a request's KV reached the decoder."""

    PULL = "pull"  # the decoder READ it from the producer
    PUSH = "push"  # the producer WROTE it into the decoder's blocks


class HandshakeOutcome(_Label):
    """How one metadata handshake with a remote engine ended."""

    SUCCESS = "success"
    TIMEOUT = "timeout"
    REFUSED = "refused"
    INCOMPATIBLE = "incompatible"
    UNREACHABLE = "unreachable"
    ERROR = "error"


class ServerSocket(_Label):
    """A socket of the handshake server."""

    SIDE_CHANNEL = "side_channel"  # peers' metadata requests
    PUBLISH = "publish"  # workers' publications (sidecar mode)


class ConnectionDrop(_Label):
    """Why the handshake server shut a TCP connection down (see `kvrdma.handshake.guard`)."""

    # it sent more bytes than a few frames without ending a message (libzmq holds them all)
    UNFINISHED_MESSAGE = "unfinished_message"
    IDLE = "idle"  # past the socket's connection bound, it was idle the longest


# which reason a request spread over several ranks reports: the one that asks the engine to
# act (re-connect) first, then the ones outside this worker's control
_SEVERITY = (
    Outcome.PEER_LOST,
    Outcome.EXPIRED,
    Outcome.CORRUPT,
    Outcome.TIMEOUT,
    Outcome.FAILED,
    Outcome.CANCELLED,
)


@dataclass(frozen=True)
class FailureReason:
    """Why a request's KV load failed: the outcome, the engine read from, the error text, and
    (once aggregated) the worker ranks that saw it fail."""

    outcome: Outcome
    remote_engine: str
    error: str
    ranks: tuple[int, ...] = ()

    def merge(self, other: FailureReason) -> FailureReason:
        """One reason for a request that failed on several ranks: the most actionable
        outcome, every rank, and each distinct error once."""
        outcome = min(self.outcome, other.outcome, key=_SEVERITY.index)
        error = self.error if other.error in self.error else f"{self.error}; {other.error}"
        return FailureReason(
            outcome=outcome,
            remote_engine=self.remote_engine,
            error=error,
            ranks=tuple(sorted({*self.ranks, *other.ranks})),
        )


@dataclass
class FinishedOutput:
    """One worker's report for one step, in the shape vLLM's connector returns.

    A failed receive is a request id in `finished_recving` with its local blocks in
    `invalid_block_ids` and its reason in `failures`; `failed` is the subset not to be
    recomputed (`kv_load_failure_policy` "fail"). `stats` are numbers or lists of numbers
    that `KVOutputAggregator` sums or concatenates over workers.
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: dict[str, set[int]] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    failures: dict[str, FailureReason] = field(default_factory=dict)
    stats: dict[str, StatValue | list[Number]] = field(default_factory=dict)
    # push mode: failed requests a producer may still write into (reuse none of their
    # blocks), and requests whose blocks are safe again
    quarantined: set[str] = field(default_factory=set)
    released: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(
            self.finished_sending or self.finished_recving or self.quarantined or self.released
        )


_new = object.__new__


def empty_output() -> FinishedOutput:
    """`FinishedOutput()`, built for a poll loop: fresh empty fields, set without the
    generated `__init__`'s per-field default checks."""
    out = _new(FinishedOutput)
    out.finished_sending = set()
    out.finished_recving = set()
    out.invalid_block_ids = {}
    out.failed = set()
    out.failures = {}
    out.stats = {}
    out.quarantined = set()
    out.released = set()
    return out
