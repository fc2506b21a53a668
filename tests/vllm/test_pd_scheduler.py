"""P and D engines, each vLLM's real Scheduler with KvrdmaConnector on both sides, in
separate processes over real NIXL: D's blocks equal P's byte for byte, the request then
finishes in D's scheduler, and P frees its blocks once D is done."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _harness import EngineProc, EngineSpec, free_port, write_model_dir

pytestmark = pytest.mark.timeout(240)

PROMPT = [(i * 37) % 900 + 5 for i in range(150)]  # 5 blocks of 32, the last partial


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "model")


def _pair(model_dir: Path, **kw: object) -> tuple[EngineProc, EngineProc]:
    tag = uuid.uuid4().hex[:6]
    p = EngineProc(EngineSpec(str(model_dir), "kv_producer", f"P-{tag}", free_port(), **kw))  # type: ignore[arg-type]
    d = EngineProc(EngineSpec(str(model_dir), "kv_consumer", f"D-{tag}", free_port(), **kw))  # type: ignore[arg-type]
    try:
        return p.ready(), d.ready()
    except BaseException:
        d.stop()
        p.stop()
        raise


@pytest.fixture
def lbhnc(model_dir: Path) -> Iterator[tuple[EngineProc, EngineProc]]:
    p, d = _pair(model_dir)
    yield p, d
    d.stop()
    p.stop()


def _prefill(p: EngineProc, rid: str) -> tuple[dict, bytes]:
    p.add(rid, PROMPT, 1, {"do_remote_decode": True, "do_remote_prefill": False})
    _, _, reason, params_json, _, snap = p.wait("finished", rid)
    assert reason == "length"
    # the proxy hands P's dict to D verbatim, through JSON
    return json.loads(params_json), snap


def test_p1_d1_lbhnc_blocks_equal_and_request_finishes(
    lbhnc: tuple[EngineProc, EngineProc],
) -> None:
    p, d = lbhnc
    params, p_bytes = _prefill(p, "req-1")
    assert params["do_remote_prefill"] is True and params["transfer_mode"] == "pull"
    assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == 5
    assert p.free_blocks() == p.free_blocks_at_start - 5  # held for D

    d.add("dreq-1", PROMPT, 3, params)
    _, _, d_ids, d_bytes, invalid = d.wait("recv_done", "dreq-1")
    assert invalid == []
    assert len(d_ids) == 5
    assert any(p_bytes)  # the stand-in runner wrote P's KV
    assert d_bytes == p_bytes
    _, _, reason, _, tokens, _ = d.wait("finished", "dreq-1")
    assert reason == "length" and len(tokens) >= 1

    p.wait("sent", "req-1")
    assert p.free_blocks() == p.free_blocks_at_start
