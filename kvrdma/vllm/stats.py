"""Connector stats through vLLM's own hooks: `KVConnectorStats` (worker → logger process,
aggregated across ranks and intervals) and `KVConnectorPromMetrics` (`vllm:kvrdma_*` series
labelled like vLLM's other per-engine metrics). kvrdma's own `kvrdma_*` series are separate:
`kvrdma_metrics` gives a rank its registry of them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvrdma.scrape import worker_metrics_port

if TYPE_CHECKING:
    from kvrdma.config import KVTransferConfig

logger = logging.getLogger(__name__)

# serve this rank's kvrdma_* series at http://HOST:(port + TP rank)/metrics
# (`kvrdma.scrape.worker_metrics_port`); the pod's agent scrapes them on loopback, so other
# hosts see them only when HOST says so
METRICS_HOST_ENV = "KVRDMA_METRICS_HOST"

_COUNTS = ("num_successful_transfers", "num_failed_transfers", "num_blocks", "num_invalid_blocks")


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = dict.fromkeys(_COUNTS, 0)
    data["transfer_seconds"] = []
    return data


@dataclass
class KvrdmaConnectorStats(KVConnectorStats):
    """Per-interval transfer counts and durations of one or more workers."""

    data: dict[str, Any] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        for key, value in _empty().items():
            self.data.setdefault(key, value)

    def record_success(self, blocks: int, seconds: float) -> None:
        self.data["num_successful_transfers"] += 1
        self.data["num_blocks"] += blocks
        self.data["transfer_seconds"].append(seconds)

    def record_failure(self, invalid_blocks: int) -> None:
        self.data["num_failed_transfers"] += 1
        self.data["num_invalid_blocks"] += invalid_blocks

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KvrdmaConnectorStats:
        for key in _COUNTS:
            self.data[key] += int(other.data.get(key, 0))
        self.data["transfer_seconds"] = self.data["transfer_seconds"] + list(
            other.data.get("transfer_seconds", ())
        )
        return self

    def reduce(self) -> dict[str, int | float]:
        secs = sorted(self.data["transfer_seconds"])
        out: dict[str, int | float] = {k: int(self.data[k]) for k in _COUNTS}
        out["avg_transfer_ms"] = round(1e3 * sum(secs) / len(secs), 3) if secs else 0.0
        out["p90_transfer_ms"] = round(1e3 * secs[int(0.9 * (len(secs) - 1))], 3) if secs else 0.0
        return out

    def is_empty(self) -> bool:
        return not (self.data["num_successful_transfers"] or self.data["num_failed_transfers"])


class KvrdmaPromMetrics(KVConnectorPromMetrics):
    """`vllm:kvrdma_*` counters and a transfer-time histogram per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counters = {
            "num_successful_transfers": (
                "vllm:kvrdma_transfers_succeeded",
                "KV reads that succeeded",
            ),
            "num_failed_transfers": ("vllm:kvrdma_transfers_failed", "KV reads that failed"),
            "num_blocks": ("vllm:kvrdma_blocks_read", "KV blocks read from producers"),
            "num_invalid_blocks": ("vllm:kvrdma_invalid_blocks", "KV blocks reported invalid"),
        }
        self._counters = {
            key: self._per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            )
            for key, (name, doc) in counters.items()
        }
        hist = self._histogram_cls(
            name="vllm:kvrdma_transfer_time_seconds",
            documentation="Time from posting a request's KV reads to their completion",
            labelnames=labelnames,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0),
        )
        self._time = self._per_engine(hist)

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {e: metric.labels(*values) for e, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            n = int(transfer_stats_data.get(key, 0))
            if n:
                per_engine[engine_idx].inc(n)
        for secs in transfer_stats_data.get("transfer_seconds", ()):
            self._time[engine_idx].observe(secs)


def kvrdma_metrics(config: KVTransferConfig, tp_rank: int) -> tuple[Any, Any]:
    """kvrdma's own `kvrdma_*` series for this rank, in a registry of their own."""
    from prometheus_client import CollectorRegistry

    from kvrdma.telemetry import KvrdmaMetrics

    role = {"kv_producer": "producer", "kv_consumer": "consumer"}.get(config.kv_role, "both")
    registry = CollectorRegistry()
    metrics = KvrdmaMetrics(
        registry=registry, engine_id=config.engine_id, role=role, tp_rank=tp_rank
    )
    return registry, metrics


def serve_metrics(registry: Any, tp_rank: int) -> Any:
    """Serve a rank's registry where `$KVRDMA_METRICS_PORT` says; the server, or None."""
    port = worker_metrics_port(tp_rank)
    if port is None:
        return None
    from kvrdma.telemetry import start_http_server

    host = os.environ.get(METRICS_HOST_ENV) or "127.0.0.1"
    server, bound = start_http_server(registry, host, port)
    logger.info("kvrdma metrics of rank %d on %s:%d", tp_rank, host, bound)
    return server
