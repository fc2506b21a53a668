"""Sidecar mode: with KVRDMA_PUBLISH_ADDRESS set, P's workers publish their kvrdma metadata
to the pod's agent (here a `HandshakeServer` with a publish socket, what `kvrdma agent`
runs) and P's scheduler binds nothing; D handshakes with the agent on the side-channel
port the kv_transfer_params name, and reads P's blocks byte for byte."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _harness import EngineSpec, free_port, requires_vllm, started, write_model_dir

from kvrdma.handshake import HandshakeServer

pytestmark = [pytest.mark.timeout(300), requires_vllm]

PROMPT = [(i * 29) % 900 + 11 for i in range(100)]  # 4 blocks of 32


@pytest.fixture
def sidecar() -> Iterator[HandshakeServer]:
    server = HandshakeServer("127.0.0.1", free_port(), publish_address="tcp://127.0.0.1:0")
    try:
        yield server
    finally:
        server.close()


def test_workers_publish_to_the_agent_and_d_reads_through_it(
    tmp_path: Path, sidecar: HandshakeServer
) -> None:
    model_dir = str(write_model_dir(tmp_path / "model"))
    tag = uuid.uuid4().hex[:6]
    env = {"KVRDMA_PUBLISH_ADDRESS": str(sidecar.publish_address)}
    p_spec = EngineSpec(model_dir, "kv_producer", f"P-{tag}", sidecar.port, env=env)
    d_spec = EngineSpec(model_dir, "kv_consumer", f"D-{tag}", free_port())
    with started({"p": p_spec}, {"d": d_spec}) as (p, d):
        deadline = time.monotonic() + 10
        while sidecar.published_ranks(f"P-{tag}") != [0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sidecar.published_ranks(f"P-{tag}") == [0]

        p.add("p", "req", PROMPT, 1, {"do_remote_decode": True, "do_remote_prefill": False})
        _, _, _, params_json, _, p_bytes, _ = p.wait("finished", "req")
        params = json.loads(params_json)
        assert params["remote_port"] == sidecar.port
        d.add("d", "dreq", PROMPT, 2, params)
        _, _, ids, d_bytes, invalid, _ = d.wait("recv_done", "dreq")
        assert invalid == [] and len(ids) == 4 and any(p_bytes) and d_bytes == p_bytes
        assert d.wait("finished", "dreq")[2] == "length"
        p.wait("sent", "req")


def test_a_restarted_agent_gets_the_ranks_again_and_d_reads_through_it(tmp_path: Path) -> None:
    """Kubernetes restarts a native sidecar alone: P's workers publish to the new agent within
    `REPUBLISH_SECONDS`, with no engine restart."""
    from kvrdma.handshake.publisher import REPUBLISH_SECONDS

    model_dir = str(write_model_dir(tmp_path / "model"))
    tag = uuid.uuid4().hex[:6]
    side_port, publish = free_port(), f"ipc://{tmp_path}/publish.sock"
    env = {"KVRDMA_PUBLISH_ADDRESS": publish}
    p_spec = EngineSpec(model_dir, "kv_producer", f"P-{tag}", side_port, env=env)
    d_spec = EngineSpec(model_dir, "kv_consumer", f"D-{tag}", free_port())
    first = HandshakeServer("127.0.0.1", side_port, publish_address=publish)
    with started({"p": p_spec}, {"d": d_spec}) as (p, d):
        assert _published(first, f"P-{tag}", 10.0)
        first.close()
        agent = HandshakeServer("127.0.0.1", side_port, publish_address=publish)
        try:
            assert _published(agent, f"P-{tag}", REPUBLISH_SECONDS + 5)
            p.add("p", "req", PROMPT, 1, {"do_remote_decode": True, "do_remote_prefill": False})
            _, _, _, params_json, _, p_bytes, _ = p.wait("finished", "req")
            d.add("d", "dreq", PROMPT, 2, json.loads(params_json))
            _, _, ids, d_bytes, invalid, _ = d.wait("recv_done", "dreq")
            assert invalid == [] and len(ids) == 4 and any(p_bytes) and d_bytes == p_bytes
        finally:
            agent.close()


def _published(agent: HandshakeServer, engine: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while agent.published_ranks(engine) != [0] and time.monotonic() < deadline:
        time.sleep(0.05)
    return agent.published_ranks(engine) == [0]
