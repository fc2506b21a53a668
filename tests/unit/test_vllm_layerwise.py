"""kvrdma.vllm.layerwise: which layers a vLLM producer pushes, when, and what goes whole."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from kvrdma.errors import ConfigError
from kvrdma.vllm.layerwise import LayerwisePush


class Recorder:
    """The Worker calls LayerwisePush makes, in order."""

    def __init__(self, refuse_layerwise: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.refuse_layerwise = refuse_layerwise

    def push(self, rid: str, ids: list[int], *, layerwise: bool = False) -> None:
        if layerwise and self.refuse_layerwise:
            raise ConfigError("layer-wise push from host-staged caches")
        self.calls.append(("push", rid, ids, layerwise))

    def push_layer(self, rid: str, layer: str) -> None:
        self.calls.append(("layer", rid, layer))

    def end_push(self, rid: str) -> None:
        self.calls.append(("end", rid))


def ids(groups: tuple[tuple[int, ...], ...]) -> list[int]:
    return [b for b in groups[0] if b]


HOST = torch.zeros(1)
STEP = {"a": ((3, 1, 2),), "b": ((7,),)}


def test_host_layers_are_pushed_as_saved_then_ended() -> None:
    w, lw = Recorder(), LayerwisePush(ids)
    for layer in ("l0", "l1"):
        lw.save(w, STEP, layer, HOST)
    lw.finish(w, STEP)
    assert w.calls == [
        ("push", "a", [3, 1, 2], True), ("push", "b", [7], True),
        ("layer", "a", "l0"), ("layer", "b", "l0"), ("layer", "a", "l1"), ("layer", "b", "l1"),
        ("end", "a"), ("end", "b"),
    ]  # fmt: skip


def test_a_step_with_nothing_to_push_calls_nothing() -> None:
    w, lw = Recorder(), LayerwisePush(ids)
    lw.save(w, {}, "l0", HOST)
    lw.finish(w, {})
    assert w.calls == []


def test_requests_that_saw_no_layer_go_whole_at_the_end() -> None:
    w, lw = Recorder(), LayerwisePush(ids)
    lw.finish(w, STEP)
    assert w.calls == [("push", "a", [3, 1, 2], False), ("push", "b", [7], False)]


def test_a_registration_that_cannot_go_layer_by_layer_pushes_whole() -> None:
    w, lw = Recorder(refuse_layerwise=True), LayerwisePush(ids)
    lw.save(w, STEP, "l0", HOST)
    lw.save(w, STEP, "l1", HOST)
    lw.finish(w, STEP)
    assert w.calls == [("push", "a", [3, 1, 2], False), ("push", "b", [7], False)]


def test_each_forward_starts_afresh() -> None:
    w, lw = Recorder(), LayerwisePush(ids)
    lw.save(w, STEP, "l0", HOST)
    lw.finish(w, STEP)
    w.calls.clear()
    lw.save(w, {"c": ((9,),)}, "l0", HOST)
    lw.finish(w, {"c": ((9,),)})
    assert w.calls == [("push", "c", [9], True), ("layer", "c", "l0"), ("end", "c")]


class FakeEvent:
    """A CUDA event whose kernels finish when the test says so."""

    made: ClassVar[list[FakeEvent]] = []

    def __init__(self) -> None:
        self.done = False
        self.waited = False
        FakeEvent.made.append(self)

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


class DeviceTensor:
    is_cuda = True


def test_device_layers_are_pushed_once_their_kernels_are_done_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    FakeEvent.made = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    synced: list[bool] = []

    class Stream:
        def synchronize(self) -> None:
            synced.append(True)

    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    w, lw = Recorder(), LayerwisePush(ids)
    step = {"a": ((3,),)}
    lw.save(w, step, "l0", DeviceTensor())
    assert w.calls == [("push", "a", [3], True)]  # launched, not done: nothing written
    lw.save(w, step, "l1", DeviceTensor())
    assert w.calls[1:] == []
    FakeEvent.made[1].done = True  # a later layer done before an earlier one: order kept
    lw.save(w, step, "l2", DeviceTensor())
    assert w.calls[1:] == []
    FakeEvent.made[0].done = True
    lw.save(w, step, "l3", DeviceTensor())
    assert w.calls[1:] == [("layer", "a", "l0"), ("layer", "a", "l1")]
    lw.finish(w, step)
    assert w.calls[3:] == [("layer", "a", "l2"), ("layer", "a", "l3"), ("end", "a")]
    assert FakeEvent.made[2].waited and FakeEvent.made[3].waited
    assert synced == [True]  # the whole forward is done before the rest is written
