"""The parent's handle on the demo's rank processes: start, wait for ready, stop and reap.

Each rank is an entry `(process, pipe, role, rank)` in one shared list, so a restarted rank
replaces its entry in place and every holder of the list sees it.
"""

from __future__ import annotations

import contextlib
import os
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from kvrdma.cli.demo.faults import FaultPlan
from kvrdma.cli.demo.rank_process import ProcSpec, run_rank
from kvrdma.cli.demo.report import Summary
from kvrdma.errors import KvrdmaError

Procs = list[tuple[Any, Connection, str, int]]


def spawn_rank(ctx: Any, procs: Procs, spec: ProcSpec, env: dict[str, str]) -> None:
    """Start one rank process with `env` added to its environment; it replaces any entry of
    the same role and rank in `procs`."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=run_rank, args=(spec, child), name=f"kvrdma-{spec.role}{spec.rank}")
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        proc.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    child.close()
    procs[:] = [e for e in procs if not (e[2] == spec.role and e[3] == spec.rank)]
    procs.append((proc, parent, spec.role, spec.rank))


def linger(procs: Procs, seconds: float) -> None:
    """Keep the ranks up (their metrics scrapeable) for a while after the run."""
    end = time.monotonic() + seconds
    live: list[Any] = [c for p, c, _, _ in procs if p.is_alive()]
    while time.monotonic() < end:
        ready: list[Any] = wait(live, timeout=0.5)
        for conn in ready:
            try:
                conn.recv()  # late reports are not needed any more
            except (OSError, EOFError):
                live.remove(conn)


def stop_all(procs: Procs, fault: FaultPlan | None) -> None:
    """Ask every rank to stop, collect producer stats, and reap (kill if it will not go)."""
    for _, conn, _, _ in procs:
        with contextlib.suppress(OSError, EOFError, ValueError):
            conn.send(("stop",))
    end = time.monotonic() + 5
    # every producer's stats before any join: a rank tearing down its agent takes a while
    for proc, conn, role, rank in procs:
        while role == "P" and time.monotonic() < end:
            try:
                if not conn.poll(0.1):
                    if not proc.is_alive():
                        break
                    continue
                msg = conn.recv()
            except (OSError, EOFError, ValueError):
                break
            if msg[0] == "stats":
                if fault:
                    fault.producer_stats[rank] = (msg[3], msg[4], msg[5])
                break
    end = time.monotonic() + 5
    for proc, conn, _, _ in procs:
        proc.join(timeout=max(0.1, end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2)
        conn.close()


def await_ready(procs: Procs, role: str, summary: Summary, deadline: float) -> None:
    waiting = {(r, k): c for _, c, r, k in procs if r == role}
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise KvrdmaError(f"{role} ranks {sorted(k for _, k in waiting)} not ready in time")
        for conn in wait(list(waiting.values()), timeout=min(left, 1.0)):
            msg = recv(conn, procs)
            if msg[0] == "error":
                raise KvrdmaError(f"{msg[1]} rank {msg[2]} failed to start: {msg[3]}\n{msg[4]}")
            if msg[0] == "ready":
                waiting.pop((msg[1], msg[2]), None)
                if len(msg) > 5 and msg[5]:
                    summary.endpoints.append(msg[5])
                if msg[4]:
                    summary.handshake_ms.append(msg[4])
        check_alive(procs)


def recv(conn: Any, procs: Procs) -> tuple[Any, ...]:
    try:
        msg: tuple[Any, ...] = conn.recv()
        return msg
    except (EOFError, OSError):
        who = next((f"{r}{k}" for _, c, r, k in procs if c is conn), "?")
        raise KvrdmaError(f"rank process {who} exited unexpectedly") from None


def check_alive(procs: Procs) -> None:
    for proc, _, role, rank in procs:
        if not proc.is_alive():
            raise KvrdmaError(f"{role} rank {rank} died (exit code {proc.exitcode})")
