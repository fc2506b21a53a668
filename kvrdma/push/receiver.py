"""The decoder side of push mode: expect a request in local blocks, watch it land, and never
let its blocks be reused while a producer might still write them.

`expect` sends each producer rank of the engine an `Expect` (block ids and this rank's
metadata). Producers send a `Segment` after each WRITE has landed and `Ended` when they stop
short. The request is reported like a read: done once every writing rank's segments have all
landed, or failed (every block invalid) when one rank ends short or the deadline passes.

A producer cannot be stopped from here, so a failed request whose writers have not all said
`Ended` is also reported `quarantined`: its blocks must not be reused until it is reported
`released`, once each such rank has ended (it is told to abort) or is found gone (a one-byte
READ to it fails, or its engine comes back under a new agent). A rank that is stalled or cut
off keeps them quarantined, which is the point, and so does one of an engine this rank removed
until it says it ended or the engine is added again.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import msgspec

from kvrdma.consumer import ConsumerSide
from kvrdma.descriptors import check_distinct_local
from kvrdma.errors import ConfigError, TransferError
from kvrdma.metadata import WorkerMetadata
from kvrdma.nixl.protocol import Xfer, XferState, running_after_grace
from kvrdma.posting import ACK_ID
from kvrdma.push import wire
from kvrdma.push.sender import LEASE_ENDED, NEVER_HAD
from kvrdma.remote import NamedAgents, Remote, restarted_since
from kvrdma.transfer import ReadOp, parked
from kvrdma.types import FinishedOutput, Outcome, TransferMode

logger = logging.getLogger(__name__)

# how often a quarantined request's silent writers are probed
PROBE_EVERY = 0.5


@dataclass
class _Wait:
    op: ReadOp
    producer_request_id: str
    writers: set[int]  # producer ranks whose segments must land
    told: dict[int, str]  # producer rank -> its agent, every rank sent the Expect
    # the request's name in this expectation's messages: producers answer an earlier push of
    # the same request id under another, so what they say of it never settles this one
    wire_id: str = ""
    expect: wire.Expect | None = None  # what the producers were told, with this rank's agent
    landed: dict[int, set[int]] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    ended: dict[int, str] = field(default_factory=dict)  # rank -> why it stopped short
    untold: set[int] = field(default_factory=set)  # ranks not told this rank's new agent yet
    # producer rank -> its agent's metadata checksum when told: a restarted process may
    # have the same agent name
    told_as: dict[int, str] = field(default_factory=dict)

    def complete(self, rank: int) -> bool:
        return rank in self.counts and len(self.landed.get(rank, ())) == self.counts[rank]

    def settled(self, rank: int) -> bool:
        return rank in self.ended or self.complete(rank)

    def silent(self) -> list[int]:
        """Told ranks that may still write into the blocks (a rank the plan gives nothing
        to write here never does)."""
        return [r for r in self.told if r in self.writers and not self.settled(r)]


@dataclass
class _Fence:
    """A given-up request whose blocks stay out of use until its writers are all settled."""

    wait: _Wait
    probes: dict[int, Xfer] = field(default_factory=dict)
    next_probe: float = 0.0


class Receiver:
    """Expects pushed requests on one consumer rank (see the module doc)."""

    def __init__(self, consumer: ConsumerSide) -> None:
        self.c = consumer
        self.s = consumer.s
        self.waits: dict[str, _Wait] = {}
        self.fences: dict[str, _Fence] = {}
        self._quarantined: set[str] = set()
        self._released: set[str] = set()
        # (engine, producer request) -> the request expecting it, while expected or quarantined
        self._expecting: dict[tuple[str, str], str] = {}
        # this rank's agent the producers were last told of: a retirement replaces it
        self._agent = ""
        self._untold: set[str] = set()  # requests with ranks to tell this rank's new agent
        self._next_retell = 0.0

    def expect(
        self,
        request_id: str,
        local_block_ids: Collection[int],
        remote_engine_id: str,
        *,
        remote_request_id: str | None = None,
        remote_block_ids: Collection[int] | None = None,
        deadline: float | None = None,
        release_only: bool = False,
        remote_agents: NamedAgents | None = None,
    ) -> None:
        s = self.s
        self.c.forget(request_id)  # no more heartbeats: it is being written, or failed
        ids = [int(b) for b in local_block_ids]
        producer_request_id = remote_request_id or request_id
        remote, meta = self._checked(
            request_id, ids, remote_engine_id, producer_request_id, remote_block_ids
        )
        restarted = restarted_since(remote, remote_agents)
        seconds = s.config.extra.kv_lease_duration if deadline is None else deadline
        now = s.clock()
        op = ReadOp(request_id, remote_engine_id, ids, [], now + seconds, now)
        op.pushed, op.plan = True, remote.plan  # no checksums: pushes carry none
        op.release_only = release_only
        # what the producers will write, as a read of the same blocks would move it (the
        # producer's block count is exact when named, else the decoder's blocks' worth)
        plan = remote.plan
        n_remote = (
            len(ids) * plan.block_ratio if remote_block_ids is None else len(remote_block_ids)
        )
        op.nbytes, op.descriptors = plan.request_bytes(n_remote), plan.num_entries * n_remote
        if s.metrics:
            s.metrics.transfer_started(remote_engine=remote_engine_id, mode=TransferMode.PUSH)
        if restarted is not None:  # never told: the process asked would write another's KV
            op.error, op.outcome = restarted, Outcome.PEER_LOST
            self.c.ready.append(op)
            logger.warning("push of request %r failed (peer_lost): %s", request_id, restarted)
            return
        t0 = time.perf_counter()
        wire_id = f"{request_id}#{secrets.token_hex(8)}"
        expect = wire.Expect(
            wire.PUSH_VERSION,
            producer_request_id,
            wire_id,
            ids,
            seconds,
            remote.plan.notify_expected,
            meta,
            None if remote_block_ids is None else [int(b) for b in remote_block_ids],
            list(s.former_agents),
        )
        msg = wire.encode(expect)
        writers = {src.remote_rank for src in remote.plan.sources}
        w = _Wait(op, producer_request_id, writers, {}, wire_id, expect)
        self.waits[request_id] = w
        self._expecting[(remote_engine_id, producer_request_id)] = request_id
        for rank in remote.plan.notify_ranks:
            agent = remote.agents[rank]
            try:
                s.reader.send_notif(agent, msg)
            except TransferError as exc:
                # NIXL never talks to a disconnected agent again: handshake before reuse
                self.c.suspect.add(remote_engine_id)
                why = f"telling producer rank {rank} failed: {exc}"
                self._give_up(w, why, Outcome.PEER_LOST)
                return
            w.told[rank] = agent
            w.told_as[rank] = remote.metas[rank].agent_metadata_sha256
        op.post_seconds = time.perf_counter() - t0

    def _checked(
        self,
        request_id: str,
        ids: list[int],
        engine_id: str,
        producer_request_id: str,
        remote_block_ids: Collection[int] | None,
    ) -> tuple[Remote, WorkerMetadata]:
        """The connected engine a new push of `request_id` comes from and this rank's
        metadata, once everything about the request checks out (before any producer is
        told)."""
        s = self.s
        if s.config.extra.integrity_checksums:
            raise ConfigError(
                "integrity_checksums: checksums are checked on READs only; a pushed request "
                "would land unchecked, so push is refused in integrity mode"
            )
        if request_id in self.waits or request_id in self.c.inflight:
            raise TransferError(f"request {request_id!r} is already expected or being read")
        if request_id in self.fences:
            raise TransferError(f"request {request_id!r} is still quarantined")
        earlier = self._expecting.get((engine_id, producer_request_id))
        if earlier is not None:  # the producer writes it into one expectation per decoder rank
            raise ConfigError(
                f"request {request_id!r}: producer request {producer_request_id!r} of engine "
                f"{engine_id!r} is already expected by request {earlier!r} on this rank"
            )
        remote = self.c.remotes.get(engine_id)
        if remote is None or s.metadata is None:
            raise TransferError(
                f"request {request_id!r}: remote engine {engine_id!r} not added; connect() first"
            )
        if remote_block_ids is not None:  # both sides' ids, checked as a read's are
            remote.plan.checked_block_ids(ids, [int(b) for b in remote_block_ids])
        n = s.metadata.num_blocks
        bad = [b for b in ids if not 0 <= b < n]
        if bad:
            raise TransferError(
                f"request {request_id!r}: local block ids out of [0, {n}): {bad[:8]}"
            )
        check_distinct_local(ids, n, engine_id)
        missing = [r for r in remote.plan.notify_ranks if r not in remote.agents]
        if missing:  # a retirement dropped them: connect() again before using the engine
            raise TransferError(
                f"request {request_id!r}: ranks {missing} of engine {engine_id!r} are not "
                "loaded; connect() again"
            )
        return remote, s.metadata

    def abandon(self, request_id: str) -> bool:
        """The decoder drops an expected request: its writers are told to abort and its
        blocks stay quarantined until they have; False if it is not an expected push."""
        w = self.waits.pop(request_id, None)
        if w is None:
            return False
        if self.s.metrics:
            self.s.metrics.transfer_finished(remote_engine=w.op.engine_id, mode=TransferMode.PUSH)
        self._fence(w, "abandoned by the decoder")
        if request_id not in self.fences:
            self._released.add(request_id)
        return True

    # ---- what producers say --------------------------------------------------------------
    def on_message(self, m: wire.Segment | wire.Ended) -> None:
        request_id = m.request_id.rpartition("#")[0]
        w = self.waits.get(request_id)
        f = self.fences.get(request_id)
        w = w or (f.wait if f is not None else None)
        if (
            w is None
            or m.request_id != w.wire_id
            or m.sender_engine != w.op.engine_id
            or m.sender_rank not in w.told
        ):
            logger.info(
                "push message for a request not expected now (%r) from %s rank %d",
                m.request_id,
                m.sender_engine,
                m.sender_rank,
            )
            return
        r = m.sender_rank
        if isinstance(m, wire.Ended):
            w.ended.setdefault(r, m.reason or "nothing to write")
        else:
            if w.counts.setdefault(r, m.count) != m.count:
                w.ended.setdefault(r, f"segment counts disagree ({w.counts[r]} vs {m.count})")
            w.landed.setdefault(r, set()).add(m.index)

    def layer_loaded(self, request_id: str, layer: str) -> bool:
        """Whether `layer`'s KV of the request has landed from every writing rank (also
        True once the request is reported: then it is all there or invalid)."""
        w = self.waits.get(request_id)
        if w is None:
            return True
        layout = self.s.layout
        index = layout.layer_index.get(layer, -1) if layout is not None else -1
        whole = layout is None or any(r.layer is None for r in layout.regions)
        for rank in w.writers:
            got, count = w.landed.get(rank, set()), w.counts.get(rank)
            if count is None:
                return False
            if count == 1 or index < 0:
                if not w.complete(rank):
                    return False
            elif index not in got or (whole and count - 1 not in got):
                return False
        return True

    # ---- progress ------------------------------------------------------------------------
    def poll(self) -> None:
        now = self.s.clock()
        meta = self.s.metadata
        if meta is not None and meta.agent_name != self._agent:
            self._agent = meta.agent_name
            for w in [*self.waits.values(), *(f.wait for f in self.fences.values())]:
                self._reintroduce(w, meta)
        if self._untold and now >= self._next_retell:
            self._next_retell = now + PROBE_EVERY
            for rid in list(self._untold):
                f = self.fences.get(rid)
                kept = self.waits.get(rid) or (f.wait if f is not None else None)
                if kept is not None:
                    self._retell(kept, kept.untold)
                if kept is None or not kept.untold:
                    self._untold.discard(rid)
        for w in list(self.waits.values()):
            if all(w.complete(r) for r in w.writers):
                del self.waits[w.op.request_id]
                self._unlist(w)
                self.c.ready.append(w.op)
            elif any(r in w.ended for r in w.writers):
                rank = min(r for r in w.writers if r in w.ended)
                self._give_up(w, f"producer rank {rank}: {w.ended[rank]}", _outcome(w.ended[rank]))
            elif now >= w.op.deadline:
                left = sorted(r for r in w.writers if not w.complete(r))
                self._give_up(
                    w,
                    f"not written {now - w.op.started:.3f}s after it was expected (deadline); "
                    f"producer ranks {left} not done",
                    Outcome.TIMEOUT,
                )
        settled = []
        for rid, f in list(self.fences.items()):
            self._probe(f, now)
            if not f.wait.silent():
                settled.append(f)
                del self.fences[rid]
                self._unlist(f.wait)
                self._released.add(rid)
                logger.info("request %r released: no producer writes to its blocks", rid)
        self._cancel(settled)  # one grace for all: a step waits for it at most once

    def _give_up(self, w: _Wait, error: str, outcome: Outcome) -> None:
        """Report the request failed; tell its unsettled writers to abort, and keep its
        blocks quarantined until they are settled."""
        op = w.op
        self.waits.pop(op.request_id, None)
        op.error, op.outcome = error, outcome
        self.c.ready.append(op)
        logger.warning("push of request %r failed (%s): %s", op.request_id, outcome.value, error)
        self._fence(w, error)

    def _fence(self, w: _Wait, error: str) -> None:
        """Tell the unsettled ranks to abort; quarantine the request until its writers
        settle."""
        op = w.op
        self._abort(w, error)
        if not w.silent() or not op.local_block_ids:  # nothing can land in no blocks
            self._unlist(w)
            return
        self.fences[op.request_id] = _Fence(w)
        self._quarantined.add(op.request_id)

    def _tell(self, w: _Wait, msg: bytes, what: str, ranks: Collection[int] = ()) -> set[int]:
        """Send `msg` to the told ranks (of `ranks`, if given) that may still write into
        `w`'s blocks; those it failed to reach."""
        s = self.s
        failed = set()
        for r in [r for r in w.told if not w.settled(r) and (not ranks or r in ranks)]:
            try:
                s.reader.send_notif(w.told[r], msg)
            except TransferError as exc:
                failed.add(r)
                logger.warning("%s of %r to producer rank %d: %s", what, w.op.request_id, r, exc)
                if s.metrics:
                    s.metrics.failed_notification(
                        remote_engine=w.op.engine_id, reason="send_failed"
                    )
        return failed

    def _reintroduce(self, w: _Wait, meta: WorkerMetadata) -> None:
        """This rank's agent was retired (`kvrdma.retirement`) and the old one no longer
        listens: its producers answer `w` to the new one once told the expectation again
        (one writing it stops, as for a restarted decoder); a given-up one is aborted again."""
        if w.expect is None or w.expect.decoder.agent_name == meta.agent_name:
            return
        w.expect = msgspec.structs.replace(
            w.expect, decoder=meta, replaced=list(self.s.former_agents)
        )
        self._retell(w, set(w.told))

    def _retell(self, w: _Wait, ranks: set[int]) -> None:
        """Tell `ranks` the expectation with this rank's agent now (a given-up one is
        aborted again). A rank the retirement dropped, or not reached, is told again at a
        later step once its engine is added again (`connect()`): its answer went to the
        retired agent, so until then nothing ends its quarantine."""
        assert w.expect is not None
        remote, engine = self.c.remotes.get(w.op.engine_id), w.op.engine_id
        loaded = (
            set() if remote is None or engine in self.c.dropped else ranks & remote.agents.keys()
        )
        failed = self._tell(w, wire.encode(w.expect), "expectation", loaded) if loaded else set()
        if loaded - failed and w.op.request_id in self.fences:
            failed |= self._abort(w, w.op.error or "given up by the decoder", loaded - failed)
        w.untold = {r for r in (ranks - loaded) | failed if not w.settled(r)}
        if w.untold:
            self._untold.add(w.op.request_id)

    def _abort(self, w: _Wait, error: str, ranks: Collection[int] = ()) -> set[int]:
        s = self.s
        msg = wire.Abort(
            wire.PUSH_VERSION, w.producer_request_id, w.wire_id, s.config.engine_id, s.tp_rank,
            error[:200],
        )  # fmt: skip
        return self._tell(w, wire.encode(msg), "abort", ranks)

    def _unlist(self, w: _Wait) -> None:
        """Nothing more of its producer request lands in `w`: another may expect it."""
        key = (w.op.engine_id, w.producer_request_id)
        if self._expecting.get(key) == w.op.request_id:
            del self._expecting[key]

    def _probe(self, f: _Fence, now: float) -> None:
        """A one-byte READ to each unsettled writer: one the peer or the transport fails
        means the rank is gone. One this side gave up (a retirement) proves nothing and is
        posted again; a writer that cannot be probed (its engine removed, or a rank not
        loaded) stays unsettled until it says `Ended` or its engine is added again."""
        w = f.wait
        remote = self.c.remotes.get(w.op.engine_id)
        due = now >= f.next_probe
        for r in w.silent():
            x = f.probes.get(r)
            if x is not None:
                res = self.s.reader.poll(x)
                if res.state is XferState.PROC:
                    continue
                x.release()
                del f.probes[r]
                if res.state is XferState.ERR and not res.abandoned:
                    w.ended[r] = f"gone: {res.error}"
                    if res.peer_lost:
                        self.c.suspect.add(w.op.engine_id)
                    continue
            agent = remote.agents.get(r) if remote is not None else None
            sha = remote.metas[r].agent_metadata_sha256 if remote and agent is not None else ""
            if agent is not None and (agent, sha) != (w.told[r], w.told_as.get(r, sha)):
                w.ended[r] = "restarted under a new NIXL agent"  # the process told is gone
                continue
            if not due or agent is None or remote is None or r not in remote.ack_lists:
                continue
            try:
                f.probes[r] = self.s.reader.post(
                    "READ", self.s.ack_local, ACK_ID, remote.ack_lists[r], ACK_ID, b""
                )
            except TransferError as exc:  # refused on this side (stale lists): no news
                logger.debug("probe of producer rank %d for %r: %s", r, w.op.request_id, exc)
        if due:
            f.next_probe = now + PROBE_EVERY

    def drop_engine(self, engine_id: str, reason: str) -> None:
        """The engine is being removed: its pushes under way fail (their writers are told
        to abort while they can still be reached) and stay quarantined; probes in flight
        are cancelled first, as removing the peer fails them without news of it."""
        for w in [w for w in self.waits.values() if w.op.engine_id == engine_id]:
            self._give_up(w, f"remote engine {engine_id!r} {reason}", Outcome.PEER_LOST)
        self._cancel([f for f in self.fences.values() if f.wait.op.engine_id == engine_id])

    def take_finished(self, out: FinishedOutput) -> None:
        """Move ended requests to the consumer's report; add the quarantine news to `out`."""
        self.poll()
        out.quarantined |= self._quarantined
        out.released |= self._released
        self._quarantined, self._released = set(), set()

    def engines_in_use(self) -> set[str]:
        return {w.op.engine_id for w in self.waits.values()} | {
            f.wait.op.engine_id for f in self.fences.values()
        }

    def close(self) -> None:
        """Release the probes in flight (their agent is closed next)."""
        self._cancel(list(self.fences.values()))

    def _cancel(self, fences: list[_Fence]) -> None:
        """Release `fences`' probes, those still running after `CANCEL_GRACE` of progress
        cancelled; one still held back by a warm-up round at once (a poll could post it)."""
        probes = [x for f in fences for x in f.probes.values()]
        running_after_grace(self.s.reader.poll, [x for x in probes if not parked(x)])
        for x in probes:
            x.release()
        for f in fences:
            f.probes.clear()

    @property
    def busy(self) -> bool:
        return bool(self.waits or self.fences or self._quarantined or self._released)


def _outcome(reason: str) -> Outcome:
    """A producer's lease ending (or passing before the request reached it) is an expiry."""
    return Outcome.EXPIRED if reason in (LEASE_ENDED, NEVER_HAD) else Outcome.FAILED
