"""`kvrdma.push.receiver`'s fences: a quarantined push is released only on news of its writer
(its `Ended`, a probe the peer or transport failed, a new agent for its rank), never on a
probe this side gave up itself."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvrdma.nixl.protocol import XferResult, XferState, running_after_grace
from kvrdma.push import receiver
from kvrdma.push.receiver import PROBE_EVERY, Receiver, _Fence, _Wait
from kvrdma.transfer import ReadOp

_META = SimpleNamespace(agent_metadata_sha256="")  # what a probe reads of a producer rank


class Reader:
    """Probes stay running until `ends` says how they end."""

    def __init__(self) -> None:
        self.ends = XferResult(XferState.PROC)
        self.posted = 0

    def post(self, *_: Any) -> Any:
        self.posted += 1
        return SimpleNamespace(release=lambda: None)

    def poll(self, _: Any) -> XferResult:
        return self.ends


def _fenced() -> tuple[Receiver, Reader, list[float], Any]:
    reader, now = Reader(), [0.0]
    s = SimpleNamespace(
        reader=reader, clock=lambda: now[0], ack_local=object(), metrics=None, metadata=None
    )
    remote = SimpleNamespace(ack_lists={0: object()}, agents={0: "P-0"}, metas={0: _META})
    consumer = SimpleNamespace(s=s, remotes={"P": remote}, suspect=set(), ready=[])
    rx = Receiver(consumer)  # type: ignore[arg-type]
    rx.fences["r"] = _Fence(_Wait(ReadOp("r", "P", [0, 1], [], 1.0, 0.0), "r", {0}, {0: "P-0"}))
    rx.poll()  # the first probe goes out
    assert reader.posted == 1
    return rx, reader, now, consumer


def test_a_probe_given_up_by_a_retirement_is_posted_again_and_keeps_the_fence() -> None:
    rx, reader, now, _ = _fenced()
    reader.ends = XferResult(XferState.ERR, "READ abandoned: agent retired", abandoned=True)
    for i in range(1, 4):
        now[0] = i * PROBE_EVERY
        rx.poll()
        reader.ends = XferResult(XferState.PROC)
        assert "r" in rx.fences and not rx._released
    assert reader.posted > 1


def test_a_probe_the_transport_failed_releases_the_fence() -> None:
    rx, reader, _, consumer = _fenced()
    reader.ends = XferResult(XferState.ERR, "remote agent disconnected", peer_lost=True)
    rx.poll()
    assert rx._released == {"r"} and consumer.suspect == {"P"}


def test_only_a_new_agent_for_the_rank_releases_a_fence_its_engine_left() -> None:
    rx, reader, now, consumer = _fenced()
    reader.ends = XferResult(XferState.DONE)  # alive: it could still write
    rx.poll()
    gone = consumer.remotes.pop("P")  # removed here: stopped nothing there
    for i in range(1, 4):
        now[0] = i * PROBE_EVERY
        rx.poll()
        assert "r" in rx.fences
    consumer.remotes["P"] = SimpleNamespace(
        ack_lists=gone.ack_lists, agents={0: "P-0"}, metas={0: _META}
    )
    rx.poll()  # added again, same agent: probed, still alive
    assert "r" in rx.fences
    consumer.remotes["P"].agents = {0: "P-1"}  # restarted
    rx.poll()
    assert rx._released == {"r"}


def _graces(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """The transfers of each `running_after_grace` the receiver waits, recorded."""
    graces: list[list[Any]] = []

    def recording(poll: Any, xfers: Any) -> list[Any]:
        graces.append(list(xfers))
        return running_after_grace(poll, graces[-1])

    monkeypatch.setattr(receiver, "running_after_grace", recording)
    return graces


def test_fences_released_in_one_step_wait_one_grace_for_their_probes_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Probes still running when their fences are released get `CANCEL_GRACE` of progress,
    once per step however many fences it releases: the step holds the worker's lock."""
    graces = _graces(monkeypatch)
    rx, _, _, _ = _fenced()
    released: list[str] = []
    rx.fences.clear()
    for i in range(4):
        w = _Wait(ReadOp(f"r{i}", "P", [0], [], 1.0, 0.0), f"r{i}", {0}, {0: "P-0"})
        w.ended[0] = "stopped"  # its only writer settled
        f = _Fence(w)
        f.probes[0] = SimpleNamespace(release=lambda i=i: released.append(f"r{i}"))
        rx.fences[f"r{i}"] = f
    rx.poll()  # every probe still running (Reader.ends is PROC)
    assert [len(xs) for xs in graces if xs] == [4]  # one grace, not one per fence
    assert sorted(released) == ["r0", "r1", "r2", "r3"] and not rx.fences


def test_a_probe_held_back_by_a_warm_up_round_is_released_unposted_without_a_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A probe posted while a warm-up round held posts back waits unposted (`held`): a fence
    released then drops it at once, neither polling it (which could post it) nor waiting a
    grace for it to end."""
    graces = _graces(monkeypatch)
    rx, reader, _, _ = _fenced()
    polled: list[Any] = []
    reader.poll = lambda x: polled.append(x) or XferResult(XferState.PROC)  # type: ignore[method-assign]
    rx.fences.clear()
    released: list[str] = []
    w = _Wait(ReadOp("r", "P", [0], [], 1.0, 0.0), "r", {0}, {0: "P-0"})
    w.ended[0] = "stopped"
    f = _Fence(w)
    f.probes[0] = SimpleNamespace(held=("args",), release=lambda: released.append("held"))
    rx.fences["r"] = f
    rx.poll()
    assert all(not xs for xs in graces), graces
    assert released == ["held"] and not polled and not rx.fences
