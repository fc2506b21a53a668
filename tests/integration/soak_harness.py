"""Long-lived P and D rank processes with real NIXL agents, and a driver that injects faults.

Child side (started with the `spawn_child` fixture, so every process dies with the test and
is reaped at teardown):

- `producer_main`: starts as a warm *spare* (imports done, NIXL plugins loaded) and waits to
  be told which P rank to become; then it builds a producer `Worker` with a fresh agent name
  (a restart is a new NIXL agent), fills its caches with the verifiable pattern, publishes its
  metadata to the test's `HandshakeServer` through a `SidecarPublisher`, and serves: holds on
  request, `get_finished()` every millisecond, and reports each finished-sending request once.
- `consumer_main`: one D rank. It handshakes like `kvrdma demo`'s ranks do (`PeerLink`:
  `Worker.connect`, again when the worker lists the P engine as suspect), posts the reads it
  is sent, and reports every request exactly once as `Outcome`:
  "ok" with the count of wrong elements (`synthetic.verify`; the local blocks are zeroed
  before each read, so a read that wrote nothing cannot pass), "failed" with the invalid block
  ids from `get_finished()` and the worker's reason (timeout, peer_lost, ...), or "rejected"
  when `start_read` raised, with how many backend calls it made first (must be 0).

All ranks run UCX over TCP (`UCX_TLS=tcp`): over shared memory (cma) a SIGSTOPped producer's
memory stays readable, so its READs would complete and a stall would test nothing. Over TCP
the stopped peer cannot serve them; they stay "in progress" until the reader's deadline.

Parent side: `Cluster` owns the handshake server and the processes and offers the faults
(kill, restart from a spare, stop/continue); `Soak` runs seeded batches of requests with one
fault per batch and keeps a record of everything each side reported.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from kvrdma.testing import stop_process, tcp_only

logger = logging.getLogger(__name__)

_POLL_S = 0.001


# ==== shared ===================================================================================
@dataclass(frozen=True)
class ClusterSpec:
    """Everything a rank needs, in plain values (picklable)."""

    p_tp: int = 2
    block_size: int = 16
    p_blocks: int = 256
    d_blocks: int = 512
    num_layers: int = 2
    num_kv_heads: int = 4
    head_dim: int = 32
    read_deadline: float = 1.0
    lease: float = 4.0
    p_engine: str = "soak-prefill"
    d_engine: str = "soak-decode"
    handshake_host: str = "127.0.0.1"  # where D finds the P engine's handshake agent
    handshake_port: int = 0
    publish_address: str = ""
    ucx_tls: str = ""  # "": TCP only (`kvrdma.testing.tcp_only`)
    num_threads: int | None = None  # None: the config's default (not set in the config)
    log_dir: str = ""

    @property
    def shape(self) -> Any:
        from kvrdma.testing.synthetic import ModelShape

        return ModelShape(
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim
        )

    @property
    def compat_hash(self) -> str:
        from kvrdma.metadata import compat_hash

        return compat_hash(
            version="kvrdma-soak",
            model=f"{self.num_layers}x{self.num_kv_heads}x{self.head_dim}",
            dtype="float16",
            total_num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            num_layers=self.num_layers,
            attn_backend="split_kv",
            cache_dtype="float16",
            cross_layer=False,
        )


@dataclass(frozen=True)
class Read:
    """One request as the D rank gets it."""

    rid: str
    local_ids: tuple[int, ...]
    remote_ids: tuple[int, ...]
    notify: bool = True
    expires_at: float | None = None  # the producer's lease end (its clock), for start_read


@dataclass(frozen=True)
class Outcome:
    """How a D rank ended one request."""

    rid: str
    kind: str  # "ok", "failed" (reported by get_finished), "rejected" (start_read raised)
    invalid: tuple[int, ...] = ()
    wrong: int = 0
    reason: str = ""  # the worker's outcome (timeout, peer_lost, ...) or the exception
    backend_calls: int = -1  # backend calls made by a rejected start_read
    waited: float = 0.0  # seconds from the D rank receiving the request to reporting it
    read_seconds: float = 0.0  # seconds from start_read to reporting it


# ==== child side ===============================================================================
def _child_setup(spec: ClusterSpec, name: str) -> None:
    """Before anything loads UCX: the transport, and logs into a file of their own."""
    os.environ["UCX_TLS"] = spec.ucx_tls or tcp_only()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.log_dir:
        fd = os.open(Path(spec.log_dir) / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)  # NIXL and UCX log to stdout/stderr
        os.dup2(fd, 2)
        os.close(fd)
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def _cache_spec(spec: ClusterSpec, role: str, rank: int) -> Any:
    from kvrdma.testing.synthetic import CacheSpec

    is_p = role == "P"
    return CacheSpec(
        spec.shape,
        "split_kv",
        "HND",
        rank,
        spec.p_tp if is_p else 1,
        spec.block_size,
        spec.p_blocks if is_p else spec.d_blocks,
    )


def _config(spec: ClusterSpec, role: str) -> Any:
    from kvrdma.config import load_kv_transfer_config

    is_p = role == "P"
    extra: dict[str, Any] = {
        "read_deadline": spec.read_deadline,
        "kv_lease_duration": spec.lease,
        "handshake_timeout": 2.0,
        "handshake_retries": 1,
    }
    if spec.num_threads is not None:
        extra["num_threads"] = spec.num_threads
    return load_kv_transfer_config(
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if is_p else "kv_consumer",
            "engine_id": spec.p_engine if is_p else spec.d_engine,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        },
        environ={},
    )


def _worker(spec: ClusterSpec, role: str, rank: int, agent_name: str, backend: Any) -> Any:
    """A P rank's worker from `Worker.create`; D's around `backend` (a `CountingBackend`)."""
    from kvrdma.worker import Worker

    is_p = role == "P"
    kwargs: dict[str, Any] = {
        "tp_rank": rank,
        "tp_size": spec.p_tp if is_p else 1,
        "total_num_kv_heads": spec.num_kv_heads,
        "compat_hash": spec.compat_hash,
    }
    config = _config(spec, role)
    if backend is None:
        return Worker.create(config, agent_name=agent_name, **kwargs)
    return Worker(config, backend, **kwargs)


def _nixl(spec: ClusterSpec, role: str, name: str) -> Any:
    """The agent `Worker.create` would build for this rank's config."""
    from kvrdma.nixl import BackendConfig, NixlBackend

    extra = _config(spec, role).extra
    return NixlBackend(
        BackendConfig(
            name=name,
            backends=tuple(extra.backends),
            num_threads=extra.num_threads,
            capture_telemetry=False,
        )
    )


def producer_main(conn: Connection, spec: ClusterSpec, name: str) -> None:
    """A spare P process: warm up, wait for ("become", rank, incarnation), then serve."""
    _child_setup(spec, name)
    import kvrdma.testing.synthetic
    import kvrdma.worker  # noqa: F401

    # plugin loading, off the restart path
    _nixl(spec, "P", f"{name}-warmup-{os.getpid()}").close()
    conn.send(("spare", name, os.getpid()))
    msg = conn.recv()
    if msg[0] != "become":
        return
    _, rank, incarnation = msg
    from kvrdma.handshake import SidecarPublisher
    from kvrdma.testing.synthetic import fill, make_caches

    cspec = _cache_spec(spec, "P", rank)
    caches, _ = make_caches(cspec)
    fill(cspec, caches)
    agent = f"{spec.p_engine}-tp{rank}-i{incarnation}-{os.getpid()}"
    worker = _worker(spec, "P", rank, agent, None)
    try:
        worker.register_kv_caches(caches, cache_layout="split_kv", block_size=spec.block_size)
        with SidecarPublisher(spec.publish_address, timeout=5.0) as pub:
            pub.publish(worker.metadata)
        conn.send(("ready", name, rank, incarnation, agent))
        while True:
            if conn.poll(_POLL_S):
                msg = conn.recv()
                if msg[0] == "hold":
                    for rid, ids in msg[1]:
                        worker.hold(rid, ids)
                elif msg[0] in ("counters", "stop"):
                    ledger = worker.producer.ledger
                    conn.send(
                        ("counters", name, {**asdict(ledger.counters), "held": ledger.num_held})
                    )
                    if msg[0] == "stop":
                        return
            out = worker.get_finished()
            if out.finished_sending:
                now = time.monotonic()
                conn.send(
                    ("sent", name, rank, incarnation, [(r, now) for r in out.finished_sending])
                )
    finally:
        worker.close()


class CountingBackend:
    """A `TransferBackend` that counts every method call it forwards (to prove that a
    rejected request never reached NIXL)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls = 0
        self.by_name: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.by_name[name] = self.by_name.get(name, 0) + 1
            return attr(*args, **kwargs)

        return counted


class PeerLink:
    """The D rank's view of the P engine, as in `kvrdma demo`: `Worker.connect`, retried
    with a pause, and again after the worker saw the peer vanish (connect then waits for the
    restarted P's new NIXL agent)."""

    def __init__(self, worker: Any, spec: ClusterSpec) -> None:
        self.worker = worker
        self.spec = spec
        self.connected = False
        self.next_try = 0.0
        self.handshakes = 0
        self.last_error = ""
        self.peer_gone = False  # the last handshake named an agent that refuses connections

    def connect(self) -> None:
        from kvrdma.errors import KvrdmaError, PeerUnreachable

        self.next_try = time.monotonic() + 0.1
        try:
            lost = self.spec.p_engine in self.worker.suspect_engines
            self.worker.connect(
                self.spec.p_engine,
                self.spec.handshake_host,
                self.spec.handshake_port,
                remote_tp_size=self.spec.p_tp,
                timeout=0.1 if lost else None,  # a lost P: ask briefly, the loop goes on
            )
        except KvrdmaError as exc:
            self.connected = False
            self.peer_gone = isinstance(exc, PeerUnreachable)
            self.last_error = f"handshake with {self.spec.p_engine!r} failed: {exc}"
            logger.warning("%s", self.last_error)
            return
        self.handshakes += 1
        self.connected = True

    def tick(self) -> None:
        if self.spec.p_engine in self.worker.suspect_engines:
            self.connected = False
        if not self.connected and time.monotonic() >= self.next_try:
            self.connect()


def consumer_main(conn: Connection, spec: ClusterSpec, name: str) -> None:
    """The D rank: read what it is sent, report each request once (`Outcome`)."""
    _child_setup(spec, name)
    import torch

    from kvrdma.errors import KvrdmaError
    from kvrdma.testing.synthetic import attention_views, make_caches, verify

    cspec = _cache_spec(spec, "D", 0)
    caches, _ = make_caches(cspec)
    agent = f"{spec.d_engine}-tp0-{os.getpid()}"
    backend = CountingBackend(_nixl(spec, "D", agent))
    worker = _worker(spec, "D", 0, agent, backend)
    views = [v for _, _, v in attention_views(cspec, caches)]
    try:
        worker.register_kv_caches(caches, cache_layout="split_kv", block_size=spec.block_size)
        link = PeerLink(worker, spec)
        link.connect()
        conn.send(("ready", name, link.connected))
        waiting: list[tuple[Read, float]] = []
        pending: dict[str, tuple[Read, float, float]] = {}
        unexpected: list[str] = []
        # the longest get_finished() since the last ("steps",): wall and this thread's CPU
        slowest_step = slowest_cpu = 0.0

        def report(o: Outcome) -> None:
            conn.send(("outcome", name, o))

        def zero(block_ids: tuple[int, ...]) -> None:
            ids = torch.as_tensor(_in_range(block_ids, spec.d_blocks), dtype=torch.int64)
            for v in views:
                v.index_fill_(0, ids, 0)

        while True:
            while conn.poll(0 if (waiting or pending) else _POLL_S):
                msg = conn.recv()
                now = time.monotonic()
                if msg[0] == "read":
                    waiting.extend((r, now) for r in msg[1])
                elif msg[0] == "keep_alive":
                    for rid in msg[1]:
                        worker.keep_alive(rid, spec.p_engine)
                elif msg[0] == "remove_remote":  # as re-adding an engine does: the reads in
                    # flight fail, its agents stay loaded (closing a stopped peer's connections
                    # makes UCX abort it when it resumes)
                    with worker._s.lock:  # as the worker's own calls, in turn with its backlog
                        worker.consumer.remove_remote(spec.p_engine, keep_agents=True)
                    link.connected = False  # handshaken with again by the next tick
                elif msg[0] == "audit":  # nonzero elements in blocks zeroed after a failure
                    ids = torch.as_tensor(_in_range(msg[1], spec.d_blocks), dtype=torch.int64)
                    nonzero = sum(int(v.index_select(0, ids).count_nonzero()) for v in views)
                    conn.send(("audit", name, nonzero))
                elif msg[0] == "steps":
                    retired = backend.by_name.get("retire", 0)
                    steps = {"slowest": slowest_step, "cpu": slowest_cpu, "retirements": retired}
                    conn.send(("steps", name, steps))
                    slowest_step = slowest_cpu = 0.0
                elif msg[0] == "stop":
                    c = worker.consumer
                    conn.send(
                        (
                            "stats",
                            name,
                            {
                                "inflight": len(c.inflight),
                                "ready": len(c.ready),
                                "pending": len(pending),
                                "waiting": len(waiting),
                                "keep_alive": len(c.waiting),
                                "handshakes": link.handshakes,
                                "unexpected": unexpected,
                            },
                        )
                    )
                    return
            link.tick()
            still: list[tuple[Read, float]] = []
            for r, t in waiting:
                now = time.monotonic()
                if not link.connected:  # wait for the handshake up to the deadline
                    if now - t < spec.read_deadline:
                        still.append((r, t))
                    else:
                        # a killed P whose engine still publishes its agent: a peer loss
                        lost = "peer_lost" if link.peer_gone else "no handshake"
                        why = f"{lost}: {link.last_error}"
                        zero(r.local_ids)  # recomputed by the engine, audited like any failure
                        ids_ = tuple(sorted(r.local_ids))
                        report(Outcome(r.rid, "failed", ids_, 0, why, -1, now - t))
                    continue
                zero(r.local_ids)  # a read that writes nothing cannot verify
                worker.consumer.send_notifications = r.notify
                calls = backend.calls
                try:
                    worker.start_read(
                        r.rid,
                        list(r.local_ids),
                        list(r.remote_ids),
                        spec.p_engine,
                        remote_expires_at=r.expires_at,
                    )
                except KvrdmaError as exc:
                    why = f"{type(exc).__name__}: {exc}"
                    calls = backend.calls - calls
                    waited = time.monotonic() - t
                    report(
                        Outcome(
                            r.rid, "rejected", tuple(sorted(r.local_ids)), 0, why, calls, waited
                        )
                    )
                    continue
                finally:
                    worker.consumer.send_notifications = True
                pending[r.rid] = (r, t, time.monotonic())
            waiting = still
            t0, c0 = time.perf_counter(), time.thread_time()
            out = worker.get_finished()
            slowest_step = max(slowest_step, time.perf_counter() - t0)
            slowest_cpu = max(slowest_cpu, time.thread_time() - c0)
            now = time.monotonic()
            unexpected += [rid for rid in out.invalid_block_ids if rid not in out.finished_recving]
            for rid in out.finished_recving:
                entry = pending.pop(rid, None)
                if entry is None:
                    unexpected.append(rid)
                    continue
                r, t, posted = entry
                if rid in out.invalid_block_ids:
                    # The engine would recompute into these blocks now: zero them, and the
                    # parent audits later that nothing (a cancelled READ) wrote them again.
                    zero(r.local_ids)
                    invalid = tuple(sorted(out.invalid_block_ids[rid]))
                    why = out.failures.get(rid)
                    reason = f"{why.outcome}: {why.error}" if why else "(no reason reported)"
                    report(Outcome(rid, "failed", invalid, 0, reason, -1, now - t, now - posted))
                else:
                    wrong = verify(cspec, caches, r.local_ids, r.remote_ids, spec.block_size)
                    report(Outcome(rid, "ok", (), wrong, "", -1, now - t, now - posted))
    finally:
        worker.close()


def _in_range(ids: Any, n: int) -> list[int]:
    return [int(i) for i in ids if 0 <= int(i) < n]


# ==== parent side ==============================================================================
Spawn = Callable[..., Any]  # the `spawn_child` fixture: (target, *args, deadline, name) -> Child


@dataclass
class _Proc:
    name: str
    child: Any  # conftest.Child
    rank: int = -1
    incarnation: int = -1
    ready: bool = False
    stopped: bool = False
    last: Any = None  # the latest counters/stats it sent


class Cluster:
    """The handshake server, P ranks (plus one warm spare), and one D rank."""

    def __init__(
        self, spec: ClusterSpec, spawn: Spawn, *, child_deadline: float = 240.0, server: Any = None
    ) -> None:
        """`server`: the P engine's handshake agent (anything with `port`, `publish_address`
        and `close()`, e.g. a sidecar on another host); default one in this process."""
        from kvrdma.handshake import HandshakeServer

        self.server = server or HandshakeServer("127.0.0.1", 0, publish_address="tcp://127.0.0.1:0")
        self.spec = replace(
            spec,
            handshake_port=self.server.port,
            publish_address=self.server.publish_address or "",
        )
        self._spawn = spawn
        self._deadline = child_deadline
        self._names = 0
        self.p: dict[int, _Proc] = {}  # rank -> the serving incarnation
        self.spares: list[_Proc] = []
        self.dead: list[_Proc] = []
        self.d: _Proc | None = None
        self.finished_d: _Proc | None = None
        self.incarnations: dict[int, int] = {}
        self.pids: list[int] = []
        # what the ranks report: by default the first outcome of each request is kept here
        self.outcomes: dict[str, Outcome] = {}
        self.on_outcome: Callable[[Outcome, float], None] = self._keep_outcome
        self.on_sent: Callable[[int, int, str, float], None] = lambda r, i, rid, t: None

    def _keep_outcome(self, o: Outcome, _at: float) -> None:
        self.outcomes.setdefault(o.rid, o)

    # ---- processes ---------------------------------------------------------------------
    def _start(self, target: Callable[..., None], prefix: str) -> _Proc:
        self._names += 1
        name = f"{prefix}{self._names}"
        child = self._spawn(target, self.spec, name, deadline=self._deadline, name=name)
        self.pids.append(child.pid)
        return _Proc(name, child)

    def start(self, timeout: float = 90.0) -> None:
        self.spares = [self._start(producer_main, "p") for _ in range(self.spec.p_tp + 1)]
        for rank in range(self.spec.p_tp):
            self.restart(rank, timeout=timeout, fresh_spare=False)
        self.d = self._start(consumer_main, "d")
        self.pump_until(lambda: self.d is not None and self.d.ready, timeout, "D rank ready")

    def _procs(self) -> list[_Proc]:
        live = [p for p in self.p.values() if not p.stopped]
        return [*live, *self.spares, *([self.d] if self.d else [])]

    def pump(self, timeout: float) -> None:
        """Handle what the ranks reported within `timeout` seconds."""
        procs = {p.child.conn: p for p in self._procs()}
        for conn in wait(list(procs), timeout=timeout):
            p = procs[conn]
            msg = p.child.recv(2.0)  # raises on a rank that raised or died
            now = time.monotonic()
            kind = msg[0]
            if kind in ("spare", "ready"):
                p.ready = True
            elif kind == "outcome":
                self.on_outcome(msg[2], now)
            elif kind == "sent":
                _, _, rank, inc, items = msg
                for rid, at in items:
                    self.on_sent(rank, inc, rid, at)
            elif kind in ("counters", "stats", "audit", "steps"):
                p.last = msg[2]
            else:
                raise AssertionError(f"rank {p.name} sent {msg!r}")

    def pump_until(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not done():
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {what} within {timeout:.1f}s")
            self.pump(min(left, 0.05))

    def restart(self, rank: int, *, timeout: float = 60.0, fresh_spare: bool = True) -> None:
        """A warm spare becomes P rank `rank` (new agent) and publishes; a new spare starts."""
        self.pump_until(lambda: any(s.ready for s in self.spares), timeout, "warm spare")
        spare = next(s for s in self.spares if s.ready)
        self.spares.remove(spare)
        if fresh_spare:
            self.spares.append(self._start(producer_main, "p"))
        inc = self.incarnations[rank] = self.incarnations.get(rank, -1) + 1
        spare.rank, spare.incarnation, spare.ready = rank, inc, False
        spare.child.send(("become", rank, inc))
        self.p[rank] = spare
        self.pump_until(lambda: spare.ready, timeout, f"P rank {rank} ready")

    def kill(self, rank: int) -> None:
        p = self.p.pop(rank)
        os.kill(p.child.pid, signal.SIGKILL)
        p.child.process.join(5)
        self.dead.append(p)

    def stall(self, rank: int) -> None:
        p = self.p[rank]
        stop_process(p.child.pid)
        p.stopped = True

    def resume(self, rank: int) -> None:
        p = self.p[rank]
        os.kill(p.child.pid, signal.SIGCONT)
        p.stopped = False

    # ---- requests ----------------------------------------------------------------------
    def hold(self, items: list[tuple[str, list[int]]]) -> list[tuple[int, int]]:
        """Every serving P rank holds these requests; returns (rank, incarnation) of each."""
        for p in self.p.values():
            p.child.send(("hold", items))
        return [(p.rank, p.incarnation) for p in self.p.values()]

    def read(self, reads: list[Read]) -> None:
        assert self.d is not None
        self.d.child.send(("read", reads))

    def keep_alive(self, rids: list[str]) -> None:
        assert self.d is not None
        self.d.child.send(("keep_alive", rids))

    def remove_remote(self) -> None:
        """D forgets P, keeping its agents loaded, then handshakes with it again."""
        assert self.d is not None
        self.d.child.send(("remove_remote",))

    def audit(self, block_ids: list[int], timeout: float = 10.0) -> int:
        """Nonzero elements in D blocks that were zeroed when their read was reported failed."""
        assert self.d is not None
        d = self.d
        d.last = None
        d.child.send(("audit", block_ids))
        self.pump_until(lambda: d.last is not None, timeout, "D audit")
        nonzero: int = d.last
        return nonzero

    def steps(self, timeout: float = 10.0) -> dict[str, Any]:
        """D's longest `get_finished()` call since the last `steps()` and its retirements
        so far."""
        assert self.d is not None
        d = self.d
        d.last = None
        d.child.send(("steps",))
        self.pump_until(lambda: d.last is not None, timeout, "D steps")
        steps: dict[str, Any] = d.last
        return steps

    def counters(self, timeout: float = 10.0) -> dict[int, dict[str, int]]:
        for p in self.p.values():
            p.last = None
            p.child.send(("counters",))
        self.pump_until(
            lambda: all(p.last is not None for p in self.p.values()), timeout, "producer counters"
        )
        return {r: p.last for r, p in self.p.items()}

    def stop_consumer(self, timeout: float = 10.0) -> dict[str, Any]:
        assert self.d is not None
        d = self.d
        d.last = None
        d.child.send(("stop",))
        self.pump_until(lambda: d.last is not None, timeout, "D rank stats")
        stats: dict[str, Any] = d.last
        d.child.process.join(timeout)
        self.d, self.finished_d = None, d
        return stats

    def close(self) -> None:
        """Stop everything (SIGCONT first: a stopped process cannot die cleanly)."""
        ds = [d for d in (self.d, self.finished_d) if d is not None]
        for p in [*self.p.values(), *self.spares, *self.dead, *ds]:
            with contextlib.suppress(Exception):
                p.child.stop(grace=2.0)
        self.server.close()

    def leftovers(self) -> list[int]:
        """Pids this cluster started that are still alive (not zombies)."""
        out = []
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except OSError:
                continue
            if state != b"Z":
                out.append(pid)
        return out


# ==== the soak =================================================================================
FAULTS = ("none", "kill_restart", "stall", "drop_notifs", "bad_ids", "keep_alive")


@dataclass
class Req:
    rid: str
    batch: int
    fault: str
    p_ids: list[int]
    local_ids: list[int] = field(default_factory=list)
    remote_ids: list[int] = field(default_factory=list)  # as sent to D (maybe corrupted)
    bad: str = ""  # how the ids were corrupted ("" = valid)
    notify: bool = True
    kept_alive: bool = False
    held_on: list[tuple[int, int]] = field(default_factory=list)
    held_at: float = 0.0
    dispatched_at: float = 0.0
    outcomes: list[tuple[Outcome, float]] = field(default_factory=list)


@dataclass
class Batch:
    index: int
    fault: str
    rank: int = -1
    rids: list[str] = field(default_factory=list)  # read in this batch
    seconds: float = 0.0


@dataclass
class SoakResult:
    spec: ClusterSpec
    seed: int
    requests: dict[str, Req]
    batches: list[Batch]
    sent: dict[tuple[int, int], dict[str, list[float]]]  # (rank, incarnation) -> rid -> times
    counters: dict[int, dict[str, int]]
    d_stats: dict[str, Any]
    restarted: set[tuple[int, int]]  # incarnations that were killed
    audits: list[tuple[int, str, int, int]]  # (batch, "failed"/"rejected", blocks, nonzero)
    seconds: float


class Soak:
    """Seeded batches of requests; one fault (or none) per batch, chosen between batches."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        seed: int,
        schedule: dict[str, int],
        batch_size: int = 16,
        max_blocks: int = 12,
        final_clean: int = 2,
    ) -> None:
        self.c = cluster
        self.spec = cluster.spec
        self.rng = random.Random(seed)
        self.seed = seed
        self.batch_size = batch_size
        self.max_blocks = max_blocks
        plan = [f for f, n in schedule.items() for _ in range(n)]
        self.rng.shuffle(plan)
        if "drop_notifs" in plan:  # one after every kill, and clear of the batch after one:
            # its holds end by the lease on ranks that live on, whatever the batches' pace
            plan.remove("drop_notifs")
            plan += ["none", "drop_notifs"]
        self.plan = plan + ["none"] * final_clean
        self.requests: dict[str, Req] = {}
        self.batches: list[Batch] = []
        self.parked: list[Req] = []  # held and kept alive, read once the lease has passed
        self.sent: dict[tuple[int, int], dict[str, list[float]]] = {}
        self.killed: set[tuple[int, int]] = set()
        self.late_after = 1.25 * self.spec.lease  # when a kept-alive request is read
        # (batch, outcome, D block ids) of reads that did not verify, kept out of use until
        # audited: (batch, outcome, blocks, nonzero elements)
        self.quarantine: list[tuple[int, str, list[int]]] = []
        self.audits: list[tuple[int, str, int, int]] = []
        cluster.on_outcome = self._outcome
        cluster.on_sent = self._sent

    def _outcome(self, o: Outcome, at: float) -> None:
        req = self.requests.get(o.rid)
        if req is None:
            raise AssertionError(f"D reported a request nobody sent: {o}")
        req.outcomes.append((o, at))

    def _sent(self, rank: int, inc: int, rid: str, at: float) -> None:
        self.sent.setdefault((rank, inc), {}).setdefault(rid, []).append(at)

    def _new(self, batch: int, fault: str) -> Req:
        rid = f"b{batch:02d}-r{len(self.requests):04d}"
        n = self.rng.randint(1, self.max_blocks)
        req = Req(rid, batch, fault, self.rng.sample(range(self.spec.p_blocks), n))
        self.requests[rid] = req
        return req

    def _corrupt(self, req: Req) -> None:
        """Out-of-range ids: must be rejected before any NIXL call."""
        kind = self.rng.choice(("remote_high", "remote_negative", "local_high"))
        i = self.rng.randrange(len(req.p_ids))
        req.bad = kind
        if kind == "remote_high":
            req.remote_ids[i] = self.spec.p_blocks + self.rng.randrange(1000)
        elif kind == "remote_negative":
            req.remote_ids[i] = -1 - self.rng.randrange(1000)
        else:
            req.local_ids[i] = self.spec.d_blocks + self.rng.randrange(1000)

    def run(self, *, batch_timeout: float) -> SoakResult:
        t0 = time.monotonic()
        for index, fault in enumerate(self.plan):
            self._batch(index, fault, batch_timeout)
        if self.parked:  # requests still kept alive: read them once their lease has passed
            last = max(r.held_at for r in self.parked) + self.late_after
            self.c.pump_until(lambda: time.monotonic() >= last, last - time.monotonic() + 1, "")
            self._batch(len(self.batches), "none", batch_timeout, fresh=0)
        held = {k for r in self.requests.values() for k in r.held_on}
        live = {(p.rank, p.incarnation) for p in self.c.p.values()}

        def all_freed() -> bool:
            return all(
                set(self.sent.get(k, {}))
                >= {r.rid for r in self.requests.values() if k in r.held_on}
                for k in held & live
            )

        self.c.pump_until(all_freed, self.spec.lease + 5.0, "every hold freed by the producers")
        self.c.pump(0.2)  # a duplicate report would arrive now
        self._audit(len(self.batches) + 2)  # a whole lease later: every failed block
        counters = self.c.counters()
        d_stats = self.c.stop_consumer()
        return SoakResult(
            self.spec,
            self.seed,
            self.requests,
            self.batches,
            self.sent,
            counters,
            d_stats,
            self.killed,
            self.audits,
            time.monotonic() - t0,
        )

    def _audit(self, index: int) -> None:
        """Blocks of reads reported failed two batches ago must still be zero: once a failure
        is reported the engine recomputes into them, so a cancelled READ must never land."""
        due = [q for q in self.quarantine if q[0] <= index - 2]
        self.quarantine = [q for q in self.quarantine if q not in due]
        for batch, kind, ids in due:
            self.audits.append((batch, kind, len(ids), self.c.audit(ids)))

    def _quarantined(self) -> set[int]:
        return {i for _, _, ids in self.quarantine for i in ids}

    def _batch(self, index: int, fault: str, timeout: float, *, fresh: int | None = None) -> None:
        rng, spec, c = self.rng, self.spec, self.c
        t0 = time.monotonic()
        batch = Batch(index, fault)
        self.batches.append(batch)
        self._audit(index)
        new = [self._new(index, fault) for _ in range(self.batch_size if fresh is None else fresh)]
        now = time.monotonic()
        held_on = c.hold([(r.rid, r.p_ids) for r in new]) if new else []
        for r in new:
            r.held_on, r.held_at = held_on, now
        to_read = list(new)
        if fault == "keep_alive":  # a quarter is read only after a whole lease has passed
            park = to_read[: self.batch_size // 4]
            to_read = to_read[len(park) :]
            for r in park:
                r.kept_alive = True
            c.keep_alive([r.rid for r in park])
            self.parked += park
        due = [r for r in self.parked if now - r.held_at >= self.late_after]
        self.parked = [r for r in self.parked if r not in due]
        to_read = due + to_read
        free = sorted(set(range(spec.d_blocks)) - self._quarantined())
        local = rng.sample(free, sum(len(r.p_ids) for r in to_read))
        for r in to_read:
            r.local_ids, local = local[: len(r.p_ids)], local[len(r.p_ids) :]
            r.remote_ids = list(r.p_ids)
            r.notify = fault != "drop_notifs"
        if fault == "bad_ids":
            for r in rng.sample(new, self.batch_size // 4):
                self._corrupt(r)
        batch.rids = [r.rid for r in to_read]
        now = time.monotonic()
        for r in to_read:
            r.dispatched_at = now
        # the first stall stops its rank before the reads go out, so that a deadline is seen
        # to end reads however fast the others finish before their stall lands
        stall_first = fault == "stall" and all(b.fault != "stall" for b in self.batches[:-1])
        if fault in ("kill_restart", "stall"):
            batch.rank, pause = rng.randrange(spec.p_tp), rng.uniform(0.0, 0.01)
            if stall_first:
                c.stall(batch.rank)
        c.read([Read(r.rid, tuple(r.local_ids), tuple(r.remote_ids), r.notify) for r in to_read])
        if fault in ("kill_restart", "stall"):
            time.sleep(pause)  # land mid-read (reads over TCP take ms)
            if fault == "stall":
                if not stall_first:
                    c.stall(batch.rank)
            else:
                self.killed.add((batch.rank, c.p[batch.rank].incarnation))
                c.kill(batch.rank)
        try:
            c.pump_until(
                lambda: all(r.outcomes for r in to_read),
                timeout,
                f"outcome for every request of batch {index} ({fault}); missing "
                f"{[r.rid for r in to_read if not r.outcomes][:8]} (a hang)",
            )
        finally:
            if fault == "stall":
                c.resume(batch.rank)
        for kind in ("failed", "rejected"):
            ids = [i for r in to_read if r.outcomes[0][0].kind == kind for i in r.local_ids]
            if ids:
                self.quarantine.append((index, kind, ids))
        if fault == "kill_restart":
            c.restart(batch.rank)
        elif fault == "stall":
            c.pump(0.2)  # let the resumed producer catch up before the next batch
        batch.seconds = time.monotonic() - t0
