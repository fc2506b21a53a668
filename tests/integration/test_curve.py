"""An agent with CURVE on: authorized peers are served, every other client is refused and
counted, and the metadata never crosses the wire in clear."""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
from pathlib import Path

import pytest
import zmq

from kvrdma.errors import HandshakeTimeout
from kvrdma.handshake import HandshakeClient, SidecarPublisher
from kvrdma.handshake.auth import CurveKeys, generate_keys
from tests.integration.sidecar_helpers import HOST, Agent, http_get, metric, worker

pytestmark = pytest.mark.timeout(60)

ENGINE = worker(0).engine_id


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    generate_keys(tmp_path / "keys")
    return tmp_path / "keys"


@pytest.fixture
def agent_args(keys: Path) -> tuple[str, ...]:
    return ("--curve-dir", str(keys))


def _client(ctx: zmq.Context[zmq.Socket[bytes]], curve: CurveKeys | None) -> HandshakeClient:
    return HandshakeClient(
        context=ctx, timeout=1.0, retries=0, tp_size=1, compat_hash="d" * 64, curve=curve
    )


def test_authorized_peers_are_served(
    agent: Agent, keys: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    curve = CurveKeys.load(keys)
    with SidecarPublisher(agent.publish, context=ctx, timeout=5.0, curve=curve) as pub:
        pub.publish(worker(0))
        assert pub.publish(worker(1)).published_ranks == [0, 1]
    with _client(ctx, curve) as peer:
        assert peer.fetch(HOST, agent.side_port, ENGINE, [0, 1]) == {0: worker(0), 1: worker(1)}
    _, text = http_get(agent.http + "/metrics")
    assert metric(text, 'kvrdma_handshake_requests_total{outcome="ok"}') == 1.0
    assert metric(text, 'kvrdma_handshake_requests_total{outcome="unauthenticated"}') == 0.0


def _stranger(tmp_path: Path, keys: Path, *, right_server_key: bool) -> CurveKeys:
    """Keys of a client the agent does not admit (with or without the server's public key)."""
    own = tmp_path / "stranger"
    generate_keys(own)
    (own / "server.key_secret").unlink()
    if right_server_key:
        shutil.copy(keys / "server.key", own / "server.key")
    return CurveKeys.load(own)


@pytest.mark.parametrize("who", ["plaintext", "unknown client key", "wrong server key"])
def test_other_clients_are_refused_and_counted(
    agent: Agent, keys: Path, tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]], who: str
) -> None:
    with SidecarPublisher(
        agent.publish, context=ctx, timeout=5.0, curve=CurveKeys.load(keys)
    ) as pub:
        pub.publish(worker(0))
    curve = (
        None
        if who == "plaintext"
        else _stranger(tmp_path, keys, right_server_key=who == "unknown client key")
    )
    with _client(ctx, curve) as peer, pytest.raises(HandshakeTimeout):
        peer.fetch(HOST, agent.side_port, ENGINE, [0])
    publisher = SidecarPublisher(agent.publish, context=ctx, timeout=1.0, retries=0, curve=curve)
    with publisher as pub, pytest.raises(HandshakeTimeout):
        pub.publish(worker(1))
    _, text = http_get(agent.http + "/metrics")
    refused = metric(text, 'kvrdma_handshake_requests_total{outcome="unauthenticated"}')
    assert refused is not None and refused >= 2
    assert metric(text, 'kvrdma_agent_publishes_total{outcome="ok"}') == 1.0
    # the agent still serves its authorized peers
    with _client(ctx, CurveKeys.load(keys)) as peer:
        assert peer.fetch(HOST, agent.side_port, ENGINE, [0]) == {0: worker(0)}


class _Tap:
    """A TCP relay on 127.0.0.1 that records every byte flowing through it."""

    def __init__(self, target_port: int) -> None:
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        self._target = target_port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                server = socket.create_connection((HOST, self._target), timeout=5.0)
                with self._lock:
                    self._sockets += [client, server]
                for a, b in ((client, server), (server, client)):
                    threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                with self._lock:
                    self.seen += chunk
                dst.sendall(chunk)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


@pytest.mark.parametrize("encrypted", [True, False])
def test_metadata_crosses_the_wire_only_encrypted(
    tmp_path: Path, keys: Path, ctx: zmq.Context[zmq.Socket[bytes]], encrypted: bool
) -> None:
    """Served through a recording relay, the metadata shows in clear without CURVE (the
    control) and never with it."""
    curve = CurveKeys.load(keys) if encrypted else None
    agent = Agent(tmp_path, *(["--curve-dir", str(keys)] if encrypted else []))
    tap = _Tap(agent.side_port)
    try:
        with SidecarPublisher(agent.publish, context=ctx, timeout=5.0, curve=curve) as pub:
            pub.publish(worker(0))
        with _client(ctx, curve) as peer:
            assert peer.fetch(HOST, tap.port, ENGINE, [0]) == {0: worker(0)}
    finally:
        tap.close()
        agent.stop()
    assert (worker(0).agent_metadata in tap.seen) is not encrypted
    assert len(tap.seen) > 1000
