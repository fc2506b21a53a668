"""kvrdma.scrape: the sidecar's scrape-time merge of worker endpoints, against real local
HTTP servers (a good worker, a dead port, one that never answers, one that trickles)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from kvrdma import scrape
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


@contextmanager
def _trickler(head: bytes) -> Iterator[int]:
    """A port that answers `head`, then one more byte every 50 ms, forever."""
    stop = threading.Event()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.1)

    def trickle(conn: socket.socket) -> None:
        with conn:
            try:
                conn.sendall(head)
                while not stop.wait(0.05):
                    conn.sendall(b"x")
            except OSError:
                pass

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=trickle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(srv.getsockname()[1])
    finally:
        stop.set()
        thread.join(timeout=5)
        srv.close()


HEADER = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n# "


@pytest.fixture
def trickle_port() -> Iterator[int]:
    """A port that answers a valid header, then one body byte every 50 ms, forever."""
    with _trickler(HEADER) as port:
        yield port


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


def test_an_answer_in_time_is_up_however_long_parsing_it_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timeout = 1.0
    parse = scrape.parse_families

    def slow_parse(text: str) -> list[Metric]:
        time.sleep(timeout + 0.5)  # started once the answer is in, so it ends past the deadline
        return parse(text)

    monkeypatch.setattr(scrape, "parse_families", slow_parse)
    server, endpoint = _worker()
    try:
        agg = aggregated_registry([endpoint], timeout=timeout)
        text = generate_latest(agg).decode()
    finally:
        server.shutdown()
    assert f'kvrdma_worker_endpoint_up{{endpoint="{endpoint}"}} 1.0' in text
    assert 'kvrdma_invalid_blocks_total{engine_id="d",remote_engine="p"' in text


def _scrape_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvrdma-scrape")]


@pytest.mark.parametrize("head", [b"HTTP/1.0 200 OK\r\nX-Slow: ", HEADER], ids=["headers", "body"])
def test_a_trickling_worker_holds_no_fetch_thread_past_the_deadline(head: bytes) -> None:
    with _trickler(head) as port:
        agg = aggregated_registry([f"127.0.0.1:{port}"], timeout=0.3)
        for _ in range(3):
            assert agg.get_sample_value(t.ENDPOINT_UP.name, {"endpoint": f"127.0.0.1:{port}"}) == 0
        stop = time.monotonic() + 1.0
        while _scrape_threads() and time.monotonic() < stop:
            time.sleep(0.02)
        assert not _scrape_threads(), "fetch threads still reading well past their deadline"


@contextmanager
def _serving(body: bytes) -> Iterator[str]:
    """A worker endpoint that answers every GET with `body`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


class _Fixed:
    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> list[Metric]:
        return [self.family]


@pytest.mark.parametrize(
    ("own", "theirs"),
    [
        (CounterMetricFamily("kvrdma_x", "h", value=1), "kvrdma_x_total gauge"),
        (HistogramMetricFamily("kvrdma_x", "h", [("+Inf", 1)], 1), "kvrdma_x_count gauge"),
        (GaugeMetricFamily("kvrdma_x_total", "h", value=1), "kvrdma_x_total counter"),
        (GaugeMetricFamily("kvrdma_x", "h", value=1), "kvrdma_x_total counter"),
    ],
    ids=["gauge-as-counter-sample", "gauge-as-histogram-sample", "counter-over-gauge", "same-name"],
)
def test_a_worker_family_clashing_with_an_earlier_one_is_dropped_with_a_warning(
    own: Metric, theirs: str, caplog: pytest.LogCaptureFixture
) -> None:
    local = CollectorRegistry()
    local.register(_Fixed(own))
    name, kind = theirs.split()
    body = f'# TYPE {name} {kind}\n{name}{{tp_rank="0"}} 7\n# TYPE kvrdma_fine gauge\n'
    with _serving(f'{body}kvrdma_fine{{tp_rank="0"}} 3\n'.encode()) as endpoint:
        agg = aggregated_registry([endpoint], local=local, timeout=2.0)
        with caplog.at_level(logging.WARNING, logger="kvrdma.scrape"):
            text = generate_latest(agg).decode()
            strict = openmetrics.generate_latest(agg).decode()
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types)), types
    list(text_string_to_metric_families(strict))  # a strict parser refuses a name exposed twice
    assert 'kvrdma_fine{tp_rank="0"} 3.0' in text  # the worker's other families still merge
    assert 'tp_rank="0"} 7.0' not in text
    assert f'kvrdma_worker_endpoint_up{{endpoint="{endpoint}"}} 1.0' in text
    warned = [r.getMessage() for r in caplog.records if endpoint in r.getMessage()]
    assert len(warned) == 1, caplog.text  # named once, not on every scrape


def test_a_workers_created_series_are_dropped_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reg = CollectorRegistry()
    m = KvrdmaMetrics(registry=reg, engine_id="p", role="producer", tp_rank=0)
    m.observe_transfer(remote_engine="d", mode="pull", outcome="success", seconds=0.01,
                       post_seconds=1e-4, nbytes=1 << 20, descriptors=8)  # fmt: skip
    m.handshake(remote_engine="d", outcome=t.HANDSHAKE_OUTCOMES[0], seconds=0.01)
    server, port = t.start_http_server(reg, "127.0.0.1", 0)
    try:
        worker = generate_latest(reg).decode()
        agg = aggregated_registry([f"127.0.0.1:{port}"], timeout=2.0)
        with caplog.at_level(logging.WARNING, logger="kvrdma.scrape"):
            text = generate_latest(agg).decode()
            strict = openmetrics.generate_latest(agg).decode()
    finally:
        server.shutdown()
    assert "# TYPE kvrdma_transfers_created gauge" in worker  # what the text format carries
    assert "kvrdma_transfer_duration_seconds_created{" in worker
    assert caplog.records == []
    assert "_created" not in text and "_created" not in strict
    labels = 'engine_id="p",mode="pull",outcome="success",remote_engine="d",role="producer"'
    assert f'kvrdma_transfers_total{{{labels},tp_rank="0"}} 1.0' in text
    assert "kvrdma_transfer_duration_seconds_count{" in text
    assert "kvrdma_handshake_duration_seconds_sum{" in text


def test_an_untyped_created_series_beside_its_histogram_is_dropped_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = b'# TYPE h histogram\nh_bucket{le="+Inf"} 1\nh_count 1\nh_sum 2\nh_created 9\n'
    with _serving(body) as endpoint, caplog.at_level(logging.WARNING, logger="kvrdma.scrape"):
        agg = aggregated_registry([endpoint], timeout=2.0)
        assert agg.get_sample_value("h_count") == 1
        assert agg.get_sample_value("h_created") is None
    assert caplog.records == []


def test_an_answer_that_is_no_exposition_reads_down_naming_its_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with _serving(b"# TYPE kvrdma_x gauge\nkvrdma_x 1\nkvrdma_y{a=1} 2\n") as endpoint:
        agg = aggregated_registry([endpoint], timeout=2.0)
        with caplog.at_level(logging.WARNING, logger="kvrdma.scrape"):
            assert agg.get_sample_value(t.ENDPOINT_UP.name, {"endpoint": endpoint}) == 0
            assert agg.get_sample_value("kvrdma_x") is None
    assert f"{endpoint} not scraped: line 3: expected" in caplog.text


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
    for bad, rank in (("x", 0), ("-1", 0), ("0", 0), ("0", 1), ("65535", 1)):
        with pytest.raises(ConfigError, match="KVRDMA_METRICS_PORT"):
            worker_metrics_port(rank, {"KVRDMA_METRICS_PORT": bad})
