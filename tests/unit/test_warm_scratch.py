"""`Warmup`'s scratch memory when preparing its descriptor list fails: the registration made
for it is undone, so a later warm-up registers scratch once, not once more per failure."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvrdma.errors import RegistrationError
from kvrdma.nixl.protocol import MemType, XferState
from kvrdma.nixl.warm import Warmup

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
