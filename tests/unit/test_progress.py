"""ProgressLoop: pacing (busy / immediate / idle backoff), wake-ups, bounded waits, argument
checks. A stand-in worker and an injected clock; real pipes and select for the wake-ups."""

from __future__ import annotations

import os
import resource
import select
import threading
import time
from collections.abc import Iterator

import pytest

from kvrdma.errors import ConfigError
from kvrdma.progress import MAX_IDLE_INTERVAL, ProgressLoop
from kvrdma.worker import FinishedOutput


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeWorker:
    """`get_finished` returns queued outputs (then empty ones); `has_work` is settable."""

    def __init__(self) -> None:
        self.has_work = False
        self.outputs: list[FinishedOutput] = []
        self.calls = 0
        self.during: list[object] = []  # callables run inside get_finished

    def get_finished(self) -> FinishedOutput:
        self.calls += 1
        for fn in self.during:
            fn()  # type: ignore[operator]
        return self.outputs.pop(0) if self.outputs else FinishedOutput()


def readable(loop: ProgressLoop) -> bool:
    return bool(select.select([loop.fileno()], [], [], 0)[0])


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def worker() -> FakeWorker:
    return FakeWorker()


def test_idle_worker_backs_off_doubling_to_idle_interval(clock: Clock, worker: FakeWorker) -> None:
    with ProgressLoop(worker, clock=clock) as loop:
        assert loop.timeout() == 0.0  # the first poll is due at once
        seen = []
        for _ in range(8):
            loop.poll()
            seen.append(round(loop.interval, 6))
            assert loop.idle
        assert seen == [0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05, 0.05]
        assert loop.timeout() == pytest.approx(0.05)
        clock.t += 0.03
        assert loop.timeout() == pytest.approx(0.02)
        clock.t += 1.0
        assert loop.timeout() == 0.0


def test_busy_worker_polls_at_busy_interval_and_output_polls_again_at_once(
    clock: Clock, worker: FakeWorker
) -> None:
    with ProgressLoop(worker, busy_interval=0.002, idle_interval=0.1, clock=clock) as loop:
        worker.has_work = True
        loop.poll()
        assert (loop.interval, loop.idle) == (0.002, False)
        assert loop.timeout() == pytest.approx(0.002)
        worker.outputs = [FinishedOutput(finished_sending={"r1"})]
        out = loop.poll()
        assert out.finished_sending == {"r1"}
        assert loop.interval == 0.0 and loop.timeout() == 0.0
        # a failed read is reported too (invalid blocks): poll again at once
        worker.outputs = [FinishedOutput(finished_recving={"r2"}, invalid_block_ids={"r2": {1}})]
        loop.poll()
        assert loop.interval == 0.0
        worker.has_work = False
        loop.poll()  # idle again: the backoff starts from the busy pace, not from 0
        assert (loop.interval, loop.idle) == (0.004, True)


def test_poll_returns_what_get_finished_returned(clock: Clock, worker: FakeWorker) -> None:
    out = FinishedOutput(finished_recving={"x"})
    worker.outputs = [out]
    with ProgressLoop(worker, clock=clock) as loop:
        assert loop.poll() is out
        assert loop.polls == worker.calls == 1


def test_work_appearing_in_the_loop_thread_ends_the_backoff(
    clock: Clock, worker: FakeWorker
) -> None:
    with ProgressLoop(worker, clock=clock) as loop:
        for _ in range(10):
            loop.poll()
        assert loop.interval == 0.05
        clock.t += 0.0004
        worker.has_work = True  # hold() in the loop's own thread, no wake()
        assert loop.timeout() == pytest.approx(0.0006)
        clock.t += 0.001
        assert loop.timeout() == 0.0
        loop.poll()
        assert (loop.interval, loop.idle) == (0.001, False)


def test_wake_makes_a_poll_due_and_the_fd_readable_until_polled(
    clock: Clock, worker: FakeWorker
) -> None:
    with ProgressLoop(worker, clock=clock) as loop:
        for _ in range(10):
            loop.poll()
        assert not readable(loop) and loop.timeout() > 0
        loop.wake()
        loop.wake()  # repeated wake-ups collapse into one poll
        assert readable(loop) and loop.timeout() == 0.0
        loop.poll()
        assert not readable(loop) and loop.timeout() > 0
        assert worker.calls == 11


def test_wake_during_get_finished_is_not_lost(clock: Clock, worker: FakeWorker) -> None:
    with ProgressLoop(worker, clock=clock) as loop:
        for _ in range(10):
            loop.poll()
        worker.during = [loop.wake]  # as if another thread called wake() mid-poll
        loop.poll()
        worker.during = []
        assert loop.timeout() == 0.0 and readable(loop)


def test_step_waits_until_due_and_max_wait_bounds_it(worker: FakeWorker) -> None:
    with ProgressLoop(worker, busy_interval=0.0, idle_interval=1.0) as loop:
        for _ in range(10):
            loop.poll()
        polled = time.monotonic()
        assert loop.interval == 1.0
        t0 = time.monotonic()
        out = loop.step(max_wait=0.02)
        waited = time.monotonic() - t0
        assert not out and loop.polls == 10, "max_wait ran out: no poll"
        assert 0.015 <= waited < 0.15
        loop.step()
        since = time.monotonic() - polled
        assert loop.polls == 11
        assert 0.99 <= since < 1.3, since  # the rest of the 1 s interval, not more


def test_wake_from_another_thread_interrupts_a_long_wait(worker: FakeWorker) -> None:
    with ProgressLoop(worker, idle_interval=MAX_IDLE_INTERVAL) as loop:
        for _ in range(12):
            loop.poll()
        assert loop.interval == MAX_IDLE_INTERVAL
        timer = threading.Timer(0.05, loop.wake)
        t0 = time.monotonic()
        timer.start()
        try:
            loop.step()
        finally:
            timer.cancel()
            timer.join(5)
        waited = time.monotonic() - t0
        assert loop.polls == 13
        assert 0.04 <= waited < 0.5, waited
        if loop.timeout() == 0:  # the poll began between wake()'s byte and its flag
            loop.poll()  # one extra poll, then settled
        assert loop.timeout() > 0 and not readable(loop)


@pytest.fixture
def descriptors_past_select() -> Iterator[None]:
    """Descriptors 0..1024 in use, as in a serving process with many files and sockets open:
    the next one opened is past what `select.select` accepts (FD_SETSIZE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is under 1100")
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (max(soft, 1100), hard) if soft != -1 else (soft, hard)
    )
    held = []
    try:
        while not held or held[-1] < 1024:
            held.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.usefixtures("descriptors_past_select")
def test_a_loop_whose_pipe_is_past_fd_setsize_waits_and_wakes(worker: FakeWorker) -> None:
    with ProgressLoop(worker, busy_interval=0.0, idle_interval=1.0) as loop:
        assert loop.fileno() >= 1024
        for _ in range(10):
            loop.poll()
        t0 = time.monotonic()
        assert not loop.step(max_wait=0.02)  # waits, no poll due
        assert 0.015 <= time.monotonic() - t0 < 0.15
        loop.wake()
        loop.step(max_wait=0.5)
        assert loop.polls == 11


def test_close_releases_the_pipe(worker: FakeWorker) -> None:
    loop = ProgressLoop(worker)
    loop.close()
    with pytest.raises(ValueError, match="closed"):
        loop.fileno()
    loop.wake()  # harmless after close
    loop.close()  # idempotent


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"busy_interval": -0.001}, "busy_interval"),
        ({"busy_interval": float("nan")}, "busy_interval"),
        ({"busy_interval": "1ms"}, "busy_interval"),
        ({"busy_interval": True}, "busy_interval"),
        ({"idle_interval": 0}, "idle_interval"),
        ({"idle_interval": float("inf")}, "idle_interval"),
        ({"idle_interval": MAX_IDLE_INTERVAL * 2}, "idle_interval"),
        ({"busy_interval": 0.01, "idle_interval": 0.005}, "idle_interval"),
    ],
)
def test_bad_arguments_are_rejected_by_name(
    worker: FakeWorker, kwargs: dict[str, object], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        ProgressLoop(worker, **kwargs)  # type: ignore[arg-type]


def test_bad_max_wait_is_rejected_by_name(worker: FakeWorker) -> None:
    with ProgressLoop(worker) as loop, pytest.raises(ConfigError, match="max_wait"):
        loop.step(max_wait=-1)
