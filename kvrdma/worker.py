"""The facade a serving engine's worker uses: register, publish, connect, read, get_finished.

Roles are separate classes — `ProducerSide` (holds blocks until readers are done) and
`ConsumerSide` (plans and posts READs, reports finished or invalid blocks) — composed by
`Worker` from the config's `kv_role`. Call it from one thread (the engine's step loop); its
calls and the thread posting large reads take turns on the worker's lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from typing import Any

import numpy.typing as npt

from kvrdma.config import KVTransferConfig
from kvrdma.connect import Connector
from kvrdma.consumer import ConsumerSide
from kvrdma.descriptors import ReadPlan
from kvrdma.errors import ConfigError, RegistrationError
from kvrdma.handshake.publisher import PUBLISH_TTL_SECONDS, publish_to_sidecar
from kvrdma.handshake.wire import worker_problems
from kvrdma.layout import KVInput
from kvrdma.metadata import CacheLayout, WorkerMetadata
from kvrdma.nixl.protocol import BackendConfig, TransferBackend
from kvrdma.nixl.transport import describe as describe_transport
from kvrdma.producer import ProducerSide
from kvrdma.push import wire
from kvrdma.push.receiver import Receiver
from kvrdma.registration import register
from kvrdma.remote import NamedAgents
from kvrdma.state import WorkerState, locked
from kvrdma.topology import TransferTopology
from kvrdma.transfer import Clock
from kvrdma.types import FinishedOutput, empty_output

logger = logging.getLogger(__name__)

# While a worker only has reads to watch, `get_finished` checks them and does nothing else
# until one ends or something is due; notifications (none expected: producers never send to
# readers) are still fetched this often, to drain what an odd peer sends.
NOTIFS_EVERY = 0.05


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
        reader: TransferBackend | None = None,
    ) -> None:
        """`reader` (kv_both only): a second agent for this worker's own reads, so retiring
        it after a read deadline never disturbs peers reading from `backend`."""
        if reader is not None and not (config.is_consumer and config.is_producer):
            raise ConfigError(
                f"reader: a separate reading agent is for kv_role 'kv_both', not {config.kv_role!r}"
            )
        self._s = WorkerState(
            config,
            backend,
            reader=reader,
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
        self.pushes = Receiver(self.consumer) if self.consumer is not None else None
        if metrics is not None:
            t = describe_transport()
            metrics.set_transport(kind=t.kind, ucx_tls=t.tls, ucx_net_devices=t.devices)
        self._next_notifs = 0.0  # clock time; see NOTIFS_EVERY
        self._connector: Connector | None = None  # built at the first connect()

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
        from kvrdma.nixl import NixlBackend

        name = agent_name or f"{config.engine_id}-dp{kwargs.get('dp_index', 0)}-tp{tp_rank}"

        def agent(name: str) -> NixlBackend:  # no NIXL telemetry: kvrdma times its requests
            extra = config.extra
            nt, backends = extra.num_threads, tuple(extra.backends)
            return NixlBackend(BackendConfig(name, backends, nt, capture_telemetry=False))

        backend = agent(name)
        if config.is_producer and config.is_consumer:
            try:
                kwargs["reader"] = agent(f"{name}-reader")
            except BaseException:
                backend.close()
                raise
        return cls(
            config,
            backend,
            tp_rank=tp_rank,
            tp_size=tp_size,
            total_num_kv_heads=total_num_kv_heads,
            **kwargs,
        )

    # ---- registration ----------------------------------------------------------------
    @locked
    def register_kv_caches(
        self,
        kv_caches: Mapping[str, KVInput],
        *,
        cache_layout: CacheLayout,
        block_size: int,
        mamba_layers: Collection[str] = (),
        host_staging: bool | None = None,
        kv_cache_order: str | None = None,
        physical_blocks_per_logical: int = 1,
    ) -> WorkerMetadata:
        """Cut the caches into regions, register them with NIXL, and build the metadata.

        `cache_layout="unified"` takes vLLM's per-layer `[num_blocks, heads, block_size,
        content]` views; `kv_cache_order` names their physical order (`LBHNC` by default, or
        `LBNHC`, `LHBNC`, `BLHNC`, `BLNHC`, `BHLNC`; `HND`/`NHD` alias the first two). MLA
        is heads = 1 with `total_num_kv_heads=1`; Mamba layers go in `mamba_layers`.
        When the kernel block is smaller than the scheduler's block (`dim 0 = num_blocks * r`),
        pass `block_size` = the kernel block, `physical_blocks_per_logical=r` (peers must
        agree), and kernel block ids (`kvrdma.descriptors.expand_block_ids(ids, r)`) to reads.

        `host_staging` (default: `kv_buffer_device == "cpu"` with caches on a GPU) registers
        host copies of the regions instead and stages blocks through them.

        Host (DRAM) regions get transparent huge pages per `kv_connector_extra_config.
        hugepages` (see `kvrdma.hugepages`): with "advise" only memory first written after
        this call (e.g. the host-staging copies) is backed by huge pages, with "collapse"
        memory already written is merged now too. GPU memory is never touched.
        """
        return register(
            self._s,
            kv_caches,
            cache_layout=cache_layout,
            block_size=block_size,
            mamba_layers=mamba_layers,
            host_staging=host_staging,
            kv_cache_order=kv_cache_order,
            physical_blocks_per_logical=physical_blocks_per_logical,
        )

    @property
    def metadata(self) -> WorkerMetadata:
        if self._s.metadata is None:
            raise RegistrationError("register_kv_caches() has not been called")
        return self._s.metadata

    def publish(
        self,
        address: str | None = None,
        *,
        timeout: float = 5.0,
        ttl: float | None = PUBLISH_TTL_SECONDS,
    ) -> None:
        """Hand this rank's metadata to the pod's sidecar (`kvrdma agent --publish`).

        `address` defaults to `$KVRDMA_PUBLISH_ADDRESS`, then `kvrdma.defaults.PUBLISH_ADDRESS`;
        with `$KVRDMA_CURVE_DIR` set the connection is CURVE-authenticated and encrypted.
        The sidecar serves it for `ttl` seconds (30 by default) unless it is published again,
        so a worker killed without unpublishing stops being served: publish again every
        `REPUBLISH_SECONDS` while the rank lives (`kvrdma.handshake.publisher.KeepPublished`
        does), or pass `ttl=None` to be served until unpublished.
        """
        publish_to_sidecar(self.metadata, address, timeout=timeout, ttl=ttl)

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

    def connect(
        self,
        engine_id: str,
        host: str,
        port: int,
        *,
        remote_tp_size: int | None = None,
        dp_index: int = 0,
        refresh: bool = False,
        timeout: float | None = None,
    ) -> ReadPlan:
        """Make `engine_id`, served by the handshake agent at `host:port`, readable; returns
        its read plan. Handshakes only the remote ranks this rank reads from (the remote TP
        size comes from `remote_tp_size`, or from the engine's rank 0), then `add_remote`.

        An engine already added is returned at once, unless `refresh` or it is in
        `suspect_engines`: then it is fetched again, waiting for a restarted engine to
        publish its new agent when the old one was lost (also while none of its ranks is
        published). `timeout` (default: the config's
        `handshake_timeout`) bounds the whole call; each fetch makes up to
        `1 + handshake_retries` attempts.
        Raises `HandshakeError` (`HandshakeTimeout`) or `ConfigError` (an impossible
        mapping, or an engine id added from another `dp_index`); every call is counted in
        `kvrdma_handshakes_total`."""
        if self._connector is None:
            s = self._s
            self._connector = Connector(
                s.config,
                self._consumer(),
                self.topology,
                identity=self.metadata.agent_name,
                compat_hash=s.compat_hash,
                tp_size=s.tp_size,
                metrics=s.metrics,
                clock=s.clock,
            )
        return self._connector.connect(
            engine_id,
            host,
            port,
            remote_tp_size=remote_tp_size,
            dp_index=dp_index,
            refresh=refresh,
            timeout=timeout,
        )

    @locked
    def add_remote(self, metas: Mapping[int, WorkerMetadata]) -> ReadPlan:
        """Add a remote engine from metadata fetched by the caller (see `connect`)."""
        for rank, meta in metas.items():
            if problems := worker_problems(meta):
                raise ConfigError(f"remote rank {rank} metadata: {'; '.join(problems)}")
        return self._consumer().add_remote(metas)

    @locked
    def remove_remote(self, engine_id: str) -> None:
        """Forget an engine: its reads and pushes under way fail (see `Receiver.drop_engine`)."""
        if self.pushes is not None:
            self.pushes.drop_engine(engine_id, "removed")
        self._consumer().remove_remote(engine_id)

    @property
    def engines_in_use(self) -> set[str]:
        """Engines `remove_remote` would cut off now: reads or heartbeats still under way."""
        if self.consumer is None or self.pushes is None:
            return set()
        return self.consumer.engines_in_use() | self.pushes.engines_in_use()

    @locked
    def start_read(
        self,
        request_id: str,
        local_block_ids: npt.ArrayLike,
        remote_block_ids: npt.ArrayLike,
        remote_engine_id: str,
        **kwargs: Any,
    ) -> None:
        """Read a held request's blocks (keywords: `ConsumerSide.start_read`)."""
        self._consumer().start_read(
            request_id, local_block_ids, remote_block_ids, remote_engine_id, **kwargs
        )

    def keep_alive(
        self, request_id: str, remote_engine_id: str, remote_request_id: str | None = None
    ) -> None:
        """Heartbeat the producer (a sixth of its or our lease, the shorter) till `start_read`."""
        self._consumer().keep_alive(request_id, remote_engine_id, remote_request_id)

    @locked
    def forget(self, request_id: str) -> bool:
        """Stop heartbeating a request that will not be read. True: it was an expected push,
        now aborted (it is in `quarantined` until `released`, never in `finished_recving`);
        False for one that ended already: reported as any other (or `released` when failed)."""
        abandoned = self.pushes is not None and self.pushes.abandon(request_id)
        if not abandoned:
            self._consumer().forget(request_id)
        return abandoned

    def will_report(self, request_id: str) -> bool:
        """Whether `get_finished` reports `request_id` later: READs of it were posted, or its
        push is expected."""
        c, r = self.consumer, self.pushes
        return (c is not None and request_id in c.inflight) or (
            r is not None and request_id in r.waits
        )

    @property
    def suspect_engines(self) -> set[str]:
        """Engines to `connect` again before reading from them: a peer vanished mid-read, or a
        retirement dropped a rank it could not reach."""
        c = self.consumer
        return c.suspect | c.dropped if c is not None else set()

    # ---- push mode --------------------------------------------------------------------
    @locked
    def expect_push(
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
        """Have `remote_engine_id` (connected) WRITE `remote_request_id` (default
        `request_id`) into these local blocks, reported like a read: `remote_block_ids` of
        its blocks (default: its last ones in order, as many as fill these); `deadline`
        (default: the lease) counts from now; `release_only`: no blocks, only telling the
        producer to let go, counted as no request; `remote_agents`: as for `start_read`. A
        failed push is also in `FinishedOutput.quarantined`: reuse its blocks only once
        `released`."""
        if self.pushes is None:
            raise ConfigError(f"kv_role {self._s.config.kv_role!r} cannot receive pushes")
        self.pushes.expect(
            request_id, local_block_ids, remote_engine_id, remote_request_id=remote_request_id,
            remote_block_ids=remote_block_ids, deadline=deadline, release_only=release_only,
            remote_agents=remote_agents,
        )  # fmt: skip

    def layer_loaded(self, request_id: str, layer: str) -> bool:
        """Whether `layer` of a pushed request has landed (True once it is reported)."""
        return self.pushes is None or self.pushes.layer_loaded(request_id, layer)

    @locked
    def push(self, request_id: str, block_ids: Collection[int], *, layerwise: bool = False) -> None:
        """WRITE the request's blocks into every decoder rank that expects it (now or when it
        says so): whole, or with `layerwise` each layer `push_layer` marks final and the rest
        at `end_push`. Held until every decoder has it or gave up, or the lease ends."""
        self._producer().push(request_id, block_ids, layerwise=layerwise)

    @locked
    def push_layer(self, request_id: str, layer: str) -> None:
        """Layer-wise push: `layer`'s KV of the request is final, write it now."""
        self._producer().pusher.layer_ready(request_id, layer)

    @locked
    def end_push(self, request_id: str) -> None:
        """Layer-wise push: prefill is done, write what is left."""
        self._producer().pusher.end(request_id)

    @locked
    def abort_push(self, request_id: str) -> None:
        """Stop pushing (WRITEs cancelled, decoders told); blocks in `finished_sending`."""
        self._producer().pusher.abort(request_id)

    @locked
    def hold(self, request_id: str, block_ids: Collection[int]) -> float:
        """Keep the request's blocks for readers; returns when its lease ends, in this
        worker's clock: pass it to the readers' `start_read(remote_expires_at=...)`, with
        `remote_agents={tp_rank: metadata.agent_metadata_sha256}` of the holding ranks so a
        read after this process restarted fails instead of reading its successor's blocks."""
        return self._producer().hold(request_id, block_ids)

    def lease_expiry(self, request_id: str) -> float | None:
        """When the request's lease ends now (heartbeats renew it), in this worker's clock;
        None when its blocks are not held."""
        return self.producer.ledger.expiry(request_id) if self.producer is not None else None

    @locked
    def get_finished(self) -> FinishedOutput:
        """Drive progress (notifications, polling) and report what finished this step.
        While the worker only has reads to watch, a call checks them (one NIXL state check
        per part) and fetches notifications at most every `NOTIFS_EVERY`."""
        s, c, p = self._s, self.consumer, self.producer
        notifs_due = True
        only_reads = c is not None and c.inflight and (p is None or p.idle)
        if c is not None and only_reads and not (self.pushes and self.pushes.busy):
            # only reads to watch: notifications (none expected) at most every
            # NOTIFS_EVERY, and nothing else while every read is still running
            now = s.clock()
            notifs_due = now >= self._next_notifs
            if not notifs_due and c.reads_still_running(now):
                return empty_output()
            if notifs_due:
                self._next_notifs = now + NOTIFS_EVERY
        out = empty_output()
        if notifs_due:
            notifs = s.backend.get_notifs()
            if s.reader is not s.backend:
                for agent, msgs in s.reader.get_notifs().items():  # progress; none expected
                    logger.debug("reading agent got %d notifications from %r", len(msgs), agent)
            if notifs:
                notifs = self._route_push(notifs)
            if p is not None:
                p.on_notifs(notifs)
        if p is not None:
            out.finished_sending = p.take_finished()
        if c is not None:
            if self.pushes is not None and self.pushes.busy:  # else nothing to poll or say
                self.pushes.take_finished(out)
            c.take_finished(out)
        return out

    def _route_push(self, notifs: dict[str, list[bytes]]) -> dict[str, list[bytes]]:
        """Hand push messages to their side; the rest are pull notifications."""
        p, r = self.producer, self.pushes
        rest, stray = wire.route(
            notifs, p.on_push if p is not None else None, r.on_message if r is not None else None
        )
        for agent in stray:  # counted like pull's malformed notifications
            logger.warning("push message from %s not for this worker", agent)
            if metrics := self._s.metrics:
                metrics.failed_notification(remote_engine="unknown", reason="malformed")
        return rest

    @property
    def pending_notifications(self) -> int:
        """D→P notifications not yet delivered: keep calling `get_finished()` until 0."""
        return self.consumer.pending_notifications if self.consumer is not None else 0

    @property
    def has_work(self) -> bool:
        """Anything that needs `get_finished()` soon: blocks held for readers, reads in
        flight or waiting to be reported, notifications on their way, heartbeats owed.
        An idle worker (False) needs no polling until the next `hold`/`start_read`."""
        p, c = self.producer, self.consumer
        if p is not None and not p.idle:
            return True
        if self.pushes is not None and self.pushes.busy:
            return True
        return c is not None and bool(c.inflight or c.ready or c.acks or c.waiting)

    @locked
    def close(self) -> None:
        if self._connector is not None:
            self._connector.close()
            self._connector = None
        pusher = self.producer.pusher if self.producer is not None else None
        for side in (pusher, self.pushes, self.consumer):
            if side is not None:
                side.close()
        s = self._s
        for h in (s.ack_local, s.scratch_reg, s.reader_registered, s.checksums_reg, s.registered):
            if h is not None:
                h.release()
        s.ack_local = s.scratch_reg = s.reader_registered = s.checksums_reg = s.registered = None
        if s.reader is not s.backend:
            s.reader.close()
        s.backend.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
