"""A decoder whose read failed because its producer died closes cleanly (real NIXL, producer
and decoder in child processes).

With UCX copy threads a READ from a producer killed just before it (the connection's warm-up
round, one piece per copy thread) fails on one thread; NIXL then ends the other threads'
pieces without progressing their UCX workers, and the cma copies left queued there made UCX
abort the decoder (SIGABRT, `ucs_arbiter_group_is_empty`) when `close()` destroyed the agent."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from kvrdma.testing.synthetic import CacheSpec, ModelShape
from tests.integration.worker_pair import local_worker

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

pytest.importorskip("nixl")

SPEC = CacheSpec(
    ModelShape(num_layers=2, num_kv_heads=4, head_dim=8), "split_kv", "HND", 0, 1, 16, 64
)
BLOCKS = list(range(64))
# producers killed per test: one attempt does not abort a decoder without the fix every time
ATTEMPTS = 3


def serve(conn: Connection, extra: dict[str, Any]) -> None:
    """P: holds every block for "r" and serves it until killed."""
    p, _ = local_worker(SPEC, "P", "kv_producer", time.monotonic, **extra)
    p.hold("r", BLOCKS)
    conn.send(p.metadata)
    while True:  # a reader's connection is wired up only while its target progresses
        p.get_finished()
        time.sleep(0.001)


def read_then_close(conn: Connection, extra: dict[str, Any], attempts: int) -> list[str]:
    """D, `attempts` times: connect to the P whose metadata arrives, read every block once P
    was killed, send how the read ended, close, send "closed". Returns the outcomes."""
    outcomes: list[str] = []
    for _ in range(attempts):
        d, _ = local_worker(SPEC, "D", "kv_consumer", time.monotonic, **extra)
        d.add_remote({0: conn.recv()})
        conn.send("connected")
        assert conn.recv() == "killed"
        d.start_read("r", BLOCKS, BLOCKS, "P")
        ends = time.monotonic() + 10.0
        while "r" not in (out := d.get_finished()).finished_recving:
            assert time.monotonic() < ends, "the read was not reported within 10 s"
            time.sleep(0.001)
        failure = out.failures.get("r")
        outcomes.append(failure.outcome.value if failure is not None else "ok")
        conn.send(outcomes[-1])
        d.close()
        conn.send("closed")
    return outcomes


def _closed(d: Any) -> str:
    """D's next message, "closed"; or, if D died instead, its exit code (-6: SIGABRT)."""
    try:
        return str(d.recv(timeout=30))
    except AssertionError:  # the child is gone (conftest's ChildError)
        d.process.join(5)
        return f"exit code {d.process.exitcode}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", [{}, {"num_threads": 4}], ids=["default-threads", "threads4"])
def test_a_decoder_closes_cleanly_after_its_producer_died_before_a_read(
    spawn_child: Callable[..., Any], extra: dict[str, Any]
) -> None:
    d = spawn_child(read_then_close, extra, ATTEMPTS, deadline=100.0)
    for i in range(ATTEMPTS):
        p = spawn_child(serve, extra, deadline=60.0)
        d.send(p.recv(timeout=30))
        assert d.recv(timeout=30) == "connected"
        p.kill()
        d.send("killed")
        assert d.recv(timeout=30) == "peer_lost"
        closed = _closed(d)
        assert closed == "closed", f"attempt {i}: the decoder's close() ended it ({closed})"
    assert d.result(timeout=30) == ["peer_lost"] * ATTEMPTS
    assert d.process.exitcode == 0
