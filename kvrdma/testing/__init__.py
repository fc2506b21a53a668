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
import random
import signal
import socket
import time
from pathlib import Path

from kvrdma.testing.metadata import worker_metadata
from kvrdma.testing.ucx import nvidia_gpu_present, tcp_only

__all__ = [
    "die_with_parent",
    "free_port",
    "nvidia_gpu_present",
    "stop_process",
    "tcp_only",
    "worker_metadata",
]

_HANDED_OUT: set[int] = set()


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent dies (Linux), so a crashed test or
    benchmark leaves no orphan holding NIXL agents and ports; a no-op elsewhere."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port(low: int = 20000, high: int = 32000) -> int:
    """A port in `low..high` that is free now and not handed out before by this process.

    The range lies below Linux's ephemeral ports: NIXL and UCX take ephemeral ports while an
    engine starts, and one of them could take a port handed out from that range before the
    engine binds it (vLLM's NixlConnector then waits forever for its listener).
    """
    for _ in range(200):
        port = random.randint(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {low}..{high}")


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
