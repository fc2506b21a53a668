"""Building transfer agents off the step loop, and knowing when a parked agent's own threads
have stopped touching memory.

NIXL's UCX backend with `num_threads > 0` copies on threads of its own: each polls its UCX
worker for as long as it has a piece of a transfer, and sleeps (waiting for work) once it has
none. A READ released while a peer is stopped is dropped by those threads at their next look,
but until then a thread may still be inside a progress call that delivers bytes. `build`
records which threads an agent started (Linux `/proc`), and `threads_quiet` waits until each
of them is seen asleep and not scheduled across a short interval: from then on nothing of
that agent runs unless it is called again.

`Standby` builds the next agent in a background thread, so a retirement swaps in a ready
agent instead of stalling the caller for the agent's construction.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

_TASKS = "/proc/self/task"
# the syscall a copy thread waiting for work sleeps in (futex); None: take every new thread
_FUTEX = {"x86_64": "202", "aarch64": "98"}.get(platform.machine())
BUILDER_NAME = b"kvrdma-agent"  # comm of the building thread; its children inherit it
_PR_SET_NAME = 15
QUIET_SAMPLE_S = 0.002  # a thread not scheduled for this long is waiting, not copying
QUIET_LIMIT_S = 2.0  # longest wait for a retired agent's threads (a stream still arriving)
# one agent constructed at a time, so the threads that appear meanwhile are that agent's
_CONSTRUCTING = threading.Lock()


@dataclass(frozen=True)
class Built(Generic[_T]):
    """An agent and the ids of the copy threads it started (empty: none, or no `/proc`)."""

    agent: _T
    threads: frozenset[int]


def _tids() -> set[int]:
    try:
        return {int(t) for t in os.listdir(_TASKS)}
    except OSError:
        return set()


def _read(tid: int, name: str) -> str | None:
    try:
        with open(f"{_TASKS}/{tid}/{name}") as f:
            return f.read()
    except OSError:  # the thread has ended
        return None


def _name_this_thread() -> None:
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(BUILDER_NAME), 0, 0, 0)


def _copy_threads(new: set[int], expected: int, limit: float = 1.0) -> frozenset[int]:
    """Of the threads started while building, those named after the builder that wait for
    work (the copy threads; the agent's event thread sleeps elsewhere)."""
    mine = {t for t in new if (_read(t, "comm") or "").strip().encode() == BUILDER_NAME}
    end = time.monotonic() + limit
    while True:
        waiting = {
            t for t in mine if _FUTEX is None or (_read(t, "syscall") or "").split(" ")[0] == _FUTEX
        }
        if len(waiting) >= expected or time.monotonic() > end:
            break
        time.sleep(0.001)  # a thread just started may not sleep yet
    if len(waiting) != expected:
        logger.warning(
            "found %d waiting copy threads among %d new ones, expected %d; retiring this "
            "agent may not wait for all of them",
            len(waiting),
            len(new),
            expected,
        )
    return frozenset(waiting)


def build(make: Callable[[], _T], copy_threads: int) -> Built[_T]:
    """Run `make()` in a thread of its own (so the threads it starts can be told apart) and
    return its agent with the ids of its `copy_threads` copy threads."""
    out: list[Built[_T]] = []
    err: list[BaseException] = []

    def run() -> None:
        _name_this_thread()
        with _CONSTRUCTING:
            before = _tids()
            try:
                agent = make()
            except BaseException as exc:
                err.append(exc)
                return
            new = _tids() - before
            threads = _copy_threads(new, copy_threads) if copy_threads else frozenset()
        out.append(Built(agent, threads))

    t = threading.Thread(target=run, name="kvrdma-agent-build", daemon=True)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def _sample(tids: frozenset[int]) -> dict[int, tuple[str, str] | None]:
    """Per thread: its state letter and context-switch counts (None: ended)."""
    out: dict[int, tuple[str, str] | None] = {}
    for t in tids:
        stat, status = _read(t, "stat"), _read(t, "status")
        if stat is None or status is None:
            out[t] = None
            continue
        state = stat.rsplit(")", 1)[1].split()[0]
        switches = "".join(line for line in status.splitlines() if "ctxt_switches" in line)
        out[t] = (state, switches)
    return out


def threads_quiet(tids: frozenset[int], limit: float = QUIET_LIMIT_S) -> bool:
    """Wait until each thread in `tids` is asleep and was not scheduled during a sample
    interval (or has ended); False if that was not seen within `limit` seconds."""
    if not tids:
        return True
    end = time.monotonic() + limit
    before = _sample(tids)
    while True:
        time.sleep(QUIET_SAMPLE_S)
        after = _sample(tids)
        busy = [t for t in tids if (a := after[t]) is not None and (a != before[t] or a[0] != "S")]
        if not busy:
            return True
        if time.monotonic() > end:
            logger.warning("threads %s still running after %.1fs", sorted(busy), limit)
            return False
        before = after


class Standby(Generic[_T]):
    """One agent built ahead in a background thread, then `load`ed (its peers: the part
    that waits on the network); `also()` applies more work to it (peers added since),
    `take()` hands over what `load` returned, `abandon()` gives it up without waiting."""

    def __init__(
        self, make: Callable[[], Any], copy_threads: int, load: Callable[[Any], _T]
    ) -> None:
        self._result: Built[_T] | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._dispose: Callable[[_T], None] | None = None
        self._more: list[Callable[[_T], None]] = []  # for the building thread, once loaded
        self._thread = threading.Thread(
            target=self._run, args=(make, copy_threads, load), name="kvrdma-standby", daemon=True
        )
        self._thread.start()

    def _run(self, make: Callable[[], Any], copy_threads: int, load: Callable[[Any], _T]) -> None:
        try:
            built = build(make, copy_threads)
            result = Built(load(built.agent), built.threads)
        except BaseException as exc:  # handed to take()
            self._error = exc
            return
        while True:
            with self._lock:
                dispose, more, self._more = self._dispose, self._more, []
                if dispose is None and not more:
                    self._result = result
                    return
            if dispose is not None:
                _dispose(dispose, result.agent)
                return
            for fn in more:
                fn(result.agent)

    @property
    def ready(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the build to end; whether it has."""
        self._thread.join(timeout)
        return self.ready

    def take(self, timeout: float) -> Built[_T]:
        """The agent (waiting up to `timeout` s for the build); raises what the build
        raised, or `TimeoutError`."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the standby agent was not built within {timeout:.0f}s")
        if self._error is not None:
            raise self._error
        result, self._result = self._result, None
        if result is None:
            raise RuntimeError("the standby agent was already taken")
        return result

    def also(self, fn: Callable[[_T], None]) -> None:
        """Apply `fn` to what `load` returned: now if the standby is ready and not taken,
        else on the building thread before it becomes ready; never once it is abandoned.
        Called from the thread that takes the standby (`fn` must not raise)."""
        with self._lock:
            if self._dispose is not None or self._error is not None:
                return
            if self._result is None:
                if self._thread.is_alive():
                    self._more.append(fn)
                return
            result = self._result
        fn(result.agent)

    def abandon(self, dispose: Callable[[_T], None]) -> None:
        """Give the agent up: `dispose(agent)` runs now if it is built, else on the
        building thread once it is (a build stuck connecting to a peer holds no one up)."""
        with self._lock:
            self._dispose = dispose
            result, self._result = self._result, None
        if result is not None:
            _dispose(dispose, result.agent)


def _dispose(dispose: Callable[[_T], None], agent: _T) -> None:
    try:
        dispose(agent)
    except Exception as exc:  # nothing waits for it: log and go on
        logger.warning("disposing of an abandoned standby agent: %s", exc)
