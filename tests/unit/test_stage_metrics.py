"""kvrdma.stages.metrics: exact sample values after scripted events, each on a fresh registry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from kvrdma import telemetry as t
from kvrdma.stages import StageMetrics

THINKER = {"pipeline": "omni", "stage": "thinker", "peer_stage": "talker", "tp_rank": "1"}
TALKER = {"pipeline": "omni", "stage": "talker", "peer_stage": "thinker", "tp_rank": "0"}
TALKER_RANK = SimpleNamespace(pipeline="omni", stage="talker", rank=0)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> StageMetrics:
    return StageMetrics(registry=registry)


def _send(metrics: StageMetrics, outcome: str, nbytes: int = 0, seconds: float = 0.0) -> None:
    metrics.transfer(pipeline="omni", stage="thinker", peer_stage="talker", tp_rank=1,
                     direction="send", outcome=outcome, nbytes=nbytes, seconds=seconds)  # fmt: skip


def test_a_success_counts_and_fills_both_histograms(
    registry: CollectorRegistry, metrics: StageMetrics
) -> None:
    _send(metrics, "success", nbytes=3 << 20, seconds=0.004)
    _send(metrics, "success", nbytes=1 << 10, seconds=0.002)
    sent = {**THINKER, "direction": "send"}
    v = registry.get_sample_value
    assert v("kvrdma_stage_transfers_total", {**sent, "outcome": "success"}) == 2.0
    assert v("kvrdma_stage_transfer_bytes_sum", sent) == float((3 << 20) + (1 << 10))
    assert v("kvrdma_stage_transfer_bytes_bucket", {**sent, "le": "1024.0"}) == 1.0
    assert v("kvrdma_stage_transfer_duration_seconds_count", sent) == 2.0
    assert v("kvrdma_stage_transfer_duration_seconds_sum", sent) == pytest.approx(0.006)
    assert v("kvrdma_stage_transfer_duration_seconds_bucket", {**sent, "le": "0.0025"}) == 1.0


def test_failures_count_without_histograms_and_every_outcome_starts_at_zero(
    registry: CollectorRegistry, metrics: StageMetrics
) -> None:
    metrics.transfer(pipeline="omni", stage="talker", peer_stage="thinker", tp_rank=0,
                     direction="receive", outcome="timeout", nbytes=5, seconds=9.0)  # fmt: skip
    got = {**TALKER, "direction": "receive"}
    v = registry.get_sample_value
    assert v("kvrdma_stage_transfers_total", {**got, "outcome": "timeout"}) == 1.0
    for outcome in ("success", "failed", "expired", "given_up"):
        assert v("kvrdma_stage_transfers_total", {**got, "outcome": outcome}) == 0.0
    assert v("kvrdma_stage_transfer_bytes_count", got) is None
    assert v("kvrdma_stage_transfer_duration_seconds_count", got) is None


def test_each_outcome_is_its_own_series(registry: CollectorRegistry, metrics: StageMetrics) -> None:
    for outcome in t.STAGE_OUTCOMES:
        _send(metrics, outcome)
    _send(metrics, "expired")
    sent = {**THINKER, "direction": "send"}
    counts = {
        o: registry.get_sample_value("kvrdma_stage_transfers_total", {**sent, "outcome": o})
        for o in t.STAGE_OUTCOMES
    }
    assert counts == {"success": 1.0, "timeout": 1.0, "failed": 1.0, "expired": 2.0,
                      "given_up": 1.0}  # fmt: skip


def test_offered_shards_gauge_is_set_per_stage_pair(
    registry: CollectorRegistry, metrics: StageMetrics
) -> None:
    metrics.set_offered(pipeline="omni", stage="thinker", peer_stage="talker", tp_rank=1, shards=3)
    assert registry.get_sample_value("kvrdma_stage_offered_shards", THINKER) == 3.0
    metrics.set_offered(pipeline="omni", stage="thinker", peer_stage="talker", tp_rank=1, shards=0)
    assert registry.get_sample_value("kvrdma_stage_offered_shards", THINKER) == 0.0


def test_unknown_outcomes_and_directions_are_refused(metrics: StageMetrics) -> None:
    with pytest.raises(ValueError, match=r"stage transfer outcome must be one of .*'lost'"):
        _send(metrics, "lost")
    with pytest.raises(ValueError, match=r"stage transfer direction must be one of .*'push'"):
        metrics.transfer(pipeline="p", stage="a", peer_stage="b", tp_rank=0, direction="push",
                         outcome="success")  # fmt: skip


def test_held_landing_slots_gauge_is_set_per_receiving_rank(
    registry: CollectorRegistry, metrics: StageMetrics
) -> None:
    metrics.held_slots_of(TALKER_RANK, "thinker", 4)
    assert registry.get_sample_value("kvrdma_stage_held_landing_slots", TALKER) == 4.0
    metrics.held_slots_of(TALKER_RANK, "thinker", 0)
    assert registry.get_sample_value("kvrdma_stage_held_landing_slots", TALKER) == 0.0


def test_stage_docs_describe_exactly_what_stage_metrics_export(
    registry: CollectorRegistry, metrics: StageMetrics
) -> None:
    _send(metrics, "success", nbytes=1, seconds=0.1)
    metrics.set_offered(pipeline="omni", stage="thinker", peer_stage="talker", tp_rank=1, shards=1)
    metrics.held_slots_of(TALKER_RANK, "thinker", 2)
    exported = {}
    for fam in registry.collect():
        name = fam.name + ("_total" if fam.type == "counter" else "")
        labels = tuple(k for k in fam.samples[0].labels if k != "le")
        exported[name] = (fam.type, labels, fam.documentation)
    assert exported == {d.name: (d.type, d.labels, d.help) for d in t.STAGE_DOCS}
    assert set(t.STAGE_DOCS) <= set(t.METRIC_DOCS)
    for d in t.STAGE_DOCS:
        assert d.name.startswith("kvrdma_stage_") and "stage" in d.labels
        assert not any("request" in label for label in d.labels)
    assert t.STAGE_SECONDS_BUCKETS[-1] >= 30.0  # a receive's default deadline
