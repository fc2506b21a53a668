"""Helpers for tests, benchmarks and the demo: things a harness driving real kvrdma
processes needs and a serving engine never does (the runtime never imports this package).

`kvrdma.testing.synthetic` holds the pattern-filled caches; it imports torch, so it is a
submodule of its own rather than part of this light import. `netns` builds "hosts" out of
network namespaces (`kvrdma demo --hosts N`, tests/integration/test_netns.py); `sidecar` runs
`kvrdma agent` on one of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from pathlib import Path

from kvrdma.testing.metadata import worker_metadata
from kvrdma.testing.ucx import nvidia_gpu_present, tcp_only

__all__ = ["die_with_parent", "nvidia_gpu_present", "stop_process", "tcp_only", "worker_metadata"]


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent dies (Linux), so a crashed test or
    benchmark leaves no orphan holding NIXL agents and ports; a no-op elsewhere."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _thread_states(pid: int) -> list[str] | None:
    """The scheduler state letter of each of `pid`'s threads, or None where /proc is absent."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return None
    states = []
    for task in tasks.iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        states.append(stat[stat.rindex(")") + 2])
    return states


def stop_process(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP `pid` and return once every one of its threads has stopped.

    `kill()` only marks the stop: each thread stops when it next runs in the kernel, so on a
    loaded host a thread already running can still serve a peer's READ after `kill()` returns.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = _thread_states(pid)
        if states is None:
            return  # no /proc to watch: the signal is all we can do
        if all(s in "TtZX" for s in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"process {pid} did not stop within {timeout:g} s (thread states {states})"
            )
        time.sleep(0.001)
