"""Loading KvrdmaConnector from the config string a user types, and load failures through
vLLM's scheduler: a producer killed before D reads its blocks makes them invalid; with
`kv_load_failure_policy: recompute` D recomputes exactly those blocks' tokens, with `fail`
the request ends in error."""

from __future__ import annotations

import json
import uuid
import zlib
from collections.abc import Iterator

import pytest
from _harness import (
    EngineProc,
    EngineSpec,
    free_port,
    parse_user_config,
    run_child,
    write_model_dir,
)

pytestmark = pytest.mark.timeout(300)


def prompt(rid: str) -> list[int]:
    """150 tokens (5 blocks of 32, the last partial), distinct per request: no prefix hits."""
    seed = zlib.crc32(rid.encode())
    return [(i * 53 + seed) % 900 + 7 for i in range(150)]


def test_factory_loads_the_connector_from_the_cli_string() -> None:
    text = (
        '{"kv_connector": "KvrdmaConnector", "kv_connector_module_path": "kvrdma.vllm", '
        '"kv_role": "kv_consumer"}'
    )
    _, module, name, hma = run_child(parse_user_config, text)
    assert (module, name, hma) == ("kvrdma.vllm.connector", "KvrdmaConnector", True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProc, EngineProc]]:
    model_dir = str(write_model_dir(tmp_path_factory.mktemp("model")))
    tag = uuid.uuid4().hex[:6]
    p = EngineProc({"p": EngineSpec(model_dir, "kv_producer", f"P-{tag}", free_port())})
    d = EngineProc(
        {
            policy: EngineSpec(
                model_dir, "kv_consumer", f"D-{policy}-{tag}", free_port(), policy=policy
            )
            for policy in ("recompute", "fail")
        }
    )
    try:
        yield p.ready(), d.ready()
    finally:
        d.stop()
        p.stop()


def _prefill(p: EngineProc, rid: str) -> dict:
    p.add("p", rid, prompt(rid), 1, {"do_remote_decode": True, "do_remote_prefill": False})
    return json.loads(p.wait("finished", rid)[3])


def test_producer_killed_recompute_and_fail(engines: tuple[EngineProc, EngineProc]) -> None:
    p, d = engines
    for policy in ("recompute", "fail"):  # both consumers know the producer (handshake done)
        d.add(policy, f"warm-{policy}", prompt(f"pw-{policy}"), 2, _prefill(p, f"pw-{policy}"))
        assert d.wait("recv_done", f"warm-{policy}")[4] == []
        assert d.wait("finished", f"warm-{policy}")[2] == "length"
    params = {policy: _prefill(p, f"p-{policy}") for policy in ("recompute", "fail")}
    p.kill()
    for policy in ("recompute", "fail"):
        d.add(policy, f"d-{policy}", prompt(f"p-{policy}"), 2, params[policy])

    _, _, ids, _, invalid, _ = d.wait("recv_done", "d-recompute")
    assert ids and invalid == sorted(ids)  # every block of the read is invalid
    _, _, reason, _, _, _, computed = d.wait("finished", "d-recompute")
    assert reason == "length"
    # the invalid blocks hold every prompt token: D recomputed exactly those
    assert len(ids) == 5 and computed == 150

    _, _, _, _, invalid, _ = d.wait("recv_done", "d-fail")
    assert len(invalid) == 5  # the failed request's blocks are freed at once
    assert d.wait("finished", "d-fail")[2] == "error"
