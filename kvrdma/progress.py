"""`ProgressLoop`: drive a `Worker` cheaply when idle and promptly when busy.

kvrdma's NIXL agents run without NIXL's progress thread (it busy-spins a core), so the
thread that owns a `Worker` must keep calling `Worker.get_finished()`: it is the agent's only
progress, and a producer that stops calling it stalls its readers' wire-up, READs that carry
a notification, and its own lease bookkeeping. Calling it at a fixed 1 ms costs an idle
worker a few percent of a core, almost all of it the wake-up itself. `ProgressLoop` polls at
`busy_interval` while the worker has work (`Worker.has_work`: blocks held for readers, reads
in flight or unreported, notifications on their way, heartbeats owed), immediately again
when a poll reported something, and backs off — doubling, up to `idle_interval` — while the
worker is idle. An idle worker needs nothing from its agent: a reader only READs blocks a
producer holds (and NIXL wires a link up on its first READ), so the backed-off wait costs
latency only to a stray message, which waits at most `idle_interval` to be progressed.

New work ends a backed-off wait at once:
- `hold()`/`start_read()`/`keep_alive()` in the loop's own thread are noticed by the next
  `timeout()`/`step()` (they make `has_work` true), nothing else to do;
- from another thread (or a signal handler) call `wake()`: it interrupts a `step()` blocked
  in its wait, and makes `fileno()` readable for loops that wait with `select` on their own
  sockets too.

Two ways to use it, both from the thread that owns the worker (`Worker` is not thread-safe;
only `wake()` may be called from elsewhere):

    loop = ProgressLoop(worker)                    # 1 ms busy, backs off to 50 ms idle
    while serving:
        out = loop.step()                          # waits (<= idle_interval), then polls
        ...                                        # out: the FinishedOutput of that poll

    # or, next to your own file descriptors (poll or epoll: a busy process's descriptors
    # can be past what select.select takes):
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(loop.fileno(), selectors.EVENT_READ)
    while serving:
        ready = sel.select(loop.timeout())
        ...                                        # handle sock; hold()/start_read() here
        if loop.timeout() == 0:
            out = loop.poll()

`poll()` returns exactly what `Worker.get_finished()` returned; `step()` returns that, or an
empty `FinishedOutput` when its `max_wait` ended before a poll was due. Every wait is
bounded: by the current interval (at most `idle_interval`) and by `max_wait`.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import time
from collections.abc import Callable
from typing import Protocol

from kvrdma.errors import ConfigError
from kvrdma.worker import FinishedOutput

DEFAULT_BUSY_INTERVAL = 0.001  # s between polls while the worker has work
DEFAULT_IDLE_INTERVAL = 0.05  # s between polls once an idle worker has backed off
MAX_IDLE_INTERVAL = 1.0  # a stray message (e.g. a reader's early heartbeat) waits this long
_FD_SETSIZE = 1024  # select.select refuses descriptors from here on
_FIRST_BACKOFF = 0.001  # the first idle interval is at least this (busy_interval may be 0)


class Progressable(Protocol):
    """What `ProgressLoop` drives: a `kvrdma.worker.Worker`, or a stand-in with the same two
    members."""

    def get_finished(self) -> FinishedOutput: ...

    @property
    def has_work(self) -> bool: ...


def _seconds(name: str, value: object, *, allow_zero: bool, upper: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
    v = float(value)
    low_ok = v >= 0 if allow_zero else v > 0
    if not math.isfinite(v) or not low_ok or (upper is not None and v > upper):
        bounds = f"{'>= 0' if allow_zero else '> 0'}" + (f" and <= {upper:g}" if upper else "")
        raise ConfigError(f"{name} must be a finite number of seconds {bounds}, got {value!r}")
    return v


class ProgressLoop:
    """Calls `worker.get_finished()` every `busy_interval` s while `worker.has_work`, at once
    again after a poll that reported something, and with a doubling wait up to
    `idle_interval` s while idle. See the module docstring for the contract.

    `busy_interval` may be 0 (a busy loop while there is work); `idle_interval` must be
    > 0, >= `busy_interval` and <= `MAX_IDLE_INTERVAL`. `clock` is for tests. The loop does
    not own the worker: `close()` releases only the loop's wake-up pipe.
    """

    def __init__(
        self,
        worker: Progressable,
        *,
        busy_interval: float = DEFAULT_BUSY_INTERVAL,
        idle_interval: float = DEFAULT_IDLE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.busy_interval = _seconds("busy_interval", busy_interval, allow_zero=True)
        self.idle_interval = _seconds(
            "idle_interval", idle_interval, allow_zero=False, upper=MAX_IDLE_INTERVAL
        )
        if self.idle_interval < self.busy_interval:
            raise ConfigError(
                f"idle_interval ({idle_interval!r} s) must be >= busy_interval "
                f"({busy_interval!r} s)"
            )
        self.worker = worker
        self._clock = clock
        self._rfd, self._wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._waiter = select.poll()
        self._waiter.register(self._rfd, select.POLLIN)
        self._woken = False
        self._idle = False  # the last poll found the worker idle
        self._interval = 0.0  # the wait after the last poll (0: the first poll is due now)
        self._last = clock()  # when the last poll ended
        self.polls = 0  # get_finished() calls made by this loop

    # ---- state ---------------------------------------------------------------------------
    @property
    def interval(self) -> float:
        """The wait planned after the last poll (0, `busy_interval`, or an idle backoff)."""
        return self._interval

    @property
    def idle(self) -> bool:
        """The last poll found the worker idle (the loop is backing off)."""
        return self._idle

    def fileno(self) -> int:
        """Readable after `wake()` until the next `poll()`: select on it with your own fds."""
        if self._rfd < 0:
            raise ValueError("ProgressLoop is closed")
        return self._rfd

    def timeout(self) -> float:
        """Seconds until the next poll is due: 0 after `wake()`, or when work appeared
        (`has_work`) and `busy_interval` has passed since the last poll."""
        if self._woken:
            return 0.0
        interval = self._interval
        if self._idle and interval > self.busy_interval and self.worker.has_work:
            interval = self.busy_interval  # hold()/start_read() since: back to the busy pace
        return max(0.0, self._last + interval - self._clock())

    # ---- driving -------------------------------------------------------------------------
    def wake(self) -> None:
        """New work (from any thread, or a signal handler): poll at once, busy pace again."""
        # the byte first, then the flag: a poll() in between drains the byte but the flag
        # survives it, so a readable fileno() always comes with a due poll
        if self._wfd >= 0:
            # a full pipe means a wake-up is pending anyway
            with contextlib.suppress(BlockingIOError):
                os.write(self._wfd, b"\0")
        self._woken = True

    def poll(self) -> FinishedOutput:
        """Call `worker.get_finished()` now and plan the next wait; returns its output."""
        if self._woken:  # cleared first: a wake() during get_finished() is kept
            self._woken = False
            self._drain()  # (a byte written by a wake() not yet flagged waits for its flag)
        out = self.worker.get_finished()
        self.polls += 1
        if out or out.invalid_block_ids or out.failed:
            self._interval, self._idle = 0.0, False
        elif self.worker.has_work:
            self._interval, self._idle = self.busy_interval, False
        else:
            prev = self._interval if self._idle else max(self.busy_interval, _FIRST_BACKOFF)
            self._interval, self._idle = min(self.idle_interval, 2 * prev), True
        self._last = self._clock()
        return out

    def step(self, max_wait: float | None = None) -> FinishedOutput:
        """Wait until the next poll is due (or `wake()`), at most `max_wait` s, then poll.
        Returns the poll's output, or an empty `FinishedOutput` if `max_wait` ran out first."""
        due_in = self.timeout()
        wait = due_in
        if max_wait is not None:
            wait = min(due_in, _seconds("max_wait", max_wait, allow_zero=True))
        if wait > 0:
            self._wait(wait)
        if wait < due_in and not self._woken and self.timeout() > 0:
            return FinishedOutput()
        return self.poll()

    def _wait(self, seconds: float) -> None:
        """Wait up to `seconds` for a `wake()`."""
        fd = self.fileno()
        if fd < _FD_SETSIZE:  # select waits to the microsecond
            select.select([fd], [], [], seconds)
        else:  # past what select takes (a busy process): poll, in whole milliseconds
            self._waiter.poll(math.ceil(seconds * 1000))

    def _drain(self) -> None:
        if self._rfd < 0:
            return
        with contextlib.suppress(BlockingIOError):
            while os.read(self._rfd, 512):
                pass

    def close(self) -> None:
        """Release the wake-up pipe (not the worker). Do not call `wake()` afterwards."""
        for fd in (self._rfd, self._wfd):
            if fd >= 0:
                os.close(fd)
        self._rfd = self._wfd = -1

    def __enter__(self) -> ProgressLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "DEFAULT_BUSY_INTERVAL",
    "DEFAULT_IDLE_INTERVAL",
    "MAX_IDLE_INTERVAL",
    "ProgressLoop",
    "Progressable",
]
