"""Generic integration fixtures: functions run in child processes that are always reaped.

`spawn_child(target, *args, deadline=30.0)` starts `target(conn, *args)` in a fresh process
(multiprocessing "spawn": no inherited NIXL/UCX/ZMQ state) and returns a `Child`. `conn` is
the child's end of a duplex pipe; the test talks to it with `child.send(obj)` and
`child.recv(timeout)`, which fails the test instead of hanging when the child is silent or
dead, and re-raises the child's exception text. What `target` returns arrives as
`child.result(timeout)`. A child cannot outlive its deadline (SIGALRM) or the test process
(PR_SET_PDEATHSIG), and every child is killed and joined at teardown.

`target` must be importable by the child (a module-level function of a test module: the
child inherits `sys.path`), and messages must pickle without this conftest.

`ctx` is a ZMQ context destroyed at teardown; `agent` a `kvrdma agent` process
(`sidecar_helpers.Agent`) started with the flags the `agent_args` fixture returns (none unless
a test module overrides it) and killed at teardown.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import runpy
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import zmq

from kvrdma.testing import die_with_parent

if TYPE_CHECKING:
    from tests.integration.sidecar_helpers import Agent


class ChildError(AssertionError):
    """The child process died, raised, or stayed silent past a timeout."""


# Plain tuples on the wire: this file is imported as "conftest", a name other conftest.py
# files share, so nothing defined here may be pickled by reference.
_RETURNED = "__spawn_child_returned__"
_RAISED = "__spawn_child_raised__"
_CHILD_RUN_NAME = "__spawn_child_main__"


def _child_main(
    target: Callable[..., Any], conn: Connection, deadline: float, args: tuple[Any, ...]
) -> None:
    die_with_parent()
    signal.alarm(max(1, math.ceil(deadline)))  # default action: terminate
    try:
        value = target(conn, *args)
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send((_RAISED, traceback.format_exc()))
        raise
    with contextlib.suppress(Exception):
        conn.send((_RETURNED, value))


def _tag(msg: Any) -> Any:
    return msg[0] if isinstance(msg, tuple) and len(msg) == 2 else None


class Child:
    """A running child process and the parent's end of its pipe."""

    def __init__(self, name: str, process: BaseProcess, conn: Connection) -> None:
        self.name = name
        self.process = process
        self.conn = conn

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def send(self, obj: Any) -> None:
        self.conn.send(obj)

    def _next(self, timeout: float) -> Any:
        end = time.monotonic() + timeout
        while not self.conn.poll(min(0.05, max(0.0, end - time.monotonic()))):
            if not self.process.is_alive() and not self.conn.poll(0):
                raise ChildError(
                    f"child {self.name!r} exited ({self.process.exitcode}) with nothing more to say"
                )
            if time.monotonic() >= end:
                raise ChildError(f"child {self.name!r} sent nothing within {timeout:.1f}s")
        try:
            msg = self.conn.recv()
        except EOFError:
            self.process.join(2)
            raise ChildError(
                f"child {self.name!r} exited ({self.process.exitcode}) with nothing more to say"
            ) from None
        if _tag(msg) == _RAISED:
            raise ChildError(f"child {self.name!r} raised:\n{msg[1]}")
        return msg

    def recv(self, timeout: float = 10.0) -> Any:
        """The child's next message; fails if it raised, died, or sent nothing in time."""
        msg = self._next(timeout)
        if _tag(msg) == _RETURNED:
            raise ChildError(f"child {self.name!r} returned {msg[1]!r}, expected a message")
        return msg

    def result(self, timeout: float = 10.0) -> Any:
        """What `target` returned (messages sent before it are dropped); then reap the child."""
        end = time.monotonic() + timeout
        while _tag(msg := self._next(max(0.0, end - time.monotonic()))) != _RETURNED:
            pass
        self.process.join(max(0.1, end - time.monotonic()))
        return msg[1]

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.process.join(5)

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; always joined and the pipe closed."""
        if self.process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)  # a stopped child cannot handle SIGTERM
            self.process.terminate()
            self.process.join(grace)
        self.kill()
        self.conn.close()


@pytest.fixture
def spawn_child() -> Iterator[Callable[..., Child]]:
    """`spawn_child(target, *args, deadline=30.0, name=None) -> Child`; reaped at teardown."""
    ctx = mp.get_context("spawn")
    children: list[Child] = []

    def start(
        target: Callable[..., Any], *args: Any, deadline: float = 30.0, name: str | None = None
    ) -> Child:
        parent_end, child_end = ctx.Pipe()
        # The child runs this file afresh (runpy) rather than unpickling `_child_main` from
        # a module called "conftest", which may be another directory's conftest.py.
        proc = ctx.Process(
            target=runpy.run_path,
            args=(os.path.abspath(__file__),),
            kwargs={
                "run_name": _CHILD_RUN_NAME,
                "init_globals": {"_CHILD_ARGS": (target, child_end, deadline, args)},
            },
            name=name or target.__name__,
            daemon=True,
        )
        proc.start()
        child_end.close()
        child = Child(proc.name, proc, parent_end)
        children.append(child)
        return child

    try:
        yield start
    finally:
        for child in children:
            child.stop()


if __name__ == _CHILD_RUN_NAME:  # this file, run by runpy in a child of `spawn_child`
    _child_main(*globals()["_CHILD_ARGS"])


@pytest.fixture(scope="session")
def rank_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """4 P and 4 D long-lived rank hosts (`rank_host.HostPool`), started once per session and
    always stopped (killed and joined) at its end. Their logs are under the session's tmp."""
    from rank_host import host_pool

    with host_pool(4, 4, tmp_path_factory.mktemp("rank-hosts")) as pool:
        yield pool


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def agent_args() -> tuple[str, ...]:
    """Flags the `agent` fixture adds to `Agent`'s own; a test module overrides it."""
    return ()


@pytest.fixture
def agent(tmp_path: Path, agent_args: tuple[str, ...]) -> Iterator[Agent]:
    # Imported here: the children of `spawn_child` run this file and need none of it.
    from tests.integration.sidecar_helpers import Agent

    a = Agent(tmp_path, *agent_args)
    yield a
    a.stop()
