"""A producer's lease seen from a consumer: the producer's clock offset, learnt at the
handshake, and the local time by which a read of leased blocks must have ended.

The producer frees a request's blocks when its lease expires (in the producer's clock) and may
reuse them at once, so a READ that runs past that instant can copy another request's KV. The
consumer converts the expiry into its own clock and keeps a margin: the offset's uncertainty
(the handshake round trip) plus `EXPIRY_SAFETY_SECONDS` for drift and scheduling since.
A heartbeat renews the lease only if the producer still holds the request when it arrives, so
the consumer counts its heartbeats only while each left that margin before the lease it renews.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvrdma.config_checks import bad_value, check_number
from kvrdma.errors import ConfigError

__all__ = [
    "EXPIRY_SAFETY_SECONDS",
    "ClockOffset",
    "Renewals",
    "check_lease_duration",
    "heartbeat_period",
    "lease_cutoff",
    "read_cutoff",
]

# slack on top of the offset's uncertainty: covers clock drift since the handshake and the
# producer stepping (and freeing) right at the expiry instant
EXPIRY_SAFETY_SECONDS = 0.25


def check_lease_duration(path: str, value: object) -> float:
    """A configured `kv_lease_duration`: longer than the margin readers keep before a lease
    ends, for a shorter one would expire every read of the producer before it started."""
    expected = (
        f"a number of seconds > {EXPIRY_SAFETY_SECONDS:g} (a READ must end that long before "
        "the producer's lease, and the handshake's round trip more)"
    )
    lease = check_number(path, value, expected, positive=True)
    if lease <= EXPIRY_SAFETY_SECONDS:
        raise bad_value(path, expected, value)
    return lease


def heartbeat_period(own: float, told: Iterable[float]) -> float:
    """Seconds between a reader's heartbeats: a sixth of the shortest lease, its own or one
    its producers told (0: not told), for a producer's may be shorter; a told lease counts as
    no shorter than the margin a read keeps, as a peer's value is not trusted below it."""
    return min([own, *(max(x, EXPIRY_SAFETY_SECONDS) for x in told if x > 0)]) / 6


@dataclass(frozen=True)
class ClockOffset:
    """remote clock − local clock, within ± `uncertainty` seconds."""

    offset: float
    uncertainty: float

    @classmethod
    def estimate(cls, sent: float, received: float, remote_time: float) -> ClockOffset:
        """From one exchange: the request left at local `sent`, the reply arrived at local
        `received`, and the remote read its clock (`remote_time`) somewhere in between. The
        offset is taken at the round trip's midpoint; the whole round trip is the uncertainty
        (twice the strict bound, for the time the reply spent queued on either side)."""
        for name, v in (("sent", sent), ("received", received), ("remote_time", remote_time)):
            if not math.isfinite(v):
                raise ValueError(f"{name}: expected a finite clock reading, got {v!r}")
        if received < sent:
            raise ValueError(f"received ({received!r}) is before sent ({sent!r})")
        return cls(remote_time - (sent + received) / 2, received - sent)

    def to_local(self, remote_time: float) -> float:
        """A remote clock reading in the local clock (the estimate's centre)."""
        return remote_time - self.offset


@dataclass
class Renewals:
    """The heartbeats sent for one request, in the local clock: the first, the last, and the
    longest time between two of them (the lease may have ended within such a gap)."""

    first: float
    last: float = field(init=False)
    longest_gap: float = 0.0

    def __post_init__(self) -> None:
        self.last = self.first

    def sent(self, now: float) -> None:
        """One more heartbeat left at `now`."""
        self.longest_gap = max(self.longest_gap, now - self.last)
        self.last = now


def read_cutoff(
    remote_expires_at: float,
    offset: ClockOffset,
    *,
    renewed_until: float | None = None,
    safety: float = EXPIRY_SAFETY_SECONDS,
) -> float:
    """The local time by which a read of blocks whose lease ends at `remote_expires_at` (the
    producer's clock) must have ended. `renewed_until` is a later local expiry this consumer
    knows of (heartbeats it sent, each renewing the lease for the producer's lease length)."""
    local = offset.to_local(remote_expires_at)
    if renewed_until is not None:
        local = max(local, renewed_until)
    return local - offset.uncertainty - safety


def lease_cutoff(
    remote_expires_at: object,
    offset: ClockOffset | None,
    *,
    renewals: Renewals | None,
    lease: float,
) -> float | None:
    """`read_cutoff` for a `start_read`: None when there is nothing to keep to (no expiry
    given) or nothing to compare with (the producers' clock offset is unknown, or heartbeats
    renewed the lease by a length the producer did not tell). `renewals` are the heartbeats
    sent for the request, `lease` the producer's lease (0: not told). They count only if the
    first left before the cutoff and none later than a lease less the margin after the one
    before: a heartbeat reaching a producer whose lease has ended renews nothing."""
    if remote_expires_at is None:
        return None
    if isinstance(remote_expires_at, bool) or not isinstance(remote_expires_at, (int, float)):
        raise ConfigError(
            "remote_expires_at: expected a number of seconds in the producer's clock, "
            f"got {remote_expires_at!r}"
        )
    if not math.isfinite(remote_expires_at):
        raise ConfigError(f"remote_expires_at: expected a finite time, got {remote_expires_at!r}")
    if offset is None:
        return None
    cutoff = read_cutoff(float(remote_expires_at), offset)
    if renewals is None:
        return cutoff
    if not lease > 0:
        return None
    margin = offset.uncertainty + EXPIRY_SAFETY_SECONDS
    if renewals.first > cutoff or renewals.longest_gap > lease - margin:
        return cutoff
    return read_cutoff(float(remote_expires_at), offset, renewed_until=renewals.last + lease)
