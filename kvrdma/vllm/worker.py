"""The worker-side half of `KvrdmaConnector` (one per TP rank, in the worker process).

A thin adapter over `kvrdma.worker.Worker`: vLLM's caches are registered through
`kvrdma.vllm.layout`, producers hold finished requests' blocks under kvrdma's lease,
consumers handshake with the producer engine (`kvrdma.handshake`), pull with one-sided READs
and report failed reads as invalid blocks (one KV-cache group) or failed requests (several),
which vLLM's `kv_load_failure_policy` then recomputes or fails.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from kvrdma.config import KVTransferConfig
from kvrdma.connect import outcome_of
from kvrdma.descriptors import expand_block_ids, kernel_pairs
from kvrdma.errors import KvrdmaError
from kvrdma.handshake.auth import CurveKeys
from kvrdma.handshake.publisher import KeepPublished
from kvrdma.types import FailureReason, HandshakeOutcome, Outcome, TransferMode
from kvrdma.vllm.config import cache_layout_name, engine_compat_hash, parallel_ranks
from kvrdma.vllm.handshakes import HandshakeDone, HandshakeJobs, handshake_failure
from kvrdma.vllm.layerwise import LayerwisePush
from kvrdma.vllm.layout import mamba_layer_names, registration
from kvrdma.vllm.owed import NotificationsOwed, OwedReport
from kvrdma.vllm.params import (
    RELEASE_PREFIX,
    BlockGroups,
    KvrdmaConnectorMetadata,
    KvrdmaHandshakeMetadata,
    RecvSpec,
    RefusedLoad,
    every_block,
    pair_groups,
    release_of,
)
from kvrdma.vllm.pushed import PushedLoads
from kvrdma.vllm.scheduler import sidecar_mode
from kvrdma.vllm.stats import KvrdmaConnectorStats, kvrdma_metrics, serve_metrics

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvrdma.handshake import HandshakeClient
    from kvrdma.handshake.client import RefreshResult
    from kvrdma.vllm.params import RemoteEngine
    from kvrdma.worker import Worker

logger = logging.getLogger(__name__)


class KvrdmaWorkerSide:
    """Registration, reads, holds, heartbeats and per-step results for one TP rank."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        config: KVTransferConfig,
        *,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        ranks = parallel_ranks() if tp_rank is None or tp_size is None else (tp_rank, tp_size)
        self.tp_rank, self.tp_size = ranks
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.config = config
        self.order = cache_layout_name(vllm_config)
        self.use_mla = bool(vllm_config.model_config.use_mla)
        self.compat_hash = engine_compat_hash(vllm_config)
        self.num_groups = max(1, len(kv_cache_config.kv_cache_groups))
        self.worker: Worker | None = None
        self._client: HandshakeClient | None = None
        # loaded now so a bad key directory stops the engine at start, not at a handshake
        self._curve = CurveKeys.from_env()
        self._engines: dict[str, int] = {}  # engine id -> its blocks per local one, once added
        self._last_used: dict[str, float] = {}  # engine id -> its last read, heartbeat or add
        self._failed_now: dict[str, set[int]] = {}  # reads that failed before posting
        self._reasons: dict[str, FailureReason] = {}  # ... and why
        self._jobs: HandshakeJobs | None = None  # built at the first remote engine
        self._pending: dict[str, dict[str, RecvSpec]] = {}  # engine -> reads awaiting it
        self._invalid: set[int] = set()
        self._pushes = PushedLoads()  # pushed loads, till reported
        self._silent: set[str] = set()  # loads that are never reported (`RecvSpec.report`)
        self._started: dict[str, tuple[float, int]] = {}  # request -> (start, blocks)
        self._stats = KvrdmaConnectorStats()
        self._owed = OwedReport()
        self._layerwise = LayerwisePush(self._push_ids)
        self._push_rids: dict[str, str] = {}  # push id -> request id, while it runs
        self.blocks_ratio = 1  # kernel blocks per scheduler block, known at registration
        self.registry, self.metrics = kvrdma_metrics(config, self.tp_rank)
        self._metrics_server: Any = None
        self._published: KeepPublished | None = None  # sidecar mode: publishing to the agent

    # ---- startup ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        from kvrdma.worker import Worker

        mc = self.vllm_config.model_config
        reg = registration(
            kv_caches,
            order=self.order,
            use_mla=self.use_mla,
            total_num_kv_heads=mc.get_total_num_kv_heads(),
            logical_block_size=self.vllm_config.cache_config.block_size,
            mamba_layers=mamba_layer_names(self.kv_cache_config),
        )
        self.blocks_ratio = reg.physical_blocks_per_logical
        worker = Worker.create(
            self.config,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            total_num_kv_heads=reg.total_num_kv_heads,
            compat_hash=self.compat_hash,
            metrics=self.metrics,
        )
        try:
            worker.register_kv_caches(
                reg.caches,
                cache_layout="unified",
                block_size=reg.block_size,
                kv_cache_order=reg.kv_cache_order,
                mamba_layers=reg.mamba_layers,
                physical_blocks_per_logical=reg.physical_blocks_per_logical,
            )
            if sidecar_mode(self.config):
                self._published = KeepPublished(
                    lambda: worker.metadata, self.config.extra.publish_address
                )
        except BaseException:
            worker.close()
            raise
        self.worker = worker
        self._metrics_server = serve_metrics(self.registry, self.tp_rank)
        logger.info(
            "kvrdma registered %d regions (unified %s, %d Mamba layers) for engine %r rank %d/%d",
            len(worker.metadata.regions),
            self.order,
            len(reg.mamba_layers),
            self.config.engine_id,
            self.tp_rank,
            self.tp_size,
        )

    def handshake_metadata(self) -> KvrdmaHandshakeMetadata | None:
        """This rank's metadata for the scheduler: it serves it (unless the sidecar does) and
        names this rank's agent in the params of the requests it holds."""
        if self.worker is None:
            return None
        return KvrdmaHandshakeMetadata(msgspec.msgpack.encode(self.worker.metadata))

    def _w(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("KvrdmaConnector: register_kv_caches() has not been called")
        return self.worker

    # ---- per step --------------------------------------------------------------------
    def start_load_kv(self, meta: KvrdmaConnectorMetadata) -> None:
        """Start this step's reads and holds; never waits for a producer: a request whose
        engine is not connected yet waits for its handshake, which runs in the background."""
        w = self._w()
        self._collect_handshakes(w)
        for rid in meta.forget:
            if w.consumer is not None:
                self._forget(w, rid)
        for rid, ka in meta.keep_alive.items():
            # heartbeats reach the producer once its handshake is done
            if w.consumer is not None and self._connect_soon(w, ka.remote) is None:
                w.keep_alive(rid, ka.remote.engine_id, ka.remote_request_id)
                self._last_used[ka.remote.engine_id] = time.monotonic()
        self._push_rids.update(meta.push_rids)
        for rid in meta.abort_push:
            try:
                w.abort_push(rid)
            except KvrdmaError as exc:  # it ended meanwhile
                logger.info("request %r: push not aborted: %s", rid, exc)
        for rid, groups in meta.send.items():
            if self.config.extra.transfer_mode == "push":
                w.push(rid, self._push_ids(groups))  # into the decoders that expect it
            else:
                w.hold(rid, self._kernel_ids(every_block(groups)))
        for rid, no in meta.refused.items():
            self._fail_now(rid, no, FailureReason(Outcome.FAILED, no.remote_engine, no.reason))
            if no.release is not None:
                self._load(w, RELEASE_PREFIX + rid, no.release)
        for rid, spec in meta.recv.items():
            self._load(w, rid, spec)

    def _load(self, w: Worker, rid: str, spec: RecvSpec) -> None:
        """Start a load now, or once its producer engine is connected."""
        engine = spec.remote.engine_id
        if self._connected(w, engine):
            self._start_read(w, rid, spec)
            return
        problem = self._connect_soon(w, spec.remote)
        if problem is not None:
            self._fail_now(rid, spec, problem)
        else:
            self._pending.setdefault(engine, {})[rid] = spec

    def save_kv_layer(self, meta: KvrdmaConnectorMetadata, layer: str, kv: torch.Tensor) -> None:
        """A layer of this step's forward is launched: push it for requests ending prefill."""
        if meta.push_layers:
            self._layerwise.save(self._w(), meta.push_layers, layer, kv)

    def wait_for_save(self, meta: KvrdmaConnectorMetadata) -> None:
        """The forward is launched: push the rest of the requests that ended prefill."""
        if meta.push_layers:
            self._layerwise.finish(self._w(), meta.push_layers)

    def _push_ids(self, groups: BlockGroups) -> list[int]:
        """A pushed request's blocks: in token order (a decoder that does not name them
        pairs its own with them in order), or every group's for a hybrid model."""
        if len(groups) == 1:
            return self._kernel_ids([b for b in groups[0] if b])
        return self._kernel_ids(every_block(groups))

    def _start_read(self, w: Worker, rid: str, spec: RecvSpec) -> None:
        if not spec.report:
            self._silent.add(rid)
        try:
            ratio = 1 if spec.push else self._engines[spec.remote.engine_id]  # push: P's plan
            local, remote = pair_groups(spec, ratio)
            self._started[rid] = (time.perf_counter(), len(local))
            self._last_used[spec.remote.engine_id] = time.monotonic()
            if spec.push:
                extra = self.config.extra
                wait = extra.push_registration_timeout or extra.decoder_kv_blocks_ttl
                w.expect_push(
                    rid,
                    self._kernel_ids(local),
                    spec.remote.engine_id,
                    remote_request_id=spec.remote_request_id,
                    remote_block_ids=None if remote is None else self._kernel_ids(remote),
                    # a release keeps the engine stepping (owed): no longer than P would hold
                    deadline=wait if spec.report else min(wait, extra.kv_lease_duration),
                    release_only=not spec.report,
                    remote_agents=spec.remote_agents or None,
                )
                self._pushes.expect(rid)
                return
            assert remote is not None
            lk, rk = kernel_pairs(local, remote, self.blocks_ratio, ratio)
            w.start_read(
                rid,
                lk,
                rk,
                spec.remote.engine_id,
                remote_request_id=spec.remote_request_id,
                remote_expires_at=spec.remote_expires_at,
                release_only=not spec.report,
                remote_agents=spec.remote_agents or None,
            )
        except Exception as exc:  # any failure fails this load alone, as vLLM's connector does
            if not isinstance(exc, KvrdmaError):
                logger.exception("request %r: starting its load failed", rid)
            if w.will_report(rid):  # what was posted or asked for ends first: reported then
                if spec.push:
                    self._pushes.expect(rid)
                return
            self._started.pop(rid, None)
            why = f"read not started: {exc}"
            self._fail_now(rid, spec, FailureReason(Outcome.FAILED, spec.remote.engine_id, why))
            if spec.report:  # refused before any READ or Expect
                self._load(w, RELEASE_PREFIX + rid, release_of(spec))

    def _forget(self, w: Worker, rid: str) -> None:
        """An aborted request: no more heartbeats; a push into it is aborted, and reported
        received (vLLM frees the blocks) once no producer can write into them."""
        self._pushes.forget(rid, abandoned=w.forget(rid))

    def _fail_now(self, rid: str, spec: RecvSpec | RefusedLoad, reason: FailureReason) -> None:
        """Report a load that never ran as invalid blocks in the next `transfer_results`."""
        if self.worker is not None and self.worker.consumer is not None:
            self.worker.consumer.forget(rid)  # no heartbeats hold the producer's blocks
        logger.warning("request %r: %s", rid, reason.error)
        local, engine = every_block(spec.local_block_ids), reason.remote_engine
        self._failed_now[rid], self._reasons[rid] = set(local), reason
        if isinstance(spec, RecvSpec) and not spec.report:  # no request: its producer goes untold
            self._silent.add(rid)
            self.metrics.failed_notification(remote_engine=engine, reason="send_failed")
            return
        if isinstance(spec, RecvSpec):  # a load it tried: a refused one never was a transfer
            mode = TransferMode.PUSH if spec.push else TransferMode.PULL
            self.metrics.transfer_not_started(
                remote_engine=engine, mode=mode, outcome=reason.outcome
            )
        self.metrics.invalid_blocks(remote_engine=engine, n=len(local))
        policy = self.config.kv_load_failure_policy
        self.metrics.request_finished(outcome="failed" if policy == "fail" else "invalid_blocks")

    def _kernel_ids(self, ids: list[int]) -> list[int]:
        """Scheduler block ids as the kernel block ids the caches are indexed by."""
        if self.blocks_ratio == 1:
            return ids
        return [int(b) for b in expand_block_ids(ids, self.blocks_ratio)]

    def _connected(self, w: Worker, engine: str) -> bool:
        return engine in self._engines and engine not in w.suspect_engines

    def _connect_soon(self, w: Worker, remote: RemoteEngine) -> FailureReason | None:
        """Make sure `remote` is connected or a handshake with it is under way (again after
        its agent was lost); a mapping that can never work fails at once."""
        if self._connected(w, remote.engine_id):
            return None
        jobs = self._handshakes()
        if jobs.in_flight(remote.engine_id):
            return None
        self._drop_idle_engines(w)  # before another engine's agents and lists come in
        try:
            ranks = w.topology.handshake_target_ranks(remote.tp_size)
        except KvrdmaError as exc:
            self._observe_handshake(remote.engine_id, outcome_of(exc), 0.0)
            return handshake_failure(remote, exc)
        jobs.submit(remote, ranks)
        return None

    def _collect_handshakes(self, w: Worker) -> None:
        """Add the engines whose handshake finished and start (or fail) their reads."""
        if self._jobs is None:
            return
        for done in self._jobs.take_done():
            reason = self._add_engine(w, done)
            for rid, spec in self._pending.pop(done.remote.engine_id, {}).items():
                if reason is None:
                    self._start_read(w, rid, spec)
                else:
                    self._fail_now(rid, spec, reason)

    def _add_engine(self, w: Worker, done: HandshakeDone) -> FailureReason | None:
        engine = done.remote.engine_id
        error, ratio = done.error, 1
        if error is None and done.result is not None:
            try:
                ratio = w.add_remote(done.result.workers).block_ratio
            except KvrdmaError as exc:
                error = exc
        if error is not None:
            self._engines.pop(engine, None)
            if self._client is not None:  # no cached reply or clock offset of it is kept
                self._client.forget(engine)
            self._observe_handshake(engine, outcome_of(error), done.seconds)
            return handshake_failure(done.remote, error)
        offset = self._handshake_client().clock_offsets.get(engine)
        if offset is not None and w.consumer is not None:  # for its requests' lease ends
            w.consumer.clock_offsets[engine] = offset
        self._engines[engine] = ratio
        self._last_used[engine] = time.monotonic()
        self._observe_handshake(engine, HandshakeOutcome.SUCCESS, done.seconds)
        return None

    def _drop_idle_engines(self, w: Worker) -> None:
        """Remove the engines unused for `engine_ttl` seconds (0: never), as vLLM does: a
        decoder that meets many short-lived prefill engines would otherwise keep every one's
        agents, descriptor lists and handshake; one removed too early is handshaken again
        when needed. Engines awaiting a new handshake (suspect, or with a rank dropped) are
        left alone: closing connections to a stopped rank makes UCX abort it."""
        ttl = self.config.extra.engine_ttl
        if not ttl or w.consumer is None:
            return
        now = time.monotonic()
        busy = w.engines_in_use | w.suspect_engines | self._pending.keys()
        for engine, last in list(self._last_used.items()):
            if now - last > ttl and engine not in busy:
                del self._last_used[engine]
                self._engines.pop(engine, None)
                w.remove_remote(engine)
                w.consumer.clock_offsets.pop(engine, None)
                if self._client is not None:
                    self._client.forget(engine)
                self.metrics.forget_peer(engine)
                logger.info("engine %r unused %.0f s: removed (engine_ttl)", engine, now - last)

    def _observe_handshake(self, engine: str, outcome: str, seconds: float) -> None:
        self.metrics.handshake(remote_engine=engine, outcome=outcome, seconds=seconds)

    def _handshake_client(self) -> HandshakeClient:
        if self._client is None:
            from kvrdma.handshake import HandshakeClient

            w = self._w()
            extra = self.config.extra
            self._client = HandshakeClient(
                timeout=extra.handshake_timeout,
                retries=extra.handshake_retries,
                identity=w.metadata.agent_name,
                compat_hash=self.compat_hash,
                tp_size=self.tp_size,
                block_size=w.metadata.block_size,
                enforce_compat=extra.enforce_handshake_compat,
                curve=self._curve,
            )
        return self._client

    def _handshakes(self) -> HandshakeJobs:
        if self._jobs is None:
            client = self._handshake_client()

            def fetch(remote: RemoteEngine, ranks: list[int], timeout: float) -> RefreshResult:
                return client.refresh(
                    remote.host, remote.port, remote.engine_id, ranks, timeout=timeout
                )

            self._jobs = HandshakeJobs(fetch, timeout=self.config.extra.handshake_timeout)
        return self._jobs

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) for this step."""
        w = self._w()
        self._collect_handshakes(w)  # reads start as soon as their engine is connected
        out = w.get_finished()
        r = self.blocks_ratio  # kvrdma reports kernel block ids: back to scheduler ids
        invalid = {rid: {b // r for b in ids} for rid, ids in out.invalid_block_ids.items()}
        recving = set(out.finished_recving)
        ended = self._pushes.take(out, invalid, recving)  # failed or aborted pushes: held back
        self._failed_now.update(ended.failed)
        self._reasons.update(ended.reasons)
        recving |= ended.aborted.keys()
        self._pushes.reported(recving | set(self._failed_now))
        invalid.update(self._failed_now)
        recving |= set(self._failed_now)
        self._failed_now = {}
        if self._silent:  # loads vLLM does not wait for: the producer was told, that is all
            quiet, self._silent = recving & self._silent, self._silent - recving
            recving -= quiet
            for rid in quiet:
                self._started.pop(rid, None)
        reasons = {**out.failures, **self._reasons}
        self._reasons = {}
        for rid, reason in reasons.items():
            logger.info("request %r: KV load failed (%s): %s", rid, reason.outcome, reason.error)
        failed: set[str] = set()
        for rid in recving:
            start, nblocks = self._started.pop(rid, (None, 0))
            if rid in ended.aborted:  # no transfer, unless it failed before vLLM aborted it
                if (blocks := ended.aborted[rid]) is not None:
                    self._stats.record_failure(len(blocks))
                continue
            bad = invalid.get(rid)
            if bad is None:
                self._stats.record_success(nblocks, time.perf_counter() - (start or 0.0))
                continue
            self._stats.record_failure(len(bad))
            if self.num_groups > 1:
                failed.add(rid)  # block ids are unique per group only: fail the request
            else:
                self._invalid |= bad
        sent = {self._push_rids.pop(k, k) for k in out.finished_sending}
        return sent, recving, failed

    def notifications_owed(self) -> NotificationsOwed | None:
        """This step's report of done notifications still on their way (`kvrdma.vllm.owed`)."""
        if self.worker is None:
            return self._owed.meta(0)
        # loads that only tell a producer to let go, not yet started or reported
        waiting = sum(not sp.report for q in self._pending.values() for sp in q.values())
        telling = len(self._silent) + waiting
        return self._owed.meta(self.worker.pending_notifications + telling)

    def take_invalid_block_ids(self) -> set[int]:
        bad, self._invalid = self._invalid, set()
        return bad

    def take_stats(self) -> KvrdmaConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KvrdmaConnectorStats()
        return stats

    def shutdown(self) -> None:
        if self._published is not None:
            self._published.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None
        if self._jobs is not None:
            self._jobs.close()  # queued ones are dropped; running ones end with the client
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._jobs is not None:
            self._jobs.join()
            self._jobs = None
        if self.worker is not None:
            self.worker.close()
            self.worker = None
