"""`Warmup`'s scratch memory when preparing its descriptor list fails: the registration made
for it is undone, so a later warm-up registers scratch once, not once more per failure."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvrdma.errors import RegistrationError
from kvrdma.nixl.protocol import MemType, XferState
from kvrdma.nixl.warm import ALONE_S, DRAIN_S, MAX_DRAIN_S, Warmup, _Peer

pytestmark = pytest.mark.timeout(10)


class _Reg:
    def __init__(self, live: list[_Reg]) -> None:
        self._live = live
        live.append(self)

    def release(self) -> None:
        if self in self._live:
            self._live.remove(self)


class _Backend:
    """Registers scratch, refuses to prepare the local scratch list the first time."""

    _threads: frozenset[int] = frozenset()
    _posted = 0
    agent_name = "d"

    def __init__(self) -> None:
        self.live: list[_Reg] = []
        self.local_preps = 0

    def _in_flight(self, but: Any) -> bool:
        return False

    def _held_back(self) -> bool:
        return False

    def register(self, regions: Any, mem_type: MemType) -> _Reg:
        return _Reg(self.live)

    def _prep(self, peer: str | None, descs: Any, mem: MemType) -> Any:
        if peer is None:
            self.local_preps += 1
            if self.local_preps == 1:
                raise RegistrationError("prep_xfer_dlist of the scratch list failed")
        return _List()

    def _post_now(self, *args: Any) -> Any:
        raise RegistrationError("no transfer in this test")

    def poll(self, xfer: Any) -> Any:
        raise AssertionError("nothing posted")


class _List:
    def release(self) -> None:
        pass


def _like() -> Any:
    """What `start` reads of a list prepared for the peer."""
    return SimpleNamespace(_arr=np.array([[4096, 8, 0]], dtype=np.uint64), _mem=MemType.DRAM)


def test_scratch_registered_once_when_its_list_failed_to_prepare_before() -> None:
    b = _Backend()
    w = Warmup(b, num_threads=0, split=None)  # type: ignore[arg-type]
    failed = w.advance("p", _like())
    assert failed is not None and failed.state is XferState.ERR
    assert "scratch list" in (failed.error or "")
    assert b.live == []  # the scratch registration was undone with the failure
    w.advance("p", _like())  # the retry: its round cannot post here, which is fine
    assert len(b.live) == 1


def test_holds_for_a_transfer_that_does_not_end_grow_then_give_up_on_proof() -> None:
    """A round waits for the copy threads to itself: it holds posts back for the transfers
    running to end, twice as long after each hold in vain (a long READ ends within one), with
    posts let through between holds, and after `ALONE_S` gives up: the peer is crowded."""
    b = _Backend()
    b._in_flight = lambda but: True  # type: ignore[method-assign]
    w = Warmup(b, num_threads=2, split=1)  # type: ignore[arg-type]
    p = _Peer(remote=_List())  # type: ignore[arg-type]
    holds: list[float] = []
    start, ms = None, 0
    while not p.crowded:  # called every millisecond
        assert not w._alone(p, ms / 1000)
        if w._hold_until and start is None:
            start = ms
        elif not w._hold_until and start is not None:
            holds.append((ms - start) / 1000)
            start = None
        ms += 1
    *whole, cut = holds  # the last is cut short by `ALONE_S`
    want = [DRAIN_S, 2 * DRAIN_S, 4 * DRAIN_S] + [MAX_DRAIN_S] * (len(whole) - 3)
    assert whole == pytest.approx(want, abs=0.0015), holds
    assert cut <= MAX_DRAIN_S
    assert ALONE_S <= ms / 1000 < ALONE_S + 0.01
    assert w._hold_until == 0.0  # nothing held back any more for it
