"""kvrdma.vllm.pushed: when a decoder rank reports its pushed loads to vLLM, and as what."""

from __future__ import annotations

import pytest

from kvrdma.types import FailureReason, FinishedOutput, Outcome
from kvrdma.vllm.pushed import PushedLoads, Released

pytestmark = pytest.mark.timeout(10)

BLOCKS = {3, 4, 5}
WHY = FailureReason(Outcome.TIMEOUT, "P", "not written 2.0s after it was expected")


def step(
    loads: PushedLoads,
    *,
    failed: bool = False,
    finished: bool = False,
    quarantined: bool = False,
    released: bool = False,
) -> tuple[set[str], Released]:
    """One `transfer_results` of request "r" as the Worker reports it: what vLLM is told
    received, and what the released loads report."""
    out = FinishedOutput()
    if finished or failed:
        out.finished_recving.add("r")
    if failed:
        out.invalid_block_ids["r"], out.failures["r"] = set(BLOCKS), WHY
    if quarantined:
        out.quarantined.add("r")
    if released:
        out.released.add("r")
    recving = set(out.finished_recving)
    done = loads.take(out, dict(out.invalid_block_ids), recving)
    recving |= done.aborted.keys() | done.failed.keys()
    loads.reported(recving)
    return recving, done


def expected() -> PushedLoads:
    loads = PushedLoads()
    loads.expect("r")
    return loads


def test_a_failed_push_is_reported_failed_once_no_producer_can_write() -> None:
    loads = expected()
    assert step(loads, failed=True, quarantined=True) == (set(), Released())
    recving, done = step(loads, released=True)
    assert recving == {"r"} and done == Released(failed={"r": BLOCKS}, reasons={"r": WHY})
    assert not loads.held and not loads.expected


@pytest.mark.parametrize("abort_first", [False, True], ids=["failed-first", "aborted-first"])
def test_a_push_that_failed_and_was_aborted_stays_a_failure(abort_first: bool) -> None:
    """vLLM frees the blocks (received, no invalid blocks for a request it no longer has);
    the blocks the failure left invalid are still counted. Either order: quarantined before
    the abort (no push left to abandon), or given up by the Worker on its own (a peer
    dropped) before vLLM's abort reached it and reported after."""
    loads = expected()
    if abort_first:
        loads.forget("r", abandoned=False)
    assert step(loads, failed=True, quarantined=True) == (set(), Released())
    if not abort_first:
        loads.forget("r", abandoned=False)
    recving, done = step(loads, released=True)
    assert recving == {"r"} and done == Released(aborted={"r": BLOCKS})
    assert not loads.held and not loads.expected


def test_an_aborted_push_is_reported_received_once_released() -> None:
    loads = expected()
    loads.forget("r", abandoned=True)
    assert step(loads, quarantined=True) == (set(), Released())
    assert step(loads, released=True) == ({"r"}, Released(aborted={"r": None}))
    assert not loads.held and not loads.expected


@pytest.mark.parametrize("failed", [False, True], ids=["landed", "failed"])
def test_a_push_that_ended_before_the_abort_reached_the_worker_is_reported_once(
    failed: bool,
) -> None:
    """The Worker has it ended but not yet reported (no push left to abandon): it reports
    it itself, and nothing waits for a `released` that never comes."""
    loads = expected()
    loads.forget("r", abandoned=False)
    recving, done = step(loads, finished=True, failed=failed)
    assert recving == {"r"} and done == Released()
    assert not loads.held and not loads.expected
    assert step(loads, released=True) == (set(), Released())  # a stray release: no report


def test_a_request_not_expected_is_never_held() -> None:
    loads = PushedLoads()
    loads.forget("r", abandoned=True)
    assert not loads.held
