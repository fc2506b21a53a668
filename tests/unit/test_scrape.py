"""kvrdma.scrape: the sidecar's scrape-time merge of worker endpoints, against real local
HTTP servers (a good worker, a dead port, one that never answers, one that trickles)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from kvrdma import telemetry as t
from kvrdma.errors import ConfigError
from kvrdma.scrape import (
    WorkerAggregator,
    aggregated_registry,
    endpoint_url,
    worker_metrics_port,
)
from kvrdma.telemetry import KvrdmaMetrics

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("127.0.0.1:9401", "http://127.0.0.1:9401/metrics"),
        ("http://localhost:9401", "http://localhost:9401/metrics"),
        ("http://localhost:9401/", "http://localhost:9401/metrics"),
        ("https://[::1]:9401/custom/path", "https://[::1]:9401/custom/path"),
        (" 10.0.0.1:80 ", "http://10.0.0.1:80/metrics"),
    ],
)
def test_endpoint_url_accepts_host_port_and_urls(given: str, url: str) -> None:
    assert endpoint_url(given) == url


@pytest.mark.parametrize("bad", ["", "localhost", "localhost:port", "ftp://h:1", "http://:9"])
def test_endpoint_url_rejects_what_is_not_an_endpoint(bad: str) -> None:
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        endpoint_url(bad)


def test_metric_family_takes_name_help_and_labels_from_the_catalogue() -> None:
    counter = t.metric_family(t.AGENT_REQUESTS)
    counter.add_metric(["ok"], 3)
    assert (counter.name, counter.type, counter.documentation) == (
        "kvrdma_handshake_requests", "counter", t.AGENT_REQUESTS.help
    )  # fmt: skip
    assert [(s.name, s.labels) for s in counter.samples] == [
        ("kvrdma_handshake_requests_total", {"outcome": "ok"})
    ]
    gauge = t.metric_family(t.ENDPOINT_UP)
    gauge.add_metric(["e"], 1)
    assert gauge.samples[0].labels == {"endpoint": "e"}
    with pytest.raises(ValueError, match="histogram"):
        t.metric_family(t.TRANSFER_DURATION)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield int(s.getsockname()[1])


@pytest.fixture
def trickle_port() -> Iterator[int]:
    """A port that answers a valid header, then one body byte every 50 ms, forever."""
    stop = threading.Event()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.1)

    def serve() -> None:
        conns = []
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            conns.append(conn)
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n# ")
            while not stop.wait(0.05):
                try:
                    conn.sendall(b"x")
                except OSError:
                    break
        for c in conns:
            c.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(srv.getsockname()[1])
    finally:
        stop.set()
        thread.join(timeout=5)
        srv.close()


def _worker() -> tuple[t.MetricsServer, str]:
    reg = CollectorRegistry()
    KvrdmaMetrics(registry=reg, engine_id="d", role="consumer", tp_rank=0).invalid_blocks(
        remote_engine="p", n=7
    )
    server, port = t.start_http_server(reg, "127.0.0.1", 0)
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("stuck", ["silent", "trickle"])
def test_a_stuck_worker_costs_the_scrape_at_most_the_timeout(
    stuck: str, silent_port: int, trickle_port: int
) -> None:
    server, good = _worker()
    port = silent_port if stuck == "silent" else trickle_port
    bad = f"127.0.0.1:{port}"
    try:
        agg = aggregated_registry([good, bad], timeout=0.5)
        t0 = time.monotonic()
        up = {
            s.labels["endpoint"]: s.value
            for fam in agg.collect()
            if fam.name == t.ENDPOINT_UP.name
            for s in fam.samples
        }
        elapsed = time.monotonic() - t0
        labels = {"engine_id": "d", "role": "consumer", "tp_rank": "0", "remote_engine": "p"}
        assert agg.get_sample_value("kvrdma_invalid_blocks_total", labels) == 7
    finally:
        server.shutdown()
    assert up == {good: 1.0, bad: 0.0}
    assert elapsed < 1.5, f"one scrape took {elapsed:.2f} s with a 0.5 s worker timeout"


def test_without_endpoints_only_the_local_series_are_served() -> None:
    local = CollectorRegistry()
    t.build_info(local)
    names = {fam.name for fam in WorkerAggregator([], local=local).collect()}
    assert names == {"kvrdma_build_info"}


def test_a_bad_endpoint_or_timeout_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="'nope'"):
        WorkerAggregator(["127.0.0.1:1", "nope"])
    with pytest.raises(ValueError, match="timeout"):
        WorkerAggregator([], timeout=0)


def test_worker_metrics_port_is_the_base_plus_the_rank() -> None:
    assert worker_metrics_port(0, {}) is None
    assert worker_metrics_port(3, {"KVRDMA_METRICS_PORT": " "}) is None
    assert worker_metrics_port(0, {"KVRDMA_METRICS_PORT": "9401"}) == 9401
    assert worker_metrics_port(3, {"KVRDMA_METRICS_PORT": "9401"}) == 9404
    for bad, rank in (("x", 0), ("-1", 0), ("0", 0), ("65535", 1)):
        with pytest.raises(ConfigError, match="KVRDMA_METRICS_PORT"):
            worker_metrics_port(rank, {"KVRDMA_METRICS_PORT": bad})
