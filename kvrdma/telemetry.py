"""Prometheus metrics for kvrdma and their HTTP exposition.

Every metric takes an injected `CollectorRegistry`; nothing is registered globally. Series
carry `engine_id`, `role` and `tp_rank` (plus `remote_engine` where a peer is involved, and
`mode` on a decoder's transfer series) and never a request id; a worker keeps series for at
most `MAX_PEERS` remote engines (peers name themselves: past that they count as
`OTHER_PEERS`), so cardinality is bounded by the size of the deployment. Several ranks of
one pod are merged into one `/metrics` by `kvrdma.scrape`.

`METRIC_DOCS` lists every metric this module can export (`metrics/generate.py` renders it,
with `VLLM_PARITY`, as `metrics/METRICS.md`).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

from kvrdma import __version__

# the HTTP exposition lives in kvrdma.http_server; part of this module's API too
from kvrdma.http_server import MetricsServer as MetricsServer
from kvrdma.http_server import exposition as exposition
from kvrdma.http_server import start_http_server as start_http_server
from kvrdma.types import ConnectionDrop, HandshakeOutcome, Outcome, ServerSocket, TransferMode

ROLES = ("producer", "consumer", "both", "sidecar")
TRANSFER_OUTCOMES = tuple(o.value for o in Outcome)
TRANSFER_MODES = tuple(m.value for m in TransferMode)
NOTIFICATION_FAILURE_REASONS = ("send_failed", "unknown_request", "expired_request", "malformed")
# How a producer let go of a request's blocks: the first two end a pull, the others a push.
FREED_BLOCK_REASONS = (
    "notified", "lease_expired", "pushed", "push_ended_short", "push_lease_expired", "push_aborted",
)  # fmt: skip
HANDSHAKE_OUTCOMES = tuple(o.value for o in HandshakeOutcome)
REQUEST_OUTCOMES = ("success", "invalid_blocks", "failed")
# The sidecar's handshake server, by the outcome of each request it answered / publish it got.
AGENT_REQUEST_OUTCOMES = ("ok", "bad", "rejected", "internal_error", "unauthenticated")
AGENT_PUBLISH_OUTCOMES = ("ok", "bad", "unpublished", "expired")
# The TCP connections its handshake server shut down, by socket and why (kvrdma.handshake.guard).
AGENT_SOCKETS = tuple(s.value for s in ServerSocket)
CONNECTION_DROP_REASONS = tuple(r.value for r in ConnectionDrop)
# Stage-to-stage shards (kvrdma.stages): how one ended, seen from the sending or receiving rank.
STAGE_OUTCOMES = ("success", "timeout", "failed", "expired", "given_up")
STAGE_DIRECTIONS = ("send", "receive")

MAX_PEERS = 256
OTHER_PEERS = "other"
WORKER_LABELS = ("engine_id", "role", "tp_rank")
PEER_LABELS = (*WORKER_LABELS, "remote_engine")
TRANSFER_LABELS = (*PEER_LABELS, "mode")
STAGE_RANK_LABELS = ("pipeline", "stage", "peer_stage", "tp_rank")
STAGE_LABELS = (*STAGE_RANK_LABELS, "direction")

# 10 µs … 10 s: a NIXL post takes microseconds, a large READ over a slow link seconds.
SECONDS_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# 1 KiB … 4 GiB in powers of 4: one block of one layer up to a long prompt's whole KV.
BYTES_BUCKETS = tuple(float(1024 * 4**k) for k in range(12))
# 1 … 1 Mi descriptors in powers of 4 (layers × regions × blocks × source ranks).
DESCRIPTOR_BUCKETS = tuple(float(4**k) for k in range(11))
# 1 ms … 30 s: a ZMQ round trip plus NIXL's add_remote_agent, up to retries of a 5 s timeout.
HANDSHAKE_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# 100 µs … 30 s: one small shard over shared memory up to a receive's default deadline.
STAGE_SECONDS_BUCKETS = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0,
)  # fmt: skip

MetricType = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricDoc:
    """One exported metric: its exposed name (counters end in `_total`), type, labels, help."""

    name: str
    type: MetricType
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()


TRANSFER_DURATION = MetricDoc(
    "kvrdma_transfer_duration_seconds", "histogram", TRANSFER_LABELS,
    "Time from posting a successful transfer (push: expecting it) until it completed.",
    SECONDS_BUCKETS,
)  # fmt: skip
POST_DURATION = MetricDoc(
    "kvrdma_transfer_post_duration_seconds", "histogram", TRANSFER_LABELS,
    "Time spent preparing and posting (submitting) a successful transfer.", SECONDS_BUCKETS,
)  # fmt: skip
TRANSFER_BYTES = MetricDoc(
    "kvrdma_transfer_bytes", "histogram", TRANSFER_LABELS,
    "Bytes moved by one successful transfer; rate(_sum) is the KV throughput.", BYTES_BUCKETS,
)  # fmt: skip
TRANSFER_DESCRIPTORS = MetricDoc(
    "kvrdma_transfer_descriptors", "histogram", TRANSFER_LABELS,
    "Descriptors in one successful transfer.", DESCRIPTOR_BUCKETS,
)  # fmt: skip
TRANSFERS = MetricDoc(
    "kvrdma_transfers_total", "counter", (*TRANSFER_LABELS, "outcome"),
    "Transfers that ended, by mode (pull, push) and outcome (success, failed, timeout, peer_lost, "
    "cancelled, expired, corrupt).",
)  # fmt: skip
FAILED_NOTIFICATIONS = MetricDoc(
    "kvrdma_failed_notifications_total", "counter", (*PEER_LABELS, "reason"),
    "Transfer notifications that could not be sent or were rejected on receipt, by reason.",
)  # fmt: skip
EXPIRED_LEASES = MetricDoc(
    "kvrdma_expired_leases_total", "counter", WORKER_LABELS,
    "Requests whose producer-side lease expired before every decoder had their KV, so their "
    "blocks were freed.",
)  # fmt: skip
FREED_BLOCKS = MetricDoc(
    "kvrdma_freed_blocks_total", "counter", (*WORKER_LABELS, "reason"),
    "Producer blocks released, by reason: pull (notified by the reader, lease_expired) or push "
    "(pushed to every decoder, push_ended_short, push_lease_expired, push_aborted).",
)  # fmt: skip
INVALID_BLOCKS = MetricDoc(
    "kvrdma_invalid_blocks_total", "counter", PEER_LABELS,
    "Local blocks reported invalid after a failed load (each is recomputed or fails a request).",
)  # fmt: skip
CORRUPT_BLOCKS = MetricDoc(
    "kvrdma_corrupt_blocks_total", "counter", PEER_LABELS,
    "Integrity mode: local blocks whose landed bytes did not match the producer's checksums "
    "(each is also counted in kvrdma_invalid_blocks_total).",
)  # fmt: skip
AGENT_RETIREMENTS = MetricDoc(
    "kvrdma_agent_retirements_total", "counter", WORKER_LABELS,
    "Reading NIXL agents retired because a read passed its deadline with data still in flight "
    "(so that data can never land); reads in flight on it were reported invalid.",
)  # fmt: skip
REQUESTS = MetricDoc(
    "kvrdma_requests_total", "counter", (*WORKER_LABELS, "outcome"),
    "Requests whose KV load finished on this consumer rank, by outcome.",
)  # fmt: skip
HANDSHAKES = MetricDoc(
    "kvrdma_handshakes_total", "counter", (*PEER_LABELS, "outcome"),
    "Metadata handshakes with a remote engine, by outcome.",
)  # fmt: skip
HANDSHAKE_DURATION = MetricDoc(
    "kvrdma_handshake_duration_seconds", "histogram", PEER_LABELS,
    "Time taken by a successful metadata handshake.", HANDSHAKE_BUCKETS,
)  # fmt: skip
REGISTERED_BYTES = MetricDoc(
    "kvrdma_registered_bytes", "gauge", WORKER_LABELS,
    "Bytes of KV cache registered with NIXL.",
)  # fmt: skip
REGISTERED_REGIONS = MetricDoc(
    "kvrdma_registered_regions", "gauge", WORKER_LABELS,
    "Memory regions registered with NIXL.",
)  # fmt: skip
IN_FLIGHT = MetricDoc(
    "kvrdma_transfers_in_flight", "gauge", TRANSFER_LABELS,
    "Transfers posted (push: expected) and not yet finished.",
)  # fmt: skip
CONNECTED_PEERS = MetricDoc(
    "kvrdma_connected_remote_engines", "gauge", WORKER_LABELS,
    "Remote engines with a completed handshake.",
)  # fmt: skip
BUILD_INFO = MetricDoc(
    "kvrdma_build_info", "gauge", ("version", "protocol_version"),
    "Always 1; labels carry the kvrdma version and its handshake protocol version.",
)  # fmt: skip
TRANSPORT_INFO = MetricDoc(
    "kvrdma_transport_info", "gauge", (*WORKER_LABELS, "transport", "ucx_tls", "ucx_net_devices"),
    "Always 1; transport is what UCX's settings and the visible devices allow (rdma, tcp, "
    "other): tcp where RDMA was meant shows a silent fallback.",
)  # fmt: skip
ENDPOINT_UP = MetricDoc(
    "kvrdma_worker_endpoint_up", "gauge", ("endpoint",),
    "Sidecar only: 1 if the worker's /metrics endpoint answered the last scrape, else 0.",
)  # fmt: skip

# The sidecar's own series (kvrdma.cli.agent.AgentCollector reads them off its handshake server).
AGENT_REQUESTS = MetricDoc(
    "kvrdma_handshake_requests_total", "counter", ("outcome",),
    "Sidecar only: handshake requests its server answered, by outcome "
    f"({', '.join(AGENT_REQUEST_OUTCOMES)}).",
)  # fmt: skip
AGENT_PUBLISHES = MetricDoc(
    "kvrdma_agent_publishes_total", "counter", ("outcome",),
    "Sidecar only: worker metadata publications received, by outcome "
    f"({', '.join(AGENT_PUBLISH_OUTCOMES)}).",
)  # fmt: skip
AGENT_DROPPED_CONNECTIONS = MetricDoc(
    "kvrdma_handshake_connections_dropped_total", "counter", ("socket", "reason"),
    "Sidecar only: TCP connections its handshake server shut down, by socket "
    f"({', '.join(AGENT_SOCKETS)}) and reason: unfinished_message (too many bytes sent without "
    "ending a message; not counted as a request), idle (idle the longest past the socket's "
    "connection bound).",
)  # fmt: skip
AGENT_PUBLISHED_RANKS = MetricDoc(
    "kvrdma_agent_published_ranks", "gauge", ("engine_id", "dp_index"),
    "Sidecar only: TP ranks currently published to it, per engine and DP index.",
)  # fmt: skip
AGENT_READY = MetricDoc(
    "kvrdma_agent_ready", "gauge", (),
    "Sidecar only: 1 when every expected TP rank has published its metadata.",
)  # fmt: skip

# Stage-to-stage transfer (kvrdma.stages.metrics.StageMetrics): a sender counts each shard it
# offered, a receiver each request it merged from its senders' shards.
STAGE_TRANSFERS = MetricDoc(
    "kvrdma_stage_transfers_total", "counter", (*STAGE_LABELS, "outcome"),
    "Stage-to-stage transfers that ended: shards offered (direction send) or requests received "
    f"(direction receive), by outcome ({', '.join(STAGE_OUTCOMES)}).",
)  # fmt: skip
STAGE_BYTES = MetricDoc(
    "kvrdma_stage_transfer_bytes", "histogram", STAGE_LABELS,
    "Packed bytes of one successful stage-to-stage transfer; rate(_sum) is the throughput.",
    BYTES_BUCKETS,
)  # fmt: skip
STAGE_DURATION = MetricDoc(
    "kvrdma_stage_transfer_duration_seconds", "histogram", STAGE_LABELS,
    "Time of one successful stage-to-stage transfer: offer until read (send), receive call "
    "until merged (receive).", STAGE_SECONDS_BUCKETS,
)  # fmt: skip
STAGE_OFFERED = MetricDoc(
    "kvrdma_stage_offered_shards", "gauge", STAGE_RANK_LABELS,
    "Shards a sending stage rank has offered and that are not yet read, given up or expired.",
)  # fmt: skip
STAGE_HELD_SLOTS = MetricDoc(
    "kvrdma_stage_held_landing_slots", "gauge", STAGE_RANK_LABELS,
    "Landing slots a receiving stage rank keeps for READs of failed receives that have not "
    "ended (a stopped sender may still write them); they are handed out again once they end.",
)  # fmt: skip
STAGE_DOCS: tuple[MetricDoc, ...] = (
    STAGE_TRANSFERS, STAGE_BYTES, STAGE_DURATION, STAGE_OFFERED, STAGE_HELD_SLOTS,
)  # fmt: skip

# Everything `kvrdma agent` serves besides its workers' merged series.
AGENT_DOCS: tuple[MetricDoc, ...] = (
    AGENT_REQUESTS, AGENT_PUBLISHES, AGENT_DROPPED_CONNECTIONS, AGENT_PUBLISHED_RANKS, AGENT_READY,
)  # fmt: skip
SIDECAR_DOCS: tuple[MetricDoc, ...] = (*AGENT_DOCS, ENDPOINT_UP, BUILD_INFO)

METRIC_DOCS: tuple[MetricDoc, ...] = (
    TRANSFER_DURATION, POST_DURATION, TRANSFER_BYTES, TRANSFER_DESCRIPTORS, TRANSFERS,
    FAILED_NOTIFICATIONS, EXPIRED_LEASES, FREED_BLOCKS, INVALID_BLOCKS, CORRUPT_BLOCKS,
    AGENT_RETIREMENTS, REQUESTS, HANDSHAKES, HANDSHAKE_DURATION, REGISTERED_BYTES,
    REGISTERED_REGIONS, IN_FLIGHT, CONNECTED_PEERS, TRANSPORT_INFO, BUILD_INFO, ENDPOINT_UP,
    AGENT_REQUESTS, AGENT_PUBLISHES, AGENT_DROPPED_CONNECTIONS, AGENT_PUBLISHED_RANKS, AGENT_READY,
    *STAGE_DOCS,
)  # fmt: skip

# vLLM NixlConnector series (SPEC §8) -> the kvrdma PromQL selector that counts the same thing.
VLLM_PARITY: dict[str, str] = {
    "nixl_xfer_time_seconds": TRANSFER_DURATION.name,
    "nixl_post_time_seconds": POST_DURATION.name,
    "nixl_bytes_transferred": TRANSFER_BYTES.name,
    "nixl_num_descriptors": TRANSFER_DESCRIPTORS.name,
    "nixl_num_failed_transfers": f'{TRANSFERS.name}{{outcome!="success"}}',
    "nixl_num_failed_notifications": FAILED_NOTIFICATIONS.name,
    "nixl_num_kv_expired_reqs": EXPIRED_LEASES.name,
}


def metric_names() -> frozenset[str]:
    """Exposed names of every metric in `METRIC_DOCS`."""
    return frozenset(d.name for d in METRIC_DOCS)


def metric_family(doc: MetricDoc) -> CounterMetricFamily | GaugeMetricFamily:
    """An empty family named, typed, documented and labelled by `doc`, for a collector that
    reads another system's counters at scrape time (`add_metric(label_values, value)`)."""
    if doc.type == "counter":
        return CounterMetricFamily(doc.name.removesuffix("_total"), doc.help, labels=doc.labels)
    if doc.type == "gauge":
        return GaugeMetricFamily(doc.name, doc.help, labels=doc.labels)
    raise ValueError(f"{doc.name}: a {doc.type} has no scrape-time family here")


def check_label(value: str, allowed: tuple[str, ...], what: str) -> None:
    """Raise `ValueError` unless `value` is one of `allowed` (a typo must not add a series)."""
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)}; got {value!r}")


def _counter(doc: MetricDoc, registry: CollectorRegistry) -> Counter:
    return Counter(doc.name, doc.help, doc.labels, registry=registry)


def _gauge(doc: MetricDoc, registry: CollectorRegistry) -> Gauge:
    # In multiprocess mode each label set belongs to one live process; a dead one drops out
    # once `prometheus_client.multiprocess.mark_process_dead(pid)` is called.
    return Gauge(doc.name, doc.help, doc.labels, registry=registry, multiprocess_mode="livesum")


def _histogram(doc: MetricDoc, registry: CollectorRegistry) -> Histogram:
    return Histogram(doc.name, doc.help, doc.labels, registry=registry, buckets=doc.buckets)


class KvrdmaMetrics:
    """The metrics of one kvrdma process (one worker rank, or the sidecar).

    Label values for modes, outcomes and reasons are checked against the sets above (a typo
    raises `ValueError` instead of creating a new series). The first event naming a remote
    engine creates that peer's counters at zero for every outcome (its transfer counters, per
    mode, at the first transfer in that mode), so ratios are 0 rather than absent.
    """

    def __init__(
        self, *, registry: CollectorRegistry, engine_id: str, role: str, tp_rank: int
    ) -> None:
        check_label(role, ROLES, "role")
        self._worker = (engine_id, role, str(tp_rank))
        # a successful transfer's seconds, post seconds, bytes and descriptors
        docs = (TRANSFER_DURATION, POST_DURATION, TRANSFER_BYTES, TRANSFER_DESCRIPTORS)
        self._histograms = tuple(_histogram(doc, registry) for doc in docs)
        self._transfers = _counter(TRANSFERS, registry)
        self._failed_notifications = _counter(FAILED_NOTIFICATIONS, registry)
        self._expired_leases = _counter(EXPIRED_LEASES, registry)
        self._freed_blocks = _counter(FREED_BLOCKS, registry)
        self._invalid_blocks = _counter(INVALID_BLOCKS, registry)
        self._corrupt_blocks = _counter(CORRUPT_BLOCKS, registry)
        self._requests = _counter(REQUESTS, registry)
        self._retirements = _counter(AGENT_RETIREMENTS, registry)
        self._handshakes = _counter(HANDSHAKES, registry)
        self._handshake_seconds = _histogram(HANDSHAKE_DURATION, registry)
        self._registered_bytes = _gauge(REGISTERED_BYTES, registry)
        self._registered_regions = _gauge(REGISTERED_REGIONS, registry)
        self._in_flight = _gauge(IN_FLIGHT, registry)
        self._connected = _gauge(CONNECTED_PEERS, registry)
        self._transport = _gauge(TRANSPORT_INFO, registry)
        self._known_peers: set[str] = set()
        self._series: dict[tuple[str, str], _Series] = {}  # by (remote engine, mode)
        self._lock = threading.Lock()
        w = self._worker
        self._expired_leases.labels(*w)
        self._retirements.labels(*w)
        for reason in FREED_BLOCK_REASONS:
            self._freed_blocks.labels(*w, reason)
        self._request_series = {o: self._requests.labels(*w, o) for o in REQUEST_OUTCOMES}
        self._registered_bytes.labels(*w).set(0)
        self._registered_regions.labels(*w).set(0)
        self._connected.labels(*w).set(0)

    def _peer(self, remote_engine: str) -> tuple[str, str, str, str]:
        if remote_engine not in self._known_peers:
            with self._lock:
                if len(self._known_peers) >= MAX_PEERS and remote_engine not in self._known_peers:
                    remote_engine = OTHER_PEERS
                if remote_engine not in self._known_peers:
                    labels = (*self._worker, remote_engine)
                    for reason in NOTIFICATION_FAILURE_REASONS:
                        self._failed_notifications.labels(*labels, reason)
                    for outcome in HANDSHAKE_OUTCOMES:
                        self._handshakes.labels(*labels, outcome)
                    self._invalid_blocks.labels(*labels)
                    self._corrupt_blocks.labels(*labels)
                    self._known_peers.add(remote_engine)
        return (*self._worker, remote_engine)

    def _transfer(self, remote_engine: str, mode: str) -> _Series:
        """The transfer series of (`remote_engine`, `mode`), created at zero the first time."""
        if (series := self._series.get((remote_engine, mode))) is not None:
            return series
        check_label(mode, TRANSFER_MODES, "transfer mode")
        labels = (*self._peer(remote_engine), str(mode))
        with self._lock:  # a peer past MAX_PEERS shares OTHER_PEERS' series, kept under it
            return self._series.setdefault((labels[3], labels[4]), _Series(self, labels))

    def forget_peer(self, remote_engine: str) -> None:
        """Drop `remote_engine`'s series (an engine removed as idle: engine ids are not
        reused, a restarted engine has a new one), which also makes room under `MAX_PEERS`."""
        with self._lock:
            if remote_engine == OTHER_PEERS or remote_engine not in self._known_peers:
                return
            self._known_peers.discard(remote_engine)
            peer = (*self._worker, remote_engine)
            drops: list[tuple[Counter | Gauge | Histogram, tuple[str, ...]]] = [
                (self._failed_notifications, (*peer, r)) for r in NOTIFICATION_FAILURE_REASONS
            ]
            drops += [(self._handshakes, (*peer, o)) for o in HANDSHAKE_OUTCOMES]
            drops += [(m, peer) for m in (self._invalid_blocks, self._corrupt_blocks)]
            drops += [(self._handshake_seconds, peer)]
            for engine, mode in [k for k in self._series if k[0] == remote_engine]:
                del self._series[engine, mode]
                t = (*peer, mode)
                drops += [(self._transfers, (*t, o)) for o in TRANSFER_OUTCOMES]
                drops += [(self._in_flight, t), *((h, t) for h in self._histograms)]
            for metric, labels in drops:
                with contextlib.suppress(KeyError):  # histograms exist once observed
                    metric.remove(*labels)

    def observe_transfer(
        self,
        *,
        remote_engine: str,
        mode: str,
        outcome: str,
        seconds: float,
        post_seconds: float,
        nbytes: int,
        descriptors: int,
    ) -> None:
        """Count one finished transfer; a successful one also feeds the four histograms."""
        check_label(outcome, TRANSFER_OUTCOMES, "transfer outcome")
        series = self._transfer(remote_engine, mode)
        series.outcomes[outcome].inc()
        if outcome == "success":
            if not series.histograms:  # created at the first success, not at zero
                series.histograms = tuple(h.labels(*series.labels) for h in self._histograms)
            values = (seconds, post_seconds, nbytes, descriptors)
            for h, value in zip(series.histograms, values, strict=True):
                h.observe(value)

    def transfer_not_started(self, *, remote_engine: str, mode: str, outcome: str) -> None:
        """Count a transfer that failed before anything was posted (its handshake failed)."""
        check_label(outcome, TRANSFER_OUTCOMES, "transfer outcome")
        self._transfer(remote_engine, mode).outcomes[outcome].inc()

    def failed_notification(self, *, remote_engine: str, reason: str) -> None:
        check_label(reason, NOTIFICATION_FAILURE_REASONS, "notification failure reason")
        self._failed_notifications.labels(*self._peer(remote_engine), reason).inc()

    def agent_retired(self) -> None:
        """The reading agent was retired (a read passed its deadline with data in flight)."""
        self._retirements.labels(*self._worker).inc()

    def expired_leases(self, n: int = 1) -> None:
        """`n` requests whose lease expired and whose blocks were freed."""
        self._expired_leases.labels(*self._worker).inc(n)

    def freed_blocks(self, n: int, *, reason: str) -> None:
        check_label(reason, FREED_BLOCK_REASONS, "freed-block reason")
        self._freed_blocks.labels(*self._worker, reason).inc(n)

    def invalid_blocks(self, *, remote_engine: str, n: int) -> None:
        self._invalid_blocks.labels(*self._peer(remote_engine)).inc(n)

    def corrupt_blocks(self, *, remote_engine: str, n: int) -> None:
        """`n` blocks read from `remote_engine` failed their integrity check."""
        self._corrupt_blocks.labels(*self._peer(remote_engine)).inc(n)

    def handshake(self, *, remote_engine: str, outcome: str, seconds: float) -> None:
        check_label(outcome, HANDSHAKE_OUTCOMES, "handshake outcome")
        labels = self._peer(remote_engine)
        self._handshakes.labels(*labels, outcome).inc()
        if outcome == "success":
            self._handshake_seconds.labels(*labels).observe(seconds)

    def set_registered(self, *, nbytes: int, regions: int) -> None:
        self._registered_bytes.labels(*self._worker).set(nbytes)
        self._registered_regions.labels(*self._worker).set(regions)

    def set_transport(self, *, kind: str, ucx_tls: str, ucx_net_devices: str) -> None:
        """The one `kvrdma_transport_info` series of this worker (a new setting replaces it)."""
        self._transport.clear()
        self._transport.labels(*self._worker, kind, ucx_tls, ucx_net_devices).set(1)

    def transfer_started(self, *, remote_engine: str, mode: str) -> None:
        self._transfer(remote_engine, mode).in_flight.inc()

    def transfer_finished(self, *, remote_engine: str, mode: str) -> None:
        self._transfer(remote_engine, mode).in_flight.dec()

    def set_connected_peers(self, n: int) -> None:
        self._connected.labels(*self._worker).set(n)

    def request_finished(self, *, outcome: str) -> None:
        check_label(outcome, REQUEST_OUTCOMES, "request outcome")
        self._request_series[outcome].inc()


class _Series:
    """A decoder's transfer series of one (remote engine, mode), looked up once: `labels()`
    costs more than the update it precedes, and a decoder updates them several times a read."""

    __slots__ = ("histograms", "in_flight", "labels", "outcomes")

    def __init__(self, metrics: KvrdmaMetrics, labels: tuple[str, ...]) -> None:
        self.labels = labels
        self.outcomes = {o: metrics._transfers.labels(*labels, o) for o in TRANSFER_OUTCOMES}
        self.in_flight = metrics._in_flight.labels(*labels)
        self.histograms: tuple[Histogram, ...] = ()


def build_info(registry: CollectorRegistry) -> None:
    """Export `kvrdma_build_info{version, protocol_version} 1`."""
    try:
        wire = importlib.import_module("kvrdma.handshake.wire")
        protocol = getattr(wire, "PROTOCOL_VERSION", 1)
    except ImportError:
        protocol = 1
    gauge = Gauge(BUILD_INFO.name, BUILD_INFO.help, BUILD_INFO.labels, registry=registry,
                  multiprocess_mode="livemax")  # fmt: skip
    gauge.labels(__version__, str(protocol)).set(1)
