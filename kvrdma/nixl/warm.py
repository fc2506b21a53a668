"""Warming a peer's connections before any data READ goes over them.

NIXL's UCX backend connects each of an agent's UCX workers to a peer lazily: the first
operation on a worker's endpoint starts the wire-up, and a READ posted before it completed
waits for the peer. From a peer that is stopped then, such a READ stays in flight, and when
the peer resumes it is served into this process's memory even after the reading agent was
retired. Once an endpoint is wired up, a READ over shared memory (cma) is copied by this
process alone, and a READ over TCP lands only while this agent is progressed.

So `NixlBackend.post` holds a data READ to a peer until every worker a READ can use has
completed a READ from that peer into scratch memory of its own (`Warmup`). Which worker runs
a piece of a transfer is not chosen by the caller: the UCX backend with `num_threads` copy
threads hands the pieces to whichever thread takes them first (one UCX worker per thread).
So each round posts one piece per thread into fresh (unmapped) scratch pages and counts, per
copy thread, the page faults it took meanwhile: an idle copy thread touches no new page, a
thread that copied a piece faults its page, and a piece served by a still-cold connection is
written by the peer (the fault is the peer's). A round during which another transfer could
run on the copy threads proves nothing, and one round is in flight at a time. Rounds repeat
until every copy thread was seen copying. A busy agent always has transfers running, so a
round that needs the copy threads to itself holds new posts back (`holding`) until those
running have ended (holding longer each time they did not), then runs alone; the posts it
held back go before the next round (if polled within `FIRST_S`), so reads to warm peers go
on between rounds. While a transfer does not end (a stopped peer's) the round waits for it
rather than prove nothing, for at most `ALONE_S`: then the peer is declared warm unproven,
with an error naming the copy threads never seen. Transfers smaller than `split_batch_size`
descriptors (all of them without copy threads) run on the agent's shared worker, which one
completed READ proves connected. The same rounds, over loopback, let `sweep` prove every
copy thread progressed its worker once more before the agent is destroyed.
"""

from __future__ import annotations

import logging
import mmap
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvrdma.errors import KvrdmaError
from kvrdma.nixl.handles import NixlDescList, NixlXfer
from kvrdma.nixl.protocol import DescArray, MemType, RegisteredMemory, XferResult, XferState

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
NIXL_SPLIT = 1024  # NIXL's split_batch_size when none is given
# a round without an answer for this long gives way to other peers' warm-ups, and its peer
# waits that long times the rounds it lost before it tries again (at most 1 s)
STALLED_S = 0.1
WANTED_S = 0.5  # a warm-up polled this recently is wanted by a transfer waiting for it
MAX_ROUNDS = 64  # warm-up rounds before a copy thread never seen copying is given up on
# how long posts are held back for the transfers running to end before a round (doubled after
# each wait that did not see them end, up to MAX_DRAIN_S), and how long after such a wait the
# posts go on unheld before the next
DRAIN_S = 0.05
MAX_DRAIN_S = 0.4
UNHELD_S = 0.2
# how long the posts a round held back have, once it ended, to be posted (by their polls)
# before the next round: one its owner does not poll must not hold up the warm-up
FIRST_S = 0.05
# longest a warm-up waits for the copy threads to itself: a transfer that never ends (to a
# stopped peer, given up but not cancellable) must not keep a new peer from ever being read;
# longer than the default read deadline, at which a READ still running retires the agent
ALONE_S = 15.0
SWEEP_ROUNDS = 16  # loopback rounds `sweep` posts at most ...
SWEEP_S = 1.0  # ... and how long it takes at most (it runs in `close()`)
_TASKS = "/proc/self/task"


def _faults(tid: int) -> int | None:
    """Minor page faults of thread `tid` so far (None: it ended, or no /proc)."""
    try:
        with open(f"{_TASKS}/{tid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return None


def _copied(tid: int, before: int | None) -> bool:
    """Whether thread `tid` faulted a page since it had `before` faults (one ended, or never
    counted, has nothing left to show)."""
    after = _faults(tid)
    return before is None or after is None or after > before


class _Backend(Protocol):
    """What a warm-up needs of `NixlBackend`."""

    _threads: frozenset[int]  # the current agent's copy threads (kvrdma.nixl.standby)
    _posted: int  # transfers posted so far

    def _in_flight(self, but: NixlXfer | None) -> bool: ...

    def _held_back(self) -> bool: ...

    @property
    def agent_name(self) -> str: ...

    def register(self, regions: DescArray, mem_type: MemType) -> RegisteredMemory: ...

    def _prep(self, peer: str | None, descs: DescArray, mem: MemType) -> NixlDescList: ...

    def _post_now(
        self, op: str, lo: NixlDescList, lids: Any, ro: NixlDescList, rids: Any, notif: bytes
    ) -> NixlXfer: ...

    def poll(self, xfer: Any) -> XferResult: ...


@dataclass
class _Peer:
    """The warm-up of one peer on the current agent."""

    remote: NixlDescList  # `rows` one-byte descriptors at the start of the peer's memory
    round: NixlXfer | None = None  # the round in flight
    shared: bool = False  # the round in flight is the shared worker's
    before: dict[int, int | None] = field(default_factory=dict)  # faults per copy thread
    proven: set[int] = field(default_factory=set)  # copy threads seen copying
    shared_done: bool = False
    clean: bool = False  # no other transfer was in flight when the round was posted
    posts: int = 0  # the backend's post count right after the round's
    rounds: int = 0
    ready: bool = False
    error: XferResult | None = None  # how the last round failed
    posted_at: float = 0.0  # when the round in flight was posted
    retry_at: float = 0.0  # no round before this (the last one got no answer)
    stalls: int = 0  # rounds given up without an answer
    wanted: float = 0.0  # when a transfer waiting for this warm-up last polled it
    waiting: float = 0.0  # since when its next round waits for the copy threads to itself
    crowded: bool = False  # it waited `ALONE_S` in vain: given up on proving the threads
    since: float = field(default_factory=time.monotonic)


class Warmup:
    """Per peer of one `NixlBackend`: whether data READs may go to it, and the warm-up
    rounds that make them."""

    def __init__(self, backend: _Backend, num_threads: int, split: int | None) -> None:
        self._b = backend
        self._threads = num_threads
        self._split = NIXL_SPLIT if split is None else split
        # descriptors per round: one piece of `split` descriptors per copy thread
        self._rows = num_threads * self._split if num_threads else 1
        self._stride = -(-2 * self._split // PAGE) * PAGE  # bytes of scratch per piece
        self._scratch: mmap.mmap | None = None
        self._reg: RegisteredMemory | None = None
        self._local: NixlDescList | None = None
        self._peers: dict[str, _Peer] = {}
        self._hold_until = 0.0  # posts are held back until then (0: not held)
        self._unheld_until = 0.0  # no holding before then
        self._drains = 0  # holds in a row that did not see the running transfers end
        self._first_until = 0.0  # the posts the last round held back go first until then

    def holding(self) -> bool:
        """Posts must wait (poll posts them later): a warm-up round waits for the transfers
        running to end, or runs, and another transfer beside it would make it prove nothing."""
        return self._hold_until > 0.0 and time.monotonic() < self._hold_until

    def ready(self, peer: str) -> bool:
        p = self._peers.get(peer)
        return p is not None and p.ready

    def start(self, peer: str, like: NixlDescList) -> None:
        """Begin warming `peer` (a no-op if under way), reading from the first descriptor of
        `like`, a list prepared for it."""
        if peer in self._peers:
            return
        if self._local is None:
            self._make_scratch()
        row = like._arr[0]
        rows = np.tile(np.array([[row[0], 1, row[2]]], dtype=np.uint64), (self._rows, 1))
        self._peers[peer] = _Peer(self._b._prep(peer, rows, like._mem))

    def advance(self, peer: str, like: NixlDescList) -> XferResult | None:
        """`start` (again, if an earlier warm-up of `peer` failed), then `step`. A warm-up
        that NIXL refuses fails `peer`'s warm-up (the result) instead of raising out of the
        `poll` of a transfer waiting for it."""
        try:
            self.start(peer, like)
            return self.step(peer)
        except (KvrdmaError, OSError) as exc:
            self.forget(peer)  # the next transfer to it starts afresh
            why = f"warming up the connection to agent {peer!r} failed: {exc}"
            return XferResult(XferState.ERR, why)

    def step(self, peer: str) -> XferResult | None:
        """Advance the warm-ups (one round in flight at a time, so that no round runs beside
        another); returns how `peer`'s failed (it cannot be read), or None (ready, or still
        warming: see `ready`)."""
        now = time.monotonic()
        for name, q in list(self._peers.items()):
            if q.round is not None:
                self._end_round(name, q, now)
        p = self._peers.get(peer)
        if p is None or p.ready:
            return None
        if p.error is not None:
            del self._peers[peer]
            p.remote.release()
            why = f"warming up the connection to agent {peer!r} failed: {p.error.error}"
            return XferResult(XferState.ERR, why, peer_lost=p.error.peer_lost)
        p.wanted = now
        if now < p.retry_at or any(q.round is not None for q in self._peers.values()):
            return None
        if any(
            q.stalls < p.stalls and not q.ready and now - q.wanted < WANTED_S
            for q in self._peers.values()
        ):
            return None  # peers that answered so far go first
        if not self._ready_if_done(peer, p) and self._alone(p, now):
            self._post_round(peer, p)
        return None

    def _ready_if_done(self, peer: str, p: _Peer) -> bool:
        if not self._done(peer, p):
            return False
        p.ready = True
        logger.debug(
            "agent %r: warm with agent %r after %d rounds (%.1f ms)",
            self._b.agent_name,
            peer,
            p.rounds,
            (time.monotonic() - p.since) * 1e3,
        )
        return True

    def _alone(self, p: _Peer, now: float) -> bool:
        """Whether `p`'s next round may be posted now: at once when it proves itself by
        completing (the shared worker's), else once no other transfer runs (posts held back
        meanwhile, `DRAIN_S` at a time and longer after each hold in vain, and while the round
        runs); `p` is `crowded` when that took `ALONE_S`."""
        if self._threads == 0 or (self._split > 1 and not p.shared_done):
            return True
        if now < self._first_until and self._b._held_back():
            return False  # the posts the last round held back go first: polls post them
        self._first_until = 0.0
        if not self._b._in_flight(None):
            return True
        p.waiting = p.waiting or now
        if now - p.waiting >= ALONE_S:
            p.crowded, self._hold_until = True, 0.0
        elif self._hold_until == 0.0 and now >= self._unheld_until:
            self._hold_until = now + min(MAX_DRAIN_S, DRAIN_S * 2**self._drains)
        elif self._hold_until and now >= self._hold_until:  # a transfer did not end: let go
            self._hold_until, self._unheld_until = 0.0, now + UNHELD_S
            self._drains += 1
        return False

    def _end_round(self, peer: str, p: _Peer, now: float) -> None:
        """Collect `peer`'s round if it completed; give it up for a while if the peer does
        not answer (stopped?), so that it does not hold up the warm-ups of other peers."""
        assert p.round is not None
        res = self._b.poll(p.round)
        if res.state is XferState.PROC:
            if now - p.posted_at > STALLED_S:
                logger.info(
                    "agent %r: no answer to a warm-up READ from agent %r in %.2f s",
                    self._b.agent_name,
                    peer,
                    STALLED_S,
                )
                self._drop_round(p)  # what it still reads can only land in scratch
                p.stalls += 1
                p.retry_at = now + min(1.0, STALLED_S * p.stalls)
            return
        clean = p.clean and p.posts == self._b._posted and not self._b._in_flight(p.round)
        self._drop_round(p)
        if res.state is XferState.ERR:
            p.error = res
        else:
            self._count(p, clean)
            # ready now, though another peer's poll saw it: its held posts go before any round
            self._ready_if_done(peer, p)

    def _drop_round(self, p: _Peer) -> None:
        """Release `p`'s round and let go of the posts it held back: they go first, for
        `FIRST_S`, before the next round."""
        assert p.round is not None
        p.round.release()
        p.round, self._hold_until = None, 0.0
        self._first_until = time.monotonic() + FIRST_S

    def _count(self, p: _Peer, clean: bool) -> None:
        """Record what the round that just completed proved; its page faults tell nothing
        if another transfer ran on the copy threads meanwhile (not `clean`)."""
        p.rounds += 1
        if p.shared:
            p.shared_done = True
            return
        if self._threads == 0:
            p.shared_done = True  # without copy threads every READ runs on the shared worker
            return
        if not clean:
            return
        for tid, n in p.before.items():
            after = _faults(tid)
            if n is not None and after is not None and after > n:
                p.proven.add(tid)

    def _done(self, peer: str, p: _Peer) -> bool:
        threads = self._b._threads
        need_shared = self._threads == 0 or self._split > 1
        if need_shared and not p.shared_done:
            return False
        if self._threads == 0 or (len(threads) == self._threads and p.proven >= threads):
            return True
        if p.rounds < MAX_ROUNDS and len(threads) == self._threads and not p.crowded:
            return False
        logger.error(
            "agent %r: after %d warm-up rounds with agent %r%s, copy threads %s (of %s) were "
            "never seen reading from it: a READ to it posted while it is stopped may land "
            "after it was given up",
            self._b.agent_name,
            p.rounds,
            peer,
            f" (none alone in {ALONE_S:g} s: transfers beside them did not end)"
            if p.crowded
            else "",
            sorted(set(threads) - p.proven),
            sorted(threads),
        )
        return True

    def _post_round(self, peer: str, p: _Peer) -> None:
        assert self._scratch is not None and self._local is not None
        p.shared = self._threads > 0 and self._split > 1 and not p.shared_done
        n = 1 if p.shared else self._rows
        self._scratch.madvise(mmap.MADV_DONTNEED)  # every copy into it faults a page again
        p.before = {t: _faults(t) for t in self._b._threads}
        p.clean = not self._b._in_flight(None)
        ids = np.arange(n, dtype=np.int32)
        p.round = self._b._post_now("READ", self._local, ids, p.remote, ids, b"")
        p.posted_at, p.posts, p.waiting = time.monotonic(), self._b._posted, 0.0
        if not p.shared and self._threads:  # nothing may run beside it: `_end_round` lets go
            self._hold_until, self._drains = p.posted_at + STALLED_S, 0

    def _make_scratch(self) -> None:
        pieces = max(1, self._threads)
        size = pieces * self._stride
        scratch = mmap.mmap(-1, size)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            scratch.madvise(mmap.MADV_NOHUGEPAGE)  # one fault per page, not per 2 MiB
        base = int(np.frombuffer(scratch, dtype=np.uint8).ctypes.data)
        j = np.arange(self._rows, dtype=np.uint64)
        addrs = base + (j // self._split) * self._stride + (j % self._split) * 2
        rows = np.stack([addrs, np.ones_like(j), np.zeros_like(j)], axis=1).astype(np.uint64)
        reg = self._b.register(np.array([[base, size, 0]], dtype=np.uint64), MemType.DRAM)
        try:
            local = self._b._prep(None, rows, MemType.DRAM)
        except BaseException:
            reg.release()  # a retry registers fresh scratch: this one must not stay registered
            raise
        self._scratch, self._reg, self._local = scratch, reg, local

    def sweep(self) -> list[int]:
        """Have each copy thread progress its UCX worker once more before the agent is
        destroyed: a piece of a transfer cut short on its thread (a sibling piece failed, or
        the transfer was released) leaves its queued cma copies on that worker, and UCX
        aborts the process when it destroys the worker with an endpoint's copies still queued
        (removing the peer first does not drain them). Posts loopback
        rounds (scratch into itself) until every copy thread was seen copying (every round,
        if they are not known), for `SWEEP_ROUNDS` rounds and `SWEEP_S` at most; returns
        the copy threads never seen (logged)."""
        if not self._threads:
            return []
        left, known = set(self._b._threads), len(self._b._threads) == self._threads
        until = time.monotonic() + SWEEP_S
        try:
            if self._local is None:
                self._make_scratch()
            assert self._scratch is not None and self._local is not None
            loop = self._b._prep(self._b.agent_name, self._local._arr, MemType.DRAM)
        except (KvrdmaError, OSError) as exc:
            logger.warning("agent %r: no loopback round to sweep it: %s", self._b.agent_name, exc)
            return sorted(left)
        ids = np.arange(self._rows, dtype=np.int32)
        try:
            for _ in range(SWEEP_ROUNDS):
                if (known and not left) or time.monotonic() >= until:
                    break
                self._scratch.madvise(mmap.MADV_DONTNEED)  # each thread's copy faults a page
                before = {t: _faults(t) for t in left}
                x = self._b._post_now("READ", self._local, ids, loop, ids, b"")
                while (res := self._b.poll(x)).state is XferState.PROC:
                    if time.monotonic() >= until:
                        break
                    time.sleep(0.0002)  # the copy threads need the cores more than this poll
                x.release()
                if res.state is not XferState.DONE:
                    break
                left = {t for t, n in before.items() if not _copied(t, n)}
        except (KvrdmaError, OSError) as exc:
            logger.warning(
                "agent %r: sweeping its copy threads failed: %s", self._b.agent_name, exc
            )
        finally:
            loop.release()
        if left and known:
            logger.warning(
                "agent %r: copy threads %s not seen swept; destroying it may abort the process",
                self._b.agent_name,
                sorted(left),
            )
        return sorted(left)

    def reset(self) -> None:
        """A new agent took over: every peer is cold again (its lists carry over)."""
        for p in self._peers.values():
            if p.round is not None:
                p.round.release()  # abandoned with the old agent already
            p.round, p.ready, p.shared, p.shared_done = None, False, False, False
            p.error, p.since, p.retry_at, p.stalls = None, time.monotonic(), 0.0, 0
            p.waiting, p.crowded = 0.0, False
            p.proven.clear()
            p.before.clear()
            p.rounds = 0
        self._hold_until = self._unheld_until = 0.0
        self._drains, self._first_until = 0, 0.0

    def forget(self, peer: str) -> None:
        p = self._peers.pop(peer, None)
        if p is not None:
            if p.round is not None:
                self._drop_round(p)
            p.remote.release()

    def keep_scratch(self) -> mmap.mmap | None:
        """The scratch mapping, which must outlive any READ into it still in flight."""
        return self._scratch
