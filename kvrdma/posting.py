"""Posting a read's READs within a time budget per call.

NIXL's `make_prepped_xfer` and `transfer` run on the caller's thread and cost in proportion to
the descriptors they post, so one request of many descriptors would stall the engine step that
posts it. A `Poster` posts what fits in the call's budget (`post_budget`) and leaves the rest to
the calls that follow (`Worker.get_finished` goes on posting). A source rank posted in more than
one READ gets its done notification only once all of them are done, by an ack READ
(`AckReads`): a notification on one slice could let the producer free blocks another slice
still reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from kvrdma.errors import TransferError
from kvrdma.nixl.protocol import DescList, TransferBackend, Xfer, XferState
from kvrdma.state import WorkerState
from kvrdma.transfer import ReadOp

logger = logging.getLogger(__name__)

ACK_ID = np.zeros(1, dtype=np.int32)  # the single descriptor of an ack (or probe) READ
# descriptors: a smaller slice would cost more in per-READ overhead than it keeps off the step
MIN_SLICE = 256
# seconds per descriptor posted, until the first slice has been timed
FIRST_GUESS = 1e-7


class Poster:
    """Posts reads' pending parts slice by slice within a budget, learning what a descriptor
    costs to post on this machine. `budget` 0: every part whole at once."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.per_descriptor = FIRST_GUESS

    def post(self, op: ReadOp, reader: TransferBackend, until: float, *, force: bool) -> None:
        """Post `op`'s pending parts with `reader` until `until` (a `time.perf_counter()`
        value), at least one slice when `force`. A slice whose post raised stays unposted."""
        if self.budget <= 0:  # every part whole, with its notification
            while op.pending:
                part = op.pending[0]
                x = reader.post(
                    "READ", part.local, part.local_ids, part.remote, part.remote_ids, op.notif
                )
                op.xfers.append((part.rank, x))
                op.pending.pop(0)
            return
        posted = False
        while op.pending:
            part = op.pending[0]
            room = until - time.perf_counter()
            if room <= 0 and (posted or not force):
                break
            n = min(part.left, max(MIN_SLICE, int(room / max(self.per_descriptor, 1e-9))))
            parked = False
            if part.posted == 0 and n == part.left:  # whole: it carries the notification
                x = reader.post(
                    "READ", part.local, part.local_ids, part.remote, part.remote_ids, op.notif
                )
            else:
                part.sliced = True
                a, b = part.posted, part.posted + n
                t0 = time.perf_counter()
                lids, rids = part.local_ids[a:b], part.remote_ids[a:b]
                x = reader.post("READ", part.local, lids, part.remote, rids, b"")
                parked = getattr(x, "held", None) is not None  # until its peer is wired up
                if not parked:  # a parked post costs nothing: no sample
                    self._learn((time.perf_counter() - t0) / n)
            op.xfers.append((part.rank, x))
            part.posted += n
            posted = True
            if not part.left:
                op.pending.pop(0)
                if part.sliced and op.notif:
                    op.notify_after.append(part.rank)
            elif parked:  # parked slices are all posted at once when the peer is ready
                break

    def _learn(self, seconds: float) -> None:
        """Take a slice's cost per descriptor: at once when dearer (slices shrink before the
        next one overruns), gradually when cheaper (one cheap post is not a trend)."""
        p = self.per_descriptor
        self.per_descriptor = seconds if seconds > p else 0.75 * p + 0.25 * seconds


@dataclass
class _Ack:
    request_id: str
    engine_id: str
    rank: int
    xfer: Xfer
    deadline: float


class AckReads:
    """One-byte READs that carry a done notification to a producer rank, tracked to their
    end: a READ is progressed to completion, while a bare `send_notif` on a link not yet
    wired up would wait for this worker's next progress call."""

    def __init__(self, shared: WorkerState) -> None:
        self.s = shared
        self.running: list[_Ack] = []  # in flight

    def __len__(self) -> int:
        return len(self.running)

    def engines(self) -> set[str]:
        return {a.engine_id for a in self.running}

    def post(
        self, op: ReadOp, lists: Mapping[int, DescList], ranks: Iterable[int], deadline: float
    ) -> None:
        """Tell `ranks` (those with an ack list in `lists`) that `op` is done; raises
        TransferError when NIXL refuses one."""
        for r in ranks:
            if r in lists:
                x = self.s.reader.post("READ", self.s.ack_local, ACK_ID, lists[r], ACK_ID, op.notif)
                self.running.append(_Ack(op.request_id, op.engine_id, r, x, deadline))

    def tell(
        self,
        op: ReadOp,
        lists: Mapping[int, DescList],
        agents: Mapping[int, str],
        deadline: float,
        lost: Callable[[str], None],
    ) -> None:
        """Tell each rank of `op.notify_after` that `op` is done: by an ack READ, or where NIXL
        refuses one by a bare notification; `lost(engine)` for a rank told neither way."""
        for r in op.notify_after:
            try:
                self.post(op, lists, [r], deadline)
            except TransferError as exc:
                try:
                    self.s.reader.send_notif(agents[r], op.notif)
                except Exception as again:  # the read landed; only the producer waits
                    logger.warning(
                        "done notification for %r to rank %d lost: %s; %s",
                        op.request_id,
                        r,
                        exc,
                        again,
                    )
                    lost(op.engine_id)

    def poll(self, now: float, lost: Callable[[str], None]) -> None:
        """Release the ended ones; `lost(engine)` for each not delivered."""
        keep = []
        for a in self.running:
            res = self.s.reader.poll(a.xfer)
            if res.state is XferState.PROC and now < a.deadline:
                keep.append(a)
                continue
            a.xfer.release()
            if res.state is not XferState.DONE:
                why = res.error or "not delivered before the read deadline"
                logger.warning(
                    "done notification for %r to rank %d lost: %s", a.request_id, a.rank, why
                )
                lost(a.engine_id)
        self.running = keep

    def settle(self, seconds: float, lost: Callable[[str], None]) -> None:
        """Give the ones in flight up to `seconds` to end (a worker closing): tearing down
        an agent with a notification still queued on a connection can abort the process
        inside UCX."""
        ends = time.monotonic() + seconds
        while self.running and time.monotonic() < ends:
            self.poll(self.s.clock(), lost)
            time.sleep(0.0005)

    def drop(self, engine_id: str) -> None:
        """Release the ones to an engine being removed."""
        for a in self.running:
            if a.engine_id == engine_id:
                a.xfer.release()
        self.running = [a for a in self.running if a.engine_id != engine_id]
