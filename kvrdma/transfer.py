"""Request bookkeeping on both sides: producer leases and consumer in-flight reads.

Producer: a finished request's blocks are held until every expected D rank said "done", or
until its lease (renewed by heartbeats) expires. Consumer: every READ has a deadline; a read
that fails in any part fails as a whole and reports all its local blocks invalid.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvrdma import notify
from kvrdma.nixl.protocol import BlockIds, DescList, PostIds, Xfer
from kvrdma.types import Outcome

if TYPE_CHECKING:
    from kvrdma.descriptors import ReadPlan
    from kvrdma.integrity import LandedChecksums

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
# notifications for requests not (yet) held are remembered for one lease, up to this many:
# a peer naming ever new request ids must not grow a producer's memory without bound
MAX_EARLY = 65536
# reader engines remembered for labels: as many as the metrics keep peers for
MAX_READERS = 256


class ProducerMetrics(Protocol):
    def expired_leases(self, n: int = 1) -> None: ...
    def freed_blocks(self, n: int, *, reason: str) -> None: ...
    def failed_notification(self, *, remote_engine: str, reason: str) -> None: ...


@dataclass
class _Held:
    block_ids: list[int]
    expires_at: float
    done: set[tuple[str, int]] = field(default_factory=set)
    expected: int | None = None


@dataclass
class _Early:
    first_seen: float
    done: set[tuple[str, int]] = field(default_factory=set)
    expected: int | None = None
    renewed: bool = False


@dataclass
class ProducerCounters:
    notified: int = 0
    expired: int = 0
    unknown_notifs: int = 0
    malformed_notifs: int = 0
    heartbeats: int = 0


class ProducerLedger:
    """Which finished requests still hold blocks, and when to let them go."""

    def __init__(
        self, lease_seconds: float, clock: Clock, metrics: ProducerMetrics | None = None
    ) -> None:
        self.lease = lease_seconds
        self.clock = clock
        self.metrics = metrics
        self.held: dict[str, _Held] = {}
        # (expires_at, request id) as of the hold: a step pops only what is due and checks
        # it against `held` (a heartbeat only moves the held entry's time later)
        self._expiries: list[tuple[float, str]] = []
        self.early: dict[str, _Early] = {}
        self._early_expiries: list[tuple[float, str]] = []  # likewise, by first_seen + lease
        # finished request ids -> (when, whether every reader said done); kept one lease long
        # so late notifications are recognised as "expired_request" rather than
        # "unknown_request"
        self.finished: dict[str, tuple[float, bool]] = {}
        # (when, request id) in finish order: pruning pops only the expired head, so a step
        # costs nothing per request that finished earlier
        self._finish_order: deque[tuple[float, str]] = deque()
        self._newly: set[str] = set()
        self.counters = ProducerCounters()
        # engines that notified about a request this producer held: a failed notification
        # is labelled with its self-declared sender only then (`MAX_READERS` at most), so
        # made-up engine ids cannot fill the bounded `remote_engine` label values
        self._readers: set[str] = set()

    def hold(self, request_id: str, block_ids: list[int]) -> float:
        """Keep `block_ids` of `request_id` until the readers are done or the lease expires;
        returns when the lease ends. Readers that all notified before the hold finish it at
        once (`take_finished` reports it), so the caller must not look it up in `held`."""
        now = self.clock()
        h = _Held(list(block_ids), now + self.lease)
        heapq.heappush(self._expiries, (h.expires_at, request_id))
        early = self.early.pop(request_id, None)
        if early:
            h.done, h.expected = early.done, early.expected
        self.held[request_id] = h
        self._maybe_done(request_id, h)
        return h.expires_at

    def on_notif(self, sender_agent: str, data: bytes) -> None:
        n = notify.decode(data)
        if n is None:
            self.malformed(sender_agent, len(data))
        else:
            self.on_message(n)

    def malformed(self, sender_agent: str, size: int) -> None:
        """A notification that is not one of ours: counted, never trusted."""
        self.counters.malformed_notifs += 1
        if self.metrics:
            self.metrics.failed_notification(remote_engine="unknown", reason="malformed")
        logger.warning("malformed notification from %s (%d bytes)", sender_agent, size)

    def on_message(self, n: notify.Notif) -> None:
        """A decoded notification from a reader: done or heartbeat."""
        now = self.clock()
        h = self.held.get(n.request_id)
        if h is None:
            ended = self.finished.get(n.request_id)
            if ended is not None and n.kind == "heartbeat" and ended[1]:
                # sent before its reader's "done", from an agent a retirement replaced since:
                # NIXL hands over different agents' notifications in no set order
                logger.debug("heartbeat for request %r read after it was done", n.request_id)
                return
            if ended is not None:
                self._unknown(n, "expired_request")
                return
            e = self.early.get(n.request_id)
            if e is None:
                if len(self.early) >= MAX_EARLY:
                    self._unknown(n, "unknown_request")
                    return
                e = self.early[n.request_id] = _Early(now)
                heapq.heappush(self._early_expiries, (now + self.lease, n.request_id))
            target: _Held | _Early = e
        else:
            target = h
            if len(self._readers) < MAX_READERS:
                self._readers.add(n.sender_engine)
        if n.kind == "heartbeat":
            self.counters.heartbeats += 1
            if isinstance(target, _Held):
                target.expires_at = max(target.expires_at, now + self.lease)
            else:
                target.renewed = True
                target.first_seen = now
            return
        target.done.add((n.sender_engine, n.sender_rank))
        target.expected = n.expected
        if isinstance(target, _Held):
            self._maybe_done(n.request_id, target)

    def _unknown(self, n: notify.Notif, reason: str) -> None:
        self.counters.unknown_notifs += 1
        if self.metrics:
            sender = n.sender_engine if n.sender_engine in self._readers else "unknown"
            self.metrics.failed_notification(remote_engine=sender, reason=reason)
        logger.info("notification %s for %s request %r", n.kind, reason, n.request_id)

    def _maybe_done(self, request_id: str, h: _Held) -> None:
        if h.expected is not None and len(h.done) >= h.expected:
            del self.held[request_id]
            self._finish(request_id, notified=True)
            self.counters.notified += 1
            if self.metrics:
                self.metrics.freed_blocks(len(h.block_ids), reason="notified")

    def _finish(self, request_id: str, *, notified: bool) -> None:
        at = self.clock()
        self.finished[request_id] = (at, notified)
        self._finish_order.append((at, request_id))
        self._newly.add(request_id)

    def expiry(self, request_id: str) -> float | None:
        """When `request_id`'s blocks stop being held (this ledger's clock), None if they are
        not held; heartbeats move it later."""
        h = self.held.get(request_id)
        return None if h is None else h.expires_at

    @property
    def has_unreported(self) -> bool:
        """Requests finished (notified) but not yet returned by `take_finished`."""
        return bool(self._newly)

    def take_finished(self) -> set[str]:
        """Requests whose blocks may be freed now (notified, or lease expired)."""
        now = self.clock()
        self._expire_leases(now)
        early = self.early
        due = _due(self._early_expiries, now, lambda r: early[r].first_seen + self.lease, early)
        for rid in due:
            del early[rid]
            self.counters.unknown_notifs += 1
            if self.metrics:
                self.metrics.failed_notification(remote_engine="unknown", reason="unknown_request")
        out, self._newly = self._newly, set()
        order = self._finish_order
        while order and now - order[0][0] >= self.lease:
            at, rid = order.popleft()
            ended = self.finished.get(rid)
            if ended is not None and ended[0] == at:  # not finished again since
                del self.finished[rid]
        return out

    def _expire_leases(self, now: float) -> None:
        for rid in _due(self._expiries, now, lambda r: self.held[r].expires_at, self.held):
            h = self.held.pop(rid)
            self._finish(rid, notified=False)
            self.counters.expired += 1
            logger.warning(
                "lease of request %r expired after %.1fs with %d/%s notifications; "
                "freeing %d blocks",
                rid,
                self.lease,
                len(h.done),
                h.expected if h.expected is not None else "?",
                len(h.block_ids),
            )
            if self.metrics:
                self.metrics.expired_leases(1)
                self.metrics.freed_blocks(len(h.block_ids), reason="lease_expired")

    @property
    def num_held(self) -> int:
        return len(self.held)


@dataclass(slots=True)
class Part:
    """One source rank's descriptors of a read (ids into its two prepped lists), and how many
    are posted so far."""

    rank: int
    local: DescList
    local_ids: PostIds
    remote: DescList
    remote_ids: PostIds
    posted: int = 0
    sliced: bool = False  # posted in more than one READ: notified by an ack READ afterwards

    @property
    def left(self) -> int:
        return len(self.local_ids) - self.posted


@dataclass(slots=True)
class ReadOp:
    """One request's READs from one remote engine (one xfer per source rank, or several
    when its descriptors did not fit one call's posting budget: see `kvrdma.posting`)."""

    request_id: str
    engine_id: str
    local_block_ids: BlockIds
    remote_block_ids: BlockIds
    deadline: float
    started: float
    # local time by which the producer may reuse the blocks (its lease, with margin): a read
    # still running then ends as expired; None when unknown
    cutoff: float | None = None
    xfers: list[tuple[int, Xfer]] = field(default_factory=list)  # (source rank, READ)
    done: set[int] = field(default_factory=set)  # indices into xfers
    failed: set[int] = field(default_factory=set)
    polled: int = 0  # every xfer before this index has ended (done or failed)
    pending: list[Part] = field(default_factory=list)  # not posted yet, in posting order
    notif: bytes = b""  # the done notification its READs carry
    # ranks read in slices: told "done" by an ack READ once the whole read is done
    notify_after: list[int] = field(default_factory=list)
    first_error: str | None = None
    first_error_peer_lost: bool = False  # the first error was the remote agent going away
    # READs still parked for their peer's warm-up when the read ran late: dropped unposted
    late_dropped: int = 0
    nbytes: int = 0
    descriptors: int = 0
    post_seconds: float = 0.0
    # on failure these producer ranks are told "done" (best effort) so they free the blocks
    # now instead of at lease expiry: this reader will not come back for them
    release_on_failure: list[int] = field(default_factory=list)
    error: str | None = None
    outcome: Outcome = Outcome.SUCCESS
    # the local sub-block ids the READs filled (integrity mode checks them when they land)
    sub_block_ids: BlockIds | None = None
    # written by the producer (push mode) rather than read: no checksum rows come with it
    pushed: bool = False
    # only tells the producer to let go (no blocks of a request read): no request is counted
    release_only: bool = False
    # how what lands is checked and permuted: the engine's plan when the read began, kept
    # with the read so that it lands even if the engine is removed before it is reported
    plan: ReadPlan | None = None
    checks: LandedChecksums | None = None

    def timed_out(self, now: float, expired: bool) -> tuple[str, Outcome]:
        """Its error and outcome when it is still not done at `now`, past its deadline (or,
        `expired`, past the producer's lease cutoff)."""
        why = "the producer's lease cutoff" if expired else "deadline"
        unposted = sum(part.left for part in self.pending)
        n = self.late_dropped
        parked = f" ({n} waiting for a warm-up: dropped unposted)" if n else ""
        error = (
            f"not done {now - self.started:.3f}s after posting ({why}); "
            f"{len(self.done)}/{len(self.xfers)} READs done{parked}, "
            f"{unposted}/{self.descriptors} descriptors not posted"
        )
        return error, Outcome.EXPIRED if expired else Outcome.TIMEOUT

    def drop_parked(self, start: int, stop: int) -> int:
        """End as failed the READs of `xfers[start:stop]` still parked until their peer's
        connection is warm (`kvrdma.nixl.warm`), releasing them unposted; how many. A read
        that already failed waits for none of them: they were never handed to NIXL, so
        nothing of them can land, and a later poll would post them."""
        dropped = 0
        for i in range(start, stop):
            x = self.xfers[i][1]
            if i not in self.done and i not in self.failed and parked(x):
                x.release()
                self.failed.add(i)
                dropped += 1
        return dropped

    def skip_ended(self) -> None:
        """Move `polled` past the READs that ended: a read of many slices is then polled
        from its first one still running."""
        while self.polled < len(self.xfers) and (
            self.polled in self.done or self.polled in self.failed
        ):
            self.polled += 1

    def drop_parked_when_late(self, now: float) -> None:
        """Past its deadline or the producer's lease cutoff, drop the READs still parked for
        their peer's warm-up unposted before anything polls them: a poll could finish the
        warm-up and post one, which then lands late or is abandoned in flight (retiring the
        reading agent). Such a read can no longer succeed (`failed` holds them)."""
        if now >= self.deadline or (self.cutoff is not None and now >= self.cutoff):
            self.late_dropped += self.drop_parked(self.polled, len(self.xfers))

    def release(self) -> None:
        for _, x in self.xfers:
            try:
                x.release()
            except Exception:  # release must never mask the original failure
                logger.exception("releasing a transfer of request %r failed", self.request_id)


def _due(
    heap: list[tuple[float, str]], now: float, due_at: Callable[[str], float], live: Container[str]
) -> Iterator[str]:
    """Pop the ids whose entry in `heap` has fallen due, lazily (the caller removes each from
    `live` before the next): an id no longer `live` is skipped, one whose due time
    (`due_at`, the same sum as its key) moved later goes back."""
    while heap and heap[0][0] <= now:
        _, rid = heapq.heappop(heap)
        if rid not in live:  # ended (or this entry is of an earlier round)
            continue
        due = due_at(rid)
        if due > now:  # renewed since: due later
            heapq.heappush(heap, (due, rid))
        else:
            yield rid


def parked(x: Xfer) -> bool:
    """`x` waits for its peer's connection warm-up: posted to nobody yet (the NIXL backend
    keeps what it was given in `held` until `poll` posts it)."""
    return getattr(x, "held", None) is not None
