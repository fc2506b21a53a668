"""The facade a serving engine's worker uses: register, publish, read, get_finished.

Roles are separate classes — `ProducerSide` (holds blocks until readers are done) and
`ConsumerSide` (plans and posts READs, reports finished or invalid blocks) — composed by
`Worker` from the config's `kv_role`. Not thread-safe: call it from the engine's step loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import torch

from kvrdma import notify
from kvrdma.backend import BackendConfig, DescList, MemType, TransferBackend, Xfer, XferState
from kvrdma.config import KVTransferConfig
from kvrdma.descriptors import ReadPlan, build_read_plan, region_table
from kvrdma.errors import ConfigError, HandshakeError, RegistrationError, TransferError
from kvrdma.layout import KVInput, KVLayoutInfo, Region, build_regions, worker_metadata
from kvrdma.metadata import CacheLayout, WorkerMetadata, sha256_hex
from kvrdma.postprocess import HostStager, apply_permutes
from kvrdma.topology import TransferTopology
from kvrdma.transfer import Clock, ProducerLedger, ReadOp

logger = logging.getLogger(__name__)

_ACK_ID = np.zeros(1, dtype=np.int64)  # the single descriptor of an ack READ


@dataclass
class FinishedOutput:
    """One step's report, in the shape vLLM's connector returns."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: dict[str, set[int]] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)  # policy "fail": not to be recomputed

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving)


class _Shared:
    """State both roles use: the backend, the registered layout, the metadata."""

    def __init__(
        self,
        config: KVTransferConfig,
        backend: TransferBackend,
        *,
        tp_rank: int,
        tp_size: int,
        total_num_kv_heads: int,
        dp_index: int,
        compat_hash: str,
        metrics: Any,
        clock: Clock,
    ) -> None:
        self.config = config
        self.backend = backend
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.total_num_kv_heads = total_num_kv_heads
        self.dp_index = dp_index
        self.compat_hash = compat_hash
        self.metrics = metrics
        self.clock = clock
        self.layout: KVLayoutInfo | None = None
        self.metadata: WorkerMetadata | None = None
        self.topology: TransferTopology | None = None
        self.stager: HostStager | None = None
        self.registered: Any = None
        # a few registered host bytes that ack READs land in (see _Remote.ack_lists)
        self.scratch = torch.zeros(64, dtype=torch.uint8)
        self.scratch_reg: Any = None
        self.ack_local: Any = None

    @property
    def regions(self) -> list[torch.Tensor]:
        """Byte views of the registered (possibly host-staging) regions."""
        if self.layout is None:
            raise RegistrationError("register_kv_caches() has not been called")
        return [r.data for r in self.layout.regions]


class ProducerSide:
    """Holds a finished request's blocks until every reader notified, or the lease ends."""

    def __init__(self, shared: _Shared) -> None:
        self.s = shared
        self.ledger = ProducerLedger(
            shared.config.extra.kv_lease_duration, shared.clock, shared.metrics
        )

    def hold(self, request_id: str, block_ids: Collection[int]) -> None:
        """The request's prefill is done: keep its blocks for readers (stage to host first).

        With host staging, call this before telling any reader about the request: the host
        copy is what they read."""
        ids = [int(b) for b in block_ids]
        self.stage(ids)
        self.ledger.hold(request_id, ids)

    def stage(self, block_ids: Collection[int]) -> None:
        """Host staging: copy these device blocks to the registered host blocks now."""
        if self.s.stager is not None:
            self.s.stager.stage_out([int(b) for b in block_ids])

    def on_notifs(self, notifs: Mapping[str, list[bytes]]) -> None:
        for agent, msgs in notifs.items():
            for m in msgs:
                self.ledger.on_notif(agent, m)

    def take_finished(self) -> set[str]:
        return self.ledger.take_finished()


@dataclass
class _Remote:
    engine_id: str
    metas: dict[int, WorkerMetadata]
    agents: dict[int, str]
    plan: ReadPlan
    local_lists: dict[int, DescList]
    remote_lists: dict[int, DescList]
    # one-byte "ack" READs carry the done notification to ranks this worker reads nothing
    # from: a READ is tracked to completion, a bare send_notif on a link that is not yet
    # wired up would wait for this worker's next progress call
    ack_lists: dict[int, DescList] = field(default_factory=dict)


class ConsumerSide:
    """Plans, posts and tracks READs; turns every failure into invalid block ids."""

    def __init__(self, shared: _Shared) -> None:
        self.s = shared
        self.remotes: dict[str, _Remote] = {}
        self.inflight: dict[str, ReadOp] = {}
        self.ready: list[ReadOp] = []
        # engines whose reads failed because the peer went away: re-handshake before reuse
        self.suspect: set[str] = set()
        # request id -> (engine, remote request id): heartbeats keep the producer's lease
        self.waiting: dict[str, tuple[str, str]] = {}
        self.next_heartbeat = 0.0
        # fault injection / tests: READs without the "done" notification
        self.send_notifications = True
        # ack READs in flight: (request id, engine, rank, xfer, deadline)
        self.acks: list[tuple[str, str, int, Xfer, float]] = []

    # ---- remote engines --------------------------------------------------------------
    def add_remote(self, metas: Mapping[int, WorkerMetadata]) -> ReadPlan:
        """Load a remote engine's ranks (from the handshake) and prepare the read plan."""
        s = self.s
        if s.metadata is None or s.topology is None:
            raise RegistrationError("register_kv_caches() must come before add_remote()")
        if not metas:
            raise ConfigError("add_remote needs the metadata of at least one remote rank")
        engine_ids = {m.engine_id for m in metas.values()}
        if len(engine_ids) != 1:
            raise ConfigError(f"add_remote got ranks of several engines: {sorted(engine_ids)}")
        engine = engine_ids.pop()
        for rank, m in metas.items():
            if m.tp_rank != rank:
                raise ConfigError(f"engine {engine!r}: metadata for rank {rank} says {m.tp_rank}")
            if m.agent_metadata_sha256 and m.agent_metadata_sha256 != sha256_hex(m.agent_metadata):
                raise HandshakeError(
                    f"engine {engine!r} rank {rank}: agent metadata checksum mismatch"
                )
        old = self.remotes.get(engine)
        if old is not None:
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
                return old.plan
            logger.warning("engine %r restarted (new NIXL agent): re-adding it", engine)
            self.remove_remote(engine, reason="restarted (new NIXL agent)")
        plan = build_read_plan(s.topology, s.metadata, metas)
        ack_lists: dict[int, DescList] = {}
        agents: dict[int, str] = {}
        local_lists: dict[int, DescList] = {}
        remote_lists: dict[int, DescList] = {}
        try:
            for rank in plan.notify_ranks:
                if rank in metas:
                    agents[rank] = s.backend.add_remote(metas[rank].agent_metadata)
            mem = MemType(s.metadata.mem_type)
            rmem = MemType(next(iter(metas.values())).mem_type)
            for src in plan.sources:
                local_lists[src.remote_rank] = s.backend.prep_local(src.local_rows, mem)
                remote_lists[src.remote_rank] = s.backend.prep_remote(
                    agents[src.remote_rank], src.remote_rows, rmem
                )
            for rank, agent in agents.items():
                r0 = metas[rank].regions[0]
                one = np.array([[r0.base_addr, 1, r0.device_id]], dtype=np.uint64)
                ack_lists[rank] = s.backend.prep_remote(agent, one, rmem)
        except Exception:
            for dl in (*local_lists.values(), *remote_lists.values(), *ack_lists.values()):
                dl.release()
            for a in agents.values():
                s.backend.remove_remote(a)
            raise
        self.remotes[engine] = _Remote(
            engine, dict(metas), agents, plan, local_lists, remote_lists, ack_lists
        )
        self.suspect.discard(engine)
        if s.metrics:
            s.metrics.set_connected_peers(len(self.remotes))
        return plan

    def remove_remote(self, engine_id: str, *, reason: str = "removed") -> None:
        """Forget an engine: fail its in-flight reads, release its lists and agents."""
        r = self.remotes.pop(engine_id, None)
        if r is None:
            return
        for op in list(self.inflight.values()):
            if op.engine_id == engine_id:
                self._fail(op, f"remote engine {engine_id!r} {reason}", "peer_lost")
        for _, engine, _, x, _ in self.acks:
            if engine == engine_id:
                x.release()
        self.acks = [a for a in self.acks if a[1] != engine_id]
        for dl in (*r.local_lists.values(), *r.remote_lists.values(), *r.ack_lists.values()):
            dl.release()
        for a in r.agents.values():
            self.s.backend.remove_remote(a)
        if self.s.metrics:
            self.s.metrics.set_connected_peers(len(self.remotes))

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
    ) -> None:
        """Post one READ per source rank; the result comes from `get_finished()`."""
        s = self.s
        self.waiting.pop(request_id, None)
        if request_id in self.inflight:
            raise TransferError(f"request {request_id!r} is already being read")
        remote = self.remotes.get(remote_engine_id)
        if remote is None:
            raise TransferError(
                f"request {request_id!r}: remote engine {remote_engine_id!r} not added "
                f"(known: {sorted(self.remotes)}); handshake first"
            )
        plan = remote.plan
        lsub, rids = plan.map_block_ids(local_block_ids, remote_block_ids)  # validates ranges
        now = s.clock()
        op = ReadOp(
            request_id=request_id,
            engine_id=remote_engine_id,
            local_block_ids=np.asarray(local_block_ids, dtype=np.int64).reshape(-1),
            remote_block_ids=rids,
            deadline=now + (deadline if deadline is not None else s.config.extra.read_deadline),
            started=now,
        )
        rid = remote_request_id or request_id
        msg = notify.encode(
            "done",
            rid,
            expected=plan.notify_expected,
            sender_engine=s.config.engine_id,
            sender_rank=s.tp_rank,
        )
        self.inflight[request_id] = op
        if self.send_notifications:
            op.release_on_failure = [
                (remote.agents[r], msg) for r in plan.notify_ranks if r in remote.agents
            ]
        if s.metrics:
            s.metrics.transfer_started(remote_engine=remote_engine_id)
        t0 = time.perf_counter()
        try:
            for src in plan.sources:
                lids, rids_p = src.descriptor_ids(lsub, rids)
                if len(lids) == 0:
                    continue
                x = s.backend.post(
                    "READ",
                    remote.local_lists[src.remote_rank],
                    lids,
                    remote.remote_lists[src.remote_rank],
                    rids_p,
                    msg if self.send_notifications else b"",
                )
                op.xfers.append((src.remote_rank, x))
                op.descriptors += len(lids)
                op.nbytes += plan.source_bytes(src, len(rids))
            read_ranks = {rank for rank, _ in op.xfers}
            if self.send_notifications and op.error is None:
                for r in plan.notify_ranks:
                    if r not in read_ranks and r in remote.ack_lists:
                        x = s.backend.post(
                            "READ", s.ack_local, _ACK_ID, remote.ack_lists[r], _ACK_ID, msg
                        )
                        self.acks.append((request_id, remote_engine_id, r, x, op.deadline))
        except TransferError as exc:
            self._fail(op, str(exc), "failed")
        op.post_seconds = time.perf_counter() - t0

    def keep_alive(
        self, request_id: str, remote_engine_id: str, remote_request_id: str | None = None
    ) -> None:
        """The request will be read later: heartbeat the producer so its lease holds."""
        self.waiting[request_id] = (remote_engine_id, remote_request_id or request_id)

    def forget(self, request_id: str) -> None:
        """Stop heartbeating a request that will not be read (aborted)."""
        self.waiting.pop(request_id, None)

    def _heartbeat(self) -> None:
        s = self.s
        now = s.clock()
        if not self.waiting or now < self.next_heartbeat:
            return
        self.next_heartbeat = now + s.config.extra.kv_lease_duration / 6
        for engine, rid in self.waiting.values():
            remote = self.remotes.get(engine)
            if remote is None:
                continue
            msg = notify.encode(
                "heartbeat",
                rid,
                expected=remote.plan.notify_expected,
                sender_engine=s.config.engine_id,
                sender_rank=s.tp_rank,
            )
            for agent in remote.agents.values():
                try:
                    s.backend.send_notif(agent, msg)
                except TransferError as exc:
                    logger.warning("heartbeat for %r to %s failed: %s", rid, agent, exc)

    def _fail(self, op: ReadOp, error: str, outcome: str) -> None:
        op.release()
        op.error = error
        op.outcome = outcome
        self.inflight.pop(op.request_id, None)
        self.ready.append(op)
        logger.warning("read of request %r failed (%s): %s", op.request_id, outcome, error)

    @property
    def pending_notifications(self) -> int:
        """Notifications still on their way to producer ranks (keep stepping until 0)."""
        return len(self.acks)

    def _poll_acks(self, now: float) -> None:
        keep = []
        for rid, engine, rank, x, deadline in self.acks:
            res = self.s.backend.poll(x)
            if res.state is XferState.PROC and now < deadline:
                keep.append((rid, engine, rank, x, deadline))
                continue
            x.release()
            if res.state is not XferState.DONE:
                why = res.error or "not delivered before the read deadline"
                logger.warning("done notification for %r to rank %d lost: %s", rid, rank, why)
                if self.s.metrics:
                    self.s.metrics.failed_notification(remote_engine=engine, reason="send_failed")
        self.acks = keep

    def poll(self) -> None:
        """Advance every in-flight read: done, failed or past its deadline."""
        now = self.s.clock()
        if self.acks:
            self._poll_acks(now)
        for op in list(self.inflight.values()):
            # a failed part does not end the read at once: parts still in flight are polled
            # until they end (or the deadline), so no bytes land after the request is reported
            for rank, x in op.xfers:
                if rank in op.done_ranks or rank in op.failed_ranks:
                    continue
                res = self.s.backend.poll(x)
                if res.state is XferState.DONE:
                    op.done_ranks.add(rank)
                elif res.state is XferState.ERR:
                    op.failed_ranks.add(rank)
                    if op.first_error is None:
                        op.first_error = f"READ from rank {rank} of {op.engine_id!r}: {res.error}"
            settled = len(op.done_ranks) + len(op.failed_ranks) == len(op.xfers)
            if op.first_error is not None and (settled or now >= op.deadline):
                outcome = "peer_lost" if "isconnect" in op.first_error else "failed"
                if outcome == "peer_lost":
                    self.suspect.add(op.engine_id)
                self._fail(op, op.first_error, outcome)
            elif settled:
                op.release()
                self.inflight.pop(op.request_id)
                self.ready.append(op)
            elif now >= op.deadline:
                self._fail(
                    op,
                    f"not done {now - op.started:.3f}s after posting (deadline); "
                    f"{len(op.done_ranks)}/{len(op.xfers)} source ranks finished",
                    "timeout",
                )

    def take_finished(self, out: FinishedOutput) -> None:
        s = self.s
        self.poll()
        self._heartbeat()
        ready, self.ready = self.ready, []
        for op in ready:
            elapsed = s.clock() - op.started
            if op.error is None:
                plan = self.remotes[op.engine_id].plan
                apply_permutes(s.regions, plan.permutes, op.local_block_ids)
                if s.stager is not None:
                    s.stager.stage_in(op.local_block_ids)
            else:
                if op.engine_id in self.remotes:  # agents of a removed engine are gone
                    self._notify(op, op.release_on_failure)
                out.invalid_block_ids[op.request_id] = {int(b) for b in op.local_block_ids}
                if s.config.kv_load_failure_policy == "fail":
                    out.failed.add(op.request_id)
            out.finished_recving.add(op.request_id)
            if s.metrics:
                s.metrics.transfer_finished(remote_engine=op.engine_id)
                s.metrics.observe_transfer(
                    remote_engine=op.engine_id,
                    outcome=op.outcome,
                    seconds=elapsed,
                    post_seconds=op.post_seconds,
                    nbytes=op.nbytes if op.error is None else 0,
                    descriptors=op.descriptors,
                )
                if op.error is not None:
                    s.metrics.invalid_blocks(remote_engine=op.engine_id, n=len(op.local_block_ids))
                s.metrics.request_finished(
                    outcome="success"
                    if op.error is None
                    else (
                        "failed" if s.config.kv_load_failure_policy == "fail" else "invalid_blocks"
                    )
                )

    def _notify(self, op: ReadOp, targets: list[tuple[str, bytes]]) -> None:
        for agent, msg in targets:
            try:
                self.s.backend.send_notif(agent, msg)
            except TransferError as exc:
                logger.warning("notification for %r to %s failed: %s", op.request_id, agent, exc)
                if self.s.metrics:
                    self.s.metrics.failed_notification(
                        remote_engine=op.engine_id, reason="send_failed"
                    )

    def close(self) -> None:
        for engine in list(self.remotes):
            self.remove_remote(engine, reason="closed")


class Worker:
    """One TP rank of one engine. Build with `Worker.create(config, ...)`."""

    def __init__(
        self,
        config: KVTransferConfig,
        backend: TransferBackend,
        *,
        tp_rank: int,
        tp_size: int,
        total_num_kv_heads: int,
        dp_index: int = 0,
        compat_hash: str = "",
        metrics: Any = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self._s = _Shared(
            config,
            backend,
            tp_rank=tp_rank,
            tp_size=tp_size,
            total_num_kv_heads=total_num_kv_heads,
            dp_index=dp_index,
            compat_hash=compat_hash,
            metrics=metrics,
            clock=clock,
        )
        self.producer = ProducerSide(self._s) if config.is_producer else None
        self.consumer = ConsumerSide(self._s) if config.is_consumer else None

    @classmethod
    def create(
        cls,
        config: KVTransferConfig,
        *,
        tp_rank: int,
        tp_size: int,
        total_num_kv_heads: int,
        agent_name: str | None = None,
        **kwargs: Any,
    ) -> Worker:
        """Build the worker with a real NIXL agent."""
        from kvrdma.nixl_backend import NixlBackend

        name = agent_name or f"{config.engine_id}-dp{kwargs.get('dp_index', 0)}-tp{tp_rank}"
        backend = NixlBackend(
            BackendConfig(
                name=name,
                backends=tuple(config.extra.backends),
                num_threads=config.extra.num_threads,
            )
        )
        return cls(
            config,
            backend,
            tp_rank=tp_rank,
            tp_size=tp_size,
            total_num_kv_heads=total_num_kv_heads,
            **kwargs,
        )

    # ---- registration ----------------------------------------------------------------
    def register_kv_caches(
        self,
        kv_caches: Mapping[str, KVInput],
        *,
        cache_layout: CacheLayout,
        block_size: int,
        mamba_layers: Collection[str] = (),
        host_staging: bool | None = None,
    ) -> WorkerMetadata:
        """Cut the caches into regions, register them with NIXL, and build the metadata.

        `host_staging` (default: `kv_buffer_device == "cpu"` with caches on a GPU) registers
        host copies of the regions instead and stages blocks through them.
        """
        s = self._s
        if s.layout is not None:
            raise RegistrationError("register_kv_caches() was already called for this worker")
        info = build_regions(
            kv_caches, cache_layout=cache_layout, block_size=block_size, mamba_layers=mamba_layers
        )
        if host_staging is None:
            host_staging = s.config.kv_buffer_device == "cpu" and info.device.type != "cpu"
        if host_staging:
            info = _host_mirror(info, s)
        mem = MemType.VRAM if info.device.type == "cuda" else MemType.DRAM
        s.registered = s.backend.register(region_table([r.meta for r in info.regions]), mem)
        ptr = s.scratch.data_ptr()
        s.scratch_reg = s.backend.register(
            np.array([[ptr, s.scratch.numel(), 0]], dtype=np.uint64), MemType.DRAM
        )
        s.ack_local = s.backend.prep_local(np.array([[ptr, 1, 0]], dtype=np.uint64), MemType.DRAM)
        s.layout = info
        s.topology = TransferTopology(
            tp_rank=s.tp_rank,
            tp_size=s.tp_size,
            block_size=block_size,
            engine_id=s.config.engine_id,
            is_mla=cache_layout == "mla",
            is_mamba=cache_layout == "mamba",
            total_num_kv_heads=s.total_num_kv_heads,
            is_blocks_first=cache_layout in ("blocks_first", "mamba"),
            is_cross_layer=cache_layout == "cross_layer",
        )
        s.metadata = worker_metadata(
            info,
            engine_id=s.config.engine_id,
            agent_name=s.backend.agent_name,
            agent_metadata=s.backend.metadata(),
            tp_rank=s.tp_rank,
            tp_size=s.tp_size,
            total_num_kv_heads=s.total_num_kv_heads,
            dp_index=s.dp_index,
            compat_hash=s.compat_hash,
        )
        if s.metrics:
            s.metrics.set_registered(nbytes=info.registered_bytes, regions=len(info.regions))
        return s.metadata

    @property
    def metadata(self) -> WorkerMetadata:
        if self._s.metadata is None:
            raise RegistrationError("register_kv_caches() has not been called")
        return self._s.metadata

    def publish(self, address: str | None = None, *, timeout: float = 5.0) -> None:
        """Hand this rank's metadata to the pod's sidecar (`kvrdma agent --publish`).

        `address` defaults to `$KVRDMA_PUBLISH_ADDRESS`, then `kvrdma.defaults.PUBLISH_ADDRESS`.
        """
        import os

        from kvrdma.defaults import PUBLISH_ADDRESS
        from kvrdma.handshake import SidecarPublisher

        target = address or os.environ.get("KVRDMA_PUBLISH_ADDRESS") or PUBLISH_ADDRESS
        pub = SidecarPublisher(target, timeout=timeout)
        try:
            pub.publish(self.metadata)
        finally:
            pub.close()

    @property
    def topology(self) -> TransferTopology:
        if self._s.topology is None:
            raise RegistrationError("register_kv_caches() has not been called")
        return self._s.topology

    @property
    def backend(self) -> TransferBackend:
        return self._s.backend

    @property
    def metrics(self) -> Any:
        """The `KvrdmaMetrics` this worker reports to (or None)."""
        return self._s.metrics

    # ---- roles -----------------------------------------------------------------------
    def _consumer(self) -> ConsumerSide:
        if self.consumer is None:
            raise ConfigError(f"kv_role {self._s.config.kv_role!r} cannot read (needs a consumer)")
        return self.consumer

    def _producer(self) -> ProducerSide:
        if self.producer is None:
            raise ConfigError(f"kv_role {self._s.config.kv_role!r} cannot serve (needs a producer)")
        return self.producer

    def add_remote(self, metas: Mapping[int, WorkerMetadata]) -> ReadPlan:
        return self._consumer().add_remote(metas)

    def remove_remote(self, engine_id: str) -> None:
        self._consumer().remove_remote(engine_id)

    def start_read(
        self,
        request_id: str,
        local_block_ids: npt.ArrayLike,
        remote_block_ids: npt.ArrayLike,
        remote_engine_id: str,
        **kwargs: Any,
    ) -> None:
        self._consumer().start_read(
            request_id, local_block_ids, remote_block_ids, remote_engine_id, **kwargs
        )

    def keep_alive(
        self, request_id: str, remote_engine_id: str, remote_request_id: str | None = None
    ) -> None:
        """Heartbeat the producer (every lease/6) until `start_read` or `forget`."""
        self._consumer().keep_alive(request_id, remote_engine_id, remote_request_id)

    def forget(self, request_id: str) -> None:
        self._consumer().forget(request_id)

    @property
    def suspect_engines(self) -> set[str]:
        """Engines whose peer vanished mid-read: re-handshake (and `add_remote`) before reuse."""
        return set(self.consumer.suspect) if self.consumer is not None else set()

    def hold(self, request_id: str, block_ids: Collection[int]) -> None:
        self._producer().hold(request_id, block_ids)

    def get_finished(self) -> FinishedOutput:
        """Drive progress (notifications, polling) and report what finished this step."""
        out = FinishedOutput()
        notifs = self._s.backend.get_notifs()
        if self.producer is not None:
            self.producer.on_notifs(notifs)
            out.finished_sending = self.producer.take_finished()
        if self.consumer is not None:
            self.consumer.take_finished(out)
        return out

    @property
    def pending_notifications(self) -> int:
        """D→P notifications not yet delivered: keep calling `get_finished()` until 0."""
        return self.consumer.pending_notifications if self.consumer is not None else 0

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
        s = self._s
        for h in (s.ack_local, s.scratch_reg, s.registered):
            if h is not None:
                h.release()
        s.ack_local = s.scratch_reg = s.registered = None
        s.backend.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _host_mirror(info: KVLayoutInfo, s: _Shared) -> KVLayoutInfo:
    """Replace device regions by host copies; the stager copies between them."""
    host_regions = []
    for r in info.regions:
        buf = torch.zeros(r.meta.num_blocks, r.meta.block_len, dtype=torch.uint8)
        meta = msgspec.structs.replace(r.meta, base_addr=buf.data_ptr(), device_id=0)
        host_regions.append(Region(name=f"{r.name}@host", data=buf, meta=meta))
    s.stager = HostStager([r.data for r in info.regions], [r.data for r in host_regions])
    return replace(info, regions=host_regions, device=torch.device("cpu"))
