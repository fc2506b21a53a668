"""Loading KvrdmaConnector from the config string a user types, and load failures through
vLLM's scheduler: a producer killed before D reads its blocks, or while D's READs are in
flight, makes them invalid; with `kv_load_failure_policy: recompute` D recomputes exactly
those blocks' tokens, with `fail` the request ends in error."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from _children import counted_since, parse_user_config, run_child
from _harness import (
    MODEL_CONFIG,
    PROMPT_FREE_SECONDS,
    EngineProc,
    EngineSpec,
    free_port,
    prompt,
    requires_vllm,
    started,
    write_model_dir,
)

from kvrdma.testing import stop_process
from kvrdma.testing.ucx import tcp_only

pytestmark = [pytest.mark.timeout(300), requires_vllm]


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
    # a decoder whose blocks hold two of the producer's each
    d_specs["bs64"] = EngineSpec(
        model_dir, "kv_consumer", f"D-bs64-{tag}", free_port(), block_size=64
    )
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


def test_a_load_whose_producer_is_unreachable_counts_a_failed_transfer(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """A load that fails at its handshake, before any READ, is a transfer that failed (by
    the handshake's outcome): the failure-ratio panel and alert see it, once."""
    p, d = engines
    nowhere = {"remote_engine_id": "P-unreachable", "remote_port": free_port()}
    params = _prefill(p, "p-unreachable") | nowhere
    transfers = d.probe("fail", "transfers")
    d.add("fail", "d-unreachable", prompt("p-unreachable"), 2, params)
    d.wait("recv_done", "d-unreachable")
    assert d.wait("finished", "d-unreachable")[2] == "error"
    assert counted_since(transfers, d.probe("fail", "transfers")) == {"timeout": 1}


def _warning(d: EngineProc, engine: str, rid: str, *, last: bool = False) -> str:
    """The first (or last) warning `engine` logged naming request `rid`."""
    said = [w for w in d.probe(engine, "warnings") if f"'{rid}'" in w]
    assert said, f"no warning names {rid!r}"
    return said[-1 if last else 0]


# a decoder request's kv_transfer_params as a client might get them wrong, and the field named
BAD_PARAMS = {
    "remote_port": {"remote_port": "abc"},
    "remote_host": {"remote_host": None},
    "transfer_mode": {"transfer_mode": "bogus"},
    "remote_blocks_expiry_time": {"remote_blocks_expiry_time": "soon"},
    "remote_num_tokens": {"remote_num_tokens": -1},
}


@pytest.mark.parametrize("field", list(BAD_PARAMS))
def test_bad_kv_transfer_params_fail_the_load_by_policy_naming_the_field(
    engines: tuple[EngineProc, EngineProc], field: str
) -> None:
    """Never an exception into vLLM's scheduler (it would end the engine): the request's
    load fails, so `fail` ends it in error and `recompute` computes its prompt locally."""
    p, d = engines
    params = _prefill(p, f"p-bad-{field}") | BAD_PARAMS[field]
    for policy in ("fail", "recompute"):
        rid = f"d-bad-{field}-{policy}"
        d.add(policy, rid, prompt(f"p-bad-{field}"), 2, params)
        _, _, _, _, invalid, failed = d.wait("recv_done", rid)
        assert (len(invalid), failed) == (5, [])  # every block of the load
        _, _, reason, _, _, _, computed = d.wait("finished", rid)
        assert (reason, computed) == (("error", 0) if policy == "fail" else ("length", 150))
        assert f"kv_transfer_params.{field}" in _warning(d, policy, rid)


def test_a_consumer_ignores_do_remote_decode_and_frees_the_blocks(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    _, d = engines
    d.add("fail", "d-decode", prompt("d-decode"), 1, {"do_remote_decode": True})
    _, _, reason, params, _, _, computed = d.wait("finished", "d-decode")
    assert (reason, json.loads(params), computed) == ("length", None, 150)
    assert d.free_blocks("fail") == d.free_at_start["fail"]
    assert "do_remote_decode ignored" in _warning(d, "fail", "d-decode")


def test_a_producer_ignores_do_remote_prefill_and_computes_the_prompt(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """A request a proxy sent to the wrong engine: a producer reads no KV, so it computes the
    prompt itself (as a consumer ignores do_remote_decode) instead of failing the request."""
    p, _ = engines
    params = _prefill(p, "p-misrouted-source")  # real params, naming this producer's blocks
    p.add("p", "p-misrouted", prompt("p-misrouted"), 1, params)  # no prefix cache hit
    _, _, reason, _, _, _, computed = p.wait("finished", "p-misrouted")
    assert (reason, computed) == ("length", 150)
    assert "do_remote_prefill ignored" in _warning(p, "p", "p-misrouted")


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_prefill": True},
        # what a producer that held nothing answers
        {
            "do_remote_prefill": True, "remote_block_ids": [[]], "remote_engine_id": "P-none",
            "remote_host": "127.0.0.1", "remote_port": 5999, "remote_request_id": "x",
        },
    ],
    ids=["no-blocks", "empty-group"],
)  # fmt: skip
def test_a_remote_prefill_with_nothing_to_read_is_computed_locally(
    engines: tuple[EngineProc, EngineProc], params: dict
) -> None:
    _, d = engines
    rid = f"d-nothing-{len(params)}"
    d.add("fail", rid, prompt(rid), 2, params)
    _, _, reason, _, _, _, computed = d.wait("finished", rid)
    assert (reason, computed) == ("length", 150)
    assert d.free_blocks("fail") == d.free_at_start["fail"]


def test_a_longer_decoder_prompt_loads_what_the_producer_computed_and_computes_the_rest(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    p, d = engines
    p.add("p", "p-long", prompt("p-long"), 1, {"do_remote_decode": True})
    _, _, _, params, _, p_bytes, _ = p.wait("finished", "p-long")
    d.add("fail", "d-long", prompt("p-long") + prompt("more")[:64], 2, json.loads(params))
    _, _, ids, d_bytes, invalid, failed = d.wait("recv_done", "d-long")
    assert (len(ids), invalid, failed) == (5, [], []) and any(p_bytes) and d_bytes == p_bytes
    _, _, reason, _, _, _, computed = d.wait("finished", "d-long")
    assert (reason, computed) == ("length", 64)  # the tokens past P's 150


def test_a_decoder_prompt_shorter_than_the_producers_fails_its_load(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """P's blocks would put another prompt's KV in D's blocks: the load fails, saying so."""
    p, d = engines
    params = _prefill(p, "p-short")
    d.add("fail", "d-short", prompt("p-short")[:100], 2, params)
    _, _, _, _, invalid, failed = d.wait("recv_done", "d-short")
    assert (len(invalid), failed) == (4, [])
    assert d.wait("finished", "d-short")[2] == "error"
    said = _warning(d, "fail", "d-short", last=True)
    assert "remote_num_tokens" in said and "a prefill is sent max_tokens 1" in said


def _older_params(p: EngineProc, rid: str, key: str = "p") -> tuple[dict, bytes]:
    """A prefill's kv_transfer_params as an older producer answers, without
    `remote_num_tokens`, and P's KV of the request."""
    p.add(key, rid, prompt(rid), 1, {"do_remote_decode": True})
    _, _, _, params, _, p_bytes, _ = p.wait("finished", rid)
    older = json.loads(params)
    del older["remote_num_tokens"]
    return older, p_bytes


def test_params_without_remote_num_tokens_load_the_whole_prompt(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    p, d = engines
    for c in ("fail", "recompute-hybrid"):
        params, p_bytes = _older_params(p, f"p-older-{c}", _producer(c))
        before = d.probe(c, "blocks_loaded")
        d.add(c, f"d-older-{c}", prompt(f"p-older-{c}"), 2, params)
        _, _, ids, d_bytes, invalid, failed = d.wait("recv_done", f"d-older-{c}")
        assert (len(ids), invalid, failed) == (5, [], []) and any(p_bytes) and d_bytes == p_bytes
        _, _, reason, _, _, _, computed = d.wait("finished", f"d-older-{c}")
        assert (reason, computed) == ("length", 1)
        if c == "fail":  # one KV-cache group: the blocks counted loaded are the prompt's
            assert d.probe(c, "blocks_loaded") - before == 5


def test_a_shorter_prompt_without_remote_num_tokens_fails_its_load(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """With no token count to compare, P's blocks spanning more blocks than D's request
    holds tell the same: P's later blocks would land in D's (read as a prefix-cache hit)."""
    p, d = engines
    params, _ = _older_params(p, "p-older-short")
    d.add("fail", "d-older-short", prompt("p-older-short")[:100], 2, params)
    _, _, _, _, invalid, failed = d.wait("recv_done", "d-older-short")
    assert (len(invalid), failed) == (4, [])
    assert d.wait("finished", "d-older-short")[2] == "error"
    assert "remote_block_ids[0]" in _warning(d, "fail", "d-older-short", last=True)


def test_a_prefix_hit_without_remote_num_tokens_loads_only_a_prompt_the_producer_computed(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """D's first four blocks are in its prefix cache: the same prompt loads P's fifth block
    only, while a longer one would have P's blocks 2-4 land in D's 4-6, so it fails."""
    p, d = engines
    d.add("fail", "d-older-local", prompt("p-older-hit"), 1, None)  # D's cache: 4 blocks
    assert d.wait("finished", "d-older-local")[2] == "length"
    params, p_bytes = _older_params(p, "p-older-hit")
    d.add("fail", "d-older-hit", prompt("p-older-hit"), 2, params)
    _, _, ids, d_bytes, invalid, failed = d.wait("recv_done", "d-older-hit")
    assert (len(ids), invalid, failed) == (5, [], []) and d_bytes == p_bytes
    assert d.wait("finished", "d-older-hit")[2] == "length"
    params, _ = _older_params(p, "p-older-hit-2")
    d.add("fail", "d-older-local-2", prompt("p-older-hit-2"), 1, None)
    assert d.wait("finished", "d-older-local-2")[2] == "length"
    d.add("fail", "d-older-long", prompt("p-older-hit-2") + prompt("more")[:64], 2, params)
    _, _, _, _, invalid, failed = d.wait("recv_done", "d-older-long")
    assert (len(invalid), failed) == (3, [])  # the blocks past D's hit
    assert d.wait("finished", "d-older-long")[2] == "error"
    assert "remote_block_ids[0]" in _warning(d, "fail", "d-older-long", last=True)


def test_a_second_load_of_one_prefill_fails_instead_of_reading_freed_blocks(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """P frees a request's blocks once D has read them and reuses them for other prompts:
    a second D request with the same kv_transfer_params (a proxy retrying) must not READ
    them, its load fails naming the request that loaded them."""
    p, d = engines
    params = _prefill(p, "p-twice")
    d.add("fail", "d-twice-1", prompt("p-twice"), 2, params)
    assert d.wait("recv_done", "d-twice-1")[4:] == ([], [])
    assert d.wait("finished", "d-twice-1")[2] == "length"
    p.wait("sent", "p-twice")  # P's blocks are free now
    d.add("fail", "d-twice-2", prompt("p-twice"), 2, params)
    _, _, _, _, invalid, failed = d.wait("recv_done", "d-twice-2")
    assert invalid and failed == []  # the blocks past D's own prefix-cache hit
    assert d.wait("finished", "d-twice-2")[2] == "error"
    said = _warning(d, "fail", "d-twice-2")
    assert "kv_transfer_params.remote_request_id" in said and "'d-twice-1'" in said, said


def test_a_decoder_whose_blocks_hold_two_of_the_producers_reads_them(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    p, d = engines
    p.add("p", "p-bs", prompt("p-bs"), 1, {"do_remote_decode": True})
    _, _, _, params, _, p_bytes, _ = p.wait("finished", "p-bs")
    d.add("bs64", "d-bs", prompt("p-bs"), 2, json.loads(params))
    _, _, ids, d_bytes, invalid, failed = d.wait("recv_done", "d-bs")
    assert (len(ids), invalid, failed) == (3, [], [])
    assert any(p_bytes)
    assert _tokens(d_bytes, 64, 3)[:, :150].tobytes() == _tokens(p_bytes, 32, 5)[:, :150].tobytes()
    _, _, reason, _, _, _, computed = d.wait("finished", "d-bs")
    assert reason == "length" and computed <= 1


def _tokens(snapshot: bytes, block_size: int, num_blocks: int) -> Any:
    """A snapshot's KV per token, `[layers, tokens, heads, content]`: comparable across
    block sizes."""
    import numpy as np

    layers, heads = MODEL_CONFIG["num_hidden_layers"], MODEL_CONFIG["num_key_value_heads"]
    kv = np.frombuffer(snapshot, np.float32).reshape(layers, num_blocks, heads, block_size, -1)
    return kv.transpose(0, 1, 3, 2, 4).reshape(layers, num_blocks * block_size, heads, -1)


@pytest.mark.parametrize("error", ["RuntimeError", "ConfigError"])
def test_a_load_whose_post_raises_fails_alone_and_once(
    engines: tuple[EngineProc, EngineProc], error: str
) -> None:
    """An unexpected error while D posts a load's READs (NIXL's bindings failing in a way
    kvrdma does not know, or a bug) fails that load only, as vLLM's own connector does: it
    is reported once, every block invalid, D recomputes it, P is told to let go at once,
    and the engine goes on loading."""
    p, d = engines
    rid, did = f"p-broken-{error}", f"d-broken-{error}"
    params = _prefill(p, rid)
    requests, transfers = d.probe("recompute", "requests"), d.probe("recompute", "transfers")
    d.break_post("recompute", error)
    d.add("recompute", did, prompt(rid), 2, params)
    _, _, ids, _, invalid, _ = d.wait("recv_done", did)
    assert ids and invalid == sorted(ids)
    assert d.wait("finished", did)[2] == "length"
    p.wait("sent", rid, timeout=PROMPT_FREE_SECONDS)  # told, not left to its lease
    with pytest.raises(TimeoutError):
        d.wait("recv_done", did, timeout=1.0)  # reported once
    assert counted_since(requests, d.probe("recompute", "requests")) == {"invalid_blocks": 1}
    # one failed transfer: telling P to let go is no transfer of its own
    assert counted_since(transfers, d.probe("recompute", "transfers")) == {"failed": 1}
    params = _prefill(p, f"{rid}-next")
    d.add("recompute", f"{did}-next", prompt(f"{rid}-next"), 2, params)
    assert d.wait("recv_done", f"{did}-next")[4:] == ([], [])


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
