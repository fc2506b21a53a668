"""Prometheus series of stage-to-stage transfer, labelled by pipeline, stage and peer stage.

The series are defined once in `kvrdma.telemetry` (`STAGE_DOCS`); this class only records
them. A `StageSender` or `StageReceiver` given `metrics=` counts every shard or request it
finishes; the first event of a stage pair creates its counters at zero for every outcome,
so failure ratios read 0 rather than absent.
"""

from __future__ import annotations

import threading
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvrdma.telemetry import (
    STAGE_BYTES,
    STAGE_DIRECTIONS,
    STAGE_DURATION,
    STAGE_HELD_SLOTS,
    STAGE_OFFERED,
    STAGE_OUTCOMES,
    STAGE_TRANSFERS,
    check_label,
)


class StageRank(Protocol):
    """What names a stage rank in the series (a `StageEndpoint`)."""

    pipeline: str
    stage: str
    rank: int


class StageMetrics:
    """The stage-transfer series of one process; several senders and receivers may share it."""

    def __init__(self, *, registry: CollectorRegistry) -> None:
        self._transfers = Counter(
            STAGE_TRANSFERS.name, STAGE_TRANSFERS.help, STAGE_TRANSFERS.labels, registry=registry
        )
        self._bytes = Histogram(
            STAGE_BYTES.name,
            STAGE_BYTES.help,
            STAGE_BYTES.labels,
            registry=registry,
            buckets=STAGE_BYTES.buckets,
        )
        self._seconds = Histogram(
            STAGE_DURATION.name,
            STAGE_DURATION.help,
            STAGE_DURATION.labels,
            registry=registry,
            buckets=STAGE_DURATION.buckets,
        )
        # livesum: in multiprocess mode each stage rank's gauges are its own live process's.
        self._offered, self._held = (
            Gauge(doc.name, doc.help, doc.labels, registry=registry, multiprocess_mode="livesum")
            for doc in (STAGE_OFFERED, STAGE_HELD_SLOTS)
        )
        self._known: set[tuple[str, ...]] = set()
        self._lock = threading.Lock()

    def _labels(
        self, pipeline: str, stage: str, peer_stage: str, tp_rank: int, direction: str
    ) -> tuple[str, ...]:
        check_label(direction, STAGE_DIRECTIONS, "stage transfer direction")
        labels = (pipeline, stage, peer_stage, str(tp_rank), direction)
        if labels not in self._known:
            with self._lock:
                for outcome in STAGE_OUTCOMES:
                    self._transfers.labels(*labels, outcome)
                self._known.add(labels)
        return labels

    def transfer(
        self,
        *,
        pipeline: str,
        stage: str,
        peer_stage: str,
        tp_rank: int,
        direction: str,
        outcome: str,
        nbytes: int = 0,
        seconds: float = 0.0,
    ) -> None:
        """Count one shard (send) or request (receive) that ended; a successful one also
        records its packed bytes and duration."""
        check_label(outcome, STAGE_OUTCOMES, "stage transfer outcome")
        labels = self._labels(pipeline, stage, peer_stage, tp_rank, direction)
        self._transfers.labels(*labels, outcome).inc()
        if outcome == "success":
            self._bytes.labels(*labels).observe(nbytes)
            self._seconds.labels(*labels).observe(seconds)

    def transfer_of(
        self,
        rank: StageRank,
        peer_stage: str,
        direction: str,
        outcome: str,
        nbytes: int = 0,
        seconds: float = 0.0,
    ) -> None:
        """`transfer` for a stage rank (an endpoint) and its peer stage."""
        self.transfer(
            pipeline=rank.pipeline,
            stage=rank.stage,
            peer_stage=peer_stage,
            tp_rank=rank.rank,
            direction=direction,
            outcome=outcome,
            nbytes=nbytes,
            seconds=seconds,
        )

    def set_offered(
        self, *, pipeline: str, stage: str, peer_stage: str, tp_rank: int, shards: int
    ) -> None:
        """Shards a sending rank holds offered to `peer_stage` and not yet finished."""
        self._offered.labels(pipeline, stage, peer_stage, str(tp_rank)).set(shards)

    def held_slots_of(self, rank: StageRank, peer_stage: str, slots: int) -> None:
        """Landing slots a receiving rank keeps for READs of failed receives, not yet ended."""
        self._held.labels(rank.pipeline, rank.stage, peer_stage, str(rank.rank)).set(slots)
