"""A stand-in for `kvrdma demo --metrics-port PORT` in the Prometheus e2e test.

It plays one pod: three worker ranks (decode-0 ranks 0 and 1, prefill-0 rank 0), each with
its own registry served on a loopback port, and a sidecar whose aggregated endpoint on
`--metrics-port` merges them (plus one worker endpoint that is down). Scripted events run
continuously, with faults, so that every dashboard query and every rule has data and every
alert condition holds:

* decode-0 rank 0 reads from prefill-0, or has it pushed (every other transfer): of every 20
  transfers 4 fail (timeout, failed, peer_lost, cancelled) and 1 succeeds slowly (3 s), so the
  failure ratio is 20% and p99 > 1 s; each failure reports invalid blocks;
* decode-0 rank 1 has KV registered and no peer: its handshakes are refused or time out;
* prefill-0 rank 0 frees blocks on notification or once pushed, lets leases expire and rejects
  notifications;
* the sidecar is not ready (an expected rank never publishes), and its handshake server keeps
  dropping a peer's connection that never ends its message;
* a "thinker" stage rank sends shards to a "talker" stage rank (one process each, pipeline
  "omni"): most arrive, some time out, fail, expire or are given up.

Runs until SIGTERM/SIGINT (or --duration seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType, SimpleNamespace

from prometheus_client import CollectorRegistry

from kvrdma.cli.agent import AgentCollector
from kvrdma.handshake import HandshakeServer, SidecarPublisher
from kvrdma.scrape import aggregated_registry
from kvrdma.stages import StageMetrics
from kvrdma.telemetry import (
    NOTIFICATION_FAILURE_REASONS,
    KvrdmaMetrics,
    MetricsServer,
    build_info,
    start_http_server,
)
from kvrdma.testing import worker_metadata
from kvrdma.testing.zmtp import UNFINISHED, send_until_dropped, zmtp_peer

TICK_SECONDS = 0.05
FAILURES = ("timeout", "failed", "peer_lost", "cancelled")


def _unfinished_messages(port: int, stop: threading.Event) -> None:
    """Every 2 s, a peer that never ends its message, which the handshake server drops."""
    while not stop.wait(2.0):
        with contextlib.suppress(OSError), zmtp_peer("127.0.0.1", port) as peer:
            send_until_dropped(peer, UNFINISHED, 4 << 20)


def _publish(server: HandshakeServer) -> None:
    """One worker's metadata through the publish socket, as an engine rank would."""
    meta = worker_metadata("prefill-0", agent_name="prefill-0-tp0")
    publisher = SidecarPublisher(server.publish_address or "", timeout=5.0)
    try:
        publisher.publish(meta)
    finally:
        publisher.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    servers: list[MetricsServer], engine_id: str, role: str, rank: int
) -> tuple[KvrdmaMetrics, str]:
    registry = CollectorRegistry()
    build_info(registry)
    metrics = KvrdmaMetrics(registry=registry, engine_id=engine_id, role=role, tp_rank=rank)
    metrics.set_transport(kind="tcp", ucx_tls="tcp", ucx_net_devices="lo")
    server, port = start_http_server(registry, "127.0.0.1", 0)
    servers.append(server)
    return metrics, f"127.0.0.1:{port}"


def _stage_rank(servers: list[MetricsServer]) -> tuple[StageMetrics, str]:
    registry = CollectorRegistry()
    metrics = StageMetrics(registry=registry)
    server, port = start_http_server(registry, "127.0.0.1", 0)
    servers.append(server)
    return metrics, f"127.0.0.1:{port}"


TALKER = SimpleNamespace(pipeline="omni", stage="talker", rank=0)  # a receiving stage rank


def stage_tick(i: int, thinker: StageMetrics, talker: StageMetrics) -> None:
    """One request from thinker to talker; every 10 steps cover every outcome."""
    phase = i % 10
    sent = {"pipeline": "omni", "stage": "thinker", "peer_stage": "talker", "tp_rank": 0}
    got = {"pipeline": "omni", "stage": "talker", "peer_stage": "thinker", "tp_rank": 0}
    outcome = {1: "timeout", 2: "failed"}.get(phase, "success")
    talker.transfer(**got, direction="receive", outcome=outcome, nbytes=(4 + phase) << 20,
                    seconds=0.002 * (1 + phase))  # fmt: skip
    outcome = {1: "given_up", 2: "failed", 3: "expired"}.get(phase, "success")
    thinker.transfer(**sent, direction="send", outcome=outcome, nbytes=(4 + phase) << 20,
                     seconds=0.001 * (1 + phase))  # fmt: skip
    thinker.set_offered(**sent, shards=phase % 3)
    talker.held_slots_of(TALKER, "thinker", phase % 2)


def tick(i: int, d0: KvrdmaMetrics, d1: KvrdmaMetrics, p0: KvrdmaMetrics) -> None:
    """One step of the script; every 20 steps cover every outcome."""
    phase = i % 20
    mode = "push" if phase % 2 else "pull"
    d0.transfer_started(remote_engine="prefill-0", mode=mode)
    if phase < len(FAILURES):
        d0.observe_transfer(remote_engine="prefill-0", mode=mode, outcome=FAILURES[phase],
                            seconds=0.2, post_seconds=3e-5, nbytes=2 << 20,
                            descriptors=256)  # fmt: skip
        d0.invalid_blocks(remote_engine="prefill-0", n=4)
        d0.request_finished(outcome="invalid_blocks" if phase % 2 else "failed")
    else:
        seconds = 3.0 if phase == 4 else 0.0004 * (1 + phase)
        d0.observe_transfer(remote_engine="prefill-0", mode=mode, outcome="success",
                            seconds=seconds, post_seconds=2e-5 * (1 + phase % 3),
                            nbytes=(1 + phase) << 20, descriptors=64 * (1 + phase))  # fmt: skip
        d0.request_finished(outcome="success")
        p0.freed_blocks(16, reason="pushed" if mode == "push" else "notified")
    d0.transfer_finished(remote_engine="prefill-0", mode=mode)
    if phase == 5:
        d0.transfer_started(remote_engine="prefill-0", mode="pull")  # one stays in flight
    if phase == 0 and i > 0:
        d0.transfer_finished(remote_engine="prefill-0", mode="pull")
    if phase % 10 == 0:
        d0.handshake(remote_engine="prefill-0", outcome="success", seconds=0.004)
        d0.failed_notification(remote_engine="prefill-0", reason="send_failed")
        d1.handshake(remote_engine="prefill-0", outcome="refused", seconds=0.001)
        p0.handshake(remote_engine="decode-0", outcome="success", seconds=0.002)
    if phase == 7:
        d1.handshake(remote_engine="prefill-0", outcome="timeout", seconds=5.0)
        p0.expired_leases()
        p0.freed_blocks(16, reason="lease_expired")
    reason = NOTIFICATION_FAILURE_REASONS[(i // 5) % len(NOTIFICATION_FAILURE_REASONS)]
    if phase % 5 == 1:
        p0.failed_notification(remote_engine="decode-0", reason=reason)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--duration", type=float, default=600.0)
    args = parser.parse_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    servers: list[MetricsServer] = []
    closers: list[Callable[[], None]] = []
    try:
        d0, e0 = _worker(servers, "decode-0", "consumer", 0)
        d1, e1 = _worker(servers, "decode-0", "consumer", 1)
        p0, e2 = _worker(servers, "prefill-0", "producer", 0)
        thinker, e3 = _stage_rank(servers)
        talker, e4 = _stage_rank(servers)
        d0.set_registered(nbytes=24 << 30, regions=64)
        d1.set_registered(nbytes=24 << 30, regions=64)
        p0.set_registered(nbytes=48 << 30, regions=64)
        d0.set_connected_peers(1)
        p0.set_connected_peers(1)
        sidecar = CollectorRegistry()
        build_info(sidecar)
        handshake = HandshakeServer("127.0.0.1", 0, publish_address="tcp://127.0.0.1:0")
        closers.append(handshake.close)
        # its handshake thread alive but rank 1 of decode-0 never published: not ready
        sidecar.register(AgentCollector(handshake, lambda: (False, {"missing_ranks": [1]})))
        _publish(handshake)
        flood = threading.Thread(target=_unfinished_messages, args=(handshake.port, stop))
        flood.start()
        closers.append(flood.join)
        agent = KvrdmaMetrics(registry=sidecar, engine_id="decode-0", role="sidecar", tp_rank=0)
        agent.set_connected_peers(1)
        endpoints = [e0, e1, e2, e3, e4, f"127.0.0.1:{_closed_port()}"]
        registry = aggregated_registry(endpoints, local=sidecar, timeout=0.5)
        servers.append(start_http_server(registry, "127.0.0.1", args.metrics_port)[0])
        deadline = time.monotonic() + args.duration
        i = 0
        while not stop.is_set() and time.monotonic() < deadline:
            tick(i, d0, d1, p0)
            stage_tick(i, thinker, talker)
            i += 1
            stop.wait(TICK_SECONDS)
    finally:
        stop.set()  # ends the flood of unfinished messages
        for server in servers:
            server.shutdown()
        for close in closers:
            close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
