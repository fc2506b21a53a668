"""kvrdma.telemetry: exact sample values after scripted events, each on a fresh registry."""

from __future__ import annotations

import math
import re
import threading
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvrdma import __version__
from kvrdma import telemetry as t
from kvrdma.scrape import aggregated_registry
from kvrdma.telemetry import KvrdmaMetrics
from kvrdma.types import Outcome, TransferMode

D = {"engine_id": "decode-0", "role": "consumer", "tp_rank": "1"}
P = {"engine_id": "prefill-0", "role": "producer", "tp_rank": "0"}


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def consumer(registry: CollectorRegistry) -> KvrdmaMetrics:
    return KvrdmaMetrics(registry=registry, engine_id="decode-0", role="consumer", tp_rank=1)


@pytest.fixture
def producer(registry: CollectorRegistry) -> KvrdmaMetrics:
    return KvrdmaMetrics(registry=registry, engine_id="prefill-0", role="producer", tp_rank=0)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_transfers_are_counted_by_outcome_and_successes_fill_the_histograms(
    registry: CollectorRegistry, consumer: KvrdmaMetrics
) -> None:
    for seconds, post, nbytes, descs in ((0.0003, 2e-5, 3 * 1024**2, 96), (0.002, 4e-5, 5000, 3)):
        consumer.observe_transfer(remote_engine="prefill-0", mode="pull", outcome="success",
                                  seconds=seconds, post_seconds=post, nbytes=nbytes,
                                  descriptors=descs)  # fmt: skip
    consumer.observe_transfer(remote_engine="prefill-0", mode="pull", outcome="timeout",
                              seconds=10.0, post_seconds=1e-5, nbytes=1 << 20,
                              descriptors=8)  # fmt: skip
    consumer.observe_transfer(remote_engine="prefill-1", mode="pull", outcome="peer_lost",
                              seconds=0.1, post_seconds=1e-5, nbytes=1 << 20,
                              descriptors=8)  # fmt: skip
    r0 = {**D, "remote_engine": "prefill-0", "mode": "pull"}
    r1 = {**D, "remote_engine": "prefill-1", "mode": "pull"}

    assert value(registry, "kvrdma_transfers_total", **r0, outcome="success") == 2
    assert value(registry, "kvrdma_transfers_total", **r0, outcome="timeout") == 1
    assert value(registry, "kvrdma_transfers_total", **r1, outcome="peer_lost") == 1
    # the first event naming a peer creates its other outcomes at zero
    for outcome in ("failed", "cancelled"):
        assert value(registry, "kvrdma_transfers_total", **r0, outcome=outcome) == 0
    assert value(registry, "kvrdma_transfers_total", **r1, outcome="success") == 0

    # histograms: successes only
    dur = "kvrdma_transfer_duration_seconds"
    assert value(registry, f"{dur}_count", **r0) == 2
    assert value(registry, f"{dur}_sum", **r0) == pytest.approx(0.0023)
    assert value(registry, f"{dur}_bucket", **r0, le="0.00025") == 0
    assert value(registry, f"{dur}_bucket", **r0, le="0.0005") == 1
    assert value(registry, f"{dur}_bucket", **r0, le="0.0025") == 2
    assert value(registry, f"{dur}_bucket", **r0, le="+Inf") == 2
    assert value(registry, f"{dur}_count", **r1) is None
    post = "kvrdma_transfer_post_duration_seconds"
    assert value(registry, f"{post}_sum", **r0) == pytest.approx(6e-5)
    assert value(registry, f"{post}_bucket", **r0, le="2.5e-05") == 1
    assert value(registry, f"{post}_bucket", **r0, le="5e-05") == 2
    by = "kvrdma_transfer_bytes"
    assert value(registry, f"{by}_sum", **r0) == 3 * 1024**2 + 5000
    assert value(registry, f"{by}_bucket", **r0, le="4096.0") == 0
    assert value(registry, f"{by}_bucket", **r0, le="16384.0") == 1
    assert value(registry, f"{by}_bucket", **r0, le="4.194304e+06") == 2
    de = "kvrdma_transfer_descriptors"
    assert value(registry, f"{de}_sum", **r0) == 99
    assert value(registry, f"{de}_bucket", **r0, le="4.0") == 1
    assert value(registry, f"{de}_bucket", **r0, le="64.0") == 1
    assert value(registry, f"{de}_bucket", **r0, le="256.0") == 2


def test_pushed_and_pulled_transfers_are_separate_series(
    registry: CollectorRegistry, consumer: KvrdmaMetrics
) -> None:
    for mode, nbytes in (("pull", 1000), ("push", 5000), ("push", 7000)):
        consumer.observe_transfer(remote_engine="prefill-0", mode=mode, outcome="success",
                                  seconds=0.01, post_seconds=1e-4, nbytes=nbytes,
                                  descriptors=4)  # fmt: skip
    consumer.observe_transfer(remote_engine="prefill-1", mode="pull", outcome="success",
                              seconds=0.01, post_seconds=1e-4, nbytes=1, descriptors=1)  # fmt: skip
    pull = {**D, "remote_engine": "prefill-0", "mode": "pull"}
    push = {**D, "remote_engine": "prefill-0", "mode": "push"}
    assert value(registry, "kvrdma_transfers_total", **pull, outcome="success") == 1
    assert value(registry, "kvrdma_transfers_total", **push, outcome="success") == 2
    assert value(registry, "kvrdma_transfers_total", **push, outcome="timeout") == 0
    assert value(registry, "kvrdma_transfer_bytes_sum", **pull) == 1000
    assert value(registry, "kvrdma_transfer_bytes_sum", **push) == 12000
    # a mode never used with a peer exports nothing for it
    never = {**D, "remote_engine": "prefill-1", "mode": "push"}
    assert value(registry, "kvrdma_transfers_total", **never, outcome="success") is None
    assert value(registry, "kvrdma_transfers_in_flight", **never) is None


def test_in_flight_gauge_follows_started_and_finished(
    registry: CollectorRegistry, consumer: KvrdmaMetrics
) -> None:
    for _ in range(3):
        consumer.transfer_started(remote_engine="prefill-0", mode="pull")
    consumer.transfer_started(remote_engine="prefill-0", mode="push")
    consumer.transfer_started(remote_engine="prefill-1", mode="pull")
    consumer.transfer_finished(remote_engine="prefill-0", mode="pull")
    name = "kvrdma_transfers_in_flight"
    assert value(registry, name, **D, remote_engine="prefill-0", mode="pull") == 2
    assert value(registry, name, **D, remote_engine="prefill-0", mode="push") == 1
    assert value(registry, name, **D, remote_engine="prefill-1", mode="pull") == 1
    consumer.transfer_finished(remote_engine="prefill-1", mode="pull")
    consumer.transfer_finished(remote_engine="prefill-0", mode="push")
    assert value(registry, name, **D, remote_engine="prefill-1", mode="pull") == 0
    assert value(registry, name, **D, remote_engine="prefill-0", mode="push") == 0


def test_failures_invalid_blocks_and_requests(
    registry: CollectorRegistry, consumer: KvrdmaMetrics
) -> None:
    consumer.invalid_blocks(remote_engine="prefill-0", n=7)
    consumer.invalid_blocks(remote_engine="prefill-0", n=5)
    consumer.failed_notification(remote_engine="prefill-0", reason="send_failed")
    consumer.failed_notification(remote_engine="prefill-0", reason="send_failed")
    consumer.request_finished(outcome="success")
    consumer.request_finished(outcome="invalid_blocks")
    consumer.request_finished(outcome="invalid_blocks")
    r0 = {**D, "remote_engine": "prefill-0"}
    assert value(registry, "kvrdma_invalid_blocks_total", **r0) == 12
    fn = "kvrdma_failed_notifications_total"
    assert value(registry, fn, **r0, reason="send_failed") == 2
    assert value(registry, fn, **r0, reason="malformed") == 0
    assert value(registry, "kvrdma_requests_total", **D, outcome="success") == 1
    assert value(registry, "kvrdma_requests_total", **D, outcome="invalid_blocks") == 2
    assert value(registry, "kvrdma_requests_total", **D, outcome="failed") == 0


def test_engines_named_past_the_peer_cap_share_one_series(
    registry: CollectorRegistry, producer: KvrdmaMetrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Peers name themselves (a notification's sender engine): a flood of new names ends in
    `other`, not in new series without end; engines seen before keep their own."""
    monkeypatch.setattr(t, "MAX_PEERS", 3)
    for i in range(50):
        producer.failed_notification(remote_engine=f"ghost-{i}", reason="unknown_request")
    producer.failed_notification(remote_engine="ghost-1", reason="unknown_request")
    engines = {
        s.labels["remote_engine"]
        for family in registry.collect()
        for s in family.samples
        if "remote_engine" in s.labels
    }
    assert engines == {"ghost-0", "ghost-1", "ghost-2", t.OTHER_PEERS}
    fn, p = "kvrdma_failed_notifications_total", {**P, "reason": "unknown_request"}
    assert value(registry, fn, **p, remote_engine="ghost-1") == 2
    assert value(registry, fn, **p, remote_engine=t.OTHER_PEERS) == 47


def test_a_forgotten_peer_leaves_no_series_and_makes_room(
    registry: CollectorRegistry, consumer: KvrdmaMetrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine dropped as idle takes its series along (engine ids are not reused), and the
    next engine takes its place under the cap instead of counting as `other`."""
    monkeypatch.setattr(t, "MAX_PEERS", 2)

    def engines() -> set[str]:
        return {
            s.labels["remote_engine"]
            for family in registry.collect()
            for s in family.samples
            if "remote_engine" in s.labels
        }

    for engine in ("prefill-0", "prefill-1"):
        consumer.handshake(remote_engine=engine, outcome="success", seconds=0.01)
        consumer.transfer_started(remote_engine=engine, mode="pull")
        done = {"seconds": 0.1, "post_seconds": 0.01, "nbytes": 4096, "descriptors": 2}
        consumer.observe_transfer(remote_engine=engine, mode="pull", outcome="success", **done)
        consumer.transfer_finished(remote_engine=engine, mode="pull")
    consumer.forget_peer("prefill-0")
    consumer.forget_peer("never-seen")  # nothing to drop
    assert engines() == {"prefill-1"}
    consumer.invalid_blocks(remote_engine="prefill-2", n=1)
    assert engines() == {"prefill-1", "prefill-2"}


def test_a_forgotten_peer_seen_again_counts_from_zero(
    registry: CollectorRegistry, consumer: KvrdmaMetrics
) -> None:
    """A decoder keeps each peer's transfer series at hand between updates; forgetting the
    peer drops them, and its next transfer lands in new series, not in the removed ones."""
    x0 = {**D, "remote_engine": "prefill-0", "mode": "pull"}
    done = {"seconds": 0.1, "post_seconds": 0.01, "nbytes": 4096, "descriptors": 2}
    for _ in range(2):  # before and after the forget: one transfer each, counted from zero
        consumer.transfer_started(remote_engine="prefill-0", mode=TransferMode.PULL)
        consumer.observe_transfer(
            remote_engine="prefill-0", mode=TransferMode.PULL, outcome=Outcome.SUCCESS, **done
        )
        assert value(registry, "kvrdma_transfers_total", **x0, outcome="success") == 1
        assert value(registry, "kvrdma_transfer_duration_seconds_count", **x0) == 1
        assert value(registry, "kvrdma_transfers_in_flight", **x0) == 1
        consumer.forget_peer("prefill-0")
        assert value(registry, "kvrdma_transfers_total", **x0, outcome="success") is None


def test_corrupt_blocks_and_transfers_are_counted_from_zero(
    registry: CollectorRegistry, consumer: KvrdmaMetrics
) -> None:
    r0 = {**D, "remote_engine": "prefill-0"}
    x0 = {**r0, "mode": "pull"}
    consumer.transfer_started(remote_engine="prefill-0", mode=TransferMode.PULL)
    assert value(registry, "kvrdma_corrupt_blocks_total", **r0) == 0
    assert value(registry, "kvrdma_transfers_total", **x0, outcome="corrupt") == 0
    consumer.corrupt_blocks(remote_engine="prefill-0", n=3)
    consumer.observe_transfer(
        remote_engine="prefill-0",
        mode=TransferMode.PULL,
        outcome=Outcome.CORRUPT,
        seconds=0.01,
        post_seconds=0.001,
        nbytes=0,
        descriptors=8,
    )
    assert value(registry, "kvrdma_corrupt_blocks_total", **r0) == 3
    assert value(registry, "kvrdma_transfers_total", **x0, outcome="corrupt") == 1
    assert value(registry, "kvrdma_transfer_bytes_count", **x0) is None  # not a success


def test_producer_leases_and_freed_blocks(
    registry: CollectorRegistry, producer: KvrdmaMetrics
) -> None:
    assert value(registry, "kvrdma_expired_leases_total", **P) == 0
    assert value(registry, "kvrdma_freed_blocks_total", **P, reason="lease_expired") == 0
    producer.freed_blocks(32, reason="notified")
    producer.expired_leases()
    producer.expired_leases(2)
    producer.freed_blocks(48, reason="lease_expired")
    producer.failed_notification(remote_engine="decode-0", reason="unknown_request")
    assert value(registry, "kvrdma_expired_leases_total", **P) == 3
    assert value(registry, "kvrdma_freed_blocks_total", **P, reason="notified") == 32
    assert value(registry, "kvrdma_freed_blocks_total", **P, reason="lease_expired") == 48
    for reason in ("pushed", "push_ended_short", "push_lease_expired", "push_aborted"):
        assert value(registry, "kvrdma_freed_blocks_total", **P, reason=reason) == 0
    producer.freed_blocks(8, reason="pushed")
    assert value(registry, "kvrdma_freed_blocks_total", **P, reason="pushed") == 8
    assert (
        value(registry, "kvrdma_failed_notifications_total", **P, remote_engine="decode-0",
              reason="unknown_request") == 1
    )  # fmt: skip


def test_handshakes(registry: CollectorRegistry, consumer: KvrdmaMetrics) -> None:
    consumer.handshake(remote_engine="prefill-0", outcome="success", seconds=0.004)
    consumer.handshake(remote_engine="prefill-0", outcome="timeout", seconds=5.0)
    consumer.handshake(remote_engine="prefill-0", outcome="incompatible", seconds=0.01)
    r0 = {**D, "remote_engine": "prefill-0"}
    hs = "kvrdma_handshakes_total"
    assert value(registry, hs, **r0, outcome="success") == 1
    assert value(registry, hs, **r0, outcome="timeout") == 1
    assert value(registry, hs, **r0, outcome="incompatible") == 1
    assert value(registry, hs, **r0, outcome="refused") == 0
    hd = "kvrdma_handshake_duration_seconds"
    assert value(registry, f"{hd}_count", **r0) == 1
    assert value(registry, f"{hd}_sum", **r0) == pytest.approx(0.004)
    assert value(registry, f"{hd}_bucket", **r0, le="0.0025") == 0
    assert value(registry, f"{hd}_bucket", **r0, le="0.005") == 1


def test_gauges_start_at_zero_and_are_set(
    registry: CollectorRegistry, consumer: KvrdmaMetrics
) -> None:
    for name in ("registered_bytes", "registered_regions", "connected_remote_engines"):
        assert value(registry, f"kvrdma_{name}", **D) == 0
    consumer.set_registered(nbytes=17 * 1024**3, regions=64)
    consumer.set_connected_peers(3)
    assert value(registry, "kvrdma_registered_bytes", **D) == 17 * 1024**3
    assert value(registry, "kvrdma_registered_regions", **D) == 64
    assert value(registry, "kvrdma_connected_remote_engines", **D) == 3
    consumer.set_connected_peers(0)
    assert value(registry, "kvrdma_connected_remote_engines", **D) == 0


def test_one_registry_holds_one_kvrdma_metrics(registry: CollectorRegistry) -> None:
    # each rank (process) owns one registry; a second set on the same one fails loudly
    KvrdmaMetrics(registry=registry, engine_id="e", role="both", tp_rank=0)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        KvrdmaMetrics(registry=registry, engine_id="e", role="both", tp_rank=1)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: m.observe_transfer(remote_engine="p", mode="pull", outcome="ok", seconds=0,
                                      post_seconds=0, nbytes=0, descriptors=0),
         "transfer outcome"),
        (lambda m: m.observe_transfer(remote_engine="p", mode="write", outcome="success",
                                      seconds=0, post_seconds=0, nbytes=0, descriptors=0),
         "transfer mode"),
        (lambda m: m.transfer_started(remote_engine="p", mode="read"), "transfer mode"),
        (lambda m: m.failed_notification(remote_engine="p", reason="lost"), "notification"),
        (lambda m: m.freed_blocks(1, reason="gc"), "freed-block"),
        (lambda m: m.handshake(remote_engine="p", outcome="ok", seconds=0), "handshake"),
        (lambda m: m.request_finished(outcome="partial"), "request outcome"),
    ],
)  # fmt: skip
def test_unknown_label_values_are_refused(
    consumer: KvrdmaMetrics, call: Callable[[KvrdmaMetrics], None], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        call(consumer)


def test_unknown_role_is_refused(registry: CollectorRegistry) -> None:
    with pytest.raises(ValueError, match="role must be one of"):
        KvrdmaMetrics(registry=registry, engine_id="e", role="decoder", tp_rank=0)


def test_every_series_carries_the_worker_labels_and_no_request_id(
    registry: CollectorRegistry, consumer: KvrdmaMetrics
) -> None:
    consumer.observe_transfer(remote_engine="p", mode="pull", outcome="success", seconds=0.1,
                              post_seconds=0.001, nbytes=1, descriptors=1)  # fmt: skip
    consumer.handshake(remote_engine="p", outcome="success", seconds=0.1)
    consumer.transfer_started(remote_engine="p", mode="push")
    samples = [s for fam in registry.collect() for s in fam.samples]
    assert samples
    for s in samples:
        assert {k: s.labels[k] for k in D} == D, s
        assert not any("request" in k for k in s.labels), s


def test_metric_docs_describe_exactly_what_is_exported(
    registry: CollectorRegistry, consumer: KvrdmaMetrics
) -> None:
    t.build_info(registry)
    consumer.observe_transfer(remote_engine="p", mode="pull", outcome="success", seconds=0.1,
                              post_seconds=0.001, nbytes=1, descriptors=1)  # fmt: skip
    consumer.handshake(remote_engine="p", outcome="success", seconds=0.1)
    consumer.transfer_started(remote_engine="p", mode="push")
    consumer.set_transport(kind="tcp", ucx_tls="tcp", ucx_net_devices="eth0")
    exported: dict[str, tuple[str, frozenset[str]]] = {}
    for fam in registry.collect():
        name = fam.name + ("_total" if fam.type == "counter" else "")
        labels = frozenset(k for s in fam.samples for k in s.labels if k != "le")
        exported[name] = (fam.type, labels)
    documented = {
        d.name: (d.type, frozenset(d.labels))
        for d in t.METRIC_DOCS
        if d is not t.ENDPOINT_UP and d not in t.AGENT_DOCS and d not in t.STAGE_DOCS
    }
    assert exported == documented
    for d in t.METRIC_DOCS:
        assert d.name.startswith("kvrdma_")
        assert (d.type == "counter") == d.name.endswith("_total")
        assert bool(d.buckets) == (d.type == "histogram")
        assert list(d.buckets) == sorted(set(d.buckets))


def test_bucket_ranges_cover_the_real_range() -> None:
    assert t.SECONDS_BUCKETS[0] == 1e-5 and t.SECONDS_BUCKETS[-1] == 10.0
    assert t.BYTES_BUCKETS[0] == 1024 and t.BYTES_BUCKETS[-1] >= 1024**3
    assert t.DESCRIPTOR_BUCKETS[0] == 1 and t.DESCRIPTOR_BUCKETS[-1] == 1024**2
    assert t.HANDSHAKE_BUCKETS[-1] >= 5.0 * 3  # HANDSHAKE_TIMEOUT_SECONDS × retries


def test_build_info_carries_version_and_protocol(registry: CollectorRegistry) -> None:
    from kvrdma.handshake.wire import PROTOCOL_VERSION

    t.build_info(registry)
    labels = {"version": __version__, "protocol_version": str(PROTOCOL_VERSION)}
    assert registry.get_sample_value("kvrdma_build_info", labels) == 1


def test_vllm_parity_covers_the_seven_nixl_series_with_like_types() -> None:
    seven = {
        "nixl_xfer_time_seconds": "histogram",
        "nixl_post_time_seconds": "histogram",
        "nixl_bytes_transferred": "histogram",
        "nixl_num_descriptors": "histogram",
        "nixl_num_failed_transfers": "counter",
        "nixl_num_failed_notifications": "counter",
        "nixl_num_kv_expired_reqs": "counter",
    }
    assert set(t.VLLM_PARITY) == set(seven)
    types = {d.name: d.type for d in t.METRIC_DOCS}
    for vllm_name, ours in t.VLLM_PARITY.items():
        assert types[ours.split("{")[0]] == seven[vllm_name], vllm_name


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    types = re.findall(r"^# TYPE (\S+) ", text, flags=re.M)
    assert len(types) == len(set(types)), "a family is exposed twice"
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_http_server_serves_the_registry_on_a_free_port(
    registry: CollectorRegistry, consumer: KvrdmaMetrics
) -> None:
    consumer.invalid_blocks(remote_engine="prefill-0", n=4)
    server, port = t.start_http_server(registry, "127.0.0.1", 0)
    try:
        assert port > 0 and server.port == port
        samples = _scrape(port)
        key = (
            "kvrdma_invalid_blocks_total",
            tuple(sorted({**D, "remote_engine": "prefill-0"}.items())),
        )
        assert samples[key] == 4
    finally:
        server.shutdown()
    server.close()  # idempotent
    with pytest.raises(OSError):
        _scrape(port)


def test_aggregator_merges_local_and_worker_families_and_reports_endpoints() -> None:
    workers = []
    try:
        for rank in (0, 1):
            reg = CollectorRegistry()
            m = KvrdmaMetrics(registry=reg, engine_id="d", role="consumer", tp_rank=rank)
            t.build_info(reg)
            m.invalid_blocks(remote_engine="p", n=rank + 1)
            workers.append(t.start_http_server(reg, "127.0.0.1", 0)[0])
        local = CollectorRegistry()
        KvrdmaMetrics(registry=local, engine_id="d", role="sidecar", tp_rank=0).handshake(
            remote_engine="p", outcome="refused", seconds=0.0
        )
        t.build_info(local)
        dead = "127.0.0.1:9"  # discard port: nothing listens there
        endpoints = [f"127.0.0.1:{w.port}" for w in workers] + [dead]
        agg = aggregated_registry(endpoints, local=local, timeout=2.0)
        server, port = t.start_http_server(agg, "127.0.0.1", 0)
        try:
            samples = _scrape(port)  # also proves the merged exposition parses
        finally:
            server.shutdown()
    finally:
        for w in workers:
            w.shutdown()

    def get(name: str, **labels: str) -> float | None:
        return samples.get((name, tuple(sorted(labels.items()))))

    for rank in (0, 1):
        w = {"engine_id": "d", "role": "consumer", "tp_rank": str(rank), "remote_engine": "p"}
        assert get("kvrdma_invalid_blocks_total", **w) == rank + 1
    sidecar = {"engine_id": "d", "role": "sidecar", "tp_rank": "0", "remote_engine": "p"}
    assert get("kvrdma_handshakes_total", **sidecar, outcome="refused") == 1
    for e in endpoints[:2]:
        assert get("kvrdma_worker_endpoint_up", endpoint=e) == 1
    assert get("kvrdma_worker_endpoint_up", endpoint=dead) == 0
    build = [k for k in samples if k[0] == "kvrdma_build_info"]
    assert len(build) == 1  # three identical series, exposed once
    assert not [k for k in samples if k[0].endswith("_created")]
    assert all(not math.isnan(v) for v in samples.values())


class _Garbage(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"this is { not the exposition format\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_worker_answering_garbage_counts_as_down_and_spoils_nothing() -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        local = CollectorRegistry()
        KvrdmaMetrics(registry=local, engine_id="d", role="sidecar", tp_rank=0)
        endpoint = f"127.0.0.1:{httpd.server_address[1]}"
        agg = aggregated_registry([endpoint], local=local, timeout=2.0)
        assert agg.get_sample_value("kvrdma_worker_endpoint_up", {"endpoint": endpoint}) == 0
        labels = {"engine_id": "d", "role": "sidecar", "tp_rank": "0"}
        assert agg.get_sample_value("kvrdma_registered_bytes", labels) == 0
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_agent_docs_describe_exactly_what_the_sidecar_exports() -> None:
    from kvrdma.cli.agent import AgentCollector
    from kvrdma.handshake import HandshakeServer

    server = HandshakeServer("127.0.0.1", 0)
    try:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(AgentCollector(server, lambda: (False, {})))
        exported: dict[str, tuple[str, str, frozenset[str]]] = {}
        for fam in registry.collect():
            name = fam.name + ("_total" if fam.type == "counter" else "")
            labels = frozenset(k for s in fam.samples for k in s.labels)
            exported[name] = (fam.type, fam.documentation, labels)
        documented = {d.name: (d.type, d.help, frozenset(d.labels)) for d in t.AGENT_DOCS}
        # no engine has published yet: the per-engine gauge has no series (no labels seen)
        exported["kvrdma_agent_published_ranks"] = documented["kvrdma_agent_published_ranks"]
        assert exported == documented
        assert registry.get_sample_value("kvrdma_agent_ready") == 0.0
        assert registry.get_sample_value("kvrdma_handshake_requests_total", {"outcome": "ok"}) == 0
        for sock in ("side_channel", "publish"):  # each socket and reason, before any drop
            for reason in ("unfinished_message", "idle"):
                labels = {"socket": sock, "reason": reason}
                value = registry.get_sample_value(t.AGENT_DROPPED_CONNECTIONS.name, labels)
                assert value == 0, labels
    finally:
        server.close()


def test_the_agent_serves_exactly_the_sidecar_docs_as_catalogued() -> None:
    from kvrdma.cli.agent import AgentCollector, SidecarSettings, agent_registry
    from kvrdma.handshake import HandshakeServer

    settings = SidecarSettings(
        engine_id="e", kv_role="kv_producer", enforce_compat=True, host="127.0.0.1",
        base_port=0, dp_index=0, http_host="127.0.0.1", http_port=0, publish="tcp://x:1",
        expected_ranks=1, worker_metrics=("http://127.0.0.1:9/metrics",),
        worker_metrics_timeout=0.5,
    )  # fmt: skip
    server = HandshakeServer("127.0.0.1", 0)
    try:
        registry = agent_registry(settings, AgentCollector(server, lambda: (False, {})))
        exported = {
            fam.name + ("_total" if fam.type == "counter" else ""): (
                fam.type, fam.documentation, frozenset(k for s in fam.samples for k in s.labels)
            )
            for fam in registry.collect()
        }  # fmt: skip
    finally:
        server.close()
    documented = {d.name: (d.type, d.help, frozenset(d.labels)) for d in t.SIDECAR_DOCS}
    # no engine has published yet: the per-engine gauge has no series (no labels seen)
    del documented["kvrdma_agent_published_ranks"]
    assert exported == documented


def test_transport_info_keeps_one_series_per_worker(
    registry: CollectorRegistry, consumer: KvrdmaMetrics
) -> None:
    """A new transport setting replaces the old series: a scrape never shows rdma and tcp."""
    consumer.set_transport(kind="rdma", ucx_tls="rc,tcp", ucx_net_devices="mlx5_0:1")
    consumer.set_transport(kind="tcp", ucx_tls="rc,tcp", ucx_net_devices="eth0")
    fam = next(f for f in registry.collect() if f.name == "kvrdma_transport_info")
    assert [(s.labels["transport"], s.labels["ucx_net_devices"], s.value) for s in fam.samples] == [
        ("tcp", "eth0", 1.0)
    ]
