"""CURVE on vLLM's side channel (the `curve` overlay): with KVRDMA_CURVE_DIR set, P's side
channel (its scheduler's, or the pod's agent's) admits only keyed clients, and D's handshake
client brings the keys; D reads P's blocks byte for byte. A D without the keys is refused,
and its load fails cleanly instead of reading."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _harness import EngineSpec, free_port, requires_vllm, started, write_model_dir

from kvrdma.handshake import HandshakeServer
from kvrdma.handshake.auth import CurveKeys, generate_keys

pytestmark = [pytest.mark.timeout(300), requires_vllm]

PROMPT = [(i * 31) % 900 + 7 for i in range(100)]  # 4 blocks of 32


@pytest.fixture
def keys(tmp_path: Path) -> str:
    generate_keys(tmp_path / "keys")
    return str(tmp_path / "keys")


@pytest.fixture
def agent(keys: str) -> Iterator[HandshakeServer]:
    server = HandshakeServer(
        "127.0.0.1",
        free_port(),
        publish_address="tcp://127.0.0.1:0",
        curve=CurveKeys.load(keys),
    )
    try:
        yield server
    finally:
        server.close()


def _pd(model_dir: str, side_port: int, p_env: dict[str, str], d_env: dict[str, str]) -> Any:
    tag = uuid.uuid4().hex[:6]
    p = EngineSpec(model_dir, "kv_producer", f"P-{tag}", side_port, env=p_env)
    d_extra = {"handshake_timeout": 2.0, "handshake_retries": 0}
    d = EngineSpec(model_dir, "kv_consumer", f"D-{tag}", free_port(), extra=d_extra, env=d_env)
    return started({"p": p}, {"d": d})


def _prefill_then_decode(p: Any, d: Any) -> tuple[list[int], bytes, bytes]:
    """P prefills, D loads: (the block ids D reported invalid, P's blocks, D's blocks)."""
    p.add("p", "req", PROMPT, 1, {"do_remote_decode": True, "do_remote_prefill": False})
    _, _, _, params_json, _, p_bytes, _ = p.wait("finished", "req")
    d.add("d", "dreq", PROMPT, 2, json.loads(params_json))
    _, _, _, d_bytes, invalid, _ = d.wait("recv_done", "dreq")
    assert any(p_bytes)
    return invalid, p_bytes, d_bytes


def test_a_keyed_d_reads_from_the_side_channel_of_a_keyed_p(tmp_path: Path, keys: str) -> None:
    env = {"KVRDMA_CURVE_DIR": keys}
    model_dir = str(write_model_dir(tmp_path / "model"))
    with _pd(model_dir, free_port(), env, env) as (p, d):
        invalid, p_bytes, d_bytes = _prefill_then_decode(p, d)
        assert invalid == [] and d_bytes == p_bytes


def test_a_keyed_d_reads_through_a_keyed_agent(
    tmp_path: Path, keys: str, agent: HandshakeServer
) -> None:
    env = {"KVRDMA_CURVE_DIR": keys}
    p_env = env | {"KVRDMA_PUBLISH_ADDRESS": str(agent.publish_address)}
    model_dir = str(write_model_dir(tmp_path / "model"))
    with _pd(model_dir, agent.port, p_env, env) as (p, d):
        deadline = time.monotonic() + 10
        while not agent.published_ranks(p.specs["p"].engine_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        invalid, p_bytes, d_bytes = _prefill_then_decode(p, d)
        assert invalid == [] and d_bytes == p_bytes


def test_a_d_without_the_keys_is_refused_and_its_load_fails(tmp_path: Path, keys: str) -> None:
    model_dir = str(write_model_dir(tmp_path / "model"))
    with _pd(model_dir, free_port(), {"KVRDMA_CURVE_DIR": keys}, {}) as (p, d):
        invalid, _, _ = _prefill_then_decode(p, d)
        assert len(invalid) == 4  # every block of the load: nothing was read
        assert d.wait("finished", "dreq")[2] == "error"  # kv_load_failure_policy "fail"
