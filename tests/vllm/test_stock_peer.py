"""A stock vLLM 0.32 NixlConnector peer and kvrdma on one side channel: no harm either way.

vLLM's own code runs here: its scheduler's side-channel listener (the staticmethod its
`NixlBaseConnectorScheduler` starts in a thread) and its worker's handshake client
(`NixlBaseConnectorWorker._nixl_handshake`, on an instance holding only the attributes that
method reads before it decodes the peer's agent metadata). Everything on 127.0.0.1.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import msgspec
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlBaseConnectorScheduler,
    NixlHandshakePayload,
    NixlPullConnectorWorker,
)

from kvrdma.errors import HandshakeError, HandshakeTimeout
from kvrdma.handshake import HandshakeClient, HandshakeServer
from kvrdma.handshake.vllm_peer import KVRDMA_HASH
from kvrdma.metadata import WorkerMetadata
from kvrdma.testing import worker_metadata

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
VLLM_HASH = "f" * 64  # a vLLM engine's compatibility hash (any sha256 hex)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class VllmListener:
    """vLLM's side-channel listener thread, serving one (pp, tp) = (0, 0) payload."""

    def __init__(self) -> None:
        self.port = free_port()
        payload = NixlHandshakePayload(compatibility_hash=VLLM_HASH, agent_metadata_bytes=b"md")
        self.served = {(0, 0): msgspec.msgpack.encode(payload)}
        ready, self.stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(
            target=NixlBaseConnectorScheduler._nixl_handshake_listener,
            args=(self.served, ready, self.stop, HOST, self.port),
            daemon=True,
        )
        self.thread.start()
        assert ready.wait(10), "vLLM's listener did not bind"

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)  # the listener polls its stop flag every second


@pytest.fixture
def vllm_listener() -> Iterator[VllmListener]:
    listener = VllmListener()
    yield listener
    listener.close()


def vllm_decoder(*, compat_hash: str = "a" * 64, enforce: bool = True) -> NixlPullConnectorWorker:
    """vLLM's worker, holding what `_nixl_handshake` reads before the peer's agent metadata."""
    worker = object.__new__(NixlPullConnectorWorker)
    worker._is_csa_linear = False
    worker.use_host_buffer = True  # skips selecting a CUDA device for the handshake thread
    worker.transfer_topo = SimpleNamespace(handshake_target_ranks=lambda tp, dcp: [0])
    worker.compat_hash = compat_hash
    worker.enforce_compat_hash = enforce
    return worker


def vllm_handshake(worker: NixlPullConnectorWorker, port: int) -> None:
    worker._nixl_handshake(HOST, port, remote_tp_size=1, expected_engine_id="prefill")


def test_kvrdma_client_at_a_vllm_listener_fails_clearly_and_leaves_it_serving(
    vllm_listener: VllmListener,
) -> None:
    with HandshakeClient(timeout=3.0) as client, pytest.raises(HandshakeError) as info:
        client.fetch(HOST, vllm_listener.port, "prefill", [0])
    assert not isinstance(info.value, HandshakeTimeout)
    message = str(info.value)
    assert "this looks like a vLLM NixlConnector side channel, not a kvrdma agent" in message
    assert f"{HOST}:{vllm_listener.port}" in message
    assert vllm_listener.thread.is_alive()
    # vLLM's own decoder still gets this prefill's metadata (its hash then differs from ours).
    with pytest.raises(RuntimeError, match=f"Remote: {VLLM_HASH}"):
        vllm_handshake(vllm_decoder(), vllm_listener.port)
    assert vllm_listener.thread.is_alive()


def worker_meta() -> WorkerMetadata:
    return worker_metadata("prefill")


@pytest.fixture
def kvrdma_server() -> Iterator[HandshakeServer]:
    with HandshakeServer(HOST, 0) as server:
        server.publish(worker_meta())
        yield server


@pytest.mark.parametrize(
    ("enforce", "error"),
    [
        (True, f"NIXL compatibility hash mismatch. Local: {'a' * 64}, Remote: {KVRDMA_HASH}"),
        (False, "Failed to decode NixlAgentMetadata"),
    ],
    ids=["enforce-compat", "compat-not-enforced"],
)
def test_vllm_decoder_at_a_kvrdma_agent_reports_a_failure_and_the_agent_keeps_serving(
    kvrdma_server: HandshakeServer, enforce: bool, error: str
) -> None:
    with pytest.raises(RuntimeError) as info:
        vllm_handshake(vllm_decoder(enforce=enforce), kvrdma_server.port)
    assert error in str(info.value)
    assert kvrdma_server.stats["requests_bad"] == 1
    with HandshakeClient(timeout=3.0) as client:
        assert client.fetch(HOST, kvrdma_server.port, "prefill", [0])[0] == worker_meta()
    assert kvrdma_server.stats["requests_ok"] == 1
    assert kvrdma_server.stats["requests_bad"] == 1  # a kvrdma client's probe is not counted
