"""kvrdma.aggregator: per-worker outputs -> the scheduler's view (SPEC §6)."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrdma.aggregator import AggregatedOutput, KVOutputAggregator, WorkerOutput
from kvrdma.types import FailureReason, FinishedOutput, Outcome


def recv(
    *req_ids: str,
    invalid: dict[str, set[int]] | None = None,
    failures: dict[str, FailureReason] | None = None,
    **stats: Any,
) -> WorkerOutput:
    return WorkerOutput(
        finished_recving=set(req_ids),
        invalid_block_ids=invalid or {},
        failures=failures or {},
        stats=stats,
    )


def send(*req_ids: str) -> WorkerOutput:
    return WorkerOutput(finished_sending=set(req_ids))


# --- the worker's output, checked on add ------------------------------------------------------


def test_add_copies_the_output() -> None:
    ids = {"a"}
    out = WorkerOutput(
        finished_sending={"s"},
        finished_recving=ids,
        invalid_block_ids={"a": {3, 1}},
        stats={"n": 1, "times": [0.5]},
    )
    assert WorkerOutput is FinishedOutput
    agg = KVOutputAggregator(1)
    agg.add(0, out)
    ids.add("b")
    out.invalid_block_ids["a"].add(7)
    got = agg.take()
    assert got.finished_sending == frozenset({"s"})
    assert got.finished_recving == frozenset({"a"})
    assert got.invalid_block_ids == {"a": frozenset({1, 3})}
    assert dict(got.stats) == {"n": 1, "times": (0.5,)}
    with pytest.raises(TypeError):
        got.stats["n"] = 2  # type: ignore[index]


def _add_rejected(out: FinishedOutput, pattern: str) -> None:
    agg = KVOutputAggregator(1)
    with pytest.raises(ValueError, match=pattern):
        agg.add(0, out)
    assert agg.num_pending == (0, 0) and agg.take().is_empty  # nothing recorded


def test_invalid_blocks_must_come_with_a_finished_receive() -> None:
    _add_rejected(
        WorkerOutput(finished_recving={"a"}, invalid_block_ids={"b": {1}}),
        r"invalid_block_ids: requests \['b'\] are not in finished_recving",
    )
    reason = FailureReason(Outcome.TIMEOUT, "P", "late")
    _add_rejected(
        WorkerOutput(finished_recving={"a"}, failures={"b": reason}),
        r"failures: requests \['b'\] are not in finished_recving",
    )


def test_failures_must_be_failure_reasons() -> None:
    _add_rejected(
        WorkerOutput(finished_recving={"a"}, failures={"a": "timeout"}),  # type: ignore[dict-item]
        r"failures\['a'\]: expected a FailureReason, got str",
    )


@pytest.mark.parametrize("bad", [-1, "3", True, 1.0])
def test_invalid_block_ids_must_be_block_ids(bad: Any) -> None:
    _add_rejected(
        WorkerOutput(finished_recving={"a"}, invalid_block_ids={"a": {bad}}),
        r"invalid_block_ids\['a'\]: expected block ids",
    )


@pytest.mark.parametrize("bad", ["1", True, None, [1, "x"], {"a": 1}])
def test_stats_must_be_numbers_or_lists_of_numbers(bad: Any) -> None:
    _add_rejected(
        WorkerOutput(stats={"k": bad}),
        r"stats\['k'\]: expected a number or a list of numbers",
    )


def test_failure_reasons_are_merged_over_ranks() -> None:
    agg = KVOutputAggregator(3)
    timeout = FailureReason(Outcome.TIMEOUT, "P", "not done by the deadline")
    lost = FailureReason(Outcome.PEER_LOST, "P", "remote agent disconnected")
    agg.add(0, recv("a", invalid={"a": {1}}, failures={"a": timeout}))
    agg.add(1, recv("a"))
    assert agg.take().failures == {}
    agg.add(2, recv("a", invalid={"a": {2}}, failures={"a": lost}))
    got = agg.take()
    assert got.invalid_block_ids == {"a": frozenset({1, 2})}
    assert got.failures == {
        "a": FailureReason(
            Outcome.PEER_LOST,
            "P",
            "not done by the deadline; remote agent disconnected",
            ranks=(0, 2),
        )
    }
    assert got.failed == {"a"}


# --- construction and inputs ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"world_size": 0}, "world_size: expected an integer >= 1, got 0"),
        ({"world_size": True}, "world_size: expected an integer >= 1, got True"),
        ({"world_size": 2, "failure_policy": "abort"}, "failure_policy: expected"),
        ({"world_size": 2, "recent_capacity": -1}, "recent_capacity: expected an integer >= 0"),
        ({"world_size": 2, "recent_capacity": 1.5}, "recent_capacity: expected an integer >= 0"),
    ],
)
def test_constructor_validates(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        KVOutputAggregator(**kwargs)


@pytest.mark.parametrize("rank", [-1, 3, True, "0", 1.0])
def test_unknown_worker_rank_is_an_error(rank: Any) -> None:
    agg = KVOutputAggregator(3)
    with pytest.raises(
        ValueError, match=r"worker_rank: expected an integer in 0\.\.2 \(world_size=3\)"
    ):
        agg.add(rank, recv("a"))
    assert agg.num_pending == (0, 0)


def test_output_must_be_a_worker_output() -> None:
    with pytest.raises(TypeError, match="expected a FinishedOutput or None, got dict"):
        KVOutputAggregator(1).add(0, {"finished_recving": {"a"}})  # type: ignore[arg-type]


def test_aggregate_needs_one_entry_per_worker() -> None:
    with pytest.raises(ValueError, match=r"expected one entry per worker \(2\), got 3"):
        KVOutputAggregator(2).aggregate([None, None, None])


# --- finishing --------------------------------------------------------------------------------


def test_single_worker_reports_immediately() -> None:
    agg = KVOutputAggregator(1)
    out = agg.aggregate([WorkerOutput(finished_sending={"s"}, finished_recving={"r"})])
    assert (out.finished_sending, out.finished_recving) == ({"s"}, {"r"})
    assert agg.take().is_empty


def test_request_is_finished_only_after_every_worker_across_steps() -> None:
    agg = KVOutputAggregator(3)
    assert agg.aggregate([recv("a"), None, None]).finished_recving == set()
    assert agg.waiting_on("a") == (frozenset(), frozenset({1, 2}))
    assert agg.aggregate([None, None, recv("a")]).finished_recving == set()
    assert agg.num_pending == (0, 1)
    assert agg.aggregate([None, recv("a"), None]).finished_recving == {"a"}
    assert agg.num_pending == (0, 0)
    assert agg.waiting_on("a") == (frozenset(), frozenset())


def test_sending_and_receiving_are_counted_separately() -> None:
    agg = KVOutputAggregator(2)
    out = agg.aggregate([send("x"), recv("x")])
    assert out.finished_sending == out.finished_recving == set()
    assert agg.num_pending == (1, 1)
    out = agg.aggregate([recv("x"), send("x")])
    assert out.finished_sending == out.finished_recving == {"x"}


def test_add_then_take_is_incremental() -> None:
    agg = KVOutputAggregator(2)
    agg.add(1, recv("a", "b"))
    agg.add(0, recv("a"))
    assert agg.take().finished_recving == {"a"}
    assert agg.take().finished_recving == set()
    agg.add(0, recv("b"))
    assert agg.take().finished_recving == {"b"}


@pytest.mark.parametrize(
    ("policy", "failed"), [("fail", frozenset({"a"})), ("recompute", frozenset())]
)
def test_invalid_blocks_are_the_union_reported_at_finish(
    policy: str, failed: frozenset[str]
) -> None:
    agg = KVOutputAggregator(3, failure_policy=policy)  # type: ignore[arg-type]
    step1 = agg.aggregate([recv("a", invalid={"a": {1, 2}}), recv("a", "b"), None])
    assert step1.invalid_block_ids == {} and step1.failed == set()
    step2 = agg.aggregate([recv("b"), recv(), recv("a", "b", invalid={"a": {2, 9}})])
    assert step2.finished_recving == {"a", "b"}
    assert step2.invalid_block_ids == {"a": frozenset({1, 2, 9})}
    assert step2.all_invalid_block_ids == {1, 2, 9}
    assert step2.failed == failed
    assert agg.failure_policy == policy


def test_stats_are_merged_per_step_and_reset() -> None:
    agg = KVOutputAggregator(3)
    out = agg.aggregate(
        [recv(num_failed=1, xfer_s=[0.1]), recv(num_failed=2, bytes=10.5), recv(xfer_s=[0.2, 0.3])]
    )
    assert dict(out.stats) == {"num_failed": 3, "xfer_s": (0.1, 0.2, 0.3), "bytes": 10.5}
    assert not out.is_empty
    assert dict(agg.aggregate([None, None, None]).stats) == {}


def test_conflicting_stat_kinds_are_an_error_that_changes_nothing() -> None:
    agg = KVOutputAggregator(2)
    agg.add(0, recv("a", n=1))
    with pytest.raises(ValueError, match=r"stats\['n'\]: a counter on one worker and a list"):
        agg.add(1, recv("a", n=[2]))
    assert agg.num_pending == (0, 1)  # the bad output's report of "a" was not applied
    agg.add(1, recv("a", n=5))
    out = agg.take()
    assert out.finished_recving == {"a"} and dict(out.stats) == {"n": 6}


# --- duplicates and bounded memory -------------------------------------------------------------


def test_duplicate_report_before_finish_is_ignored_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    agg = KVOutputAggregator(2)
    with caplog.at_level(logging.WARNING, logger="kvrdma.aggregator"):
        agg.aggregate([recv("a"), None])
        out = agg.aggregate([recv("a", invalid={"a": {4}}), None])
    assert out.finished_recving == set()  # rank 0's second report did not stand in for rank 1
    assert agg.duplicate_reports == 1
    assert "worker 0 reported request 'a' finished receiving twice" in caplog.text
    out = agg.aggregate([None, recv("a")])
    assert out.finished_recving == {"a"}
    assert out.invalid_block_ids == {"a": frozenset({4})}  # never drop an invalid block


@pytest.mark.parametrize("same_step", [True, False])
def test_late_report_after_finish_is_ignored_and_counted(same_step: bool) -> None:
    agg = KVOutputAggregator(2)
    agg.add(0, send("a"))
    agg.add(1, send("a"))
    if not same_step:
        assert agg.take().finished_sending == {"a"}
    agg.add(0, send("a"))
    out = agg.take()
    assert out.finished_sending == ({"a"} if same_step else set())
    assert agg.duplicate_reports == 1
    assert agg.num_pending == (0, 0)  # no entry left behind to wait forever


def test_completed_ids_are_remembered_in_a_bounded_window() -> None:
    agg = KVOutputAggregator(1, recent_capacity=2)
    for req in "abc":
        assert agg.aggregate([recv(req)]).finished_recving == {req}
    assert agg.aggregate([recv("c")]).finished_recving == set()  # still remembered
    assert agg.duplicate_reports == 1
    # "a" fell out of the window: a report is a new request again (memory stays bounded).
    assert agg.aggregate([recv("a")]).finished_recving == {"a"}


def test_entries_are_removed_once_reported() -> None:
    agg = KVOutputAggregator(4)
    for step in range(50):
        ids = {f"r{step}-{i}" for i in range(20)}
        agg.aggregate([recv(*ids), recv(*ids), send(*ids), recv(*ids)])
        agg.aggregate([send(*ids), send(*ids), recv(*ids), send(*ids)])
        assert agg.num_pending == (0, 0)


# --- property: random interleavings of reports across steps ---------------------------------


@st.composite
def schedules(draw: st.DrawFn) -> tuple[int, dict[tuple[str, int], tuple[int, frozenset[int]]]]:
    """For each (request, rank): the step it reports at and the invalid blocks it found."""
    world = draw(st.integers(1, 4))
    requests = draw(st.lists(st.text("abcdef", min_size=1, max_size=3), unique=True, max_size=8))
    plan = {
        (req, rank): (
            draw(st.integers(0, 5)),
            draw(st.frozensets(st.integers(0, 40), max_size=3)),
        )
        for req in requests
        for rank in range(world)
    }
    return world, plan


@given(schedules(), st.sampled_from(["fail", "recompute"]), st.integers(0, 5))
def test_property_each_request_reported_once_after_all_workers(
    schedule: tuple[int, dict[tuple[str, int], tuple[int, frozenset[int]]]],
    policy: str,
    repeats_from: int,
) -> None:
    world, plan = schedule
    steps = 8
    outputs: list[list[dict[str, Any]]] = [
        [{"recving": set(), "sending": set(), "invalid": {}} for _ in range(world)]
        for _ in range(steps)
    ]
    for (req, rank), (step, invalid) in plan.items():
        slot = outputs[step][rank]
        slot["recving"].add(req)
        slot["sending"].add(req)
        if invalid:
            slot["invalid"][req] = invalid
        # Workers that repeat themselves later (from step `repeats_from` on) are ignored.
        if rank == 0 and step < repeats_from < steps:
            outputs[repeats_from][rank]["recving"].add(req)
    agg = KVOutputAggregator(world, failure_policy=policy)  # type: ignore[arg-type]
    seen: dict[str, list[tuple[int, AggregatedOutput]]] = defaultdict(list)
    sent_at: dict[str, list[int]] = defaultdict(list)
    for step, per_rank in enumerate(outputs):
        result = agg.aggregate(
            [
                WorkerOutput(
                    finished_sending=slot["sending"],
                    finished_recving=slot["recving"],
                    invalid_block_ids=slot["invalid"],
                    stats={"reports": len(slot["recving"])},
                )
                for slot in per_rank
            ]
        )
        for req in result.finished_recving:
            seen[req].append((step, result))
        for req in result.finished_sending:
            sent_at[req].append(step)
        assert result.failed <= result.finished_recving
        assert result.stats["reports"] == sum(len(slot["recving"]) for slot in per_rank)

    requests = {req for req, _ in plan}
    assert set(seen) == set(sent_at) == requests
    for req in requests:
        [(step, result)] = seen[req]  # exactly once
        assert sent_at[req] == [step]
        assert step == max(plan[req, rank][0] for rank in range(world))  # after the last worker
        union = frozenset().union(*(plan[req, rank][1] for rank in range(world)))
        assert result.invalid_block_ids.get(req, frozenset()) == union
        assert (req in result.failed) == (policy == "fail" and bool(union))
    assert agg.num_pending == (0, 0)
    repeated = sum(
        1 for (req, rank), (step, _) in plan.items() if rank == 0 and step < repeats_from < steps
    )
    assert agg.duplicate_reports == repeated
