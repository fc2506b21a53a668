"""The target side of every benchmark: one process that owns producer workers and plain
agents, answers handshakes, and keeps progressing its agents.

NIXL runs without a progress thread here (kvrdma's default), so a target must keep calling
`get_notifs` (via `Worker.get_finished`) or wire-up never completes. The loop does exactly
what a serving worker does between steps: wait for a command up to `wait` seconds
(`Connection.poll`, a blocking select), then progress every agent once. `wait=0` is a busy
loop (lowest notification latency, a full core). `set_loop(adaptive=True)` drives each
producer worker with kvrdma's `ProgressLoop` instead (busy pace while it holds blocks, backing
off while idle); plain agents keep the `wait` cadence.

Commands arrive as `(name, kwargs)` and are answered `("ok", value)` or `("err", text)`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from benchmarks._common import (
    COMPAT,
    Geometry,
    agent_name,
    cpu_seconds,
    die_with_parent,
    fill_pattern,
    huge_page_fraction,
    make_caches,
    new_worker,
    nixl_progress_delay,
)


class _Peer:
    def __init__(self, conn: Connection, wait: float) -> None:
        self.conn = conn
        self.wait = wait
        self.workers: dict[str, Any] = {}  # key -> kvrdma Worker
        self.caches: dict[str, Any] = {}
        self.backends: dict[str, Any] = {}  # key -> NixlBackend (echo agents)
        self.echo: set[str] = set()
        self.server: Any = None
        self.sent: dict[str, set[str]] = {}  # key -> requests the readers notified as done
        self.sent_at: dict[str, dict[str, float]] = {}  # key -> request -> time.monotonic()
        self.stopped = False
        self.adaptive = False  # drive workers with kvrdma.progress.ProgressLoop
        self.loop_kw: dict[str, float] = {}  # its busy_interval / idle_interval
        self.loops: dict[str, Any] = {}  # key -> ProgressLoop (adaptive mode)

    # ---- the loop ------------------------------------------------------------------------
    def _loop(self, key: str) -> Any:
        loop = self.loops.get(key)
        if loop is None:
            from kvrdma.progress import ProgressLoop

            loop = self.loops[key] = ProgressLoop(self.workers[key], **self.loop_kw)
        return loop

    def _record(self, key: str, sent: set[str]) -> None:
        if sent:
            self.sent.setdefault(key, set()).update(sent)
            now = time.monotonic()
            self.sent_at.setdefault(key, {}).update(dict.fromkeys(sent, now))

    def timeout(self) -> float:
        """How long the loop may wait: `wait`, or (adaptive) until the next poll is due."""
        if not self.adaptive:
            return self.wait
        due = [self._loop(k).timeout() for k in self.workers]
        if self.backends:
            due.append(self.wait)
        return min(due, default=self.wait)

    def progress(self, force: bool = False) -> None:
        """Progress every agent once (adaptive: the workers whose poll is due, or all)."""
        for key, w in self.workers.items():
            if self.adaptive and not force:
                loop = self._loop(key)
                if loop.timeout() == 0:
                    self._record(key, loop.poll().finished_sending)
            else:
                self._record(key, w.get_finished().finished_sending)
        for key, b in self.backends.items():
            notifs = b.get_notifs()
            if key in self.echo:
                for sender, msgs in notifs.items():
                    for m in msgs:
                        b.send_notif(sender, m)

    def run(self) -> None:
        fd = self.conn.fileno()
        while not self.stopped:
            # select() on the pipe: a cheaper wait than Connection.poll (~13 vs ~30 µs CPU)
            ready, _, _ = select.select([fd], [], [], self.timeout())
            if ready:
                try:
                    cmd, kw = self.conn.recv()
                except EOFError:
                    return
                try:
                    value = getattr(self, f"cmd_{cmd}")(**kw)
                    self.conn.send(("ok", value))
                except Exception:
                    self.conn.send(("err", traceback.format_exc(limit=8)))
            self.progress()

    # ---- commands ----------------------------------------------------------------------
    def cmd_ping(self) -> str:
        return "pong"

    def cmd_stop(self) -> None:
        self.stopped = True

    def cmd_set_wait(self, wait: float) -> float:
        old, self.wait = self.wait, wait
        return old

    def cmd_set_loop(
        self,
        adaptive: bool,
        busy_interval: float | None = None,
        idle_interval: float | None = None,
    ) -> dict[str, Any]:
        """Drive workers with `ProgressLoop` (None: its defaults) or the fixed `wait` loop;
        returns the old settings (pass them back as keywords to restore)."""
        old = {"adaptive": self.adaptive, **self.loop_kw}
        for loop in self.loops.values():
            loop.close()
        self.loops.clear()
        self.adaptive = adaptive
        kw = {"busy_interval": busy_interval, "idle_interval": idle_interval}
        self.loop_kw = {k: v for k, v in kw.items() if v is not None}
        return old

    def cmd_make_worker(
        self,
        key: str,
        engine_id: str,
        geom: Geometry,
        tp_rank: int = 0,
        tp_size: int = 1,
        total_heads: int | None = None,
        touch: bool = True,
        fill: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        t0 = time.perf_counter()
        caches = make_caches(geom, touch=touch and not fill)
        if fill:
            fill_pattern(geom, caches)
        t1 = time.perf_counter()
        w = new_worker(
            "P",
            engine_id,
            geom,
            caches,
            tp_rank=tp_rank,
            tp_size=tp_size,
            total_heads=total_heads,
            extra=extra,
        )
        self.workers[key] = w
        self.caches[key] = caches
        return {
            "meta": w.metadata,
            "huge_page_fraction": huge_page_fraction(caches.values()) if touch or fill else None,
            "alloc_seconds": t1 - t0,
            "register_seconds": time.perf_counter() - t1,
        }

    def cmd_make_backend(
        self,
        key: str,
        progress_thread: bool = False,
        num_threads: int = 0,
        pthr_delay_us: int | None = None,
        buffer_bytes: int = 0,
    ) -> dict[str, Any]:
        """A plain NixlBackend (optionally with a registered, filled buffer)."""
        import numpy as np
        import torch

        from kvrdma.backend import BackendConfig, MemType
        from kvrdma.nixl_backend import NixlBackend

        with nixl_progress_delay(pthr_delay_us):
            b = NixlBackend(
                BackendConfig(
                    name=agent_name(f"echo-{key}"),
                    progress_thread=progress_thread,
                    num_threads=num_threads,
                )
            )
        self.backends[key] = b
        addr = 0
        if buffer_bytes:
            buf = torch.ones(buffer_bytes, dtype=torch.uint8)
            table = np.array([(buf.data_ptr(), buffer_bytes, 0)], dtype=np.uint64)
            self.caches[key] = (buf, b.register(table, MemType.DRAM))
            addr = buf.data_ptr()
        return {"metadata": b.metadata(), "addr": addr}

    def cmd_add_remote(self, key: str, metadata: bytes) -> str:
        obj = self.workers.get(key)
        backend = obj.backend if obj is not None else self.backends[key]
        return str(backend.add_remote(metadata))

    def cmd_echo(self, key: str, on: bool = True) -> None:
        (self.echo.add if on else self.echo.discard)(key)

    def cmd_close(self, key: str) -> None:
        loop = self.loops.pop(key, None)
        if loop is not None:
            loop.close()
        w = self.workers.pop(key, None)
        if w is not None:
            w.close()
        b = self.backends.pop(key, None)
        if b is not None:
            b.close()  # releases the registration kept in self.caches too
        self.caches.pop(key, None)
        self.echo.discard(key)

    def cmd_close_all(self) -> None:
        for key in [*self.workers, *self.backends]:
            self.cmd_close(key)
        self.cmd_handshake_stop()

    def cmd_handshake_start(self, keys: list[str]) -> int:
        from kvrdma.handshake import HandshakeServer

        self.cmd_handshake_stop()
        self.server = HandshakeServer("127.0.0.1", 0)
        for k in keys:
            self.server.publish(self.workers[k].metadata)
        return int(self.server.port)

    def cmd_handshake_stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def cmd_idle(self, seconds: float, progress: bool = True) -> dict[str, float]:
        """Run the loop for `seconds` with nothing to do; own CPU seconds per wall second.
        `progress=False`: only wait (an agent nobody polls). Adaptive loops first back off to
        their idle interval (`ramp_s`, not measured): an idle worker's steady state."""
        adaptive = progress and self.adaptive and bool(self.workers)
        ramp = 0.0
        if adaptive:
            t = time.monotonic()
            loops = [self._loop(k) for k in self.workers]
            while time.monotonic() - t < 5.0 and not all(
                lp.idle and lp.interval >= lp.idle_interval for lp in loops
            ):
                self._idle_step()
            ramp = time.monotonic() - t
        polls0 = sum(lp.polls for lp in self.loops.values())
        c0, t0 = cpu_seconds(), time.monotonic()
        loops_run = 0
        while time.monotonic() - t0 < seconds:
            if adaptive:
                self._idle_step()
            else:
                time.sleep(self.wait)  # the parent is blocked on our answer: nothing arrives
                if progress:
                    self.progress()
            loops_run += 1
        wall = time.monotonic() - t0
        cpu = cpu_seconds() - c0
        if adaptive:  # get_finished() calls, not wake-ups
            loops_run = sum(lp.polls for lp in self.loops.values()) - polls0
        # the progress call alone, back to back: kvrdma's share of each loop
        n = 2000 if progress else 0
        c1 = cpu_seconds()
        for _ in range(n):
            self.progress(force=True)
        per_call = (cpu_seconds() - c1) / n if n else 0.0
        return {
            "cpu_per_wall": cpu / wall,
            "wall": wall,
            "loops": loops_run,
            "progress_cpu_s": per_call,
            "ramp_s": ramp,
        }

    def _idle_step(self) -> None:
        """One adaptive iteration as a serving loop does it: wait on the loops' wake-up fds
        until the next poll is due, then poll the due ones."""
        fds = [lp.fileno() for lp in self.loops.values()]
        select.select(fds, [], [], self.timeout())
        self.progress()

    def cmd_hold(self, key: str, request_id: str, block_ids: list[int]) -> None:
        self.workers[key].hold(request_id, block_ids)

    def cmd_sent(self, key: str) -> list[str]:
        """Requests whose blocks were freed because every reader notified (then forgets)."""
        self.sent_at.pop(key, None)
        return sorted(self.sent.pop(key, set()))

    def cmd_sent_at(self, key: str) -> dict[str, float]:
        """Like `sent`, with when (`time.monotonic()`, comparable across processes on
        Linux) this process saw each request finished."""
        self.sent.pop(key, None)
        return self.sent_at.pop(key, {})

    def cmd_ledger(self, key: str) -> dict[str, int]:
        c = self.workers[key].producer.ledger.counters
        return {k: int(v) for k, v in vars(c).items() if isinstance(v, int)}


def serve(conn: Connection, wait: float) -> None:
    """Process entry point (multiprocessing "spawn")."""
    die_with_parent()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    logging.basicConfig(level=logging.ERROR)
    p = _Peer(conn, wait)
    try:
        p.run()
    finally:
        with contextlib.suppress(Exception):
            p.cmd_close_all()
        conn.close()


__all__ = ["COMPAT", "serve"]
