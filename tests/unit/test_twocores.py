"""kvrdma.twocores: both parts run, on two threads, and neither part's error escapes while
the other part still runs."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from kvrdma import twocores
from kvrdma.twocores import _wait, both, by_halves


def test_both_runs_the_parts_on_two_threads_and_returns_their_results() -> None:
    def name() -> str:
        return threading.current_thread().name

    mine, theirs = both(name, name)
    assert mine == threading.current_thread().name
    assert theirs.startswith("kvrdma-helper")


def test_by_halves_cuts_only_when_asked_and_worth_it() -> None:
    def part(items: list[int]) -> tuple[list[int], str]:
        return items, threading.current_thread().name

    here = threading.current_thread().name
    (head, h), (tail, t) = by_halves(part, [1, 2, 3, 4, 5], split=True)
    assert (head, tail, h) == ([1, 2], [3, 4, 5], here) and t.startswith("kvrdma-helper")
    assert by_halves(part, [1, 2, 3], split=False) == [([1, 2, 3], here)]
    assert by_halves(part, [7], split=True) == [([7], here)]  # nothing to cut


@pytest.mark.parametrize("failing", ["mine", "theirs"])
def test_an_error_is_raised_only_once_the_other_part_ended(failing: str) -> None:
    ended: list[str] = []

    def part(who: str) -> None:
        if who == failing:
            raise ValueError(who)
        time.sleep(0.05)
        ended.append(who)

    with pytest.raises(ValueError, match=failing):
        both(lambda: part("mine"), lambda: part("theirs"))
    assert ended == [w for w in ("mine", "theirs") if w != failing]


def test_an_interrupt_is_raised_only_once_the_helper_is_done() -> None:
    """The caller frees the memory the helper works on once `both` returns or raises."""

    class Interrupted(Future[None]):
        calls = 0

        def result(self, timeout: float | None = None) -> None:
            self.calls += 1
            if self.calls == 1:  # Ctrl-C while the helper still works
                threading.Timer(0.05, self.set_result, [None]).start()
                raise KeyboardInterrupt
            return super().result(timeout)

    done = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        _wait(done)
    assert done.done()


def test_at_interpreter_shutdown_the_caller_runs_both(monkeypatch: pytest.MonkeyPatch) -> None:
    class ShutDown:
        def submit(self, *args: object) -> None:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(twocores, "_helper", ShutDown)
    here = threading.current_thread().name
    assert both(lambda: threading.current_thread().name, lambda: 7) == (here, 7)
