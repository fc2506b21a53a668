"""The producer side of push mode: WRITE each request into the blocks its decoders expect.

A decoder rank introduces itself with an `Expect` (its metadata travels in it, so the producer
loads the decoder's agent without a handshake). The producer starts a request with `begin`
(its blocks), marks layers ready with `layer_ready` as prefill computes them, and `end`s it.
Each ready segment is written to every decoder rank that expects it as soon as both are
known, in either order. A request's blocks are held until every expected decoder rank has
all of it or was told `Ended`, or until the lease passes; a decoder's copy is only ever given
up by cancelling its in-flight WRITEs first, so nothing of it lands after `Ended` is sent.
"""

from __future__ import annotations

import collections
import contextlib
import logging

import msgspec

from kvrdma.errors import ConfigError, KvrdmaError, TransferError
from kvrdma.handshake.wire import worker_problems
from kvrdma.layout import KVLayoutInfo
from kvrdma.metadata import sha256_hex
from kvrdma.nixl.protocol import MemType, Xfer, XferState
from kvrdma.push import wire
from kvrdma.push.jobs import Decoder, Job, Key, Target, Unloaded, key_of, older, stale
from kvrdma.push.plan import build_write_plan, segment_count
from kvrdma.state import WorkerState

logger = logging.getLogger(__name__)

LEASE_ENDED = "the producer's lease ended"
NEVER_HAD = "the producer never had the request"
TOO_MANY_EARLY = "too many requests expected before the producer had them"
# Expect/Abort messages kept for requests the producer does not have yet: decoders name
# requests, so this bounds what they can make a producer hold
MAX_EARLY_MESSAGES = 16384
_SWEEP_SECONDS = 1.0  # how often decoders no request names are looked for
# how long a decoder rank's agent that could not be loaded is not tried again (at first; the
# wait doubles up to MAX_RELOAD_S): loading one that cannot be reached blocks this producer's
# step until TCP gives up, and its rank sends an Expect per request
RELOAD_AFTER_S = 10.0
MAX_RELOAD_S = 300.0
MAX_OWED = 4096  # `Ended` kept per decoder rank not loaded


class Pusher:
    """Writes requests into the decoder ranks that expect them (see the module doc)."""

    def __init__(self, shared: WorkerState) -> None:
        self.s = shared
        self.decoders: dict[Key, Decoder] = {}
        self.jobs: dict[str, Job] = {}
        # messages for requests not begun yet, with when the first came (in that order)
        self.early: dict[str, tuple[float, list[wire.Expect | wire.Abort]]] = {}
        self._early_messages = 0
        # request id -> (when its blocks were let go, why), in that order: a late Expect is
        # told so
        self.let_go: dict[str, tuple[float, str]] = {}
        self._next_sweep = 0.0
        # decoder ranks whose agent could not be loaded (tried again when due, see `_prune`)
        self.unloadable: dict[Key, Unloaded] = {}
        self.finished: set[str] = set()
        # segments written so far, by kind: "layer" (during prefill) or "whole"
        self.written: collections.Counter[str] = collections.Counter()

    # ---- the producer's calls ----------------------------------------------------------
    def begin(self, request_id: str, block_ids: list[int], *, layerwise: bool) -> None:
        """Prefill of `request_id` into `block_ids` starts (layer-wise) or has finished."""
        s = self.s
        if request_id in self.jobs:
            raise TransferError(f"request {request_id!r} is already being pushed")
        if layerwise and s.stager is not None:
            raise ConfigError("layer-wise push from host-staged caches: push the whole request")
        self._layout()
        lease = s.config.extra.kv_lease_duration
        job = Job([int(b) for b in block_ids], s.clock() + lease, layerwise, done=not layerwise)
        self.jobs[request_id] = job
        self.let_go.pop(request_id, None)
        for m in self._take_early(request_id):
            self._attach(request_id, job, m)
        self._post(job)

    def layer_ready(self, request_id: str, layer: str) -> None:
        """The KV of `layer` for this request is final: write it."""
        job = self._job(request_id)
        if job is None:
            return
        if not job.layerwise:
            raise TransferError(f"request {request_id!r} is pushed whole, not layer by layer")
        index = self._layout().layer_index.get(layer)
        if index is None:  # its KV lives in another layer's region (a shared cache, or
            return  # Mamba state in attention pages): it goes with that layer
        job.ready.add(index)
        self._post(job)

    def end(self, request_id: str) -> None:
        """Prefill is done: write whatever is not written yet."""
        job = self._job(request_id)
        if job is not None and job.layerwise:
            job.ready.update(range(segment_count(self._layout())))
            job.done = True
            self._post(job)

    def abort(self, request_id: str) -> None:
        """The producer drops the request: stop every copy, let go of its blocks."""
        job = self._job(request_id)
        if job is None:
            return
        for t in job.targets.values():
            if not t.settled:
                self._stop(t, "aborted by the producer", cancel=True)
        self._finish(request_id, "aborted by the producer", "push_aborted")

    def renew(self, request_id: str) -> bool:
        """A decoder's heartbeat: the request's lease runs on; False if it is not pushed."""
        job = self.jobs.get(request_id)
        if job is None:
            return False
        job.expires_at = max(job.expires_at, self.s.clock() + self.s.config.extra.kv_lease_duration)
        return True

    def _job(self, request_id: str) -> Job | None:
        """The request's push; None once it was let go (its decoders ended or the lease)."""
        job = self.jobs.get(request_id)
        if job is None and request_id not in self.let_go:
            raise TransferError(f"request {request_id!r} is not being pushed")
        return job

    def _layout(self) -> KVLayoutInfo:
        if self.s.layout is None or self.s.metadata is None:
            raise ConfigError("register_kv_caches() must come before pushing")
        return self.s.layout

    # ---- messages from decoders --------------------------------------------------------
    def on_message(self, m: wire.Expect | wire.Abort) -> None:
        kept = self.early.get(m.request_id, (0.0, []))[1]
        if isinstance(m, wire.Expect) and stale(m, self.decoders.get(key_of(m)), kept):
            logger.info("Expect for %r from a replaced agent ignored", m.request_id)
            return  # that agent no longer listens
        job = self.jobs.get(m.request_id)
        if job is not None:
            self._attach(m.request_id, job, m)
            self._post(job)
        elif m.request_id in self.let_go:  # nothing (more) will come
            why = self.let_go[m.request_id][1]
            if isinstance(m, wire.Expect):
                self._end_unknown(m, why)
            else:
                key = (m.decoder_engine, m.decoder_rank)
                self._ended_to(self.decoders.get(key), m.decoder_request_id, why, key)
        else:
            self._keep_early(m)

    def _keep_early(self, m: wire.Expect | wire.Abort) -> None:
        """Keep `m` until the producer has its request: one message of a kind per decoder
        rank, `MAX_EARLY_MESSAGES` in all (an Abort of a kept Expect always: it ends it)."""
        entry = self.early.get(m.request_id)
        msgs = entry[1] if entry is not None else []
        mine = [e for e in msgs if key_of(e) == key_of(m)]
        if isinstance(m, wire.Abort) and any(
            isinstance(e, wire.Expect) and e.decoder_request_id != m.decoder_request_id
            for e in mine
        ):
            # the rank expects again only once its earlier expectation settled, so this one
            # was read late (from an agent a retirement replaced): the kept one stands
            logger.info("Abort of an earlier expectation of %r ignored", m.request_id)
            return
        if not mine and self._early_messages >= MAX_EARLY_MESSAGES:
            logger.warning("%s for %r dropped: %s", type(m).__name__, m.request_id, TOO_MANY_EARLY)
            if isinstance(m, wire.Expect):
                self._end_unknown(m, TOO_MANY_EARLY)
            return
        self.early.setdefault(m.request_id, (self.s.clock(), msgs))
        same = [e for e in mine if type(e) is type(m)]
        for e in same:  # a decoder rank's message sent again replaces it
            msgs.remove(e)
        msgs.append(m)
        self._early_messages += 1 - len(same)
        if isinstance(m, wire.Abort):  # it will never be written: say so now
            for e in mine:
                if isinstance(e, wire.Expect):
                    self._end_unknown(e, "aborted before the producer had the request")

    def _attach(self, request_id: str, job: Job, m: wire.Expect | wire.Abort) -> None:
        if isinstance(m, wire.Abort):
            key = (m.decoder_engine, m.decoder_rank)
            t = job.targets.get(key)
            if t is not None and t.expect.decoder_request_id != m.decoder_request_id:
                t = None  # about an expectation the target is not: it was never written
            if t is not None and not t.settled:
                self._stop(t, f"aborted by the decoder: {m.reason}")
                return
            if t is None:
                job.aborted.add(m.decoder_request_id)
            # nothing more lands in it (never written, complete or ended): say so again, in
            # case the decoder gave up before the last word came
            why = "aborted before the write" if t is None else t.ended or "complete"
            self._ended_to(self.decoders.get(key), m.decoder_request_id, why, key)
            return
        d = m.decoder
        key = (d.engine_id, d.tp_rank)
        old = job.targets.get(key)
        if old is not None and old.expect.decoder_request_id == m.decoder_request_id:
            if old.dec is not None and old.dec.agent != d.agent_name:  # its agent was retired
                self._end_unknown(m, "the decoder's agent changed")  # stop; tell the new one
            return  # a repeated Expect changes nothing else
        job.expected = m.expected
        try:
            dec = self._load(m)  # a restarted decoder's old copy is stopped here
        except KvrdmaError as exc:  # told once it is loaded, if it ever is (`_ended_to`)
            self._refuse(request_id, job, m, None, str(exc))
            return
        if dec.refused is not None:
            self._refuse(request_id, job, m, dec, dec.refused)
            return
        if old is not None and not self._advance(old).settled:
            # the decoder rank expects it again (a retry) while its earlier copy is written
            why = "an earlier expectation of it by this decoder rank is still being written"
            self._ended_to(dec, m.decoder_request_id, why)
            return
        # a decoder that comes once prefill is over gets it in one WRITE
        whole = job.done
        count = 0 if dec.plan is None else 1 if whole else len(dec.plan.segments)
        ids = m.producer_block_ids
        if ids is None:  # its last blocks, as many as the decoder's hold (a prefix hit)
            ratio = 1 if dec.plan is None else dec.plan.plan.block_ratio
            surplus = -(-len(job.block_ids) // ratio) - len(m.block_ids)
            ids = job.block_ids[max(0, surplus) * ratio :]
        job.targets[key] = t = Target(key, m, count, ids, whole, dec)
        dec.last_used = self.s.clock()
        if m.decoder_request_id in job.aborted:
            self._stop(t, "aborted before the write")
        elif not set(ids) <= set(job.block_ids):
            self._stop(
                t,
                f"refused: producer blocks {sorted(set(ids) - set(job.block_ids))[:8]} "
                "are not the request's",
            )

    def _refuse(
        self, request_id: str, job: Job, m: wire.Expect, dec: Decoder | None, why: str
    ) -> None:
        key = key_of(m)
        logger.warning("push of %r to %s rank %d refused: %s", request_id, *key, why)
        job.targets[key] = t = Target(key, m, 0, [], dec=dec)
        self._stop(t, f"refused by the producer: {why}")

    def _load(self, m: wire.Expect) -> Decoder:
        """The agent and plan of the decoder rank that sent `m`, loaded once per agent. One
        this producer cannot write to is loaded all the same, `refused`, to be told so (else
        it keeps the request's blocks quarantined for as long as this producer lives); one
        whose metadata is unfit to load raises."""
        s, d = self.s, m.decoder
        key = (d.engine_id, d.tp_rank)
        sha = sha256_hex(d.agent_metadata)
        old = self.decoders.get(key)
        if old is not None and old.agent == d.agent_name and old.sha256 == sha:
            return old
        # from the network, checked as a handshake's; an empty checksum means "not sent"
        filled = msgspec.structs.replace(d, agent_metadata_sha256=d.agent_metadata_sha256 or sha)
        if problems := worker_problems(filled, sha):
            raise ConfigError(f"decoder {d.engine_id!r} rank {d.tp_rank}: {'; '.join(problems)}")
        layout, meta = self._layout(), s.metadata
        assert meta is not None  # checked by _layout
        plan, refused = None, None
        if s.config.extra.enforce_handshake_compat and d.compat_hash != s.compat_hash:
            refused = (
                f"decoder {d.engine_id!r} rank {d.tp_rank}: compat hash {d.compat_hash[:12]!r} "
                f"differs from this producer's {s.compat_hash[:12]!r}"
            )
        else:
            try:
                plan = build_write_plan(meta, layout, d)
            except ConfigError as exc:
                refused = str(exc)
        if old is not None:  # restarted: what was going to the old process goes nowhere now
            for job in self.jobs.values():
                for t in job.targets.values():
                    if t.dec is old and not t.settled:
                        self._stop(t, "the decoder restarted", cancel=True)
            self._drop(key)
        failed = self.unloadable.pop(key, None)
        if failed is not None and failed.sha256 != sha:
            failed = None  # another process of the rank: what the last one is owed is void
        elif failed is not None and s.clock() < failed.retry_at:
            self.unloadable[key] = failed
            raise TransferError(f"decoder {d.engine_id!r} rank {d.tp_rank}: {failed.why}")
        try:
            agent = s.backend.add_remote(d.agent_metadata)
        except TransferError as exc:
            wait = RELOAD_AFTER_S if failed is None else min(2 * failed.wait, MAX_RELOAD_S)
            owed = {} if failed is None else failed.owed
            why = f"cannot be loaded: {exc}"
            self.unloadable[key] = Unloaded(sha, s.clock() + wait, wait, why, m, owed)
            raise
        dec = Decoder(
            agent, sha, plan, d.engine_id, replaced=frozenset(m.replaced), refused=refused
        )
        dec.last_used = s.clock()  # kept `engine_ttl` from now, whether it is answered or written
        self.decoders[key] = dec
        if plan is not None:
            try:
                dec.local = s.backend.prep_local(plan.source.remote_rows, MemType(meta.mem_type))
                dec.remote = s.backend.prep_remote(
                    dec.agent, plan.source.local_rows, MemType(d.mem_type)
                )
            except BaseException:
                self._drop(key)
                raise
        for drid, why in () if failed is None else failed.owed.items():
            self._ended_to(dec, drid, why)
        return dec

    def _drop(self, key: Key) -> None:
        dec = self.decoders.pop(key)
        dec.release()
        try:
            self.s.backend.remove_remote(dec.agent)
        except TransferError as exc:
            logger.info("removing decoder agent %s: %s", dec.agent, exc)

    # ---- writing -----------------------------------------------------------------------
    def _post(self, job: Job) -> None:
        s = self.s
        for t in job.targets.values():
            dec = t.dec
            if t.ended is not None or dec is None or dec.plan is None:
                continue
            if t.whole:
                segments = [0] if job.done and not t.posted else []
            else:
                segments = sorted(job.ready - t.posted)
            for seg in segments:
                msg = wire.Segment(
                    wire.PUSH_VERSION,
                    t.expect.decoder_request_id,
                    s.config.engine_id,
                    s.tp_rank,
                    seg,
                    t.segments,
                )
                notif = wire.encode(msg)
                try:
                    pids, dids = dec.plan.descriptor_ids(
                        None if t.whole else seg, t.expect.block_ids, t.producer_ids
                    )
                    if len(pids) == 0:  # nothing of this layer here: say so all the same
                        s.backend.send_notif(dec.agent, notif)
                    else:
                        assert dec.local is not None and dec.remote is not None
                        x = s.backend.post("WRITE", dec.local, pids, dec.remote, dids, notif)
                        t.xfers.append((seg, x))
                    t.posted.add(seg)
                    self.written["whole" if t.whole else "layer"] += 1
                except KvrdmaError as exc:
                    self._stop(t, f"posting the WRITE failed: {exc}")
                    break

    def poll(self) -> None:
        """Advance every WRITE; let go of requests that are complete or past their lease."""
        now = self.s.clock()
        for rid, job in list(self.jobs.items()):
            for t in job.targets.values():
                self._advance(t)
            targets = job.targets.values()
            expected = job.expected is not None and len(job.targets) >= job.expected
            if expected and all(t.settled for t in targets):
                whole = all(t.ended is None for t in targets)
                reason = "pushed" if whole else "push_ended_short"
                self._finish(rid, "every decoder that expected it is done", reason)
                continue
            if now >= job.expires_at:
                for t in targets:
                    if not t.settled:
                        self._stop(t, LEASE_ENDED, cancel=True)
                if self.s.metrics:
                    self.s.metrics.expired_leases(1)
                self._finish(rid, LEASE_ENDED, "push_lease_expired")
        self._prune(now)

    def _advance(self, t: Target) -> Target:
        """Poll the target's WRITEs: a failed one stops it; once its WRITEs have all ended, a
        stopped target is told so."""
        running: list[tuple[int, Xfer]] = []
        error = None
        for seg, x in t.xfers:
            res = self.s.backend.poll(x)
            if res.state is XferState.PROC:
                running.append((seg, x))
            else:
                x.release()
                if res.state is not XferState.DONE and error is None:
                    error = f"WRITE of segment {seg} failed: {res.error}"
        t.xfers = running
        if error is not None and t.ended is None:
            self._stop(t, error)
        elif t.ended is not None and not t.xfers and not t.told:
            self._ended_to(t.dec, t.expect.decoder_request_id, t.ended, t.key)  # they ended
            t.told = True
        return t

    def _stop(self, t: Target, reason: str, *, cancel: bool = False) -> None:
        """Post nothing more to the target; once its WRITEs in flight have ended (`cancel`:
        cancelled now, when the producer must let go of its blocks), tell it so."""
        if t.ended is None:
            t.ended = reason
        if cancel:
            for _, x in t.xfers:
                x.release()  # NIXL cancels a running transfer (it logs one it cannot)
            t.xfers = []
        if not t.xfers and not t.told:
            self._ended_to(t.dec, t.expect.decoder_request_id, t.ended, t.key)
            t.told = True

    def _ended_to(
        self, dec: Decoder | None, decoder_request_id: str, reason: str, key: Key | None = None
    ) -> None:
        """Tell a decoder rank that nothing more of its expectation lands; one whose agent
        could not be loaded (`key`) is told once it is, lest its blocks stay quarantined."""
        if dec is None:
            owed = self.unloadable[key].owed if key in self.unloadable else None
            if owed is not None and (decoder_request_id in owed or len(owed) < MAX_OWED):
                owed[decoder_request_id] = reason
            return
        s = self.s
        msg = wire.Ended(
            wire.PUSH_VERSION, decoder_request_id, s.config.engine_id, s.tp_rank, reason
        )
        try:
            s.backend.send_notif(dec.agent, wire.encode(msg))
        except TransferError as exc:
            logger.warning("telling %s that %r ended: %s", dec.agent, decoder_request_id, exc)
            if s.metrics:
                s.metrics.failed_notification(remote_engine=dec.engine_id, reason="send_failed")

    def _end_unknown(self, m: wire.Expect, reason: str) -> None:
        try:
            dec = self._load(m)
        except KvrdmaError as exc:
            logger.warning("Expect for %r from an unusable decoder: %s", m.request_id, exc)
            self._ended_to(None, m.decoder_request_id, reason, key_of(m))
            return
        self._ended_to(dec, m.decoder_request_id, reason)

    def _finish(self, request_id: str, why: str, reason: str) -> None:
        """Let go of the request's blocks; `reason` labels them in `kvrdma_freed_blocks_total`."""
        job = self.jobs.pop(request_id)
        self.finished.add(request_id)
        self.let_go.pop(request_id, None)  # kept in the order they were let go
        self.let_go[request_id] = (self.s.clock(), why)
        if self.s.metrics:
            self.s.metrics.freed_blocks(len(job.block_ids), reason=reason)

    def _take_early(self, request_id: str) -> list[wire.Expect | wire.Abort]:
        msgs = self.early.pop(request_id, (0.0, []))[1]
        self._early_messages -= len(msgs)
        return msgs

    def _prune(self, now: float) -> None:
        lease = self.s.config.extra.kv_lease_duration
        # both tables are in time order: only their expired heads are walked
        for rid in older(self.early, now - lease):
            for m in self._take_early(rid):
                if isinstance(m, wire.Expect):
                    self._end_unknown(m, NEVER_HAD)
        for rid in older(self.let_go, now - lease):
            del self.let_go[rid]
        for key, u in [(k, u) for k, u in self.unloadable.items() if u.retry_at <= now]:
            if not u.owed:
                del self.unloadable[key]
                continue
            with contextlib.suppress(KvrdmaError):  # once loaded, it is told what it is owed
                self._load(u.expect)
        ttl = self.s.config.extra.engine_ttl  # decoders no request names any more go
        if ttl and self.decoders and now >= self._next_sweep:
            self._next_sweep = now + _SWEEP_SECONDS
            used = {id(t.dec) for job in self.jobs.values() for t in job.targets.values()}
            for key, dec in list(self.decoders.items()):
                if now - dec.last_used > ttl and id(dec) not in used:
                    self._drop(key)

    def take_finished(self) -> set[str]:
        """Requests whose blocks are free again."""
        self.poll()
        out, self.finished = self.finished, set()
        return out

    @property
    def idle(self) -> bool:
        return not (self.jobs or self.early or self.finished or self.unloadable)

    def close(self) -> None:
        for job in self.jobs.values():
            for t in job.targets.values():
                if not t.settled:
                    self._stop(t, "the producer closed", cancel=True)
        for key in list(self.decoders):
            self._drop(key)
