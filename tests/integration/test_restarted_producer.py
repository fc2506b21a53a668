"""A request's blocks belong to the producer process that held them: once that process has
restarted (a new NIXL agent, under the same default name) and the decoder connected to the
new one, a read or push naming the old process's agents fails, naming the engine, instead of
moving the new process's blocks at those ids, and the new process is told nothing. Real NIXL
agents in one process; the new process holds a request of the same id and blocks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from test_push_reuse import _rank

from kvrdma.metadata import agent_tag
from kvrdma.testing.synthetic import CacheSpec, verify
from kvrdma.types import FinishedOutput, Outcome
from kvrdma.worker import Worker

LOCAL, REMOTE = [3, 5], [4, 9]


@contextmanager
def _restarted(**extra: Any) -> Iterator[tuple[Worker, Worker, str, CacheSpec, dict[str, Any]]]:
    """(D, P's second process, the first one's agent checksum, D's spec and caches): the first
    held "r" in `REMOTE` and died, D connected to the second, which holds its own "r" there."""
    d, spec, caches = _rank("split_kv", "D", "kv_consumer", 0, 1)
    p2 = None
    try:
        p1 = _rank("split_kv", "P", "kv_producer", 0, 1, **extra)[0]
        d.add_remote({0: p1.metadata})
        p1.hold("r", REMOTE)
        first = p1.metadata.agent_metadata_sha256
        p1.close()
        p2 = _rank("split_kv", "P", "kv_producer", 0, 1, **extra)[0]
        assert p2.metadata.agent_name == p1.metadata.agent_name
        assert p2.metadata.agent_metadata_sha256 != first
        d.add_remote({0: p2.metadata})  # as `connect` re-adds it, found by its checksum
        yield d, p2, first, spec, caches
    finally:
        d.close()
        if p2 is not None:
            p2.close()


def _reported(p: Worker, d: Worker, rid: str, timeout: float = 10.0) -> FinishedOutput:
    """Step both until D reports `rid`; what D reported then."""
    end = time.monotonic() + timeout
    while True:
        assert time.monotonic() < end, f"{rid!r} not reported within {timeout}s"
        p.get_finished()
        out = d.get_finished()
        if rid in out.finished_recving:
            return out


def _untouched(caches: dict[str, Any]) -> bool:
    return all(int(kv[LOCAL].count_nonzero()) == 0 for pair in caches.values() for kv in pair)


def test_a_read_named_by_the_process_before_a_restart_fails_and_tells_the_new_one_nothing() -> None:
    with _restarted() as (d, p2, first, spec, caches):
        p2.hold("r", REMOTE)  # another request's KV, under the same id and blocks
        d.start_read("r", LOCAL, REMOTE, "P", remote_agents={0: first})
        out = _reported(p2, d, "r")
        reason = out.failures["r"]
        assert reason.outcome is Outcome.PEER_LOST, reason
        assert "engine 'P' restarted since its blocks were named" in reason.error, reason
        assert out.invalid_block_ids["r"] == set(LOCAL)
        assert _untouched(caches)
        end = time.monotonic() + 0.3
        while time.monotonic() < end:  # a "done" would free the new process's request
            p2.get_finished()
            d.get_finished()
        assert p2.lease_expiry("r") is not None
        # the new process's agents named (by tag): its blocks are read, and it lets go
        now = [agent_tag(p2.metadata)]
        d.start_read("r2", LOCAL, REMOTE, "P", remote_request_id="r", remote_agents=now)
        out = _reported(p2, d, "r2")
        assert not out.invalid_block_ids and not out.failures, out
        assert verify(spec, caches, LOCAL, REMOTE, 16) == 0


def test_a_push_named_by_the_process_before_a_restart_fails_unwritten_and_unquarantined() -> None:
    with _restarted(kv_lease_duration=2.0) as (d, p2, first, _, caches):
        assert p2.producer is not None
        p2.push("r", REMOTE)  # waits for decoders that expect "r"
        d.expect_push("r", LOCAL, "P", remote_block_ids=REMOTE, remote_agents={0: first})
        out = _reported(p2, d, "r")
        assert out.failures["r"].outcome is Outcome.PEER_LOST, out.failures
        assert "engine 'P' restarted" in out.failures["r"].error
        assert "r" not in out.quarantined
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            p2.get_finished()
            d.get_finished()
        assert not p2.producer.pusher.jobs["r"].targets  # never told of D
        assert _untouched(caches)
