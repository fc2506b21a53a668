"""`kvrdma agent` as a real process: publish over ipc, readiness, metrics, peers, SIGTERM."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvrdma.cli.agent import main as agent_main
from kvrdma.cli.main import main as kvrdma_main
from kvrdma.handshake import HandshakeClient, SidecarPublisher
from tests.integration.sidecar_helpers import (
    CONFIG,
    ENGINE,
    HOST,
    Agent,
    dry_run,
    http_get,
    metric,
    worker,
)

pytestmark = pytest.mark.timeout(60)


def test_agent_serves_published_ranks_and_stops_on_sigterm(
    agent: Agent, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    assert agent.endpoints["publish"] == agent.publish
    assert http_get(agent.http + "/healthz")[0] == 200
    status, body = http_get(agent.http + "/readyz")
    assert status == 503
    assert json.loads(body)["missing_ranks"] == [0, 1]

    with SidecarPublisher(agent.publish, context=ctx, timeout=5.0) as pub:
        assert pub.publish(worker(0)).published_ranks == [0]
        status, body = http_get(agent.http + "/readyz")
        assert (status, json.loads(body)["missing_ranks"]) == (503, [1])
        assert pub.publish(worker(1)).published_ranks == [0, 1]
    status, body = http_get(agent.http + "/readyz")
    assert status == 200
    assert json.loads(body) == {
        "ready": True,
        "engine_id": ENGINE,
        "dp_index": 0,
        "expected_ranks": 2,
        "published_ranks": [0, 1],
        "missing_ranks": [],
    }

    with HandshakeClient(context=ctx, timeout=5.0, tp_size=1, compat_hash="d" * 64) as peer:
        got = peer.fetch(HOST, agent.side_port, ENGINE, [0, 1])
    assert got == {0: worker(0), 1: worker(1)}

    status, text = http_get(agent.http + "/metrics")
    assert status == 200
    assert metric(text, 'kvrdma_handshake_requests_total{outcome="ok"}') == 1.0
    assert metric(text, 'kvrdma_handshake_requests_total{outcome="bad"}') == 0.0
    assert metric(text, 'kvrdma_agent_publishes_total{outcome="ok"}') == 2.0
    assert metric(text, f'kvrdma_agent_published_ranks{{dp_index="0",engine_id="{ENGINE}"}}') == 2
    assert metric(text, "kvrdma_agent_ready") == 1.0
    assert http_get(agent.http + "/nope")[0] == 404

    t0 = time.monotonic()
    agent.proc.send_signal(signal.SIGTERM)
    rc = agent.proc.wait(timeout=5)
    assert time.monotonic() - t0 < 1.0
    assert rc == 0
    assert not Path(agent.publish[len("ipc://") :]).exists()  # socket file removed


def test_sigint_also_exits_cleanly(agent: Agent) -> None:
    agent.proc.send_signal(signal.SIGINT)
    assert agent.proc.wait(timeout=5) == 0


def test_bad_frames_are_counted_in_metrics(
    agent: Agent, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"tcp://{HOST}:{agent.side_port}")
        dealer.send(b"\xc1garbage")
        assert dealer.poll(5000)
        dealer.recv()
    finally:
        dealer.close(linger=0)
    _, text = http_get(agent.http + "/metrics")
    assert metric(text, 'kvrdma_handshake_requests_total{outcome="bad"}') == 1.0


def test_dry_run_prints_effective_settings(tmp_path: Path) -> None:
    path = tmp_path / "kv.json"
    path.write_text(CONFIG)
    res = dry_run("--config", str(path), "--dp-index", "2", VLLM_NIXL_SIDE_CHANNEL_PORT="6000")
    assert res.returncode == 0, res.stderr
    out: dict[str, Any] = json.loads(res.stdout)
    assert out["engine_id"] == ENGINE
    assert (out["base_port"], out["dp_index"], out["port"]) == (6000, 2, 6002)
    assert out["host"] == "localhost" and out["http_host"] == "127.0.0.1"
    assert out["enforce_compat"] is True


def test_dry_run_reads_config_from_environment() -> None:
    res = dry_run(KVRDMA_KV_TRANSFER_CONFIG=CONFIG, VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.2")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["host"] == "127.0.0.2"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--config", '{"kv_connector": "NixlConnector", "kv_role": "sender"}'], "kv_role"),
        (["--config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'], "engine_id"),
        (["--config", "/nonexistent/kv.json"], "no such file"),
        ([], "--config"),
        (["--config", CONFIG, "--expected-ranks", "0"], "--expected-ranks"),
        # a typo must not make the agent list (and wait for) a trillion ranks
        (["--config", CONFIG, "--expected-ranks", "10" + "0" * 12], "in 1..1024"),
        (["--config", CONFIG, "--port", "70000"], "--port"),
        (["--config", CONFIG, "--http-host", "no such host"], "--http-host: expected a host name"),
        (["--config", CONFIG, "--http-host", "198.51.100.7"], "is not an address of this host"),
        (["--config", CONFIG, "--publish", "/tmp/x.sock"], "--publish"),
        (["--config", CONFIG, "--publish", "tcp://127.0.0.1:99999"], "--publish: expected tcp:"),
        (["--config", CONFIG, "--publish", "tcp://127.0.0.1:abc"], "PORT an integer in 0..65535"),
        (["--config", CONFIG, "--worker-metrics", "nope"], "--worker-metrics: expected HOST:PORT"),
        (["--config", CONFIG, "--worker-metrics", "h:1,h:1/"], "listed twice"),
        (["--config", CONFIG, "--worker-metrics-timeout", "0"], "--worker-metrics-timeout"),
        (["--config", CONFIG, "--worker-metrics", "localhost:9400"], "this agent's own"),
    ],
)
def test_dry_run_rejects_bad_config(args: list[str], fragment: str) -> None:
    res = dry_run(*args)
    assert res.returncode != 0
    assert fragment in res.stderr
    assert res.stdout == ""


@pytest.mark.parametrize("level", ["TRACE", "BASIC_FORMAT"])
def test_an_unknown_log_level_is_refused_naming_the_flag_and_the_levels(
    level: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused by `kvrdma` and `kvrdma.cli.agent` alike, not read as WARNING or crashing logging."""
    for main in (kvrdma_main, agent_main):
        argv = ["--log-level", level, *(["agent"] if main is kvrdma_main else []), "--dry-run"]
        with pytest.raises(SystemExit) as exited:
            main([*argv, "--config", CONFIG])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "argument --log-level: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL" in err
        assert repr(level) in err
    for known in ("debug", "warn", "FATAL"):  # Python's aliases too
        assert dry_run("--log-level", known, "--config", CONFIG).returncode == 0


def test_dry_run_resolves_worker_metrics_from_flags_then_environment() -> None:
    def endpoints(*args: str, **env: str) -> list[str]:
        res = dry_run("--config", CONFIG, *args, **env)
        assert res.returncode == 0, res.stderr
        return list(json.loads(res.stdout)["worker_metrics"])

    flags = ["--worker-metrics", "127.0.0.1:9401,127.0.0.1:9402", "--worker-metrics", "h:1/m"]
    assert endpoints(*flags, KVRDMA_WORKER_METRICS="ignored:1") == [
        "http://127.0.0.1:9401/metrics", "http://127.0.0.1:9402/metrics", "http://h:1/m"
    ]  # fmt: skip
    assert endpoints(KVRDMA_WORKER_METRICS="a:1, b:2") == [
        "http://a:1/metrics",
        "http://b:2/metrics",
    ]
    # what the pod's engine ranks serve on: base port + rank, for each expected rank
    assert endpoints("--expected-ranks", "2", KVRDMA_METRICS_PORT="9401") == [
        "http://127.0.0.1:9401/metrics", "http://127.0.0.1:9402/metrics"
    ]  # fmt: skip
    assert endpoints() == []
    res = dry_run("--config", CONFIG, KVRDMA_METRICS_PORT="nine")
    assert res.returncode != 0 and "KVRDMA_METRICS_PORT" in res.stderr


def test_agent_merges_worker_metrics_and_a_silent_worker_does_not_hang_it(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from kvrdma.telemetry import KvrdmaMetrics, start_http_server

    registry = CollectorRegistry()
    KvrdmaMetrics(registry=registry, engine_id=ENGINE, role="producer", tp_rank=1).freed_blocks(
        5, reason="notified"
    )
    worker_server, port = start_http_server(registry, HOST, 0)
    silent = socket.socket()
    silent.bind((HOST, 0))
    silent.listen(4)  # accepts, never answers
    good, stuck = (f"http://{HOST}:{p}/metrics" for p in (port, silent.getsockname()[1]))
    agent = Agent(
        tmp_path, "--worker-metrics", f"{good},{stuck}", "--worker-metrics-timeout", "0.5"
    )
    try:
        t0 = time.monotonic()
        status, text = http_get(agent.http + "/metrics")
        elapsed = time.monotonic() - t0
    finally:
        agent.stop()
        worker_server.shutdown()
        silent.close()
    assert status == 200
    assert elapsed < 3.0, f"the scrape took {elapsed:.1f} s with a 0.5 s worker timeout"
    labels = f'engine_id="{ENGINE}",reason="notified",role="producer",tp_rank="1"'
    assert metric(text, f"kvrdma_freed_blocks_total{{{labels}}}") == 5
    assert metric(text, f'kvrdma_worker_endpoint_up{{endpoint="{good}"}}') == 1
    assert metric(text, f'kvrdma_worker_endpoint_up{{endpoint="{stuck}"}}') == 0
    assert metric(text, "kvrdma_agent_ready") == 0
    assert "kvrdma_build_info{" in text


def test_agent_with_a_trickling_worker_still_stops_on_sigterm(tmp_path: Path) -> None:
    stop = threading.Event()
    trickler = socket.socket()
    trickler.bind((HOST, 0))
    trickler.listen(4)

    def trickle() -> None:  # a header, then a byte every 0.1 s: no read ever waits long
        conn, _ = trickler.accept()
        with conn, contextlib.suppress(OSError):  # the agent hangs up at its deadline
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 1000000\r\n\r\n# ")
            while not stop.wait(0.1):
                conn.sendall(b"x")

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    slow = f"http://{HOST}:{trickler.getsockname()[1]}/metrics"
    agent = Agent(tmp_path, "--worker-metrics", slow, "--worker-metrics-timeout", "0.5")
    try:
        status, text = http_get(agent.http + "/metrics")
        assert status == 200
        assert metric(text, f'kvrdma_worker_endpoint_up{{endpoint="{slow}"}}') == 0
        agent.proc.send_signal(signal.SIGTERM)
        rc = agent.proc.wait(timeout=5)
    finally:
        agent.stop()
        stop.set()
        trickler.close()
        thread.join(timeout=5)
    assert rc == 0
