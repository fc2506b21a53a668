"""The demo's kill-producer verdict judges the requests dispatched once the killed producer
had ended: between SIGKILL and its end its memory can still be read, and a READ verifies."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvrdma.cli.demo.faults import FaultPlan, RequestResult


def _result(index: int, dispatched_at: float, ok: bool) -> RequestResult:
    blocks = [index]
    r = RequestResult(f"req-{index}", index, blocks, dispatched_at, dispatched_at + 0.01, ok)
    if not ok:
        r.invalid, r.errors = list(blocks), ["peer_lost"]
    return r


def _plan(injected: float, gone: float | None) -> FaultPlan:
    plan = FaultPlan("kill-producer", at=1, read_deadline=1.0)
    plan.injected_at, plan.gone_at = injected, gone
    return plan


@pytest.mark.parametrize(
    ("late_ok_at", "passes"),
    [(10.5, True), (11.5, False)],
    ids=["verified-before-the-end", "verified-after-the-end"],
)
def test_only_requests_dispatched_once_the_producer_ended_must_fail(
    late_ok_at: float, passes: bool
) -> None:
    results = [
        _result(0, 9.0, True),
        _result(1, late_ok_at, True),  # SIGKILL at 10.0, the process ended at 11.0
        _result(2, 12.0, False),
        _result(3, 13.0, False),
    ]
    ok, lines = _plan(10.0, 11.0).judge(results, p_tp=1)
    assert ok is passes, lines
    if passes:
        assert any("of the 1 request(s) dispatched in between 1 verified" in x for x in lines)


def test_failures_of_requests_dispatched_before_the_producer_ended_are_enough() -> None:
    """Requests can all be dispatched while the killed process is still ending."""
    results = [_result(0, 9.0, True), _result(1, 10.2, False), _result(2, 10.4, False)]
    ok, lines = _plan(10.0, 11.0).judge(results, p_tp=1)
    assert ok, lines


def test_no_failure_after_the_fault_is_a_mismatch() -> None:
    results = [_result(0, 9.0, True), _result(1, 10.5, True)]
    ok, lines = _plan(10.0, 11.0).judge(results, p_tp=1)
    assert not ok and any("requests after the fault verified" in x for x in lines), lines


def test_a_killed_producer_that_never_ended_is_a_mismatch() -> None:
    results = [_result(0, 9.0, True), _result(1, 12.0, False)]
    ok, lines = _plan(10.0, None).judge(results, p_tp=1)
    assert not ok and any("had not ended" in line for line in lines), lines


def test_the_end_of_the_killed_producer_is_stamped_and_it_is_left_for_its_parent() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        plan = FaultPlan("kill-producer", at=0, read_deadline=1.0)
        plan.before_dispatch(0, [(child, None, "P", 0)], respawn=lambda: None)
        assert plan.injected_at is not None
        deadline = time.monotonic() + 10
        while plan.gone_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert plan.gone_at is not None and plan.gone_at >= plan.injected_at
        assert child.wait(timeout=5) == -9  # not reaped by the watch: its parent still can
    finally:
        child.kill()
        child.wait(timeout=5)
