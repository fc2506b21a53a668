"""What a poll loop around `get_finished()` goes through while reads run: the empty report
(`empty_output`) and a transfer's NIXL state read from the binding (`kvrdma.nixl.status`)."""

from __future__ import annotations

import dataclasses
import enum
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from kvrdma.nixl.status import state_check
from kvrdma.types import FinishedOutput, empty_output


def test_empty_output_is_a_fresh_default_output() -> None:
    out = empty_output()
    assert type(out) is FinishedOutput and out == FinishedOutput() and not out
    # every field set (one added to FinishedOutput must be added there too)
    assert vars(out).keys() == {f.name for f in dataclasses.fields(FinishedOutput)}


def test_empty_outputs_share_no_field() -> None:
    a, b = empty_output(), empty_output()
    a.finished_sending.add("s")
    a.finished_recving.add("r")
    a.invalid_block_ids["r"] = {1}
    a.failed.add("r")
    a.stats["n"] = 1
    assert b == FinishedOutput() and empty_output() == FinishedOutput()
    for f in dataclasses.fields(FinishedOutput):
        assert getattr(a, f.name) is not getattr(b, f.name), f.name


class Status(enum.Enum):
    """Stands for the binding's status enum (values as NIXL's)."""

    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_REMOTE_DISCONNECT = -9


class Binding:
    """Stands for NIXL's binding agent: answers each transfer integer from `states`."""

    def __init__(self) -> None:
        self.states: dict[int, Status] = {}
        self.asked: list[int] = []

    def getXferStatus(self, handle: int) -> Status:
        self.asked.append(handle)
        if handle not in self.states:
            raise RuntimeError("NIXL_ERR_NOT_FOUND")
        return self.states[handle]


class Agent:
    """Stands for `nixl_agent`: `check_xfer_state` as NIXL writes it, over `agent`."""

    def __init__(self, binding: Any) -> None:
        self.agent = binding

    def check_xfer_state(self, handle: Any) -> str:
        status = self.agent.getXferStatus(handle._handle)
        if status == Status.NIXL_SUCCESS:
            return "DONE"
        return "PROC" if status == Status.NIXL_IN_PROG else "ERR"


@pytest.fixture
def binding_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """A module holding the stand-in binding class and the status constants, as NIXL's
    `_bindings` does."""
    mod = types.ModuleType("fake_nixl_bindings")
    mod.NIXL_IN_PROG = Status.NIXL_IN_PROG  # type: ignore[attr-defined]
    mod.NIXL_SUCCESS = Status.NIXL_SUCCESS  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(Binding, "__module__", mod.__name__)
    yield mod


def test_the_binding_is_read_directly_with_the_handles_current_integer(
    binding_module: types.ModuleType,
) -> None:
    agent = Agent(Binding())
    agent.agent.states = {
        1: Status.NIXL_IN_PROG,
        2: Status.NIXL_SUCCESS,
        3: Status.NIXL_ERR_REMOTE_DISCONNECT,
    }
    check = state_check(agent)
    assert check != agent.check_xfer_state
    handle = types.SimpleNamespace(_handle=1)
    answers = []
    for value in (1, 2, 3):
        handle._handle = value
        answers.append((check(handle), agent.check_xfer_state(handle)))
    assert answers == [("PROC", "PROC"), ("DONE", "DONE"), ("ERR", "ERR")]
    assert agent.agent.asked == [1, 1, 2, 2, 3, 3]
    handle._handle = 4
    with pytest.raises(RuntimeError, match="NOT_FOUND"):  # poll turns it into ERR
        check(handle)


@pytest.mark.parametrize("missing", ["binding", "module", "constant"])
def test_without_nixls_binding_it_is_check_xfer_state(
    binding_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    agent = Agent(Binding())
    agent.agent.states = {5: Status.NIXL_SUCCESS}
    if missing == "binding":
        agent = Agent(types.SimpleNamespace())
        monkeypatch.setattr(agent, "check_xfer_state", lambda handle: "PROC")
    elif missing == "module":
        monkeypatch.delitem(sys.modules, binding_module.__name__)
    else:
        monkeypatch.delattr(binding_module, "NIXL_IN_PROG")
    check = state_check(agent)
    assert check == agent.check_xfer_state
    assert check(types.SimpleNamespace(_handle=5)) == ("PROC" if missing == "binding" else "DONE")
