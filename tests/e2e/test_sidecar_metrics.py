"""Prometheus scraping only `kvrdma agent` sees the engine ranks' transfer series.

Two worker processes with real NIXL (`kvrdma.cli.demo.rank_process` ranks: a producer and a consumer
moving real blocks, each serving its own `/metrics` on a loopback port), and the sidecar
`kvrdma agent --worker-metrics P,D` in its own process, wired as in a pod: the producer
publishes its metadata to the agent's publish socket and the consumer handshakes on the
agent's side channel. A real Prometheus scrapes the agent's port and nothing else. PromQL
over its HTTP API must answer for successful transfers, for invalid blocks after the
producer is killed and a read of it fails, and for `kvrdma_worker_endpoint_up` (1 for both
ranks, then 0 for the killed one, which puts `KvrdmaWorkerMetricsDown` in pending).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest

from kvrdma.cli.demo.rank_process import ProcSpec, run_rank
from kvrdma.testing import free_port
from kvrdma.testing.synthetic import ModelShape

pytestmark = pytest.mark.timeout(120)

SHAPE = ModelShape.parse("layers=2,heads=4,head_dim=32")
BLOCK_SIZE = 16
NUM_BLOCKS = 32
P_ENGINE, D_ENGINE = "prefill-e2e", "decode-e2e"
GOOD_READS = 4
START_S = 60.0  # a rank's imports and first NIXL agent on a loaded 2-core machine
READ_S = 30.0  # a read of a killed producer fails by the default read deadline (10 s)
PROM_S = 20.0  # a few 1 s scrapes
RULE_FILES = sorted(
    (Path(__file__).resolve().parents[2] / "metrics" / "prometheus").glob("*_rules.yml")
)


def _config(role: str, engine: str) -> dict[str, Any]:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "engine_id": engine,
        "kv_load_failure_policy": "recompute",
    }


class Rank:
    """One `rank_process` rank process and its pipe; every receive has a deadline."""

    def __init__(self, spec: ProcSpec) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc: BaseProcess = ctx.Process(target=run_rank, args=(spec, child), daemon=True)
        self.proc.start()
        child.close()
        self.name = f"{spec.role}{spec.rank}"

    def recv(self, kind: str, timeout: float) -> tuple[Any, ...]:
        """The next message of `kind` (others dropped); fails on an error, exit or timeout."""
        end = time.monotonic() + timeout
        while self.conn.poll(max(0.0, end - time.monotonic())):
            try:
                msg: tuple[Any, ...] = self.conn.recv()
            except EOFError:
                self.proc.join(5)
                pytest.fail(f"rank {self.name} exited ({self.proc.exitcode}) before {kind!r}")
            if msg[0] == "error":
                pytest.fail(f"rank {self.name}: {msg[3]}\n{msg[4]}")
            if msg[0] == kind:
                return msg
        pytest.fail(f"rank {self.name}: no {kind!r} within {timeout:.0f} s (alive: {self.alive})")

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        if self.proc.pid is not None and self.alive:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        if self.alive:
            with contextlib.suppress(OSError):
                self.conn.send(("stop",))
            self.proc.join(5)
        self.kill()
        self.conn.close()


@pytest.fixture
def ranks() -> Iterator[Callable[[ProcSpec], Rank]]:
    started: list[Rank] = []

    def start(spec: ProcSpec) -> Rank:
        started.append(Rank(spec))
        return started[-1]

    try:
        yield start
    finally:
        for rank in reversed(started):
            rank.stop()


def _spec(role: str, metrics_port: int, side_port: int, publish: str) -> ProcSpec:
    producer = role == "P"
    return ProcSpec(
        role=role,
        rank=0,
        tp_size=1,
        engine_id=P_ENGINE if producer else D_ENGINE,
        cache_layout="split_kv",
        kv_layout="NHD",
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        shape=SHAPE,
        kv_transfer_config=_config(
            "kv_producer" if producer else "kv_consumer", P_ENGINE if producer else D_ENGINE
        ),
        handshake_host="127.0.0.1",
        handshake_port=side_port,
        publish_address=publish,
        peer_engine=P_ENGINE,
        metrics=True,
        metrics_port=metrics_port,
        compat_hash="e" * 64,
    )


def _value(prom: Any, expr: str) -> float | None:
    result = prom.query(expr)
    return float(result[0]["value"][1]) if result else None


def _wait_value(prom: Any, expr: str, ok: Callable[[float], bool], what: str) -> float:
    end = time.monotonic() + PROM_S
    got: float | None = None
    while time.monotonic() < end:
        got = _value(prom, expr)
        if got is not None and ok(got):
            return got
        time.sleep(0.5)
    pytest.fail(f"{what}: `{expr}` gave {got} after {PROM_S:.0f} s\n{prom.log_tail()}")


def test_prometheus_scraping_only_the_sidecar_sees_both_ranks_series(
    start_process: Callable[..., subprocess.Popen[bytes]],
    start_prometheus: Callable[..., Any],
    ranks: Callable[[ProcSpec], Rank],
    wait_for: Callable[..., None],
) -> None:
    # never one port twice (bind-to-0 ports repeat), and none a rank's UCX could take first
    side_port, http_port, p_port, d_port = (free_port() for _ in range(4))
    publish = f"tcp://127.0.0.1:{free_port()}"
    p_url, d_url = (f"http://127.0.0.1:{port}/metrics" for port in (p_port, d_port))
    agent = start_process(
        [sys.executable, "-m", "kvrdma", "agent",
         "--config", json.dumps(_config("kv_producer", P_ENGINE)),
         "--host", "127.0.0.1", "--port", str(side_port), "--http-port", str(http_port),
         "--publish", publish, "--worker-metrics", f"127.0.0.1:{p_port},127.0.0.1:{d_port}"]
    )  # fmt: skip
    agent_url = f"http://127.0.0.1:{http_port}"

    def agent_up() -> bool:
        assert agent.poll() is None, f"kvrdma agent exited with {agent.returncode}"
        with urllib.request.urlopen(agent_url + "/healthz", timeout=1) as resp:
            return bool(resp.status == 200)

    wait_for("kvrdma agent /healthz", agent_up, timeout=START_S)
    prom = start_prometheus([f"127.0.0.1:{http_port}"], RULE_FILES)

    producer = ranks(_spec("P", p_port, side_port, publish))
    producer.recv("ready", START_S)  # it has published its metadata to the agent
    consumer = ranks(_spec("D", d_port, side_port, publish))
    handshake = consumer.recv("ready", START_S)[4]
    assert handshake != "failed", "the consumer's handshake on the agent's side channel failed"

    for i in range(GOOD_READS):
        blocks = [2 * i, 2 * i + 1]
        producer.conn.send(("hold", f"ok-{i}", blocks))
        consumer.conn.send(("read", f"ok-{i}", blocks, blocks, BLOCK_SIZE))
        msg = consumer.recv("recv", READ_S)
        assert (msg[3], msg[4], msg[5]) == (f"ok-{i}", 0, ""), f"read {i}: {msg}"

    end = time.monotonic() + PROM_S  # Prometheus is ready before it has loaded its targets
    while not (targets := prom.api("targets")["activeTargets"]) and time.monotonic() < end:
        time.sleep(0.2)
    assert [t["scrapeUrl"] for t in targets] == [agent_url + "/metrics"]
    success = 'sum(kvrdma_transfers_total{outcome="success", role="consumer"})'
    _wait_value(prom, success, lambda v: v == GOOD_READS, "successful transfers")
    for url in (p_url, d_url):
        up = f'kvrdma_worker_endpoint_up{{endpoint="{url}"}}'
        _wait_value(prom, up, lambda v: v == 1, f"{url} up")
    _wait_value(prom, 'kvrdma_handshake_requests_total{outcome="ok"}', lambda v: v >= 1, "agent")
    assert _value(prom, "sum(kvrdma_invalid_blocks_total)") == 0

    producer.kill()
    failed = [2 * GOOD_READS, 2 * GOOD_READS + 1]
    consumer.conn.send(("read", "after-kill", failed, failed, BLOCK_SIZE))
    msg = consumer.recv("recv", READ_S)
    assert msg[3] == "after-kill" and msg[4] == -1 and "invalid blocks" in msg[5], msg

    invalid = 'sum(kvrdma_invalid_blocks_total{role="consumer"})'
    _wait_value(prom, invalid, lambda v: v == len(failed), "invalid blocks")
    _wait_value(prom, f'kvrdma_worker_endpoint_up{{endpoint="{p_url}"}}', lambda v: v == 0, "P")
    assert _value(prom, f'kvrdma_worker_endpoint_up{{endpoint="{d_url}"}}') == 1
    assert _value(prom, success) == GOOD_READS
    assert _value(prom, 'sum(kvrdma_transfers_total{outcome!="success"})') == 1

    def worker_down_alert() -> bool:
        return any(
            a["labels"]["alertname"] == "KvrdmaWorkerMetricsDown"
            and a["labels"]["endpoint"] == p_url
            for a in prom.api("alerts")["alerts"]
        )

    wait_for("KvrdmaWorkerMetricsDown for the killed rank", worker_down_alert, timeout=PROM_S)
