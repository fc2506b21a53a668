"""`Warmup` between rounds: the posts a round held back go before the next round, for at most
`FIRST_S`, and a peer whose last round ended is ready whichever poll saw the end. A fake
backend stands in for NIXL, whose rounds end when the test says."""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvrdma.nixl import warm
from kvrdma.nixl.protocol import MemType, XferResult, XferState
from kvrdma.nixl.warm import FIRST_S, Warmup
from tests.unit.test_warm_scratch import _like

pytestmark = pytest.mark.timeout(10)

THREADS = frozenset({101, 102})


class _Handle:
    def __init__(self, state: XferState = XferState.PROC) -> None:
        self.state = state

    def release(self) -> None:
        pass


class _Backend:
    """Rounds stay in flight until `end_rounds`; `held` says whether a post waits for the
    hold to end (what `NixlBackend._held_back` tells)."""

    agent_name = "d"
    _threads = THREADS

    def __init__(self) -> None:
        self._posted = 0
        self.rounds: list[_Handle] = []
        self.held = False

    def _in_flight(self, but: Any) -> bool:
        return False

    def _held_back(self) -> bool:
        return self.held

    def register(self, regions: Any, mem_type: MemType) -> _Handle:
        return _Handle()

    def _prep(self, peer: str | None, descs: Any, mem: MemType) -> Any:
        return SimpleNamespace(_arr=descs, _mem=mem, release=lambda: None)

    def _post_now(self, *args: Any) -> _Handle:
        self._posted += 1
        self.rounds.append(_Handle())
        return self.rounds[-1]

    def poll(self, xfer: _Handle) -> XferResult:
        return XferResult(xfer.state)

    def end_rounds(self) -> None:
        for r in self.rounds:
            r.state = XferState.DONE


@pytest.fixture(autouse=True)
def _copying(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every copy thread takes a page fault per look: a clean round proves them all. A round
    in flight is never given up as stalled: a preempted test must not see that happen."""
    faults = itertools.count()
    monkeypatch.setattr(warm, "_faults", lambda tid: next(faults))
    monkeypatch.setattr(warm, "STALLED_S", 60.0)


def _to_first_held_round(b: _Backend, w: Warmup, peer: str) -> None:
    """The shared worker's round, then the first round that holds posts back."""
    w.start(peer, _like())
    w.step(peer)
    assert len(b.rounds) == 1 and not w.holding()  # the shared worker's: nothing held
    b.end_rounds()
    w.step(peer)
    assert len(b.rounds) == 2 and w.holding()


def test_the_posts_a_round_held_back_go_before_the_next_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(warm, "_faults", lambda tid: 0)  # no round proves a copy thread
    monkeypatch.setattr(warm, "FIRST_S", 60.0)  # the window does not end during the test
    b = _Backend()
    w = Warmup(b, num_threads=2, split=None)  # type: ignore[arg-type]
    _to_first_held_round(b, w, "p")
    b.held = True  # a READ to a warm peer posted meanwhile
    b.end_rounds()
    w.step("p")
    assert len(b.rounds) == 2 and not w.holding()  # its poll can post it now
    w.step("p")
    assert len(b.rounds) == 2  # not yet posted: the round still waits for it
    b.held = False  # posted
    w.step("p")
    assert len(b.rounds) == 3 and w.holding()


def test_a_held_post_nobody_polls_holds_the_next_round_back_first_s_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(warm, "_faults", lambda tid: 0)
    b = _Backend()
    w = Warmup(b, num_threads=2, split=None)  # type: ignore[arg-type]
    _to_first_held_round(b, w, "p")
    b.held = True  # and it stays held: its owner never polls it
    b.end_rounds()
    ended = time.monotonic()
    while len(b.rounds) == 2:
        w.step("p")
        assert time.monotonic() - ended < FIRST_S + 1.0, "the round never went on"
        time.sleep(0.001)
    assert time.monotonic() - ended >= FIRST_S


def test_a_peer_whose_last_round_another_peers_poll_saw_end_is_ready_at_once() -> None:
    """Its reads, held while it was cold, go before the other peer's round."""
    b = _Backend()
    w = Warmup(b, num_threads=2, split=None)  # type: ignore[arg-type]
    _to_first_held_round(b, w, "p")  # this round proves both copy threads
    w.start("q", _like())
    b.end_rounds()
    w.step("q")  # q's poll sees p's round end
    assert w.ready("p")
