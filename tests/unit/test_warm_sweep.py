"""`Warmup.sweep`, run by `NixlBackend.close()` after a transfer ended early: loopback rounds
until each copy thread was seen copying (its page faults grew), bounded in rounds."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from kvrdma.nixl import warm
from kvrdma.nixl.protocol import MemType, XferResult, XferState
from kvrdma.nixl.warm import SWEEP_ROUNDS, Warmup

pytestmark = pytest.mark.timeout(10)


class _List:
    def __init__(self, peer: str | None, descs: Any, released: list[str | None]) -> None:
        self.peer, self._arr, self._released = peer, np.asarray(descs), released

    def release(self) -> None:
        self._released.append(self.peer)


class _Xfer:
    def release(self) -> None:
        pass


class _Backend:
    """Copy threads 1 and 2; each round is copied by the next thread of `copiers`."""

    agent_name = "d"

    def __init__(self, copiers: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
        self._threads = frozenset({1, 2})
        self.faults = {1: 0, 2: 0}
        self.copiers = copiers
        self.posts: list[tuple[str, str | None]] = []
        self.released: list[str | None] = []
        monkeypatch.setattr(warm, "_faults", lambda tid: self.faults.get(tid))

    def register(self, regions: Any, mem_type: MemType) -> Any:
        return _Xfer()

    def _prep(self, peer: str | None, descs: Any, mem: MemType) -> _List:
        return _List(peer, descs, self.released)

    def _post_now(self, op: str, lo: Any, lids: Any, ro: _List, rids: Any, notif: bytes) -> Any:
        self.posts.append((op, ro.peer))
        copier = self.copiers[(len(self.posts) - 1) % len(self.copiers)]
        self.faults[copier] += 1
        return _Xfer()

    def poll(self, xfer: Any) -> XferResult:
        return XferResult(XferState.DONE)


def test_rounds_until_every_copy_thread_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    b = _Backend([1, 1, 2], monkeypatch)
    w = Warmup(b, num_threads=2, split=4)  # type: ignore[arg-type]
    assert w.sweep() == []
    assert b.posts == [("READ", "d")] * 3  # loopback READs, until thread 2 copied one
    assert b.released == ["d"]  # the loopback list, once


def test_a_copy_thread_never_seen_is_returned_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    b = _Backend([1], monkeypatch)
    w = Warmup(b, num_threads=2, split=4)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="kvrdma.nixl.warm"):
        assert w.sweep() == [2]
    assert len(b.posts) == SWEEP_ROUNDS
    assert "copy threads [2] not seen swept" in caplog.text


def test_nothing_to_sweep_without_copy_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    b = _Backend([1], monkeypatch)
    w = Warmup(b, num_threads=0, split=None)  # type: ignore[arg-type]
    assert w.sweep() == []
    assert b.posts == []
