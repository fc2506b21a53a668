"""The worker-side half of `KvrdmaConnector` (one per TP rank, in the worker process).

A thin adapter over `kvrdma.worker.Worker`: vLLM's caches are registered through
`kvrdma.vllm.layout`, producers hold finished requests' blocks under kvrdma's lease,
consumers handshake with the producer engine (`kvrdma.handshake`), pull with one-sided READs
and report failed reads as invalid blocks (one KV-cache group) or failed requests (several),
which vLLM's `kv_load_failure_policy` then recomputes or fails.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from kvrdma.config import KVTransferConfig
from kvrdma.errors import KvrdmaError
from kvrdma.vllm.config import cache_layout_name, engine_compat_hash
from kvrdma.vllm.layout import mamba_layer_names, registration
from kvrdma.vllm.params import KvrdmaConnectorMetadata, KvrdmaHandshakeMetadata, RecvSpec
from kvrdma.vllm.scheduler import sidecar_mode
from kvrdma.vllm.stats import KvrdmaConnectorStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvrdma.handshake import HandshakeClient
    from kvrdma.vllm.params import RemoteEngine
    from kvrdma.worker import Worker

logger = logging.getLogger(__name__)

# serve this rank's kvrdma_* series at http://0.0.0.0:(port + TP rank)/metrics (0: any port)
METRICS_PORT_ENV = "KVRDMA_METRICS_PORT"


def _parallel_ranks() -> tuple[int, int]:
    """(TP rank, TP size) from vLLM's process groups; (0, 1) when none were set up."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


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
        ranks = _parallel_ranks() if tp_rank is None or tp_size is None else (tp_rank, tp_size)
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
        self._engines: dict[str, int] = {}  # engine id -> its TP size, once added
        self._failed_now: dict[str, set[int]] = {}  # reads that failed before posting
        self._invalid: set[int] = set()
        self._started: dict[str, tuple[float, int]] = {}  # request -> (start, blocks)
        self._stats = KvrdmaConnectorStats()
        self.blocks_ratio = 1  # kernel blocks per scheduler block, known at registration
        self.registry, self.metrics = _kvrdma_metrics(config, self.tp_rank)
        self._metrics_server: Any = None

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
                worker.publish(self.config.extra.other.get("publish_address"))
        except BaseException:
            worker.close()
            raise
        self.worker = worker
        self._serve_metrics()
        logger.info(
            "kvrdma registered %d regions (unified %s, %d Mamba layers) for engine %r rank %d/%d",
            len(worker.metadata.regions),
            self.order,
            len(reg.mamba_layers),
            self.config.engine_id,
            self.tp_rank,
            self.tp_size,
        )

    def _serve_metrics(self) -> None:
        port = os.environ.get(METRICS_PORT_ENV)
        if not port:
            return
        from kvrdma.telemetry import start_http_server

        base = int(port)
        self._metrics_server, bound = start_http_server(
            self.registry, "0.0.0.0", base + self.tp_rank if base else 0
        )
        logger.info("kvrdma metrics of rank %d on port %d", self.tp_rank, bound)

    def handshake_metadata(self) -> KvrdmaHandshakeMetadata | None:
        if self.worker is None or sidecar_mode(self.config):
            return None
        return KvrdmaHandshakeMetadata(msgspec.msgpack.encode(self.worker.metadata))

    def _w(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("KvrdmaConnector: register_kv_caches() has not been called")
        return self.worker

    # ---- per step --------------------------------------------------------------------
    def start_load_kv(self, meta: KvrdmaConnectorMetadata) -> None:
        w = self._w()
        for rid in meta.forget:
            if w.consumer is not None:
                w.forget(rid)
        for rid, ka in meta.keep_alive.items():
            if w.consumer is not None and self._ensure_remote(ka.remote) is None:
                w.keep_alive(rid, ka.remote.engine_id, ka.remote_request_id)
        for rid, groups in meta.send.items():
            w.hold(rid, self._kernel_ids(sorted({b for g in groups for b in g if b})))
        for rid, spec in meta.recv.items():
            self._start_read(w, rid, spec)

    def _start_read(self, w: Worker, rid: str, spec: RecvSpec) -> None:
        local, remote = _pair_groups(spec)
        problem = self._ensure_remote(spec.remote)
        if problem is not None:
            logger.warning("request %r: %s", rid, problem)
            self._failed_now[rid] = set(local)
            return
        self._started[rid] = (time.perf_counter(), len(local))
        try:
            w.start_read(
                rid,
                self._kernel_ids(local),
                self._kernel_ids(remote),
                spec.remote.engine_id,
                remote_request_id=spec.remote_request_id,
                remote_expires_at=spec.remote_expires_at,
            )
        except KvrdmaError as exc:
            logger.warning("request %r: read not started: %s", rid, exc)
            self._failed_now[rid] = set(local)

    def _kernel_ids(self, ids: list[int]) -> list[int]:
        """Scheduler block ids as the kernel block ids the caches are indexed by."""
        if self.blocks_ratio == 1:
            return ids
        from kvrdma.descriptors import expand_block_ids

        return [int(b) for b in expand_block_ids(ids, self.blocks_ratio)]

    def _ensure_remote(self, remote: RemoteEngine) -> str | None:
        """Handshake with a producer engine once (again after its agent was lost)."""
        w = self._w()
        if remote.engine_id in self._engines and remote.engine_id not in w.suspect_engines:
            return None
        t0 = time.perf_counter()
        try:
            ranks = w.topology.handshake_target_ranks(remote.tp_size)
            metas = self._handshake_client().refresh(
                remote.host, remote.port, remote.engine_id, ranks
            )
            w.add_remote(metas.workers)
            offset = self._handshake_client().clock_offsets.get(remote.engine_id)
            if offset is not None and w.consumer is not None:  # for its requests' lease ends
                w.consumer.clock_offsets[remote.engine_id] = offset
        except KvrdmaError as exc:
            self._engines.pop(remote.engine_id, None)
            self._observe_handshake(remote.engine_id, _handshake_outcome(exc), t0)
            where = f"{remote.host}:{remote.port}"
            return f"handshake with engine {remote.engine_id!r} at {where} failed: {exc}"
        self._engines[remote.engine_id] = remote.tp_size
        self._observe_handshake(remote.engine_id, "success", t0)
        return None

    def _observe_handshake(self, engine: str, outcome: str, t0: float) -> None:
        seconds = time.perf_counter() - t0
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
            )
        return self._client

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) for this step."""
        out = self._w().get_finished()
        recving = set(out.finished_recving)
        r = self.blocks_ratio  # kvrdma reports kernel block ids: back to scheduler ids
        invalid = {rid: {b // r for b in ids} for rid, ids in out.invalid_block_ids.items()}
        invalid.update(self._failed_now)
        recving |= set(self._failed_now)
        self._failed_now = {}
        failed: set[str] = set()
        for rid in recving:
            start, nblocks = self._started.pop(rid, (None, 0))
            bad = invalid.get(rid)
            if bad is None:
                self._stats.record_success(nblocks, time.perf_counter() - (start or 0.0))
                continue
            self._stats.record_failure(len(bad))
            if self.num_groups > 1:
                failed.add(rid)  # block ids are unique per group only: fail the request
            else:
                self._invalid |= bad
        return set(out.finished_sending), recving, failed

    def take_invalid_block_ids(self) -> set[int]:
        bad, self._invalid = self._invalid, set()
        return bad

    def take_stats(self) -> KvrdmaConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KvrdmaConnectorStats()
        return stats

    def shutdown(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def _handshake_outcome(exc: KvrdmaError) -> str:
    """The `kvrdma_handshakes_total` outcome of a failed handshake."""
    from kvrdma.errors import ConfigError, HandshakeTimeout

    if isinstance(exc, HandshakeTimeout):
        return "timeout"
    if isinstance(exc, ConfigError) or "compat" in str(exc):
        return "incompatible"
    return "refused" if "refus" in str(exc) else "error"


def _kvrdma_metrics(config: KVTransferConfig, tp_rank: int) -> tuple[Any, Any]:
    """kvrdma's own `kvrdma_*` series for this rank, in a registry of their own."""
    from prometheus_client import CollectorRegistry

    from kvrdma.telemetry import KvrdmaMetrics

    role = {"kv_producer": "producer", "kv_consumer": "consumer"}.get(config.kv_role, "both")
    registry = CollectorRegistry()
    metrics = KvrdmaMetrics(
        registry=registry, engine_id=config.engine_id, role=role, tp_rank=tp_rank
    )
    return registry, metrics


def _pair_groups(spec: RecvSpec) -> tuple[list[int], list[int]]:
    """Flat (local, remote) block ids over the groups (vLLM's groups overlay one buffer, so a
    block id names the same page in every group); a local prefix-cache hit covers a group's
    first blocks, so it reads only P's last `len(local)` blocks; the null block (id 0,
    padding) is never read into."""
    local: list[int] = []
    remote: list[int] = []
    for i, lg in enumerate(spec.local_block_ids):
        rg = spec.remote_block_ids[i] if i < len(spec.remote_block_ids) else ()
        n = min(len(lg), len(rg))
        for lb, rb in zip(lg[len(lg) - n :], rg[len(rg) - n :], strict=True):
            if lb and rb:
                local.append(lb)
                remote.append(rb)
    return local, remote
