"""Push mode through real NIXL agents in separate processes: P ranks WRITE each request into
the blocks D ranks expect, whole or layer by layer, for the layouts and TP mixes pull
supports, byte for byte; and every way a push can fail ends it exactly once, with nothing
landing in blocks after they are released."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry
from rank_host import EnginePair, EngineSpec, HostPool, RankHost
from test_data_path_matrix import D_BLOCK, D_BLOCKS, P_BLOCKS, check_pair, shape
from worker_pair import step_until

from kvrdma.config import load_kv_transfer_config
from kvrdma.defaults import ucx_num_threads
from kvrdma.errors import ConfigError, TransferError
from kvrdma.lease import Renewals
from kvrdma.push import receiver as push_receiver
from kvrdma.push import sender as push_sender
from kvrdma.push import wire
from kvrdma.telemetry import KvrdmaMetrics
from kvrdma.testing import stop_process
from kvrdma.testing.synthetic import CacheSpec, ModelShape, fill, make_caches, verify
from kvrdma.types import FinishedOutput
from kvrdma.worker import Worker

pytest.importorskip("nixl")

CASES = [
    # (layout, P tp, D tp, KV heads, block ratio, D kv layout)
    ("split_kv", 1, 1, 8, 1, "HND"),
    ("split_kv", 1, 2, 8, 2, "NHD"),
    ("split_kv", 2, 1, 8, 1, "HND"),
    ("blocks_first", 2, 4, 8, 1, "HND"),
    ("blocks_first", 4, 2, 8, 2, "NHD"),
    ("mla", 1, 2, 1, 1, "HND"),
    ("cross_layer", 2, 1, 8, 2, "HND"),
    ("mamba", 1, 2, 2, 1, "HND"),
    ("mamba", 2, 1, 8, 1, "HND"),
]


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize(
    ("layout", "p_tp", "d_tp", "heads", "ratio", "d_kvl"),
    [pytest.param(*c, id=f"{c[0]}-p{c[1]}d{c[2]}-h{c[3]}-r{c[4]}-{c[5]}") for c in CASES],
)
def test_push_lands_byte_exact(
    rank_hosts: HostPool,
    layout: str,
    p_tp: int,
    d_tp: int,
    heads: int,
    ratio: int,
    d_kvl: str,
    layerwise: bool,
) -> None:
    p = EngineSpec(p_tp, D_BLOCK // ratio, P_BLOCKS, layout, "HND", shape(heads))
    d = EngineSpec(d_tp, D_BLOCK, D_BLOCKS, layout, d_kvl, shape(heads))
    check_pair(rank_hosts, p, d, ratio, "layerwise" if layerwise else "whole")


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize(
    ("order", "p_tp", "d_tp", "heads", "ratio", "hybrid"),
    [
        ("LBHNC", 1, 2, 8, 2, False),
        ("LHBNC", 2, 1, 8, 1, False),
        ("BLHNC", 4, 2, 8, 1, True),
        ("BHLNC", 2, 4, 8, 2, False),
        ("LBNHC", 4, 2, 8, 1, False),
    ],
)
def test_push_lands_byte_exact_in_vllm_unified_orders(
    rank_hosts: HostPool,
    order: str,
    p_tp: int,
    d_tp: int,
    heads: int,
    ratio: int,
    hybrid: bool,
    layerwise: bool,
) -> None:
    def spec(tp: int, block: int, blocks: int) -> EngineSpec:
        return EngineSpec(
            tp, block, blocks, "unified", "HND", shape(heads), kv_cache_order=order, hybrid=hybrid
        )

    p = spec(p_tp, D_BLOCK // ratio, P_BLOCKS)
    d = spec(d_tp, D_BLOCK, D_BLOCKS)
    check_pair(rank_hosts, p, d, ratio, "layerwise" if layerwise else "whole")


# ---- failures: each ends the request once; blocks are released only when nothing can land ----
# the default UCX threads (the rank hosts' default is 0): a WRITE may still be in flight when
# a push is given up, which is what these guarantees are about
SPEC = EngineSpec(
    1, D_BLOCK, D_BLOCKS, "split_kv", "HND", shape(8), extra={"num_threads": ucx_num_threads()}
)
LOCAL, REMOTE = [3, 5, 7], [10, 11, 12]


def _wait(
    pair: EnginePair, what: str, ok: Callable[[dict[str, Any]], bool], timeout: float = 8.0
) -> dict[str, Any]:
    """Poll D rank 0's push report until `ok` holds; returns it."""
    end = time.monotonic() + timeout
    while True:
        state = pair.d[0].call("push_state")
        if ok(state):
            return state
        assert time.monotonic() < end, f"{what}: not within {timeout}s; D reports {state}"
        time.sleep(0.05)


def _kill(host: RankHost) -> None:
    """SIGKILL a rank host and reap it (the pool replaces it before the next case)."""
    os.kill(host.process.pid or 0, signal.SIGKILL)
    host.process.join(5.0)


def _sent(pair: EnginePair, rid: str, timeout: float = 8.0) -> None:
    got = pair.wait_sent([rid], timeout=timeout)
    assert all(rid in g for g in got), f"P ranks did not free {rid!r}: {got}"


def test_a_push_never_started_fails_at_the_deadline_and_nothing_lands_later(
    rank_hosts: HostPool,
) -> None:
    with EnginePair(rank_hosts, SPEC, SPEC) as pair:
        pair.connect()
        t0 = time.monotonic()
        pair.d[0].call("expect_push", [("r", LOCAL, REMOTE)], 1.0)
        state = _wait(pair, "the failure", lambda s: "r" in s["recvd"])
        assert state["recvd"]["r"] == (LOCAL, "timeout")
        assert 1.0 <= time.monotonic() - t0 < 3.0
        _wait(pair, "the release", lambda s: "r" in s["released"])  # P had nothing posted
        pair.p[0].call("push", [("r", REMOTE)], False)  # prefill ends after D gave up
        _sent(pair, "r")
        assert pair.d[0].call("untouched_nonzero", LOCAL) == 0


def test_a_stalled_producer_keeps_the_blocks_quarantined_until_it_stops_writing(
    rank_hosts: HostPool,
) -> None:
    with EnginePair(rank_hosts, SPEC, SPEC) as pair:
        pair.connect()
        pair.d[0].call("expect_push", [("r", LOCAL, REMOTE)], 1.5)
        pair.p[0].call("push", [("r", REMOTE)], True, 1)  # the first layer, prefill goes on
        pid = pair.p[0].process.pid or 0
        stop_process(pid)
        try:
            state = _wait(pair, "the failure", lambda s: "r" in s["recvd"])
            assert state["recvd"]["r"] == (LOCAL, "timeout") and state["quarantined"] == ["r"]
            time.sleep(2.0)  # probes find the stopped rank alive: it could still write
            assert pair.d[0].call("push_state")["quarantined"] == ["r"]
        finally:
            os.kill(pid, signal.SIGCONT)
        _wait(pair, "the release", lambda s: "r" in s["released"] and not s["quarantined"])
        pair.d[0].call("zero", LOCAL)  # the decoder reuses the blocks
        pair.p[0].call("push_rest", "r")  # the producer's prefill ends
        _sent(pair, "r")
        time.sleep(0.3)
        assert pair.d[0].call("untouched_nonzero", LOCAL) == 0


def test_a_killed_producer_is_found_gone_and_the_blocks_released(rank_hosts: HostPool) -> None:
    with EnginePair(rank_hosts, SPEC, SPEC) as pair:
        pair.connect()
        pair.d[0].call("expect_push", [("r", LOCAL, REMOTE)], 1.0)
        pair.p[0].call("push", [("r", REMOTE)], True, 1)
        _kill(pair.p[0])
        state = _wait(pair, "the failure", lambda s: "r" in s["recvd"])
        assert state["recvd"]["r"][0] == LOCAL
        _wait(pair, "the release", lambda s: "r" in s["released"] and not s["quarantined"])


def test_a_decoder_abort_stops_the_producer_and_frees_both_sides(rank_hosts: HostPool) -> None:
    with EnginePair(rank_hosts, SPEC, SPEC) as pair:
        pair.connect()
        pair.d[0].call("expect_push", [("r", LOCAL, REMOTE)], 30.0)
        pair.p[0].call("push", [("r", REMOTE)], True, 1)
        pair.d[0].call("forget", "r")
        state = _wait(pair, "the release", lambda s: "r" in s["released"])
        assert "r" not in state["recvd"]  # an abandoned request is not reported received
        _sent(pair, "r")  # long before the lease
        pair.d[0].call("zero", LOCAL)
        pair.p[0].call("push_rest", "r")
        time.sleep(0.3)
        assert pair.d[0].call("untouched_nonzero", LOCAL) == 0


def test_a_producer_abort_fails_the_request_at_once_without_quarantine(
    rank_hosts: HostPool,
) -> None:
    with EnginePair(rank_hosts, SPEC, SPEC) as pair:
        pair.connect()
        pair.d[0].call("expect_push", [("r", LOCAL, REMOTE)], 30.0)
        pair.p[0].call("push", [("r", REMOTE)], True, 1)
        t0 = time.monotonic()
        pair.p[0].call("abort_push", "r")
        state = _wait(pair, "the failure", lambda s: "r" in s["recvd"])
        assert state["recvd"]["r"] == (LOCAL, "failed") and state["quarantined"] == []
        assert time.monotonic() - t0 < 2.0
        _sent(pair, "r")


def test_a_producer_whose_decoder_vanished_frees_its_blocks(rank_hosts: HostPool) -> None:
    with EnginePair(rank_hosts, SPEC, SPEC) as pair:
        pair.connect()
        pair.d[0].call("expect_push", [("r", LOCAL, REMOTE)], 30.0)
        end = time.monotonic() + 5.0
        while "r" not in pair.p[0].call("push_state")["expected"]:
            assert time.monotonic() < end, "the producer never got the decoder's Expect"
            time.sleep(0.02)
        _kill(pair.d[0])
        t0 = time.monotonic()
        pair.p[0].call("push", [("r", REMOTE)], False)
        _sent(pair, "r", timeout=10.0)
        assert time.monotonic() - t0 < 10.0  # the lease is 30 s


# ---- in one process: layer by layer, and what push refuses ---------------------------------
def _local(
    engine: str,
    role: str,
    registry: CollectorRegistry | None = None,
    compat_hash: str = "",
    **extra: Any,
) -> tuple[Worker, CacheSpec, dict[str, Any]]:
    spec = CacheSpec(
        ModelShape(num_layers=3, num_kv_heads=4, head_dim=8), "split_kv", "HND", 0, 1, 16, 16
    )
    caches, _ = make_caches(spec)
    if role == "kv_producer":
        fill(spec, caches)
    raw = {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine}
    config = load_kv_transfer_config({**raw, "kv_connector_extra_config": extra}, environ={})
    metrics = None
    if registry is not None:
        side = "producer" if role == "kv_producer" else "consumer"
        metrics = KvrdmaMetrics(registry=registry, engine_id=engine, role=side, tp_rank=0)
    w = Worker.create(
        config, tp_rank=0, tp_size=1, total_num_kv_heads=4, metrics=metrics,
        compat_hash=compat_hash,
    )  # fmt: skip
    w.register_kv_caches(caches, cache_layout="split_kv", block_size=16)
    return w, spec, caches


@contextlib.contextmanager
def _local_pair(**extra: Any) -> Iterator[tuple[Worker, Worker, CacheSpec, dict[str, Any]]]:
    """A producer "P" and a consumer "D" in this process, closed after the block."""
    d, spec, caches = _local("D", "kv_consumer", **extra)
    try:
        p, _, _ = _local("P", "kv_producer", **extra)
        try:
            yield p, d, spec, caches
        finally:
            p.close()
    finally:
        d.close()


def _received(p: Worker, d: Worker, rid: str, timeout: float = 10.0) -> None:
    """Step both until D reports `rid` received."""
    got: set[str] = set()
    end = time.monotonic() + timeout
    while rid not in got:
        assert time.monotonic() < end, f"{rid!r} not received within {timeout}s"
        p.get_finished()
        got |= d.get_finished().finished_recving


def test_each_layer_is_loaded_once_its_write_landed_and_not_before() -> None:
    with _local_pair() as (p, d, spec, caches):
        d.add_remote({0: p.metadata})
        d.expect_push("r", [0, 1], "P")
        p.push("r", [4, 9], layerwise=True)
        layers = list(caches)
        for i, layer in enumerate(layers):
            assert not any(d.layer_loaded("r", name) for name in layers[i:])
            p.push_layer("r", layer)
            step_until(p, d, lambda: d.layer_loaded("r", layer))  # noqa: B023
            assert all(d.layer_loaded("r", name) for name in layers[: i + 1])
        p.end_push("r")
        _received(p, d, "r")
        assert verify(spec, caches, [0, 1], [4, 9], 16) == 0


def test_transfer_series_tell_a_pushed_request_from_a_pulled_one() -> None:
    d_registry, p_registry = CollectorRegistry(), CollectorRegistry()
    d, spec, caches = _local("D", "kv_consumer", d_registry)
    p, _, _ = _local("P", "kv_producer", p_registry)
    peer = {"engine_id": "D", "role": "consumer", "tp_rank": "0", "remote_engine": "P"}
    producer = {"engine_id": "P", "role": "producer", "tp_rank": "0"}

    def transfers(mode: str) -> float | None:
        labels = {**peer, "mode": mode, "outcome": "success"}
        return d_registry.get_sample_value("kvrdma_transfers_total", labels)

    def freed(reason: str) -> float | None:
        labels = {**producer, "reason": reason}
        return p_registry.get_sample_value("kvrdma_freed_blocks_total", labels)

    try:
        d.add_remote({0: p.metadata})
        d.expect_push("pushed", [0, 1], "P")
        p.push("pushed", [4, 9])
        expires_at = p.hold("pulled", [5, 8])
        d.start_read("pulled", [2, 3], [5, 8], "P", remote_expires_at=expires_at)
        step_until(p, d, lambda: transfers("push") == transfers("pull") == 1)
        step_until(p, d, lambda: freed("notified") == 2)
        step_until(p, d, lambda: freed("pushed") == 2)
        assert verify(spec, caches, [0, 1, 2, 3], [4, 9, 5, 8], 16) == 0
        for mode in ("push", "pull"):
            labels = {**peer, "mode": mode}
            for name in ("kvrdma_transfer_bytes_count", "kvrdma_transfer_descriptors_count",
                         "kvrdma_transfer_duration_seconds_count",
                         "kvrdma_transfer_post_duration_seconds_count"):  # fmt: skip
                assert d_registry.get_sample_value(name, labels) == 1, (name, mode)
            assert d_registry.get_sample_value("kvrdma_transfers_in_flight", labels) == 0
        # the same two blocks moved each way: the same bytes
        sums = [
            d_registry.get_sample_value("kvrdma_transfer_bytes_sum", {**peer, "mode": m})
            for m in ("push", "pull")
        ]
        assert sums[0] == sums[1] > 0, sums
        assert freed("lease_expired") == freed("push_ended_short") == freed("push_aborted") == 0
    finally:
        d.close()
        p.close()


def test_freed_blocks_say_how_a_push_ended() -> None:
    p_registry, q_registry = CollectorRegistry(), CollectorRegistry()
    d, _, _ = _local("D", "kv_consumer")
    p, _, _ = _local("P", "kv_producer", p_registry)
    q, _, _ = _local("Q", "kv_producer", q_registry, kv_lease_duration=0.3)

    def freed(registry: CollectorRegistry, engine: str, reason: str) -> float | None:
        labels = {"engine_id": engine, "role": "producer", "tp_rank": "0", "reason": reason}
        return registry.get_sample_value("kvrdma_freed_blocks_total", labels)

    try:
        p.push("aborted", [1, 2, 3])
        p.abort_push("aborted")
        assert freed(p_registry, "P", "push_aborted") == 3
        d.add_remote({0: p.metadata})
        p.push("short", [4, 5], layerwise=True)  # no layer is ever ready: it cannot complete
        d.expect_push("short", [0, 1], "P")
        d.forget("short")
        step_until(p, d, lambda: freed(p_registry, "P", "push_ended_short") == 2)
        q.push("unexpected", [6])
        step_until(q, d, lambda: freed(q_registry, "Q", "push_lease_expired") == 1)
        producer = {"engine_id": "Q", "role": "producer", "tp_rank": "0"}
        assert q_registry.get_sample_value("kvrdma_expired_leases_total", producer) == 1
        assert freed(p_registry, "P", "pushed") == freed(q_registry, "Q", "pushed") == 0
    finally:
        d.close()
        p.close()
        q.close()


def _quarantined_mid_push(p: Worker, d: Worker, layers: list[str]) -> None:
    """D expects "r" in blocks 3 and 5 for 1 s; P writes the first layer, then stops stepping
    (a slow prefill) until D gives the push up and quarantines it."""
    d.expect_push("r", [3, 5], "P", deadline=1.0)
    p.push("r", [4, 9], layerwise=True)
    p.push_layer("r", layers[0])
    step_until(p, d, lambda: d.layer_loaded("r", layers[0]))
    end, quarantined = time.monotonic() + 10.0, set()
    while "r" not in quarantined:
        assert time.monotonic() < end, "never quarantined"
        out = d.get_finished()
        quarantined |= out.quarantined
        assert "r" not in out.released


def test_removing_the_engine_keeps_a_push_quarantined_until_its_producer_stopped() -> None:
    """Removing an engine stops nothing on it: a push it may still write stays quarantined
    until the producer says it ended, and nothing lands once it is released."""
    with _local_pair() as (p, d, _, caches):
        d.add_remote({0: p.metadata})
        layers = list(caches)
        _quarantined_mid_push(p, d, layers)
        d.remove_remote("P")
        for _ in range(8):  # several probe periods
            assert "r" not in d.get_finished().released
            time.sleep(push_receiver.PROBE_EVERY / 2)
        released: set[str] = set()
        end = time.monotonic() + 10.0
        while "r" not in released:  # P steps again: it reads D's abort and says it stopped
            assert time.monotonic() < end, "never released"
            p.get_finished()
            released |= d.get_finished().released
        for t in caches.values():
            for kv in t:
                kv[[3, 5]] = 0  # D reuses the blocks
        p.end_push("r")  # P's prefill ends: it must not write them any more
        for _ in range(20):
            p.get_finished()
            d.get_finished()
        assert all(int(kv[[3, 5]].count_nonzero()) == 0 for t in caches.values() for kv in t)


def test_a_push_under_way_fails_when_its_engine_is_removed() -> None:
    with _local_pair() as (p, d, _, _):
        d.add_remote({0: p.metadata})
        d.expect_push("r", [3, 5], "P")
        p.push("r", [4, 9], layerwise=True)
        d.remove_remote("P")
        out = d.get_finished()
        assert out.finished_recving == {"r"} and out.invalid_block_ids == {"r": {3, 5}}
        assert out.failures["r"].outcome.value == "peer_lost"
        assert "r" in out.quarantined  # P was told to abort, and has not said it stopped
        step_until(p, d, lambda: d.pushes is not None and not d.pushes.fences)


def test_a_read_that_landed_is_reported_whole_even_if_its_engine_is_removed_first() -> None:
    """A read done but not yet reported keeps the plan it lands with."""
    with _local_pair() as (p, d, spec, caches):
        d.add_remote({0: p.metadata})
        assert d.consumer is not None
        d.start_read("r", [0, 1], [4, 9], "P", remote_expires_at=p.hold("r", [4, 9]))
        c, end = d.consumer, time.monotonic() + 10.0
        while not c.ready:  # done, not yet reported
            assert time.monotonic() < end, "the read never finished"
            p.get_finished()
            c.poll()
        d.remove_remote("P")
        out = d.get_finished()
        assert out.finished_recving == {"r"} and not out.invalid_block_ids
        assert verify(spec, caches, [0, 1], [4, 9], 16) == 0


def test_metadata_a_reader_could_not_use_is_refused_naming_the_field(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`add_remote` and a producer given a decoder's metadata in an Expect check it as a
    handshake does, so a bad value is a clear error, not a crash in `get_finished`."""
    with _local_pair() as (p, d, _, _), caplog.at_level(logging.WARNING, "kvrdma.push"):
        bad = msgspec.structs.replace(d.metadata, mem_type="GPU0")
        with pytest.raises(ConfigError, match="remote rank 0 metadata: mem_type 'GPU0'"):
            d.add_remote({0: msgspec.structs.replace(p.metadata, mem_type="GPU0")})
        p.push("r", [4, 9])
        expect = wire.Expect(wire.PUSH_VERSION, "r", "d-r", [0, 1], 30.0, 1, bad)
        assert p.producer is not None
        p.producer.on_push(expect)
        p.get_finished()
        assert "push of 'r' to D rank 0 refused" in caplog.text
        assert "mem_type 'GPU0' is not one of" in caplog.text


@contextlib.contextmanager
def _refused_pair() -> Iterator[tuple[Worker, Worker]]:
    """P and D whose compat hashes differ: P refuses to write into D, which connected all
    the same (it does not enforce them)."""
    d, _, _ = _local("D", "kv_consumer", compat_hash="model-a", enforce_handshake_compat=False)
    try:
        p, _, _ = _local("P", "kv_producer", compat_hash="model-b")
        try:
            d.add_remote({0: p.metadata})
            yield p, d
        finally:
            p.close()
    finally:
        d.close()


def _until(
    p: Worker, d: Worker, what: str, done: Callable[[FinishedOutput], bool]
) -> FinishedOutput:
    """Step both until what D reported so far is `done`; all it reported."""
    got, t0 = FinishedOutput(), time.monotonic()
    while not done(got):
        assert time.monotonic() - t0 < 10.0, f"{what} never came: {got}"
        p.get_finished()
        out = d.get_finished()
        got.finished_recving |= out.finished_recving
        got.invalid_block_ids.update(out.invalid_block_ids)
        got.quarantined |= out.quarantined
        got.released |= out.released
    return got


def test_a_decoder_the_producer_refuses_is_told_so_and_holds_no_blocks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A refusal is an answer: D fails the request at once, not at its deadline, with no
    block quarantined (nothing was written, and P said so)."""
    with _refused_pair() as (p, d), caplog.at_level(logging.WARNING, "kvrdma.push"):
        p.push("r", [4, 9])
        d.expect_push("r", [0, 1], "P", deadline=30.0)
        t0 = time.monotonic()
        _until(p, d, "the failure", lambda g: "r" in g.finished_recving)
        assert time.monotonic() - t0 < 5.0
        assert "compat hash 'model-a' differs" in caplog.text
        out = d.get_finished()
        assert "r" not in out.quarantined


def test_a_decoder_the_producer_refuses_has_its_abort_answered() -> None:
    """D gives up (its deadline) before P has the request, so its blocks stay quarantined
    until P answers D's abort, which P does although it refuses to write into D."""
    with _refused_pair() as (p, d):
        d.expect_push("r", [0, 1], "P", deadline=1.0)
        _until(p, d, "the timeout", lambda g: "r" in g.quarantined)
        _until(p, d, "the release", lambda g: "r" in g.released)


def test_a_decoder_rank_whose_agent_cannot_be_loaded_is_not_tried_at_each_expect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loading the agent of a decoder rank this producer cannot reach blocks its step until
    TCP gives up, and the rank sends an Expect per request: after a failure the producer
    tries again only `RELOAD_AFTER_S` later."""
    monkeypatch.setattr(push_sender, "RELOAD_AFTER_S", 1.0)
    with _local_pair() as (p, d, _, _):
        d.add_remote({0: p.metadata})
        tries: list[float] = []

        def unreachable(_: bytes) -> str:
            tries.append(time.monotonic())
            raise TransferError("UCX endpoint create failed: Destination is unreachable")

        monkeypatch.setattr(p.backend, "add_remote", unreachable)
        for rid in ("r1", "r2", "r3"):
            p.push(rid, [4, 9])
            d.expect_push(rid, [0, 1], "P", deadline=0.5)
        _until(p, d, "the timeouts", lambda g: len(g.finished_recving) == 3)
        assert len(tries) == 1
        time.sleep(max(0.0, tries[0] + 1.0 - time.monotonic()))
        p.push("r4", [4, 9])
        d.expect_push("r4", [0, 1], "P", deadline=0.5)
        _until(p, d, "the next try", lambda _: len(tries) == 2)


def test_a_decoder_rank_loaded_after_a_failure_is_told_what_it_was_owed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A producer that could not load a decoder rank's agent cannot answer it; once it loads
    it (tried again `RELOAD_AFTER_S` later), it says that the pushes it refused ended, so
    the decoder's blocks are released rather than quarantined for as long as it lives."""
    monkeypatch.setattr(push_sender, "RELOAD_AFTER_S", 1.0)
    with _local_pair() as (p, d, _, _):
        d.add_remote({0: p.metadata})
        load, tries = p.backend.add_remote, []

        def once_unreachable(metadata: bytes) -> str:
            tries.append(time.monotonic())
            if len(tries) == 1:
                raise TransferError("UCX endpoint create failed: Destination is unreachable")
            return load(metadata)

        monkeypatch.setattr(p.backend, "add_remote", once_unreachable)
        for rid, blocks in (("r1", [0, 1]), ("r2", [2, 3])):
            p.push(rid, [4, 9])
            d.expect_push(rid, blocks, "P", deadline=0.5)
        got = _until(p, d, "the release", lambda g: {"r1", "r2"} <= g.released)
        assert {"r1", "r2"} <= got.quarantined and len(tries) == 2


def test_push_is_refused_in_integrity_mode_whose_checks_cover_reads_only() -> None:
    with _local_pair(integrity_checksums=True) as (p, d, _, _):
        d.add_remote({0: p.metadata})
        with pytest.raises(
            ConfigError, match="integrity_checksums: checksums are checked on READs"
        ):
            d.expect_push("r", [0], "P")


def test_a_decoder_that_comes_after_prefill_gets_it_in_one_write() -> None:
    with _local_pair() as (p, d, spec, caches):
        d.add_remote({0: p.metadata})
        p.push("r", [4, 9], layerwise=True)
        for layer in caches:
            p.push_layer("r", layer)
        p.end_push("r")
        d.expect_push("r", [0, 1], "P")
        assert d.pushes is not None
        wait = d.pushes.waits["r"]
        _received(p, d, "r")
        assert wait.counts == {0: 1}  # one segment: the whole request
        assert verify(spec, caches, [0, 1], [4, 9], 16) == 0


def test_expect_push_refuses_block_ids_that_do_not_pair_before_telling_anyone() -> None:
    with _local_pair() as (p, d, _, _):
        d.add_remote({0: p.metadata})
        with pytest.raises(ConfigError, match="1 remote blocks at block_size_ratio 1 need 1"):
            d.expect_push("r", [0, 1], "P", remote_block_ids=[4])
        assert d.pushes is not None and not d.pushes.waits


@pytest.mark.parametrize("named", [False, True], ids=["own-blocks", "named-blocks"])
def test_expect_push_refuses_a_local_block_named_twice_before_telling_anyone(named) -> None:
    """Two producer blocks written into one decoder block leave whichever landed last."""
    with _local_pair() as (p, d, spec, caches):
        assert p.producer is not None and d.pushes is not None
        d.add_remote({0: p.metadata})
        remote = [4, 9, 11] if named else None
        with pytest.raises(ConfigError, match=r"^local_block_ids: .* got \[1\] more than once"):
            d.expect_push("r", [1, 0, 1], "P", remote_block_ids=remote)
        assert not d.pushes.waits
        p.get_finished()
        assert not p.producer.pusher.early  # no Expect was sent
        d.expect_push("r", [0, 1, 2], "P", remote_block_ids=remote)
        p.push("r", [4, 9, 11])
        _received(p, d, "r")
        assert verify(spec, caches, [0, 1, 2], [4, 9, 11], 16) == 0


def test_a_producer_does_not_write_an_expect_naming_a_decoder_block_twice() -> None:
    """A decoder of another make may send such an Expect: P ends it instead of writing."""
    with _local_pair() as (p, d, _, _):
        assert p.producer is not None
        p.push("r", [4, 9])
        p.producer.on_push(wire.Expect(wire.PUSH_VERSION, "r", "d-r", [1, 1], 30.0, 1, d.metadata))
        p.get_finished()
        assert "r" in p.producer.pusher.let_go  # nothing in flight: let go at once
        assert p.producer.pusher.written.total() == 0


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_kept_alive_request_whose_transfer_is_refused_is_no_longer_heartbeated(mode) -> None:
    """A decoder heartbeats a request it will read (its producer's lease holds); if the read
    or the push expectation is then refused, the heartbeats stop and the producer's lease
    runs out, so no blocks stay held by a request nobody will read."""
    with _local_pair() as (p, d, _, _):
        d.add_remote({0: p.metadata})
        assert d.consumer is not None
        p.hold("r", [4, 9])
        d.keep_alive("r", "P")
        d.consumer.renewed["r"] = Renewals(time.monotonic())  # as after a heartbeat was sent
        with pytest.raises(ConfigError):
            if mode == "pull":
                d.start_read("r", [0, 1], [4], "P")
            else:
                d.expect_push("r", [0, 1], "P", remote_block_ids=[4])
        assert "r" not in d.consumer.waiting and "r" not in d.consumer.renewed


def test_messages_for_requests_a_producer_does_not_have_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decoders may expect a request before its producer has it; what they send for such
    requests is kept once per decoder rank, up to `MAX_EARLY_MESSAGES`: an Expect past that
    is answered at once (its decoder fails the request) instead of being kept."""
    monkeypatch.setattr(push_sender, "MAX_EARLY_MESSAGES", 3)
    with _local_pair() as (p, d, _, _):
        assert p.producer is not None
        pusher = p.producer.pusher

        def expect(rid: str) -> wire.Expect:
            return wire.Expect(wire.PUSH_VERSION, rid, f"d-{rid}", [0], 30.0, 1, d.metadata)

        for rid in ("r0", "r1", "r2"):
            pusher.on_message(expect(rid))
        sent_again = expect("r0")
        pusher.on_message(sent_again)  # at the cap, but it replaces r0's Expect
        assert [len(msgs) for _, msgs in pusher.early.values()] == [1, 1, 1]
        assert pusher.early["r0"][1] == [sent_again]
        pusher.on_message(expect("r3"))
        assert list(pusher.early) == ["r0", "r1", "r2"]
        p.push("r1", [4])  # the producer gets r1: its Expect is taken, room for one more
        pusher.on_message(expect("r3"))
        assert list(pusher.early) == ["r0", "r2", "r3"]
        abort = wire.Abort(wire.PUSH_VERSION, "r2", "d-r2", d.metadata.engine_id, 0, "aborted")
        pusher.on_message(abort)  # an Abort of a kept Expect is taken whatever the count
        assert pusher.early["r2"][1][-1] == abort


def test_a_decoder_naming_no_producer_blocks_gets_the_last_ones_in_order() -> None:
    """A decoder that expects a push before prefill cannot name P's blocks: P writes its own
    in order, its last ones when the decoder's prefix-cache hit covers the first."""
    with _local_pair() as (p, d, spec, caches):
        d.add_remote({0: p.metadata})
        d.expect_push("all", [0, 1, 2], "P")
        d.expect_push("tail", [5], "P")
        p.push("all", [9, 4, 11], layerwise=True)
        p.push("tail", [9, 4, 11])
        for layer in caches:
            p.push_layer("all", layer)
        p.end_push("all")
        got: set[str] = set()
        end = time.monotonic() + 10
        while got != {"all", "tail"}:
            assert time.monotonic() < end, f"only {got} received"
            p.get_finished()
            got |= d.get_finished().finished_recving
        assert verify(spec, caches, [0, 1, 2], [9, 4, 11], 16) == 0
        assert verify(spec, caches, [5], [11], 16) == 0
        assert verify(spec, caches, [6], [4], 16) > 0  # nothing else written
