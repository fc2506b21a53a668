"""The target process of every benchmark: it owns producer workers and plain agents, answers
handshakes, and keeps progressing its agents as a serving worker does between steps.

NIXL runs without a progress thread (kvrdma's default), so the target must keep calling
`get_notifs` (via `Worker.get_finished`) or wire-up never completes. The loop waits for a
command up to `wait` seconds (select on the pipe), then progresses every agent once;
`wait=0` is a busy loop. `set_loop(adaptive=True)` drives each producer worker with kvrdma's
`ProgressLoop` instead. Commands arrive as `(name, kwargs)`, answered `("ok", value)` or
`("err", text)`.
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

from benchmarks import harness as h


class _Peer:
    def __init__(self, conn: Connection, wait: float) -> None:
        self.conn, self.wait = conn, wait
        self.workers: dict[str, Any] = {}  # key -> kvrdma Worker
        self.backends: dict[str, Any] = {}  # key -> NixlBackend (plain agents)
        self.keep: dict[str, Any] = {}  # key -> caches / buffers that must outlive the agent
        self.echo: set[str] = set()
        self.server: Any = None
        self.stopped = False
        self.adaptive = False
        self.loops: dict[str, Any] = {}  # key -> ProgressLoop (adaptive mode)

    def _loop(self, key: str) -> Any:
        if key not in self.loops:
            from kvrdma.progress import ProgressLoop

            self.loops[key] = ProgressLoop(self.workers[key])
        return self.loops[key]

    def timeout(self) -> float:
        """How long the loop may wait: `wait`, or (adaptive) until the next poll is due."""
        if not self.adaptive:
            return self.wait
        due = [self._loop(k).timeout() for k in self.workers]
        return min([*due, self.wait] if self.backends else due, default=self.wait)

    def progress(self, force: bool = False) -> None:
        for key, w in self.workers.items():
            if not self.adaptive or force:
                w.get_finished()
            elif self._loop(key).timeout() == 0:
                self._loop(key).poll()
        for key, b in self.backends.items():
            notifs = b.get_notifs()
            if key in self.echo:
                for sender, msgs in notifs.items():
                    for m in msgs:
                        b.send_notif(sender, m)

    def run(self) -> None:
        fd = self.conn.fileno()
        while not self.stopped:
            if select.select([fd], [], [], self.timeout())[0]:
                try:
                    cmd, kw = self.conn.recv()
                except EOFError:
                    return
                try:
                    self.conn.send(("ok", getattr(self, f"cmd_{cmd}")(**kw)))
                except Exception:
                    self.conn.send(("err", traceback.format_exc(limit=8)))
            self.progress()

    def cmd_ping(self) -> str:
        return "pong"

    def cmd_stop(self) -> None:
        self.stopped = True

    def cmd_set_wait(self, wait: float) -> float:
        old, self.wait = self.wait, wait
        return old

    def cmd_set_loop(self, adaptive: bool) -> None:
        """Drive workers with `ProgressLoop` (its defaults) or the fixed `wait` loop."""
        for loop in self.loops.values():
            loop.close()
        self.loops.clear()
        self.adaptive = adaptive

    def cmd_make_worker(
        self,
        key: str,
        engine_id: str,
        geom: h.Geometry,
        touch: bool = True,
        fill: bool = True,
        **kw: Any,
    ) -> dict[str, Any]:
        """A producer worker over fresh caches (pattern-filled unless `fill=False`); `kw`
        goes to `new_worker` (tp_rank, tp_size, total_heads, extra)."""
        caches = h.make_caches(geom, touch=touch and not fill)
        if fill:
            h.fill_pattern(geom, caches)
        self.workers[key] = w = h.new_worker("P", engine_id, geom, caches, **kw)
        self.keep[key] = caches
        huge = h.huge_page_fraction(caches.values()) if touch or fill else None
        return {"meta": w.metadata, "huge_page_fraction": huge}

    def cmd_make_backend(
        self,
        key: str,
        progress_thread: bool = False,
        pthr_delay_us: int | None = None,
        buffer_bytes: int = 0,
        echo: bool = False,
    ) -> dict[str, Any]:
        """A plain NixlBackend, optionally with a registered buffer of ones."""
        import numpy as np
        import torch

        from kvrdma.nixl import BackendConfig, MemType, NixlBackend

        if echo:
            self.echo.add(key)
        with h.nixl_progress_delay(pthr_delay_us):
            cfg = BackendConfig(name=h.agent_name(f"echo-{key}"), progress_thread=progress_thread)
            self.backends[key] = b = NixlBackend(cfg)
        addr = 0
        if buffer_bytes:
            buf = torch.ones(buffer_bytes, dtype=torch.uint8)
            table = np.array([(buf.data_ptr(), buffer_bytes, 0)], dtype=np.uint64)
            self.keep[key] = (buf, b.register(table, MemType.DRAM))
            addr = buf.data_ptr()
        return {"metadata": b.metadata(), "addr": addr}

    def cmd_add_remote(self, key: str, metadata: bytes) -> str:
        w = self.workers.get(key)
        return str((w.backend if w is not None else self.backends[key]).add_remote(metadata))

    def cmd_close(self, key: str) -> None:
        if (loop := self.loops.pop(key, None)) is not None:
            loop.close()
        if (w := self.workers.pop(key, None)) is not None:
            w.close()
        if (b := self.backends.pop(key, None)) is not None:
            b.close()  # releases the registration kept in self.keep too
        self.keep.pop(key, None)
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
        """Run the loop `seconds` with nothing to do: own CPU seconds per wall second, loops
        run, and one progress call's CPU alone. `progress=False`: only wait. Adaptive loops
        first back off to their idle interval (not measured): an idle worker's steady state."""
        adaptive = progress and self.adaptive and bool(self.workers)
        if adaptive:
            t, loops = time.monotonic(), [self._loop(k) for k in self.workers]
            while time.monotonic() - t < 5.0 and not all(
                lp.idle and lp.interval >= lp.idle_interval for lp in loops
            ):
                self._idle_step()
        polls0 = sum(lp.polls for lp in self.loops.values())
        c0, t0, n = h.cpu_seconds(), time.monotonic(), 0
        while time.monotonic() - t0 < seconds:
            if adaptive:
                self._idle_step()
            else:
                time.sleep(self.wait)  # the parent waits for our answer: nothing arrives
                if progress:
                    self.progress()
            n += 1
        wall, cpu = time.monotonic() - t0, h.cpu_seconds() - c0
        if adaptive:  # get_finished() calls, not wake-ups
            n = sum(lp.polls for lp in self.loops.values()) - polls0
        reps, c1 = (2000 if progress else 0), h.cpu_seconds()
        for _ in range(reps):
            self.progress(force=True)
        per_call = (h.cpu_seconds() - c1) / reps if reps else 0.0
        return {"cpu_per_wall": cpu / wall, "wall": wall, "loops": n, "progress_cpu_s": per_call}

    def _idle_step(self) -> None:
        """One adaptive iteration: wait on the loops' wake-up fds until a poll is due."""
        select.select([lp.fileno() for lp in self.loops.values()], [], [], self.timeout())
        self.progress()


def serve(conn: Connection, wait: float) -> None:
    """Process entry point (multiprocessing "spawn")."""
    h.die_with_parent()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    logging.basicConfig(level=logging.ERROR)
    p = _Peer(conn, wait)
    try:
        p.run()
    finally:
        with contextlib.suppress(Exception):
            p.cmd_close_all()
        conn.close()
