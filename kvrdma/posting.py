"""Posting a read's READs within a time budget per call.

NIXL's `make_prepped_xfer` and `transfer` run on the caller's thread and cost in proportion to
the descriptors they post, so one request of many descriptors would stall the engine step that
posts it. `start_read` posts a read whole when it fits the budget (`post_budget`); a larger one
is posted by a `Backlog` thread, one budget's slice at a time under the worker's lock, so a
caller waits for at most about one slice (NIXL lets go of the GIL while it posts, so the
caller's other Python runs meanwhile). A source rank posted in more than one READ gets its
done notification only once all of them are done, by an ack READ (`AckReads`): a notification
on one slice could let the producer free blocks another slice still reads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from kvrdma.errors import TransferError
from kvrdma.nixl.merging import contiguous_runs
from kvrdma.nixl.protocol import DescList, TransferBackend, Xfer, XferState
from kvrdma.state import WorkerLock, WorkerState
from kvrdma.transfer import ReadOp, parked

logger = logging.getLogger(__name__)

ACK_ID = np.zeros(1, dtype=np.int32)  # the single descriptor of an ack (or probe) READ
# descriptors: a smaller slice would cost more in per-READ overhead than it keeps off the step
MIN_SLICE = 256
# seconds per descriptor posted, until the first slice has been timed: on the dear side, as
# a first slice too large stalls the caller (a parked one is posted by its next poll) while
# one too small costs only extra slices until the cost is learnt
FIRST_GUESS = 2e-6
# seconds NIXL takes to post one (merged) descriptor: what decides whether a read goes to
# the backlog thread. A fixed figure: a whole post's time also holds the copy NIXL makes on
# the caller's thread, which posting from the thread does not save
POST_COST = 1e-7


class Poster:
    """Posts reads' pending parts: a read that fits the budget whole at once (`start_read`),
    a larger one slice by slice within the budget (the backlog thread), learning from the
    slices what a descriptor costs to post. `budget` 0: every read whole at once."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.per_descriptor = FIRST_GUESS  # in a slice, beside the copies of earlier slices

    def fits(self, op: ReadOp) -> bool:
        """Whether `op` is posted whole by its caller rather than by the backlog thread: its
        descriptors, once NIXL merges adjacent ones, cost at most the budget to post."""
        most = self.budget / POST_COST
        if self.budget <= 0 or op.descriptors <= max(MIN_SLICE, most):
            return True
        runs, over = 0, int(most) + 1
        for part in op.pending:  # counted only until past the budget
            runs += contiguous_runs(part.local_ids, part.remote_ids, stop_at=over - runs)
            if runs >= over:
                return False
        return True

    def post_read(self, op: ReadOp, reader: TransferBackend, until: float | None) -> None:
        """Post `op`'s pending parts whole (`until` None) or what fits before `until` (a
        `time.perf_counter()` value, at least one slice). A failure to post ends the read
        once what is posted has ended (`op.first_error`, nothing more pending)."""
        try:
            if until is None:
                self._post_whole(op, reader)
            else:
                self.post(op, reader, until, force=True)
        except TransferError as exc:
            op.first_error = op.first_error or str(exc)
        except BaseException as exc:
            op.first_error = op.first_error or f"posting the READs failed: {exc!r}"
            raise
        finally:
            if op.first_error is not None:
                op.pending.clear()

    def _post_whole(self, op: ReadOp, reader: TransferBackend) -> None:
        """Every pending part in one READ, with its notification (timed by `start_read`,
        its only caller)."""
        while op.pending:
            part = op.pending[0]
            x = reader.post(
                "READ", part.local, part.local_ids, part.remote, part.remote_ids, op.notif
            )
            op.xfers.append((part.rank, x))
            op.pending.pop(0)

    def post_oldest(self, ops: Iterable[ReadOp], shared: WorkerState) -> bool:
        """Post about one budget of the first of `ops` with READs left to post, and not past
        its deadline or lease cutoff (those end at the next poll), unless a READ it posted
        failed (it then posts no more); whether any still has READs left to post."""
        now, until = shared.clock(), time.perf_counter() + self.budget
        postable = [
            op
            for op in ops
            if op.pending
            and now < op.deadline
            and (op.cutoff is None or now < op.cutoff)
            and not (op.xfers and getattr(op.xfers[-1][1], "held", None) is not None)
        ]  # a read whose last slice is parked until its peer is wired up waits: the poll
        # that posts that slice kicks the thread again
        if postable and _failed_posted(postable[0], shared.reader):
            postable[0].pending.clear()  # the next poll fails the read on it
        elif postable:
            self.post_read(postable[0], shared.reader, until)
        return any(op.pending for op in postable)

    def post(self, op: ReadOp, reader: TransferBackend, until: float, *, force: bool) -> None:
        """Post `op`'s pending parts with `reader` in slices until `until` (a
        `time.perf_counter()` value), at least one slice when `force`. A slice whose post
        raised stays unposted."""
        posted = False
        while op.pending:
            part = op.pending[0]
            room = until - time.perf_counter()
            if room < min(MIN_SLICE, part.left) * self.per_descriptor and (posted or not force):
                break  # even the smallest slice would overrun `until`
            n = min(part.left, max(MIN_SLICE, int(room / max(self.per_descriptor, 1e-9))))
            parked = False
            t0 = time.perf_counter()
            if part.posted == 0 and n == part.left:  # whole: it carries the notification
                x = reader.post(
                    "READ", part.local, part.local_ids, part.remote, part.remote_ids, op.notif
                )
                op.post_seconds += time.perf_counter() - t0
            else:
                part.sliced = True
                a, b = part.posted, part.posted + n
                lids, rids = part.local_ids[a:b], part.remote_ids[a:b]
                x = reader.post("READ", part.local, lids, part.remote, rids, b"")
                parked = getattr(x, "held", None) is not None  # until its peer is wired up
                spent = time.perf_counter() - t0
                op.post_seconds += spent
                if not parked:  # a parked post costs nothing: no sample
                    self.per_descriptor = _learnt(self.per_descriptor, spent / n)
            op.xfers.append((part.rank, x))
            part.posted += n
            posted = True
            ended = getattr(x, "result", None)  # NIXL refused it at once: the peer is gone
            if ended is not None and ended.state is XferState.ERR:
                op.pending.clear()  # the next poll fails the read on it
                break
            if not part.left:
                op.pending.pop(0)
                if part.sliced and op.notif:
                    op.notify_after.append(part.rank)
            elif parked:  # parked slices are all posted at once when the peer is ready
                break


def _failed_posted(op: ReadOp, reader: TransferBackend) -> bool:
    """Whether a READ `op` posted already ended in error that no poll has seen yet: the
    read fails on it, so posting more of it would only move bytes nobody will use. READs seen
    done are recorded as a poll would, so each turn looks only at those still running or
    new, not at every slice since the caller's last poll."""
    for i in range(op.polled, len(op.xfers)):
        x = op.xfers[i][1]
        if i in op.done or i in op.failed or parked(x):  # polling a parked READ posts it
            continue
        state = reader.poll(x).state
        if state is XferState.ERR:
            return True
        if state is XferState.DONE:
            op.done.add(i)
    op.skip_ended()
    return False


def _learnt(estimate: float, seconds: float) -> float:
    """A new cost per descriptor: at once when dearer (the next post keeps to the budget),
    gradually when cheaper (one cheap post is not a trend)."""
    return seconds if seconds > estimate else 0.75 * estimate + 0.25 * seconds


class Backlog:
    """A thread that posts what the callers left unposted, calling `post_next` (with `lock`
    held) until it says nothing is left. `post_next` posts about one budget's worth; between
    calls the lock is free, so the caller's next call into the worker gets in."""

    def __init__(
        self,
        lock: WorkerLock,
        post_next: Callable[[], bool],
        on_start: Callable[[], None] = lambda: None,
    ) -> None:
        self._lock, self._post_next, self._on_start = lock, post_next, on_start
        self._work = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self.closed = False

    def kick(self) -> bool:
        """Have the thread post what is pending (call with the lock held); False when it
        cannot run (closed, or the interpreter shutting down): the caller posts itself."""
        if self.closed:
            return False
        if not self._alive():
            thread = threading.Thread(target=self._run, name="kvrdma-backlog", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # no new threads at interpreter shutdown
                return False
            self._thread, self._pid = thread, os.getpid()
        self._work.set()
        return True

    @property
    def busy(self) -> bool:
        """Whether the thread is posting (or about to): pending parts are its to post."""
        return not self.closed and self._alive() and self._work.is_set()

    def _alive(self) -> bool:
        """This process's thread is running (a forked child has none)."""
        return self._thread is not None and self._pid == os.getpid() and self._thread.is_alive()

    def close(self) -> None:
        """Stop for good (with the lock held): the thread ends when it next takes the lock."""
        self.closed = True
        self._work.set()

    def _run(self) -> None:
        try:
            self._on_start()
        except Exception:  # e.g. no CUDA device to select: post from this thread regardless
            logger.exception("preparing the backlog thread failed")
        while True:
            self._work.wait()
            with self._lock.turn():
                if self.closed:
                    return
                try:
                    more = self._post_next()
                except Exception:  # that read fails; the next poll kicks for the others
                    logger.exception("posting a read's remaining READs failed")
                    more = False
                if not more:  # cleared under the lock: a kick after this is not missed
                    self._work.clear()
                    continue


def select_device(shared: WorkerState) -> None:
    """Select the worker's GPU on the calling thread: a new thread has no CUDA context, and
    UCX then cannot use CUDA IPC for the transfers it posts."""
    layout = shared.layout
    if layout is not None and layout.device.type == "cuda":
        import torch

        torch.cuda.set_device(layout.device)


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
        ranks: Iterable[int],
        lists: Mapping[int, DescList],
        agents: Mapping[int, str],
        deadline: float,
        lost: Callable[[str], None],
    ) -> None:
        """Tell each of `ranks` that `op` is done: by an ack READ (counted until it ends), or
        where posting one fails by a bare notification; `lost(engine)` for a rank told
        neither way."""
        for r in ranks:
            try:
                self.post(op, lists, [r], deadline)
            except Exception as exc:  # whatever posting raises, telling never stops the step
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

    def drop(self, engine_id: str, lost: Callable[[str], None]) -> None:
        """Release (cancel) the ones to an engine being removed; `lost(engine)` for each not
        delivered yet, its producer never told."""
        for a in self.running:
            if a.engine_id == engine_id:
                delivered = self.s.reader.poll(a.xfer).state is XferState.DONE
                a.xfer.release()
                if delivered:
                    continue
                logger.warning(
                    "done notification for %r to rank %d lost: engine %r removed first",
                    a.request_id, a.rank, engine_id,
                )  # fmt: skip
                lost(engine_id)
        self.running = [a for a in self.running if a.engine_id != engine_id]
