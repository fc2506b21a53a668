"""Reads still waiting for their peer's connection warm-up (`kvrdma.nixl.warm`: posted to
nobody yet) when they end: real NIXL, D and P in one process. Such a read passing its
deadline, or losing its engine, just fails with its blocks invalid: nothing of it can land,
so the reading agent is not retired (which would cancel every other read on it). A warm-up
round NIXL refuses fails the reads waiting for it instead of raising out of the step.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvrdma.testing.synthetic import CacheSpec, ModelShape, verify
from kvrdma.types import FinishedOutput, Outcome
from kvrdma.worker import Worker
from tests.integration.worker_pair import reader_pair

pytest.importorskip("nixl")

SHAPE = ModelShape(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32")
BLOCK_SIZE, BLOCKS = 2, 64
SPEC = CacheSpec(SHAPE, "split_kv", "HND", 0, 1, BLOCK_SIZE, BLOCKS)
LB, RB = [5, 9, 2], [1, 7, 3]  # the read that waits: D blocks, P blocks


def _start_waiting_read(d: Worker, p: Worker) -> None:
    """Start read "r" (`RB` into `LB`): its READ waits for P's warm-up."""
    p.hold("r", RB)
    d.start_read("r", LB, RB, "P")
    assert d.consumer is not None
    xfers = [x for _, x in d.consumer.inflight["r"].xfers]
    assert xfers and all(getattr(x, "held", None) is not None for x in xfers)


def _run(d: Worker, p: Worker, rid: str, seconds: float = 30.0) -> FinishedOutput:
    """Step both until D reports `rid`; its `get_finished` output."""
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        p.get_finished()
        out = d.get_finished()
        if rid in out.finished_recving:
            return out
    raise AssertionError(f"read {rid!r} not reported in {seconds} s")


def _still_works(d: Worker, p: Worker, caches: dict[str, torch.Tensor]) -> None:
    """After some progress nothing landed in D's blocks, and a new read lands exactly."""
    ends = time.monotonic() + 0.3
    while time.monotonic() < ends:
        p.get_finished()
        d.get_finished()
    assert all(int(t.count_nonzero()) == 0 for t in caches.values())
    p.hold("after", [4, 6])
    d.start_read("after", [20, 21], [4, 6], "P")
    out = _run(d, p, "after")
    assert not out.failures, out.failures
    assert verify(SPEC, caches, [20, 21], [4, 6], BLOCK_SIZE) == 0


@pytest.mark.timeout(60)
def test_a_read_waiting_for_warm_up_at_its_deadline_fails_without_a_retirement() -> None:
    now = [1000.0]
    with reader_pair(SPEC, lambda: now[0]) as (d, p, caches):
        name = d.backend.agent_name
        _start_waiting_read(d, p)
        now[0] += 3600.0
        out = d.get_finished()  # a warm-up round goes out; the READ still waits for it
        assert "r" in out.finished_recving
        assert out.failures["r"].outcome is Outcome.TIMEOUT
        assert out.invalid_block_ids["r"] == set(LB)
        assert d._s.retirements == 0 and d.backend.agent_name == name
        _still_works(d, p, caches)
        assert d._s.retirements == 0 and d.backend.agent_name == name


@pytest.mark.timeout(60)
def test_removing_the_engine_of_a_read_waiting_for_warm_up_retires_nothing() -> None:
    with reader_pair(SPEC) as (d, p, caches):
        name = d.backend.agent_name
        _start_waiting_read(d, p)
        d.remove_remote("P")
        out = d.get_finished()
        assert out.failures["r"].outcome is Outcome.PEER_LOST
        assert out.invalid_block_ids["r"] == set(LB)
        assert d._s.retirements == 0 and d.backend.agent_name == name
        d.add_remote({0: p.metadata})
        _still_works(d, p, caches)


@pytest.mark.timeout(60)
def test_a_warm_up_round_nixl_refuses_fails_the_waiting_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from nixl._bindings import nixlInvalidParamError

    with reader_pair(SPEC) as (d, p, caches):
        _start_waiting_read(d, p)
        agent = d.backend._agent  # type: ignore[attr-defined]

        def refuse(*args: object, **kwargs: object) -> None:
            raise nixlInvalidParamError("test: refused")

        monkeypatch.setattr(agent, "make_prepped_xfer", refuse)
        out = d.get_finished()  # the warm-up round is refused: the read fails, nothing raises
        monkeypatch.undo()
        assert "r" in out.finished_recving
        failure = out.failures["r"]
        assert failure.outcome is Outcome.FAILED
        assert "warming up the connection to agent" in failure.error
        assert "nixlInvalidParamError: test: refused" in failure.error
        assert out.invalid_block_ids["r"] == set(LB)
        _still_works(d, p, caches)  # the next read warms P up afresh
