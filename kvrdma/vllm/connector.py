"""`KvrdmaConnector`: vLLM's `KVConnectorBase_V1` over kvrdma, loaded with
``{"kv_connector": "KvrdmaConnector", "kv_connector_module_path": "kvrdma.vllm", ...}``.

The class only dispatches: the scheduler role runs `KvrdmaScheduler`, the worker role
`KvrdmaWorkerSide`; each is built lazily by role, so the engine core never imports NIXL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvrdma.vllm.config import kvrdma_config
from kvrdma.vllm.owed import NotificationsOwed
from kvrdma.vllm.params import KvrdmaConnectorMetadata
from kvrdma.vllm.scheduler import KvrdmaScheduler
from kvrdma.vllm.stats import KvrdmaConnectorStats, KvrdmaPromMetrics

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvrdma.vllm.worker import KvrdmaWorkerSide


class KvrdmaConnector(KVConnectorBase_V1, SupportsHMA):
    """P/D KV transfer through kvrdma (one-sided NIXL READs, or WRITEs in push mode; leases,
    invalid blocks), with vLLM's `kv_transfer_params` and side-channel conventions."""

    # vLLM splits cached prompt tokens by source; ours come from a peer engine, as NixlConnector's
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = kvrdma_config(vllm_config)
        self._sched: KvrdmaScheduler | None = None
        self._worker: KvrdmaWorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = KvrdmaScheduler(vllm_config, kv_cache_config, config)
        else:
            from kvrdma.vllm.worker import KvrdmaWorkerSide

            self._worker = KvrdmaWorkerSide(vllm_config, kv_cache_config, config)

    @property
    def scheduler_side(self) -> KvrdmaScheduler:
        if self._sched is None:
            raise RuntimeError("KvrdmaConnector: a scheduler method was called on a worker")
        return self._sched

    @property
    def worker_side(self) -> KvrdmaWorkerSide:
        if self._worker is None:
            raise RuntimeError("KvrdmaConnector: a worker method was called on the scheduler")
        return self._worker

    # ---- class hooks -----------------------------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None if vllm_config.model_config.use_mla else "LBHNC"

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KvrdmaConnectorStats | None:
        return KvrdmaConnectorStats(data=dict(data)) if data is not None else KvrdmaConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvrdmaPromMetrics:
        return KvrdmaPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler role --------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(self._kv_cache_config.transfer_group_ids)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        """vLLM's hook for keeping an engine without requests stepping: also while a worker
        still has done notifications on their way, which only its steps carry out."""
        return self.scheduler_side.notifications_owed

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.scheduler_side.set_handshake_metadata({(0, tp): m for tp, m in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self.scheduler_side.set_handshake_metadata(metadata)

    # ---- worker role -----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker_side.handshake_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads (read or pushed) are asynchronous, and vLLM schedules a
        request only once all of its KV has landed (`finished_recving`)."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Push mode: write this layer of the requests whose prefill ends in this step to
        the decoders that expect them, once its kernels are done."""
        if self.has_connector_metadata():
            self.worker_side.save_kv_layer(self._meta(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """Push mode: write what is left of those requests once the forward is done."""
        if self.has_connector_metadata():
            self.worker_side.wait_for_save(self._meta())

    def _meta(self) -> KvrdmaConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvrdmaConnectorMetadata):
            raise TypeError(f"KvrdmaConnector got {type(meta).__name__} metadata")
        return meta

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self.worker_side.transfer_results()
        return KVConnectorTransferResults(sending, recving, failed)

    def build_connector_worker_meta(self) -> NotificationsOwed | None:
        return self.worker_side.notifications_owed()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_invalid_block_ids()

    def get_kv_connector_stats(self) -> KvrdmaConnectorStats | None:
        return self.worker_side.take_stats() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._sched is not None:
            self._sched.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
