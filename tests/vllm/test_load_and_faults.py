"""Loading KvrdmaConnector from the config string a user types, and load failures through
vLLM's scheduler: a producer killed before D reads its blocks, or while D's READs are in
flight, makes them invalid; with `kv_load_failure_policy: recompute` D recomputes exactly
those blocks' tokens, with `fail` the request ends in error."""

from __future__ import annotations

import json
import time
import uuid
import zlib
from collections.abc import Iterator

import pytest
from _children import parse_user_config, run_child
from _harness import (
    EngineProc,
    EngineSpec,
    free_port,
    requires_vllm,
    started,
    write_model_dir,
)

from kvrdma.testing import stop_process
from kvrdma.testing.ucx import tcp_only

pytestmark = [pytest.mark.timeout(300), requires_vllm]


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
    p_specs = {
        key: EngineSpec(model_dir, "kv_producer", f"P{key}-{tag}", free_port(), hybrid=hybrid)
        for key, hybrid in (("p", False), ("p-hybrid", True))
    }
    d_specs = {
        f"{policy}{suffix}": EngineSpec(
            model_dir,
            "kv_consumer",
            f"D-{policy}{suffix}-{tag}",
            free_port(),
            policy=policy,
            hybrid=bool(suffix),
        )
        for policy in ("recompute", "fail")
        for suffix in ("", "-hybrid")
    }
    with started(p_specs, d_specs) as engines:
        yield engines


def _prefill(p: EngineProc, rid: str, key: str = "p") -> dict:
    p.add(key, rid, prompt(rid), 1, {"do_remote_decode": True, "do_remote_prefill": False})
    return json.loads(p.wait("finished", rid)[3])


CONSUMERS = ("recompute", "fail", "recompute-hybrid", "fail-hybrid")


def _producer(consumer: str) -> str:
    return "p-hybrid" if consumer.endswith("hybrid") else "p"


def test_a_read_whose_handshake_fails_is_not_heartbeated_on(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """A request recomputed because its producer could not be reached is not heartbeated
    afterwards: heartbeats would hold that producer's blocks for a read that never runs."""
    p, d = engines
    nowhere = {"remote_engine_id": "P-nowhere", "remote_port": free_port()}
    params = _prefill(p, "p-nowhere") | nowhere
    d.add("recompute", "d-nowhere", prompt("p-nowhere"), 2, params)
    _, _, ids, _, invalid, _ = d.wait("recv_done", "d-nowhere")
    assert ids and invalid == sorted(ids)
    assert d.wait("finished", "d-nowhere")[2] == "length"
    assert d.probe("recompute", "heartbeating") == []


def test_producer_killed_recompute_and_fail(engines: tuple[EngineProc, EngineProc]) -> None:
    p, d = engines
    for c in CONSUMERS:  # every consumer knows its producer (handshake done)
        d.add(c, f"warm-{c}", prompt(f"pw-{c}"), 2, _prefill(p, f"pw-{c}", _producer(c)))
        assert d.wait("recv_done", f"warm-{c}")[4:] == ([], [])
        assert d.wait("finished", f"warm-{c}")[2] == "length"
    params = {c: _prefill(p, f"p-{c}", _producer(c)) for c in CONSUMERS}
    p.kill()
    for c in CONSUMERS:
        d.add(c, f"d-{c}", prompt(f"p-{c}"), 2, params[c])

    # one KV-cache group: the failed read's blocks are reported invalid
    _, _, ids, _, invalid, _ = d.wait("recv_done", "d-recompute")
    assert ids and invalid == sorted(ids)  # every block of the read is invalid
    _, _, reason, _, _, _, computed = d.wait("finished", "d-recompute")
    assert reason == "length"
    # the invalid blocks hold every prompt token: D recomputed exactly those
    assert len(ids) == 5 and computed == 150
    _, _, _, _, invalid, _ = d.wait("recv_done", "d-fail")
    assert len(invalid) == 5  # the failed request's blocks are freed at once
    assert d.wait("finished", "d-fail")[2] == "error"

    # several groups (block ids are unique per group only): the request is reported failed
    _, _, _, _, invalid, failed = d.wait("recv_done", "d-recompute-hybrid")
    assert (invalid, failed) == ([], ["d-recompute-hybrid"])
    _, _, reason, _, _, _, computed = d.wait("finished", "d-recompute-hybrid")
    assert reason == "length" and computed == 150  # the whole prompt, recomputed locally
    _, _, _, _, invalid, failed = d.wait("recv_done", "d-fail-hybrid")
    assert (invalid, failed) == ([], ["d-fail-hybrid"])
    assert d.wait("finished", "d-fail-hybrid")[2] == "error"


@pytest.fixture(scope="module")
def tcp_engines(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EngineProc, EngineProc]]:
    """P and D with UCX over TCP only: a READ from a stopped producer stays in flight (over
    cma it would be done inside its post)."""
    model_dir = str(write_model_dir(tmp_path_factory.mktemp("model")))
    tag, env = uuid.uuid4().hex[:6], {"UCX_TLS": tcp_only()}

    def spec(role: str, engine: str, **kw: str) -> EngineSpec:
        return EngineSpec(model_dir, role, f"{engine}-{tag}", free_port(), env=env, **kw)

    p_specs = {"p": spec("kv_producer", "Pt")}
    d_specs = {c: spec("kv_consumer", f"Dt-{c}", policy=c) for c in ("recompute", "fail")}
    with started(p_specs, d_specs) as engines:
        yield engines


def test_producer_killed_while_reads_are_in_flight(
    tcp_engines: tuple[EngineProc, EngineProc],
) -> None:
    p, d = tcp_engines
    policies = ("recompute", "fail")
    for c in policies:  # connected, and the TCP lanes to P wired up
        d.add(c, f"twarm-{c}", prompt(f"tpw-{c}"), 2, _prefill(p, f"tpw-{c}"))
        assert d.wait("recv_done", f"twarm-{c}")[4:] == ([], [])
    params = {c: _prefill(p, f"tp-{c}") for c in policies}
    stop_process(p.proc.pid)  # P's side of the READs cannot progress
    for c in policies:
        d.add(c, f"td-{c}", prompt(f"tp-{c}"), 2, params[c])
    deadline = time.monotonic() + 30
    while not all(f"td-{c}" in d.probe(c, "reading") for c in policies):
        assert time.monotonic() < deadline, "D's READs were never in flight"
        time.sleep(0.01)
    p.kill()  # SIGKILL, READs in flight

    _, _, ids, _, invalid, _ = d.wait("recv_done", "td-recompute")
    assert len(ids) == 5 and invalid == sorted(ids)  # every block of the read is invalid
    _, _, reason, _, _, _, computed = d.wait("finished", "td-recompute")
    assert reason == "length" and computed == 150  # exactly the invalid blocks' tokens
    _, _, _, _, invalid, _ = d.wait("recv_done", "td-fail")
    assert len(invalid) == 5
    assert d.wait("finished", "td-fail")[2] == "error"
    # the reads ended because their peer went away, not by their deadline
    said = [w for w in d.probe("fail", "warnings") if w.startswith("read of request 'td-")]
    assert len(said) == 2 and all("(peer_lost)" in w for w in said), said


@pytest.fixture(scope="module")
def checked_engines(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EngineProc, EngineProc]]:
    """P and D with per-block checksums (`integrity_checksums`), D recomputing failed loads."""
    model_dir = str(write_model_dir(tmp_path_factory.mktemp("model")))
    tag, extra = uuid.uuid4().hex[:6], {"integrity_checksums": True}
    p_specs = {"p": EngineSpec(model_dir, "kv_producer", f"P-{tag}", free_port(), extra=extra)}
    d_specs = {
        "d": EngineSpec(
            model_dir, "kv_consumer", f"D-{tag}", free_port(), policy="recompute", extra=extra
        )
    }
    with started(p_specs, d_specs) as engines:
        yield engines


def test_recompute_starts_at_the_first_invalid_block(
    checked_engines: tuple[EngineProc, EngineProc],
) -> None:
    """A block P overwrote after holding it fails its checksum: only that block is invalid,
    and D's scheduler recomputes from its first token on, keeping the two blocks before it."""
    p, d = checked_engines
    params = _prefill(p, "req-partial")
    bad = params["remote_block_ids"][0][2]  # the third block: tokens 64..95
    deadline = time.monotonic() + 10
    while not p.probe("p", "held:req-partial"):  # held, so checksummed, before it changes
        assert time.monotonic() < deadline, "P never held the request's blocks"
        time.sleep(0.05)
    p.corrupt("p", bad)
    d.add("d", "d-partial", prompt("req-partial"), 2, params)
    _, _, ids, _, invalid, failed = d.wait("recv_done", "d-partial")
    assert (invalid, failed) == ([ids[2]], [])
    _, _, reason, _, _, _, computed = d.wait("finished", "d-partial")
    assert reason == "length" and computed == 150 - 2 * 32
