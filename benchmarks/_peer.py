"""The target process and its client (`Peer`): producer workers and plain agents progressed
as a serving worker progresses them between steps (NIXL has no progress thread by kvrdma's
default, so without these calls wire-up never completes). The loop waits up to `wait` seconds
for a command, then progresses every agent once, or (`adaptive`) drives each worker with
`ProgressLoop`. Commands arrive as `(name, kwargs)`, answered `("ok", value)` or `("err", text)`."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import resource
import select
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from benchmarks import harness as h
from kvrdma.handshake import HandshakeServer
from kvrdma.nixl import BackendConfig, MemType, NixlBackend
from kvrdma.progress import ProgressLoop
from kvrdma.testing import die_with_parent, synthetic


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class _Peer:
    def __init__(self, conn: Connection, wait: float) -> None:
        self.conn, self.wait, self.adaptive, self.stopped = conn, wait, False, False
        self.workers: dict[str, Any] = {}  # key -> kvrdma Worker
        self.backends: dict[str, Any] = {}  # key -> NixlBackend (plain agents)
        self.keep: dict[str, Any] = {}  # key -> caches / buffers that must outlive the agent
        self.loops: dict[str, Any] = {}  # key -> ProgressLoop (adaptive mode)
        self.writers: dict[str, dict[str, Any]] = {}  # key -> setup -> raw NIXL writer
        self.echo: set[str] = set()
        self.server: Any = None

    def _loop(self, key: str) -> Any:
        if key not in self.loops:
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
            for sender, msgs in b.get_notifs().items():
                for m in msgs if key in self.echo else ():
                    b.send_notif(sender, m)

    def run(self) -> None:
        while not self.stopped:
            if select.select([self.conn.fileno()], [], [], self.timeout())[0]:
                try:
                    cmd, kw = self.conn.recv()
                except EOFError:
                    return
                try:
                    self.conn.send(("ok", getattr(self, f"cmd_{cmd}")(**kw)))
                except Exception:
                    self.conn.send(("err", traceback.format_exc(limit=8)))
            self.progress()

    def cmd_stop(self) -> None:
        self.stopped = True

    def cmd_set_loop(self, wait: float, adaptive: bool = False) -> float:
        """Progress every `wait` s, or with `ProgressLoop` (its defaults); the old `wait`."""
        for loop in self.loops.values():
            loop.close()
        self.loops.clear()
        old, self.wait, self.adaptive = self.wait, wait, adaptive
        return old

    def cmd_make_worker(
        self, key: str, engine_id: str, spec: Any, fill: bool = True, zeroed: bool = True
    ) -> dict[str, Any]:
        """A producer worker over fresh caches of `spec`, pattern-filled unless `fill=False`
        (`zeroed=False` too: never touched)."""
        caches, _ = synthetic.make_caches(spec, zeroed=zeroed or fill)
        if fill:
            synthetic.fill(spec, caches)
        self.workers[key] = w = h.new_worker("P", engine_id, spec, caches)
        self.keep[key] = caches
        huge = h.huge_page_fraction(caches.values()) if zeroed or fill else None
        return {"meta": w.metadata, "huge_page_fraction": huge}

    def cmd_make_backend(
        self, key: str, progress_thread: bool = False, pthr_delay_us: int | None = None, **kw: Any
    ) -> dict[str, Any]:
        """A plain NixlBackend; keywords: `buffer_bytes` (a registered buffer of ones) and
        `echo` (send every notification back)."""
        if kw.get("echo"):
            self.echo.add(key)
        with h.nixl_progress_delay(pthr_delay_us):
            cfg = BackendConfig(name=h.agent_name(f"echo-{key}"), progress_thread=progress_thread)
            self.backends[key] = b = NixlBackend(cfg)
        if n := kw.get("buffer_bytes", 0):
            buf = torch.ones(n, dtype=torch.uint8)
            table = np.array([(buf.data_ptr(), n, 0)], dtype=np.uint64)
            self.keep[key] = (buf, b.register(table, MemType.DRAM))
        return {"metadata": b.metadata(), "addr": buf.data_ptr() if n else 0}

    def cmd_add_remote(self, key: str, metadata: bytes) -> str:
        return str(self.backends[key].add_remote(metadata))

    def cmd_close(self, key: str) -> None:
        for raw in self.writers.pop(key, {}).values():
            raw.close()
        for owner in (self.loops, self.workers, self.backends):
            if (obj := owner.pop(key, None)) is not None:
                obj.close()  # a backend's close releases the registration kept in self.keep
        self.keep.pop(key, None)
        self.echo.discard(key)

    def _until(self, w: Any, done: Any, what: str, timeout: float = 30.0) -> None:
        """Progress worker `w` until `done(its output)`, yielding the CPU between polls."""
        end = time.perf_counter() + timeout
        while not done(w.get_finished()):
            if time.perf_counter() > end:
                raise RuntimeError(f"{what}: not within {timeout:g} s")
            os.sched_yield()

    def cmd_prefill(
        self, key: str, rid: str, ids: list[int], compute_s: float, mode: str, wait: bool = False
    ) -> dict[str, float]:
        """A simulated prefill of `rid` into blocks `ids` of worker `key`: layer i's KV is
        final `(i + 1) * compute_s` after the start, a wall time in which this loop keeps
        progressing the worker (a GPU computes while the CPU drives NIXL). `mode`: "pull"
        holds the blocks at the end, "push" pushes them whole then, "layerwise" pushes from
        the start, layer by layer. Push modes start once the decoder's Expect is here;
        `wait`: until the blocks are free. perf_counter times: start, end of the last layer's
        compute (before the hold or push), and sent (the blocks free)."""
        w, layers = self.workers[key], list(self.keep[key])
        if mode != "pull":
            self._until(w, lambda _: w.has_work, f"{rid}: the decoder's Expect")
        t0 = time.perf_counter()
        if mode == "layerwise":
            w.push(rid, ids, layerwise=True)
        for i, layer in enumerate(layers):
            if compute_s:  # on the GPU's schedule, which does not wait for this loop
                due = t0 + (i + 1) * compute_s
                self._until(w, lambda _, t=due: time.perf_counter() >= t, f"{rid}: prefill")
            if mode == "layerwise":
                w.push_layer(rid, layer)
        out = {"start": t0, "end": time.perf_counter()}
        {"pull": w.hold, "push": w.push, "layerwise": lambda r, _: w.end_push(r)}[mode](rid, ids)
        if wait:
            self._until(w, lambda o: rid in o.finished_sending, f"{rid}: finished_sending")
            out["sent"] = time.perf_counter()
        return out

    def cmd_settle(self, key: str) -> None:
        """Progress worker `key` until it has nothing left to do (its blocks all free)."""
        self._until(self.workers[key], lambda _: not self.workers[key].has_work, f"{key} settles")

    def cmd_raw_write(
        self, key: str, setup: Any, ids: list[int], remote_meta: Any, remote_ids: list[int]
    ) -> float:
        """Seconds of one raw NIXL WRITE (`h.RawReader`, `setup`) of worker `key`'s blocks
        `ids` into `remote_ids` of `remote_meta`'s memory, with a notification."""
        raws = self.writers.setdefault(key, {})
        if setup.label not in raws:
            raws[setup.label] = h.RawReader(self.workers[key].metadata, remote_meta, setup, "WRITE")
        return raws[setup.label].read(ids, remote_ids)

    def cmd_handshake(self, keys: list[str]) -> int:
        """Serve the handshake of the workers `keys` (none: stop serving); its port."""
        if self.server is not None:
            self.server.close()
        self.server = HandshakeServer("127.0.0.1", 0) if keys else None
        for k in keys:
            self.server.publish(self.workers[k].metadata)
        return int(self.server.port) if keys else 0

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
        c0, t0, n = _cpu(), time.monotonic(), 0
        while time.monotonic() - t0 < seconds:
            if adaptive:
                self._idle_step()
            else:
                time.sleep(self.wait)  # the parent waits for our answer: nothing arrives
                if progress:
                    self.progress()
            n += 1
        wall, cpu = time.monotonic() - t0, _cpu() - c0
        if adaptive:  # get_finished() calls, not wake-ups
            n = sum(lp.polls for lp in self.loops.values()) - polls0
        reps, c1 = (2000 if progress else 0), _cpu()
        for _ in range(reps):
            self.progress(force=True)
        per_call = (_cpu() - c1) / reps if reps else 0.0
        return {"cpu_per_wall": cpu / wall, "wall": wall, "loops": n, "progress_cpu_s": per_call}

    def _idle_step(self) -> None:
        """One adaptive iteration: wait on the loops' wake-up fds until a poll is due."""
        select.select([lp.fileno() for lp in self.loops.values()], [], [], self.timeout())
        self.progress()


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
            for key in [*p.workers, *p.backends]:
                p.cmd_close(key)
            p.cmd_handshake([])
        conn.close()


class Peer:
    """Client of the target process (`serve`); every call has a deadline."""

    def __init__(self, wait: float = 0.001, timeout: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, wait), name="kvrdma-bench-peer")
        self.proc.start()
        child.close()
        self.timeout, self.pending = timeout, ""
        self.call("set_loop", wait=wait, timeout=60.0)  # answered once the target is up

    def call(self, cmd: str, timeout: float | None = None, **kw: Any) -> Any:
        self.send(cmd, **kw)
        return self.result(timeout)

    def send(self, cmd: str, **kw: Any) -> None:
        """Start `cmd`; its answer is `result()` (`ready()` says whether it has come)."""
        self.conn.send((cmd, kw))
        self.pending = cmd

    def ready(self) -> bool:
        return self.conn.poll(0)

    def result(self, timeout: float | None = None) -> Any:
        cmd, limit = self.pending, self.timeout if timeout is None else timeout
        if not self.conn.poll(limit):
            raise RuntimeError(f"peer: no answer to {cmd!r} within {limit:.0f} s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"peer died during {cmd!r} (exit {self.proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"peer failed {cmd!r}: {value}")
        return value

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(("stop", {}))
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self.conn.close()
