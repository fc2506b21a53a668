"""The consumer side of a worker: plans, posts and tracks READs, turns every failure into
invalid block ids, and retires its reading agent when a read is abandoned in flight."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import numpy.typing as npt

from kvrdma import notify
from kvrdma.descriptors import ReadPlan
from kvrdma.errors import HandshakeError, RegistrationError, TransferError
from kvrdma.finish import count_read, land
from kvrdma.integrity import LandedChecksums
from kvrdma.lease import ClockOffset, Renewals, heartbeat_period, lease_cutoff
from kvrdma.metadata import WorkerMetadata, dp_index_of, engine_of, other_dp_rank
from kvrdma.nixl.protocol import XferState
from kvrdma.plan import build_read_plan
from kvrdma.posting import AckReads, Backlog, Poster, select_device
from kvrdma.remote import NamedAgents, Remote, load_agents, prepare_remote, restarted_since
from kvrdma.retirement import Failing, retire_for, settle_parked, settle_reads
from kvrdma.state import WorkerState
from kvrdma.transfer import Part, ReadOp
from kvrdma.types import FailureReason, FinishedOutput, Outcome, TransferMode

logger = logging.getLogger(__name__)

# how long closing waits for done notifications still on their way
CLOSE_SETTLE_SECONDS = 1.0
_PROC = XferState.PROC  # looked up once: on Python 3.11 an Enum attribute runs Python code


class ConsumerSide:
    """Plans, posts and tracks READs; turns every failure into invalid block ids."""

    def __init__(self, shared: WorkerState) -> None:
        self.s = shared
        self.remotes: dict[str, Remote] = {}
        self.inflight: dict[str, ReadOp] = {}
        self.ready: list[ReadOp] = []
        # engines whose reads failed because the peer went away: re-handshake before reuse
        self.suspect: set[str] = set()
        # engines with a rank a retirement dropped (its agent alive, maybe unreachable):
        # handshake and add again, keeping the ranks still loaded
        self.dropped: set[str] = set()
        # request id -> (engine, remote request id): heartbeats keep the producer's lease
        self.waiting: dict[str, tuple[str, str]] = {}
        self.next_heartbeat = 0.0
        # fault injection / tests: READs without the "done" notification
        self.send_notifications = True
        self.acks = AckReads(shared)  # done notifications in flight
        # engine id -> its producers' clock offset (learnt at the handshake, see `connect`)
        self.clock_offsets: dict[str, ClockOffset] = {}
        # request id -> the heartbeats sent for it: the lease runs on while they arrive in time
        self.renewed: dict[str, Renewals] = {}
        extra = shared.config.extra
        # with no UCX copy threads NIXL copies inside transfer(): slicing would only slow it
        self.poster = Poster(extra.post_budget if extra.num_threads > 0 else 0.0)
        self.backlog = Backlog(
            shared.lock,
            lambda: self.poster.post_oldest(self.inflight.values(), shared),
            on_start=lambda: select_device(shared),
        )

    # ---- remote engines --------------------------------------------------------------
    def add_remote(self, metas: Mapping[int, WorkerMetadata]) -> ReadPlan:
        """Load a remote engine's ranks (from the handshake) and prepare the read plan."""
        with self.s.lock:  # `Worker.connect` calls it without the lock
            return self._add_remote(metas)

    def _add_remote(self, metas: Mapping[int, WorkerMetadata]) -> ReadPlan:
        s = self.s
        if s.metadata is None or s.topology is None or s.layout is None:
            raise RegistrationError("register_kv_caches() must come before add_remote()")
        engine = engine_of(metas)
        old = self.remotes.get(engine)
        readd = False  # of an engine a retirement dropped a rank of
        if old is not None:
            added, asked = dp_index_of(old.metas), dp_index_of(metas)
            if added != asked:
                raise other_dp_rank(engine, added, asked)
            if all(
                old.metas.get(r) is not None
                and old.metas[r].agent_name == m.agent_name
                and old.metas[r].agent_metadata_sha256 == m.agent_metadata_sha256
                for r, m in metas.items()
            ):
                if engine in self.suspect:
                    # NIXL never talks to a disconnected agent again: wait for the engine to
                    # publish its new one rather than keep reading from the dead one
                    raise HandshakeError(
                        f"engine {engine!r}: its NIXL agent was lost and the handshake still "
                        "names the same agent; waiting for the restarted engine to publish"
                    )
                if engine not in self.dropped:
                    return old.plan
                readd = True
            else:
                logger.warning("engine %r restarted (new NIXL agent): re-adding it", engine)
                self.remove_remote(engine, reason="restarted (new NIXL agent)")
        plan = build_read_plan(s.topology, s.metadata, metas, mamba_states=s.layout.mamba_states)
        checks = None
        if s.config.extra.integrity_checksums:
            checks = LandedChecksums(plan, s.metadata, s.regions, metas)
            plan = checks.plan  # the data rows, then their checksum rows
        loaded = set(s.reader.remotes())
        if readd:
            # the dropped ranks first: one still unreachable leaves the engine as it was, its
            # other ranks loaded (UCX aborts a stopped peer whose connection was closed)
            load_agents(s.reader, metas, plan.notify_ranks, loaded)
            self.remove_remote(engine, reason="re-added after a retirement", keep_agents=True)
        # a failure from here on leaves it unlisted (and still suspect if it was) to connect again
        self.remotes[engine] = prepare_remote(s, engine, metas, plan, checks, loaded)
        self.suspect.discard(engine)
        self.dropped.discard(engine)
        if s.metrics:
            s.metrics.set_connected_peers(len(self.remotes))
        return plan

    def remove_remote(
        self, engine_id: str, *, reason: str = "removed", keep_agents: bool = False
    ) -> None:
        """Forget an engine: fail its in-flight reads (parts parked for a warm-up dropped
        unposted, the reading agent retired first if a posted READ still runs), release its
        lists and (unless `keep_agents`) its agents."""
        r = self.remotes.pop(engine_id, None)
        if r is None:
            return
        poll, why = self.s.reader.poll, f"remote engine {engine_id!r} {reason}"
        self._end([  # a READ still running retires the agent first: it may land any time
            (op, why, Outcome.PEER_LOST, settle_parked(op, poll))
            for op in list(self.inflight.values()) if op.engine_id == engine_id
        ], why=f"was being read when engine {engine_id!r} was {reason}")  # fmt: skip
        self.acks.drop(engine_id, self._lost_notification)
        for dl in (*r.local_lists.values(), *r.remote_lists.values(), *r.ack_lists.values()):
            dl.release()
        for a in () if keep_agents else r.agents.values():
            self.s.reader.remove_remote(a)
        if r.checks_reg is not None:
            r.checks_reg.release()
        if self.s.metrics:
            self.s.metrics.set_connected_peers(len(self.remotes))

    def engines_in_use(self) -> set[str]:
        """Engines with reads in flight or to report, ack READs running or heartbeats owed."""
        used = {op.engine_id for op in (*self.inflight.values(), *self.ready)}
        return used | self.acks.engines() | {engine for engine, _ in self.waiting.values()}

    # ---- reads -----------------------------------------------------------------------
    def start_read(
        self,
        request_id: str,
        local_block_ids: npt.ArrayLike,
        remote_block_ids: npt.ArrayLike,
        remote_engine_id: str,
        *,
        remote_request_id: str | None = None,
        deadline: float | None = None,
        remote_expires_at: float | None = None,
        release_only: bool = False,
        remote_agents: NamedAgents | None = None,
    ) -> None:
        """Post one READ per source rank; the result comes from `get_finished()`.

        `remote_expires_at` is when the producer's lease of these blocks ends, in its clock
        (`Worker.hold`'s return): once that, less a margin, has passed no READ is posted and
        the read ends as expired; a read still running then ends so too (never a success).
        `release_only`: a read of no blocks that only tells the producer to let go, counted
        as no request (a producer it fails to tell counts as a failed notification).
        `remote_agents`: the agents of the producer ranks that hold the blocks (rank -> their
        `agent_metadata_sha256` or its `agent_tag`): a rank serving another agent now (its
        process restarted) fails the read as `peer_lost`, unread and the producer untold."""
        s = self.s
        renewals = self.renewed.pop(request_id, None)  # whatever happens next
        remote = self._remote_for(request_id, remote_engine_id)
        restarted = restarted_since(remote, remote_agents)
        plan = remote.plan
        lb, lsub, rids = plan.checked_block_ids(local_block_ids, remote_block_ids)
        cutoff = self._cutoff(remote, remote_expires_at, renewals)
        now = s.clock()
        ends = now + (deadline if deadline is not None else s.config.extra.read_deadline)
        ends = ends if cutoff is None else min(ends, cutoff)
        op = ReadOp(request_id, remote_engine_id, lb, rids, ends, now, cutoff)
        op.sub_block_ids, op.plan, op.checks = lsub, plan, remote.checks
        op.release_only = release_only
        if self._refused(op, restarted, now):
            return
        t0 = time.perf_counter()
        msg = notify.encode(
            "done",
            remote_request_id or request_id,
            expected=plan.notify_expected,
            sender_engine=s.config.engine_id,
            sender_rank=s.tp_rank,
        )
        op.notif = msg if self.send_notifications else b""
        for src in plan.sources:
            lids, rids_p = src.descriptor_ids(lsub, rids)
            if len(lids):
                r = src.remote_rank
                part = Part(r, remote.local_lists[r], lids, remote.remote_lists[r], rids_p)
                op.pending.append(part)
                op.descriptors += len(lids)
                op.nbytes += plan.source_bytes(src, len(rids))
        read_ranks = [part.rank for part in op.pending]
        try:  # the data READs first: the request's bookkeeping is done while they run
            if self.poster.fits(op):  # else the backlog thread posts it, below
                self.poster.post_read(op, s.reader, None)
        finally:  # whatever went wrong, what was posted is tracked (and told) as the read
            self.inflight[request_id] = op
            if self.send_notifications:
                op.release_on_failure = [r for r in plan.notify_ranks if r in remote.agents]
            if s.metrics:
                s.metrics.transfer_started(remote_engine=remote_engine_id, mode=TransferMode.PULL)
        if op.first_error is None and self.send_notifications:
            others = [r for r in plan.notify_ranks if r not in read_ranks]
            try:
                if others:
                    self.acks.post(op, remote.ack_lists, others, op.deadline)
            except TransferError as exc:
                op.first_error = str(exc)
                op.pending.clear()
        if op.first_error is not None and not op.xfers:
            self._fail(op, op.first_error, Outcome.FAILED)
        elif op.pending and not self.backlog.kick():
            self.poster.post_read(op, s.reader, None)
        # parts already running: poll() ends the read once they have (or at the deadline), so
        # nothing lands after the report
        op.post_seconds = time.perf_counter() - t0  # the backlog thread adds its slices' own

    def _cutoff(
        self, remote: Remote, remote_expires_at: float | None, renewals: Renewals | None
    ) -> float | None:
        """The local time by which this read must end (None: no lease to keep to)."""
        if remote_expires_at is None:  # nothing to keep to: spare the lease's lookup
            return None
        return lease_cutoff(
            remote_expires_at,
            self.clock_offsets.get(remote.engine_id),
            renewals=renewals,
            lease=min(m.kv_lease_duration for m in remote.metas.values()),
        )

    def _refused(self, op: ReadOp, restarted: str | None, now: float) -> bool:
        """No READ for blocks another process holds now (`restarted`, why), nor for those the
        producer may have reused (past the lease cutoff): the read ends at once (True)."""
        if restarted is not None:  # never told: "done" would free another request's blocks
            why, outcome = restarted, Outcome.PEER_LOST
        elif op.cutoff is not None and now >= op.cutoff:
            left = f"{op.cutoff - now:+.3f}s"
            why = f"the producer's lease cutoff is {left} from now; not read: the blocks may be"
            why, outcome = f"{why} reused", Outcome.EXPIRED
        else:
            return False
        if self.s.metrics:
            self.s.metrics.transfer_started(remote_engine=op.engine_id, mode=TransferMode.PULL)
        self._fail(op, why, outcome)
        return True

    def _remote_for(self, request_id: str, engine_id: str) -> Remote:
        """The added engine a new read of `request_id` goes to."""
        self.waiting.pop(request_id, None)
        if request_id in self.inflight:
            raise TransferError(f"request {request_id!r} is already being read")
        remote = self.remotes.get(engine_id)
        if remote is None:
            raise TransferError(
                f"request {request_id!r}: remote engine {engine_id!r} not added "
                f"(known: {sorted(self.remotes)}); handshake first"
            )
        return remote

    def keep_alive(
        self, request_id: str, remote_engine_id: str, remote_request_id: str | None = None
    ) -> None:
        """The request will be read later: heartbeat the producer so its lease holds."""
        self.waiting[request_id] = (remote_engine_id, remote_request_id or request_id)

    def forget(self, request_id: str) -> None:
        """Stop heartbeating a request that will not be read (aborted)."""
        self.waiting.pop(request_id, None)
        self.renewed.pop(request_id, None)

    def _heartbeat(self) -> None:
        s = self.s
        now = s.clock()
        if not self.waiting or now < self.next_heartbeat:
            return
        told = [m.kv_lease_duration for r in self.remotes.values() for m in r.metas.values()]
        self.next_heartbeat = now + heartbeat_period(s.config.extra.kv_lease_duration, told)
        for request_id, (engine, rid) in self.waiting.items():
            remote = self.remotes.get(engine)
            if remote is None:
                continue
            sent_all = True
            msg = notify.encode(
                "heartbeat",
                rid,
                expected=remote.plan.notify_expected,
                sender_engine=s.config.engine_id,
                sender_rank=s.tp_rank,
            )
            for agent in remote.agents.values():
                try:
                    s.reader.send_notif(agent, msg)
                except TransferError as exc:
                    sent_all = False
                    logger.warning("heartbeat for %r to %s failed: %s", rid, agent, exc)
                    self._lost_notification(engine)
            if sent_all:
                self.renewed.setdefault(request_id, Renewals(now)).sent(now)

    def _fail(self, op: ReadOp, error: str, outcome: Outcome) -> None:
        op.release()
        op.error = error
        op.outcome = outcome
        self.inflight.pop(op.request_id, None)
        self.ready.append(op)
        logger.warning("read of request %r failed (%s): %s", op.request_id, outcome.value, error)

    @property
    def pending_notifications(self) -> int:
        """Notifications still on their way to producer ranks (keep stepping until 0)."""
        return len(self.acks)

    def reads_still_running(self, now: float) -> bool:
        """Reads are in flight, every part of them not yet done is still running (one state
        check each), none is past its deadline and nothing else is due (reads to report,
        ack READs, heartbeats): a full `take_finished` would report nothing now."""
        if not self.inflight or self.ready or self.acks.running or self.waiting:
            return False
        reader = self.s.reader
        for op in self.inflight.values():
            kick = op.pending and not self.backlog.busy  # no thread posting them
            if now >= op.deadline or op.first_error is not None or kick:
                return False
            running = bool(op.pending)
            for i in range(op.polled, len(op.xfers)):
                if i in op.done:
                    continue
                if reader.poll(op.xfers[i][1]).state is not _PROC:
                    return False
                running = True
            if not running:
                return False
        return True

    def poll(self) -> None:
        """Advance every in-flight read: done, failed or past its deadline."""
        now = self.s.clock()
        if self.acks.running:
            self.acks.poll(now, self._lost_notification)
        failing: list[Failing] = []
        finished: list[ReadOp] = []
        for op in list(self.inflight.values()):
            # a failed part does not end the read at once: parts in flight are polled until they end
            # (or the deadline); parked ones are dropped unposted once the read failed or ran late
            op.drop_parked_when_late(now)  # before a poll below could post them
            waiting = 0  # parts never posted (their peer's warm-up is under way): none lands
            for i in range(op.polled, len(op.xfers)):
                if i in op.done or i in op.failed:
                    continue
                if op.first_error is not None and op.drop_parked(i, i + 1):
                    continue  # polling it could post it once its peer is warm
                rank, x = op.xfers[i]
                res = self.s.reader.poll(x)
                if res.state is XferState.DONE:
                    op.done.add(i)
                elif res.state is XferState.ERR:
                    op.failed.add(i)
                    if op.first_error is None:
                        op.first_error = f"READ from rank {rank} of {op.engine_id!r}: {res.error}"
                        op.first_error_peer_lost = res.peer_lost
                        op.pending.clear()
                elif res.unposted:
                    waiting += 1
            if op.first_error is not None:  # parked parts polled before a later one failed
                waiting -= op.drop_parked(op.polled, len(op.xfers))
            op.skip_ended()
            # done only now, past the lease cutoff: the bytes may be the producer's next KV
            expired = op.cutoff is not None and now >= op.cutoff
            if op.pending and not expired and now < op.deadline and not self.backlog.kick():
                try:  # no backlog thread (interpreter shutting down): post here
                    until = time.perf_counter() + self.poster.budget
                    self.poster.post_read(op, self.s.reader, until)
                except Exception:  # the read fails (first_error); the step goes on
                    logger.exception("posting the READs of request %r failed", op.request_id)
            ended = len(op.done) + len(op.failed)
            settled = ended == len(op.xfers)  # what was posted
            quiet = ended + waiting == len(op.xfers)  # nothing posted still runs
            if op.first_error is not None and (settled or now >= op.deadline):
                outcome = Outcome.PEER_LOST if op.first_error_peer_lost else Outcome.FAILED
                if outcome is Outcome.PEER_LOST:
                    self.suspect.add(op.engine_id)
                failing.append((op, op.first_error, outcome, quiet))
            elif settled and not op.pending and not expired and not op.failed:
                op.release()
                self.inflight.pop(op.request_id)
                self.ready.append(op)
                finished.append(op)
            elif expired or now >= op.deadline:
                failing.append((op, *op.timed_out(now, expired), quiet))
        self._end(failing)
        for op in finished:  # ranks read in slices are told now, on the agent retirement left
            if op.notify_after:
                self._tell(op, op.notify_after)

    def _end(self, failing: list[Failing], why: str = "passed its deadline") -> None:
        """Report these reads failed; one with READs still running (it `why`) first
        retires the reading agent, which cancels every other read on it."""
        if not failing:
            return
        gone = set(retire_for(self.s, failing, self.inflight.values(), why))
        for op, error, outcome, _ in failing:
            self._fail(op, error, outcome)
        if gone:  # their engines are handshaken with again by `Worker.connect`
            self.dropped |= {e for e, r in self.remotes.items() if gone & set(r.agents.values())}

    def _lost_notification(self, engine_id: str) -> None:
        if self.s.metrics:
            self.s.metrics.failed_notification(remote_engine=engine_id, reason="send_failed")

    def take_finished(self, out: FinishedOutput) -> None:
        s = self.s
        self.poll()
        self._heartbeat()
        ready, self.ready = self.ready, []
        for op in ready:
            elapsed = s.clock() - op.started if s.metrics else 0.0
            if op.error is None:
                assert op.plan is not None  # every read and push is given its engine's plan
                invalid = land(s, op, op.plan, op.checks)
            else:
                if op.engine_id in self.remotes:  # agents of a removed engine are gone
                    self._tell(op, op.release_on_failure)
                invalid = {int(b) for b in op.local_block_ids}
            if op.error is not None:
                out.invalid_block_ids[op.request_id] = invalid
                out.failures[op.request_id] = FailureReason(op.outcome, op.engine_id, op.error)
                if s.config.kv_load_failure_policy == "fail":
                    out.failed.add(op.request_id)
            out.finished_recving.add(op.request_id)
            if s.metrics:
                count_read(s.metrics, s.config.kv_load_failure_policy, op, elapsed, len(invalid))

    def _tell(self, op: ReadOp, ranks: list[int]) -> None:
        """Tell `ranks` that `op` is done by ack READs, tracked (and owed) until delivered: a
        bare notification on a link not yet wired up goes out only while this worker steps."""
        r = self.remotes[op.engine_id]
        deadline = self.s.clock() + self.s.config.extra.read_deadline
        self.acks.tell(op, ranks, r.ack_lists, r.agents, deadline, self._lost_notification)

    def close(self) -> None:
        self.backlog.close()
        self.acks.settle(CLOSE_SETTLE_SECONDS, self._lost_notification)
        settle_reads(self.inflight.values(), self.s.reader.poll, CLOSE_SETTLE_SECONDS)
        for op in list(self.inflight.values()):  # no retirement: the agent goes with us
            self._fail(op, f"remote engine {op.engine_id!r} closed", Outcome.PEER_LOST)
        for engine in list(self.remotes):
            self.remove_remote(engine, reason="closed")
