"""Push mode's quarantine ends when, and only when, no producer process can write into the
blocks any more: not while a stalled writer lives (whatever this decoder does to its own
agents meanwhile), and not never when the writer is gone or has said it stopped. Real NIXL
agents in one process; a producer that stalls is one that is not stepped."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from test_push_reuse import _rank

from kvrdma.nixl.retire import _destroy_standby
from kvrdma.retirement import retire_reader
from kvrdma.types import FinishedOutput
from kvrdma.worker import Worker

LOCAL, REMOTE = [3, 5], [4, 9]
Caches = dict[str, Any]  # layer -> its (K, V) tensors


def _worker(role: str, rank: int = 0, tp: int = 1, **extra: Any) -> tuple[Worker, Caches]:
    """A rank of engine "D" (consumer) or "P" (producer) and its caches by layer."""
    engine = "D" if role == "kv_consumer" else "P"
    w, _, caches = _rank("split_kv", engine, role, rank, tp, **extra)
    return w, caches


def _until(
    stepped: Iterable[Worker],
    d: Worker,
    what: str,
    done: Callable[[FinishedOutput], bool],
    out: FinishedOutput | None = None,
    timeout: float = 10.0,
) -> FinishedOutput:
    """Step `stepped` and D until what D reported (added to `out`) is `done`."""
    out = out if out is not None else FinishedOutput()
    end = time.monotonic() + timeout
    while not done(out):
        assert time.monotonic() < end, f"{what} never came: {out}"
        for w in stepped:
            w.get_finished()
        got = d.get_finished()
        out.finished_recving |= got.finished_recving
        out.quarantined |= got.quarantined
        out.released |= got.released
    return out


def _first_layer(ps: list[Worker], d: Worker, layers: list[str], deadline: float) -> None:
    """D expects "r" from the ranks `ps`, which push it layer by layer; its first layer lands."""
    d.add_remote({i: p.metadata for i, p in enumerate(ps)})
    for p in ps:
        p.push("r", REMOTE, layerwise=True)
    d.expect_push("r", LOCAL, "P", deadline=deadline)
    for p in ps:
        p.push_layer("r", layers[0])
    _until(ps, d, "the first layer", lambda _: d.layer_loaded("r", layers[0]))


def _for(seconds: float) -> Callable[[FinishedOutput], bool]:
    end = time.monotonic() + seconds
    return lambda _: time.monotonic() >= end


def _written(caches: Caches) -> int:
    """Nonzero elements in the blocks `LOCAL` of `caches`."""
    return sum(int(kv[LOCAL].count_nonzero()) for pair in caches.values() for kv in pair)


def test_a_producer_restarted_under_the_same_agent_name_releases_the_quarantine() -> None:
    """A restarted producer process keeps its agent name (`{engine}-dp0-tp0` by default) but
    not its agent: once the decoder connects to it again, the push the dead process wrote
    into is released, for the new process never heard of it."""
    d, _ = _worker("kv_consumer")
    p, caches = _worker("kv_producer", kv_lease_duration=1.0)
    layers, again = list(caches), None
    try:
        _first_layer([p], d, layers, 1.5)
        assert p.producer is not None
        p.producer.pusher.jobs.clear()  # killed: it says nothing on the way out
        p.close()
        again, _ = _worker("kv_producer", kv_lease_duration=1.0)
        assert again.metadata.agent_name == p.metadata.agent_name
        d.add_remote({0: again.metadata})  # D connects to the restarted engine
        out = _until([again], d, "the failure", lambda o: "r" in o.quarantined)
        _until([again], d, "the release", lambda o: "r" in o.released, out)
    finally:
        d.close()
        if again is not None:
            again.close()


def test_connecting_again_does_not_take_a_stalled_writer_for_gone() -> None:
    """D connects again to a producer engine (one rank restarted) while it probes the other,
    stalled, rank: re-adding the engine removes that rank's agent under the probe, which
    says nothing of the rank, so the push stays quarantined and nothing lands after."""
    d, mine = _worker("kv_consumer")
    p0, caches = _worker("kv_producer", 0, 2)
    p1, _ = _worker("kv_producer", 1, 2)
    layers, p1_again = list(caches), None
    try:
        _first_layer([p0, p1], d, layers, 1.0)
        out = _until([p1], d, "the failure", lambda o: "r" in o.quarantined)  # p0 stalls
        assert d.pushes is not None
        fence = d.pushes.fences["r"]
        _until([p1], d, "rank 1's end", lambda _: fence.wait.silent() == [0], out)
        p1.close()
        p1_again, _ = _worker("kv_producer", 1, 2)
        _until([], d, "a probe of rank 0", lambda _: 0 in fence.probes, out)
        d.add_remote({0: p0.metadata, 1: p1_again.metadata})
        _until([p1_again], d, "more probes", _for(1.2), out)
        assert "r" not in out.released
        p0.push_layer("r", layers[1])  # the stalled rank's prefill goes on
        p0.end_push("r")
        _until([p0, p1_again], d, "its stop", lambda o: "r" in o.released, out)
        for pair in mine.values():  # D reuses the blocks
            for kv in pair:
                kv[LOCAL] = 0
        _until([p0, p1_again], d, "nothing", _for(0.3), out)
        assert _written(mine) == 0
    finally:
        for w in (d, p0, p1_again):
            if w is not None:
                w.close()


def _retire_dropping_every_peer(d: Worker) -> None:
    """Retire D's reading agent with no standby built, as when the standby had not loaded
    the peers yet: the fresh agent drops them, and the consumer marks their engines so."""
    backend = d._s.reader
    standby, backend._standby = backend._standby, None  # type: ignore[attr-defined]
    if standby is not None:
        standby.abandon(_destroy_standby)
    retired = retire_reader(d._s, [], "a read passed its deadline")
    assert retired is not None and retired[1], retired
    assert d.consumer is not None
    d.consumer.dropped |= set(d.consumer.remotes)


def test_a_writer_a_retirement_dropped_is_told_again_once_its_engine_is_added() -> None:
    """The producer's word that it stopped went to D's agent just retired, whose successor
    did not load the producer: told nothing more, it would keep the push quarantined for as
    long as it lives. Once D connects again, it is told the expectation again, answers, and
    the push is released."""
    d, _ = _worker("kv_consumer")
    p, caches = _worker("kv_producer")
    layers = list(caches)
    try:
        _first_layer([p], d, layers, 0.5)
        out = _until([], d, "the failure", lambda o: "r" in o.quarantined)  # P stalls
        assert p.producer is not None
        pusher = p.producer.pusher
        end = time.monotonic() + 10.0
        while "r" not in pusher.let_go:  # P reads the abort and says it stopped
            assert time.monotonic() < end, "P never read the abort"
            p.get_finished()
        _retire_dropping_every_peer(d)
        _until([p], d, "nothing", _for(1.2), out)
        assert "r" not in out.released  # P cannot be reached: it could still write
        d.add_remote({0: p.metadata})  # connect() again
        _until([p], d, "the release", lambda o: "r" in o.released, out)
    finally:
        d.close()
        p.close()
