"""`kvrdma.nixl.standby` with real threads standing in for an agent's copy threads: one that waits
for work (quiet) and one that spins (busy), as NIXL's copy threads do without and with a
piece of a transfer."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Iterator

import pytest

from kvrdma.nixl.standby import Standby, build, threads_quiet

SPIN_BYTES = 8 << 20
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")


class Worker:
    """A thread that waits for work on a condition, or spins while `busy` is set."""

    def __init__(self) -> None:
        self.busy = threading.Event()
        self.stop = threading.Event()
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        buf = ctypes.create_string_buffer(SPIN_BYTES)
        while not self.stop.is_set():
            if self.busy.is_set():
                # spinning like a copy thread polling its UCX worker: in C, without the GIL
                # (a Python loop would sleep whenever another thread holds the GIL)
                ctypes.memset(buf, 0, SPIN_BYTES)
                continue
            with self.cond:
                self.cond.wait(timeout=5)

    @property
    def tid(self) -> int:
        assert self.thread.native_id is not None
        return self.thread.native_id

    def close(self) -> None:
        self.stop.set()
        self.busy.clear()
        with self.cond:
            self.cond.notify_all()
        self.thread.join(5)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    made: list[Worker] = []
    yield made
    for w in made:
        w.close()


def test_waiting_threads_are_quiet(workers: list[Worker]) -> None:
    workers.extend(Worker() for _ in range(2))
    time.sleep(0.05)
    assert threads_quiet(frozenset(w.tid for w in workers), limit=2.0)


def test_a_spinning_thread_is_not_quiet_until_it_waits(workers: list[Worker]) -> None:
    w = Worker()
    workers.append(w)
    w.busy.set()
    with w.cond:
        w.cond.notify_all()
    assert not threads_quiet(frozenset([w.tid]), limit=0.1)
    stopped: list[float] = []

    def stop_spinning() -> None:
        stopped.append(time.monotonic())
        w.busy.clear()

    threading.Timer(0.1, stop_spinning).start()
    assert threads_quiet(frozenset([w.tid]), limit=5.0)
    assert stopped and time.monotonic() > stopped[0]  # not before it stopped spinning


def test_build_finds_the_threads_the_builder_started(workers: list[Worker]) -> None:
    def make() -> str:
        workers.append(Worker())
        return "agent"

    other = threading.Thread(target=time.sleep, args=(0.3,))  # started elsewhere: not counted
    other.start()
    built = build(make, copy_threads=1)
    other.join()
    assert built.agent == "agent"
    assert built.threads == frozenset([workers[0].tid])


def test_standby_hands_over_its_agent_or_its_error() -> None:
    s: Standby[str] = Standby(lambda: "built", copy_threads=0, load=lambda a: f"{a}+loaded")
    assert s.take(timeout=5).agent == "built+loaded"
    with pytest.raises(RuntimeError, match="already taken"):
        s.take(timeout=5)

    def fail() -> str:
        raise ValueError("no agent")

    with pytest.raises(ValueError, match="no agent"):
        Standby(fail, copy_threads=0, load=str).take(timeout=5)


def test_an_abandoned_standby_is_disposed_of_once_its_load_ends_and_holds_no_one_up() -> None:
    """A standby stuck loading (a peer the network cannot reach) is given up at once; what
    it built is disposed of when the load returns. One already built is disposed of now."""
    release = threading.Event()
    disposed: list[str] = []

    def load(agent: str) -> str:
        release.wait(10)
        return agent

    stuck: Standby[str] = Standby(lambda: "a", copy_threads=0, load=load)
    assert not stuck.wait(0.05)
    t0 = time.monotonic()
    stuck.abandon(disposed.append)
    assert time.monotonic() - t0 < 0.05
    assert disposed == []
    release.set()
    assert stuck.wait(5)
    assert disposed == ["a"]

    done: Standby[str] = Standby(lambda: "b", copy_threads=0, load=str)
    assert done.wait(5)
    done.abandon(disposed.append)
    assert disposed == ["a", "b"]


def test_work_given_to_a_standby_runs_before_it_is_ready_or_at_once_and_never_after_it_goes() -> (
    None
):
    """`also` while the load runs: done on the building thread before `take` sees the agent;
    once ready: done by the caller; once taken or abandoned: dropped."""
    release = threading.Event()

    def load(agent: str) -> list[str]:
        release.wait(10)
        return [agent]

    s: Standby[list[str]] = Standby(lambda: "a", copy_threads=0, load=load)
    s.also(lambda peers: peers.append("early"))
    assert not s.ready
    release.set()
    assert s.wait(5)
    s.also(lambda peers: peers.append("late"))
    assert s.take(timeout=0).agent == ["a", "early", "late"]
    s.also(lambda peers: peers.append("after take"))  # nothing to apply it to

    gone: Standby[list[str]] = Standby(lambda: "b", copy_threads=0, load=lambda a: [a])
    assert gone.wait(5)
    disposed: list[list[str]] = []
    gone.abandon(disposed.append)
    gone.also(lambda peers: peers.append("after abandon"))
    assert disposed == [["b"]]
