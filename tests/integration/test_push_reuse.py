"""Push mode when a decoder request id or a producer rank outlives one push: what one
expectation's producers say never settles another, a rank that writes nothing into a
decoder rank never keeps its blocks quarantined, a decoder rank expects a producer
request once at a time, and one that expects it again (a retry) gets it while the producer
holds it."""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec
import pytest
from test_push import _local_pair, _received
from worker_pair import step_until

from kvrdma.config import load_kv_transfer_config
from kvrdma.errors import ConfigError
from kvrdma.push import wire
from kvrdma.retirement import retire_reader
from kvrdma.testing.synthetic import CacheSpec, ModelShape, fill, make_caches, verify
from kvrdma.types import FinishedOutput
from kvrdma.worker import Worker


def test_a_late_word_from_an_earlier_push_under_the_same_id_does_not_end_the_next() -> None:
    """D gives "r" up, its blocks are released once P's WRITE landed, and D expects "r" again
    (a retry) before P has read the first abort: P's answer to that abort is about the
    first push, so the second is written and received, not failed unquarantined while P
    goes on writing into its blocks."""
    with _local_pair() as (p, d, spec, caches):
        assert p.producer is not None and d.pushes is not None
        d.add_remote({0: p.metadata})
        p.push("p1", [4, 9], layerwise=True)
        d.expect_push("r", [3, 5], "P", remote_request_id="p1", deadline=0.3)
        step_until(p, d, lambda: bool(p.producer and p.producer.pusher.jobs["p1"].targets))
        time.sleep(0.3)
        step_until(p, d, lambda: d.pushes is not None and "r" in d.pushes.fences)  # abort sent
        p.end_push("p1")  # P's prefill ends before it reads the abort
        released: set[str] = set()
        end = time.monotonic() + 10.0
        while "r" not in released:  # the WRITEs land: nothing more can, "r" is released
            assert time.monotonic() < end, "the first push was never released"
            p.producer.pusher.poll()  # P's transfers progress; its notifications wait
            released |= d.get_finished().released
        d.expect_push("r", [6, 7], "P", remote_request_id="p2")
        p.push("p2", [8, 10], layerwise=True)
        for _ in range(20):  # P answers the first abort and takes the second Expect
            p.get_finished()
            got = d.get_finished()
            assert "r" not in got.finished_recving, got  # nothing of p2 is written yet
        p.end_push("p2")
        end = time.monotonic() + 10.0
        while "r" not in got.finished_recving:
            assert time.monotonic() < end, "the second push was never reported"
            p.get_finished()
            got = d.get_finished()
        assert not got.invalid_block_ids and "r" not in got.failures, got
        assert verify(spec, caches, [6, 7], [8, 10], 16) == 0


def _rank(
    layout: Literal["mla", "split_kv"], engine: str, role: str, rank: int, tp: int, **extra: Any
) -> tuple[Worker, CacheSpec, dict[str, Any]]:
    """One rank of an engine in this process, its spec and its caches (an MLA latent cache
    is whole on every rank; split_kv caches have 4 KV heads in all)."""
    heads = 1 if layout == "mla" else 4
    spec = CacheSpec(
        ModelShape(num_layers=2, num_kv_heads=heads, head_dim=8), layout, "HND", rank, tp, 16, 16
    )
    caches, _ = make_caches(spec)
    if role == "kv_producer":
        fill(spec, caches)
    raw = {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine}
    config = load_kv_transfer_config({**raw, "kv_connector_extra_config": extra}, environ={})
    w = Worker.create(config, tp_rank=rank, tp_size=tp, total_num_kv_heads=heads)
    w.register_kv_caches(caches, cache_layout=layout, block_size=16)
    return w, spec, caches  # type: ignore[return-value]


def _mla(engine: str, role: str, rank: int, tp: int, **extra: Any) -> Worker:
    return _rank("mla", engine, role, rank, tp, **extra)[0]


def test_a_producer_rank_that_writes_nothing_here_does_not_keep_a_failed_push_quarantined() -> None:
    """D (TP 1) reads an MLA cache from P rank 0 only; P rank 1 is told of the request but
    writes nothing into D. When the push fails, the blocks stay quarantined until rank 0
    stopped, and not for as long as rank 1 lives: rank 1 let go of the request as soon as
    it was expected, and no longer remembers it when D's abort comes a lease later."""
    d = _mla("D", "kv_consumer", 0, 1)
    ps = [_mla("P", "kv_producer", r, 2, kv_lease_duration=1.0) for r in (0, 1)]
    try:
        plan = d.add_remote({r: p.metadata for r, p in enumerate(ps)})
        assert [s.remote_rank for s in plan.sources] == [0] and plan.notify_ranks == (0, 1)
        for p in ps:
            p.push("r", [4, 9], layerwise=True)
        d.expect_push("r", [3, 5], "P", deadline=1.5)  # longer than P's lease
        pushers = [p.producer.pusher for p in ps if p.producer is not None]
        end = time.monotonic() + 10.0
        while not (pushers[0].jobs["r"].targets and "r" in pushers[1].let_go):
            assert time.monotonic() < end, "the producer ranks never took the Expect"
            for x in (*ps, d):
                x.get_finished()
        out = FinishedOutput()
        end = time.monotonic() + 10.0
        others = 0
        while "r" not in out.quarantined:  # P rank 0 stalls (a slow prefill): D gives up
            assert time.monotonic() < end, "never quarantined"
            if pushers[1].idle:  # rank 1 serves other requests meanwhile
                others += 1
                ps[1].push(f"other-{others}", [1])
            ps[1].get_finished()
            out = d.get_finished()
        released: set[str] = set()
        end = time.monotonic() + 5.0
        while "r" not in released:  # rank 0 goes on, reads the abort and says it stopped
            assert time.monotonic() < end, "still quarantined after the only writer stopped"
            for p in ps:
                p.get_finished()
            released |= d.get_finished().released
    finally:
        for x in (*ps, d):
            x.close()


def _ended(p: Worker, d: Worker, rid: str) -> FinishedOutput:
    """Step both until D reports `rid`; everything D reported meanwhile."""
    out = FinishedOutput()
    end = time.monotonic() + 10.0
    while rid not in out.finished_recving:
        assert time.monotonic() < end, f"{rid!r} never reported"
        p.get_finished()
        got = d.get_finished()
        out.finished_recving |= got.finished_recving
        out.quarantined |= got.quarantined
        out.failures.update(got.failures)
    return out


def test_a_producer_request_expected_again_while_expected_is_refused() -> None:
    """P writes a request into one expectation per decoder rank: a second one under another
    local id would never be written, its abort would stop the first, and it would stay
    quarantined while P lives. D refuses it, naming both, and takes it once the first ended
    (P, done with the request, then ends it at once)."""
    with _local_pair() as (p, d, spec, caches):
        d.add_remote({0: p.metadata})
        p.push("p1", [4, 9], layerwise=True)
        d.expect_push("r1", [3, 5], "P", remote_request_id="p1")
        with pytest.raises(
            ConfigError,
            match=r"^request 'r2': producer request 'p1' of engine 'P' is already expected by "
            r"request 'r1'",
        ):
            d.expect_push("r2", [6, 7], "P", remote_request_id="p1")
        for layer in caches:
            p.push_layer("p1", layer)
        p.end_push("p1")
        _received(p, d, "r1")
        assert verify(spec, caches, [3, 5], [4, 9], 16) == 0
        d.expect_push("r2", [6, 7], "P", remote_request_id="p1")
        out = _ended(p, d, "r2")
        assert "r2" in out.failures and "r2" not in out.quarantined, out


def test_a_producer_request_expected_again_while_quarantined_is_refused() -> None:
    """While the first expectation is quarantined P may still write into it: a second one
    is refused until it is released."""
    with _local_pair() as (p, d, _, _):
        assert d.pushes is not None
        d.add_remote({0: p.metadata})
        p.push("p1", [4, 9], layerwise=True)  # a stalled prefill
        d.expect_push("r1", [3, 5], "P", remote_request_id="p1", deadline=0.3)
        step_until(p, d, lambda: bool(p.producer and p.producer.pusher.jobs["p1"].targets))
        time.sleep(0.3)
        quarantined: set[str] = set()
        end = time.monotonic() + 10.0
        while "r1" not in quarantined:  # D gives up; P has not read the abort yet
            assert time.monotonic() < end, "never quarantined"
            quarantined |= d.get_finished().quarantined
        with pytest.raises(ConfigError, match="already expected by request 'r1'"):
            d.expect_push("r2", [6, 7], "P", remote_request_id="p1")
        step_until(p, d, lambda: d.pushes is not None and not d.pushes.fences)  # P stopped
        d.expect_push("r2", [6, 7], "P", remote_request_id="p1")
        out = _ended(p, d, "r2")
        assert "r2" in out.failures and "r2" not in out.quarantined, out


def _step(p: Worker, d: Worker, out: FinishedOutput) -> None:
    """Step both; add what D reported to `out`."""
    p.get_finished()
    got = d.get_finished()
    out.finished_recving |= got.finished_recving
    out.quarantined |= got.quarantined
    out.released |= got.released
    out.failures.update(got.failures)


def _reported(p: Worker, d: Worker, rid: str) -> FinishedOutput:
    """Step both until D reports `rid` received or failed and released."""
    out = FinishedOutput()
    end = time.monotonic() + 10.0
    while rid not in out.finished_recving or (rid in out.quarantined and rid not in out.released):
        assert time.monotonic() < end, f"{rid!r} never reported: {out}"
        _step(p, d, out)
    return out


def test_a_push_expected_again_while_the_producer_holds_it_is_written() -> None:
    """D rank 0 of 2 gives "p1" up (P's prefill stalls) and expects it again once released.
    P still holds the request, for D rank 1 that has not expected it yet: the retry is
    written byte for byte, not left to fail at its deadline."""
    p, _, p_caches = _rank("split_kv", "P", "kv_producer", 0, 1)
    d, spec, caches = _rank("split_kv", "D", "kv_consumer", 0, 2)
    try:
        d.add_remote({0: p.metadata})
        p.push("p1", [4, 9], layerwise=True)
        d.expect_push("r", [3, 5], "P", remote_request_id="p1", deadline=0.3)
        step_until(p, d, lambda: bool(p.producer and p.producer.pusher.jobs["p1"].targets))
        time.sleep(0.3)
        first = _reported(p, d, "r")
        assert "r" in first.failures and "r" in first.released, first
        d.expect_push("r", [6, 7], "P", remote_request_id="p1", deadline=5.0)
        for layer in p_caches:
            p.push_layer("p1", layer)
        p.end_push("p1")
        t0 = time.monotonic()
        out = _reported(p, d, "r")
        assert "r" not in out.failures, out
        assert time.monotonic() - t0 < 2.0, "the retry waited for its deadline"
        assert verify(spec, caches, [6, 7], [4, 9], 16) == 0
    finally:
        d.close()
        p.close()


def test_an_abort_before_the_producer_had_the_request_does_not_refuse_its_retry() -> None:
    """D expects "p1" before P has it, gives it up, and expects it again: P keeps the abort
    with the retry, and the abort ends only the expectation it names."""
    with _local_pair() as (p, d, spec, caches):
        assert p.producer is not None
        pusher = p.producer.pusher
        d.add_remote({0: p.metadata})
        d.expect_push("r", [3, 5], "P", remote_request_id="p1", deadline=0.3)
        step_until(p, d, lambda: "p1" in pusher.early)
        time.sleep(0.3)
        first = _reported(p, d, "r")
        assert "r" in first.failures, first
        d.expect_push("r", [6, 7], "P", remote_request_id="p1", deadline=5.0)
        assert d.pushes is not None
        retry = d.pushes.waits["r"].wire_id

        def kept() -> list[str]:
            msgs = pusher.early.get("p1", (0.0, []))[1]
            return [m.decoder_request_id for m in msgs if isinstance(m, wire.Expect)]

        step_until(p, d, lambda: kept() == [retry])  # P holds the first abort and the retry
        p.push("p1", [4, 9])
        out = _reported(p, d, "r")
        assert "r" not in out.failures, out
        assert verify(spec, caches, [6, 7], [4, 9], 16) == 0


def test_an_expectation_while_the_decoder_ranks_copy_is_written_does_not_take_it_over() -> None:
    """A second Expect from the decoder rank (another expectation of "p1") while P still
    writes the first into it is answered "ended": the first copy goes on and lands whole."""
    with _local_pair() as (p, d, spec, caches):
        assert p.producer is not None
        pusher = p.producer.pusher
        d.add_remote({0: p.metadata})
        p.push("p1", [4, 9], layerwise=True)
        d.expect_push("r", [3, 5], "P", remote_request_id="p1")
        step_until(p, d, lambda: bool(pusher.jobs["p1"].targets))
        (first,) = pusher.jobs["p1"].targets.values()
        other = msgspec.structs.replace(first.expect, decoder_request_id="r#other", block_ids=[6])
        pusher.on_message(other)
        assert pusher.jobs["p1"].targets[first.key] is first
        for layer in caches:
            p.push_layer("p1", layer)
        p.end_push("p1")
        out = _reported(p, d, "r")
        assert "r" not in out.failures, out
        assert verify(spec, caches, [3, 5], [4, 9], 16) == 0


def test_an_expectation_of_no_blocks_given_up_is_reported_and_never_quarantined() -> None:
    """A release (D only tells P to let go, expecting none of its blocks) that P does not
    answer by its deadline fails at once: nothing can land in no blocks, so it is not held
    back for as long as P stays silent (a decoder keeps stepping until it is reported)."""
    with _local_pair() as (p, d, _, _):
        assert d.pushes is not None
        d.add_remote({0: p.metadata})
        d.expect_push("r", [], "P", remote_request_id="p1", deadline=0.3, release_only=True)
        got = FinishedOutput()
        end = time.monotonic() + 5.0
        while "r" not in got.finished_recving:  # P never reads the Expect: it stays silent
            assert time.monotonic() < end, "the release was never reported"
            got = d.get_finished()
            assert "r" not in got.quarantined, got
        assert "r" in got.failures and not d.pushes.fences


def test_a_decoder_rank_whose_agent_was_retired_still_hears_its_producers() -> None:
    """A read past its deadline retires the decoder rank's agent (`kvrdma.retirement`); the
    producer still answers the old one, which no longer listens. A push given up before the
    retirement must still be released once P stopped writing it, and one P writes meanwhile
    must end (it is stopped: its WRITEs go through the old agent), not stay quarantined for
    as long as P lives."""
    with _local_pair() as (p, d, _, caches):
        d.add_remote({0: p.metadata})
        layers = list(caches)
        d.expect_push("given-up", [3, 5], "P", deadline=0.5)
        d.expect_push("writing", [6, 7], "P", deadline=30.0)
        for rid, ids in (("given-up", [4, 9]), ("writing", [8, 10])):
            p.push(rid, ids, layerwise=True)
            p.push_layer(rid, layers[0])
        step_until(p, d, lambda: d.layer_loaded("writing", layers[0]))
        quarantined: set[str] = set()
        end = time.monotonic() + 10.0
        while "given-up" not in quarantined:  # P's prefill stalls: D gives the first up
            assert time.monotonic() < end, "never quarantined"
            quarantined |= d.get_finished().quarantined
        retire_reader(d._s, [], "a read passed its deadline")
        out = FinishedOutput()
        end = time.monotonic() + 5.0  # well before "writing"'s deadline
        while "given-up" not in out.released or "writing" not in out.finished_recving:
            assert time.monotonic() < end, f"still quarantined after the retirement: {out}"
            _step(p, d, out)
        assert "writing" in out.failures and "writing" not in out.quarantined, out
        for t in caches.values():
            for kv in t:
                kv[[3, 5, 6, 7]] = 0  # D reuses the blocks
        for rid in ("given-up", "writing"):
            p.end_push(rid)  # P's prefill ends: it must not write them any more
        for _ in range(20):
            p.get_finished()
            d.get_finished()
        assert all(int(kv[[3, 5, 6, 7]].count_nonzero()) == 0 for t in caches.values() for kv in t)


@pytest.mark.parametrize(
    "about", ["the request", "the request, before P has it", "another request"]
)
def test_a_stale_expectation_from_a_retired_agent_does_not_take_the_producer_back(
    about: str,
) -> None:
    """NIXL hands a producer the notifications of different agents in no set order, so after
    a retirement P may read an Expect the decoder rank sent from its old agent after the
    ones from its new agent. That old agent no longer listens: P must go on writing to the
    new one, whether the stale Expect is about the request being written (or about to be)
    or another one."""
    with _local_pair() as (p, d, spec, caches):
        assert p.producer is not None and d.pushes is not None
        pusher = p.producer.pusher
        d.add_remote({0: p.metadata})
        old = d.metadata
        retire_reader(d._s, [], "a read passed its deadline")
        p.push("gone", [1, 2])
        p.abort_push("gone")  # let go: an Expect of it is answered from what P remembers
        early = about == "the request, before P has it"
        if not early:
            p.push("r", [4, 9])
        d.expect_push("r", [3, 5], "P", deadline=30.0)
        if early:
            step_until(p, d, lambda: "r" in pusher.early)
        else:
            step_until(p, d, lambda: bool(pusher.jobs.get("r") and pusher.jobs["r"].targets))
        fresh = d.pushes.waits["r"].expect
        assert fresh is not None and fresh.decoder.agent_name != old.agent_name
        rid = "gone" if about == "another request" else "r"
        wire_id = f"{rid}#stale" if about == "another request" else fresh.decoder_request_id
        stale = msgspec.structs.replace(
            fresh, request_id=rid, decoder_request_id=wire_id, decoder=old, replaced=[]
        )
        pusher.on_message(stale)
        if early:
            p.push("r", [4, 9])
        out = _reported(p, d, "r")
        assert "r" not in out.failures, out
        assert verify(spec, caches, [3, 5], [4, 9], 16) == 0


def test_a_stale_abort_from_a_retired_agent_does_not_end_the_next_expectation() -> None:
    """D gives "r" up before P has it (P answers the abort from what it kept), its agent is
    retired, and it expects "r" again from the new agent. P may read the old agent's copy
    of the abort after that expectation (NIXL orders no two agents' notifications): it
    names the first expectation, so the second is kept and written, not ended."""
    with _local_pair() as (p, d, spec, caches):
        assert p.producer is not None and d.pushes is not None
        pusher = p.producer.pusher
        d.add_remote({0: p.metadata})
        d.expect_push("r", [3, 5], "P", deadline=30.0)
        first = d.pushes.waits["r"].expect
        assert first is not None
        step_until(p, d, lambda: "r" in pusher.early)
        assert d.forget("r")
        out = FinishedOutput()
        end = time.monotonic() + 10.0
        while "r" not in out.released:  # P ends the kept expectation: nothing was written
            assert time.monotonic() < end, f"the first expectation never settled: {out}"
            _step(p, d, out)
        retire_reader(d._s, [], "a read passed its deadline")
        d.expect_push("r", [3, 5], "P", deadline=30.0)
        second = d.pushes.waits["r"].expect
        assert second is not None and second.decoder.agent_name != first.decoder.agent_name
        step_until(p, d, lambda: any(m == second for m in pusher.early.get("r", (0, []))[1]))
        stale = wire.Abort(
            wire.PUSH_VERSION, "r", first.decoder_request_id, "D", 0, "abandoned by the decoder"
        )
        pusher.on_message(stale)
        p.push("r", [4, 9])
        out = _reported(p, d, "r")
        assert "r" not in out.failures, out
        assert verify(spec, caches, [3, 5], [4, 9], 16) == 0


def test_a_decoder_loaded_only_to_be_answered_is_kept_for_its_engine_ttl() -> None:
    """P answers an Expect of a request it let go by loading the decoder rank's agent; that
    agent is kept for `engine_ttl` after, as one P writes to is, not dropped at P's next
    sweep (a notification on a connection removed that soon may never go out)."""
    with _local_pair(engine_ttl=60.0) as (p, d, _, _):
        assert p.producer is not None
        pusher = p.producer.pusher
        p.push("p1", [4, 9])
        p.abort_push("p1")  # let go: an Expect of it is answered from what P remembers
        d.add_remote({0: p.metadata})
        d.expect_push("r", [3, 5], "P", remote_request_id="p1")
        assert "r" in _ended(p, d, "r").failures
        assert len(pusher.decoders) == 1
        p.push("other", [6, 7], layerwise=True)  # P has work: it steps its pushes
        end = time.monotonic() + 2.5  # past P's sweep of decoders no request names
        while time.monotonic() < end:
            p.get_finished()
            d.get_finished()
        assert len(pusher.decoders) == 1, "the decoder was dropped before its engine_ttl"
