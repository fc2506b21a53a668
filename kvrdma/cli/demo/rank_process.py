"""The processes of `kvrdma demo`: one per TP rank of the prefill (P) and decode (D) engines.

Each runs a real `Worker` with a real NIXL agent. P ranks publish their metadata to the
P engine's handshake agent; D ranks fetch it from there, add the remote engine, and read.
The parent drives them over a pipe with small tuples and gets results back the same way.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

# a posted read: local block ids, remote block ids, remote block size, when D was asked
_Pending = tuple[list[int], list[int], int, float]

_P_BUSY_S = 0.0005  # a producer rank's get_finished() cadence while it holds blocks
_LOST_PEER_WAIT_S = 0.1  # how long one connect waits for a lost peer's new agent


@dataclass(frozen=True)
class ProcSpec:
    """Everything a rank process needs to build its worker (picklable, plain values)."""

    role: str  # "P" or "D"
    rank: int
    tp_size: int
    engine_id: str
    cache_layout: str
    kv_layout: str
    block_size: int
    num_blocks: int
    shape: Any  # synthetic.ModelShape
    kv_transfer_config: dict[str, Any]
    handshake_host: str
    handshake_port: int
    publish_address: str
    peer_engine: str = ""
    peer_tp_size: int = 1
    read_deadline: float = 10.0
    host_staging: bool = False
    metrics: bool = False
    metrics_port: int = 0  # with `metrics`: where this rank serves /metrics (0: any free port)
    compat_hash: str = ""
    log_level: str = "WARNING"
    drop_notifications: bool = False
    device: str = "cpu"  # where this rank's caches live
    kv_cache_order: str = "LBHNC"  # cache_layout "unified" only
    netns: str = ""  # the network namespace ("host") this rank runs in; "" = the parent's


def _send(conn: Connection, msg: tuple[Any, ...]) -> None:
    try:
        conn.send(msg)
    except (BrokenPipeError, EOFError, OSError):
        os._exit(3)  # the parent is gone: nothing left to report to


def run_rank(spec: ProcSpec, conn: Connection) -> None:
    """Process entry point."""
    if spec.netns:  # before UCX or any socket exists: they belong to the namespace they start in
        from kvrdma.testing.netns import enter

        enter(spec.netns)
    logging.basicConfig(
        level=spec.log_level, format=f"%(asctime)s {spec.role}{spec.rank} %(name)s: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    try:
        _run(spec, conn)
    except Exception as exc:  # report, never hang the parent
        _send(
            conn,
            ("error", spec.role, spec.rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()),
        )
    finally:
        conn.close()


def _make_worker(spec: ProcSpec) -> tuple[Any, Any, Any, str]:
    from kvrdma.config import load_kv_transfer_config
    from kvrdma.testing.synthetic import CacheSpec, fill, make_caches
    from kvrdma.worker import Worker

    cspec = CacheSpec(
        spec.shape,
        spec.cache_layout,  # type: ignore[arg-type]
        spec.kv_layout,  # type: ignore[arg-type]
        spec.rank,
        spec.tp_size,
        spec.block_size,
        spec.num_blocks,
        spec.device,
        spec.kv_cache_order,
    )
    caches, mamba = make_caches(cspec)
    if spec.role == "P":
        fill(cspec, caches)
    config = load_kv_transfer_config(spec.kv_transfer_config, environ={})
    metrics = None
    endpoint = ""
    if spec.metrics:
        # each rank serves its own /metrics on a loopback port; the parent aggregates them
        # the way the sidecar does in a pod
        from prometheus_client import CollectorRegistry

        from kvrdma.telemetry import KvrdmaMetrics, build_info, start_http_server

        registry = CollectorRegistry()
        metrics = KvrdmaMetrics(
            registry=registry,
            engine_id=spec.engine_id,
            role="producer" if spec.role == "P" else "consumer",
            tp_rank=spec.rank,
        )
        build_info(registry)
        _server, port = start_http_server(registry, "127.0.0.1", spec.metrics_port)
        endpoint = f"127.0.0.1:{port}"
    worker = Worker.create(
        config,
        tp_rank=spec.rank,
        tp_size=spec.tp_size,
        total_num_kv_heads=spec.shape.num_kv_heads,
        agent_name=f"{spec.engine_id}-tp{spec.rank}-{os.getpid()}",
        compat_hash=spec.compat_hash,
        metrics=metrics,
    )
    logging.getLogger("nixl").setLevel(logging.WARNING)  # nixl forces INFO on stdout
    worker.register_kv_caches(
        caches,
        mamba_layers=mamba,
        host_staging=spec.host_staging,
        **cspec.layout_args,  # type: ignore[arg-type]
    )
    return worker, cspec, caches, endpoint


def _run(spec: ProcSpec, conn: Connection) -> None:
    t0 = time.perf_counter()
    worker, cspec, caches, endpoint = _make_worker(spec)
    try:
        if spec.role == "P":
            if spec.host_staging:
                # the demo's producer content never changes: stage every block once, so a
                # read racing the parent's "hold" message still finds the staged copy
                worker.producer.stage(range(spec.num_blocks))
            from kvrdma.handshake.publisher import KeepPublished

            # published again while the rank lives: each publish lasts only its ttl
            kept = KeepPublished(lambda: worker.metadata, spec.publish_address)
            try:
                _send(conn, ("ready", spec.role, spec.rank, time.perf_counter() - t0, "", endpoint))
                _producer_loop(worker, conn, spec, list(caches))
            finally:
                kept.close()
        else:
            if worker.consumer is not None and spec.drop_notifications:
                worker.consumer.send_notifications = False
            link = _PeerLink(worker, spec)
            link.connect()
            hs = f"{link.last_ms:.1f}" if link.connected else "failed"
            _send(conn, ("ready", spec.role, spec.rank, time.perf_counter() - t0, hs, endpoint))
            _consumer_loop(worker, conn, spec, cspec, caches, link)
    finally:
        worker.close()


class _PeerLink:
    """The D rank's view of the P engine: `Worker.connect`, retried with a pause while it
    fails, and again after the worker saw the peer vanish (connect then waits for the
    restarted producer's new NIXL agent)."""

    def __init__(self, worker: Any, spec: ProcSpec) -> None:
        self.worker = worker
        self.spec = spec
        self.connected = False
        self.next_try = 0.0
        self.last_ms = 0.0
        self.last_error = ""

    def connect(self) -> None:
        from kvrdma.errors import KvrdmaError

        # a lost peer is asked often and briefly (its restart publishes a new agent any
        # moment; meanwhile this loop keeps failing its reads fast), an unreachable handshake
        # with backoff
        lost = self.spec.peer_engine in self.worker.suspect_engines
        t = time.perf_counter()
        try:
            self.worker.connect(
                self.spec.peer_engine,
                self.spec.handshake_host,
                self.spec.handshake_port,
                remote_tp_size=self.spec.peer_tp_size,
                timeout=_LOST_PEER_WAIT_S if lost else None,
            )
        except KvrdmaError as exc:
            self.connected = False
            self.next_try = time.monotonic() + (0.01 if lost else 0.25)
            self.last_error = f"handshake with {self.spec.peer_engine!r} failed: {exc}"
            logger.warning("%s", self.last_error)
            return
        self.last_ms = (time.perf_counter() - t) * 1e3
        self.connected = True

    def tick(self) -> None:
        """Re-handshake when disconnected or when the worker saw the peer vanish."""
        if self.spec.peer_engine in self.worker.suspect_engines:
            self.connected = False
            self.last_error = f"peer engine {self.spec.peer_engine!r} lost; re-handshaking"
        if not self.connected and time.monotonic() >= self.next_try:
            self.connect()


def _producer_loop(worker: Any, conn: Connection, spec: ProcSpec, layers: list[str]) -> None:
    """Serve holds until "stop": `get_finished()` every 0.5 ms while blocks are held, backing
    off to 50 ms while idle (`ProgressLoop`); a message from the parent ends the wait."""
    from kvrdma.progress import ProgressLoop

    with ProgressLoop(worker, busy_interval=_P_BUSY_S) as loop:
        while True:
            conn.poll(loop.timeout())
            while conn.poll(0):
                msg = conn.recv()
                if msg[0] == "stop":
                    c = worker.producer.ledger.counters
                    _send(
                        conn,
                        ("stats", spec.role, spec.rank, c.notified, c.expired, c.unknown_notifs),
                    )
                    return
                if msg[0] == "hold":
                    worker.hold(msg[1], msg[2])  # has_work: the loop is busy again at once
                elif msg[0] == "push":
                    _push(worker, msg[1], msg[2], layers if msg[3] else [])
            if loop.timeout() == 0:
                out = loop.poll()
                for rid in out.finished_sending:
                    _send(conn, ("sent", spec.role, spec.rank, rid))


def _push(worker: Any, rid: str, block_ids: list[int], layers: list[str]) -> None:
    """Push a request: whole, or (`layers` given) layer by layer as a prefill would, each
    written as soon as it is marked done."""
    worker.push(rid, block_ids, layerwise=bool(layers))
    if layers:
        for name in layers:
            worker.push_layer(rid, name)
            worker.get_finished()
        worker.end_push(rid)


def _consumer_loop(
    worker: Any, conn: Connection, spec: ProcSpec, cspec: Any, caches: Any, link: _PeerLink
) -> None:
    """Post reads as asked; verify finished ones on a helper thread so reads keep flowing.

    `get_finished()` runs back to back while reads are in flight and backs off to 50 ms
    while idle (`ProgressLoop`); a message from the parent or a verified read (the helper
    thread calls `wake()`) ends the wait."""
    import queue
    import threading
    from multiprocessing.connection import wait

    from kvrdma.progress import ProgressLoop
    from kvrdma.testing.synthetic import verify

    pending: dict[str, _Pending] = {}
    to_check: queue.Queue[tuple[str, list[int], list[int], int, float] | None] = queue.Queue()
    results: queue.Queue[tuple[Any, ...]] = queue.Queue()
    loop = ProgressLoop(worker, busy_interval=0.0)

    def checker() -> None:
        while (item := to_check.get()) is not None:
            rid, local_ids, remote_ids, remote_bs, latency = item
            try:
                bad = verify(cspec, caches, local_ids, remote_ids, remote_bs)
                nbytes = _bytes_read(worker, len(remote_ids))
                results.put(("recv", spec.role, spec.rank, rid, bad, "", latency, nbytes))
            except Exception as exc:  # a verification bug must surface, not hang
                results.put(("recv", spec.role, spec.rank, rid, -1, f"verify: {exc}", latency, 0))
            loop.wake()

    held: list[tuple[tuple[Any, ...], float]] = []
    thread = threading.Thread(target=checker, name="kvrdma-demo-verify", daemon=True)
    thread.start()
    try:
        while True:
            timeout = 0.0 if held else loop.timeout()
            if not link.connected:  # the next handshake attempt is due then
                timeout = min(timeout, max(0.0, link.next_try - time.monotonic()))
            wait([conn, loop.fileno()], timeout)
            while conn.poll(0):
                msg = conn.recv()
                if msg[0] == "stop":
                    return
                if msg[0] in ("read", "expect"):
                    held.append((msg, time.perf_counter()))
            link.tick()
            if held and not link.connected and spec.peer_engine in worker.suspect_engines:
                link.connect()  # a restarted producer may have published by now: ask first
            held = _post_reads(worker, conn, spec, link, held, pending)
            if loop.timeout() == 0:
                _collect_reads(loop.poll(), conn, spec, pending, to_check)
            while not results.empty():
                _send(conn, results.get())
    finally:
        to_check.put(None)
        thread.join(timeout=30)
        loop.close()


def _post_reads(
    worker: Any,
    conn: Connection,
    spec: ProcSpec,
    link: _PeerLink,
    held: list[tuple[tuple[Any, ...], float]],
    pending: dict[str, _Pending],
) -> list[tuple[tuple[Any, ...], float]]:
    """Start the held reads the peer is connected for; the ones still waiting for a handshake
    are returned. Reads wait up to their deadline, then fail as invalid."""
    from kvrdma.errors import KvrdmaError

    keep: list[tuple[tuple[Any, ...], float]] = []
    for msg, t in held:
        kind, rid, local_ids, remote_ids, remote_bs = msg
        if not link.connected:
            lost = spec.peer_engine in worker.suspect_engines  # agent gone: fail fast
            if not lost and time.perf_counter() - t < spec.read_deadline:
                keep.append((msg, t))
            else:
                err = link.last_error or "no handshake yet"
                _send(conn, ("recv", spec.role, spec.rank, rid, -1, err, 0.0, 0))
            continue
        try:
            if kind == "expect":
                worker.expect_push(rid, local_ids, spec.peer_engine, deadline=spec.read_deadline)
            else:
                worker.start_read(rid, local_ids, remote_ids, spec.peer_engine)
        except KvrdmaError as exc:
            _send(conn, ("recv", spec.role, spec.rank, rid, -1, str(exc), 0.0, 0))
            continue
        pending[rid] = (local_ids, remote_ids, remote_bs, t)
    return keep


def _collect_reads(
    out: Any,
    conn: Connection,
    spec: ProcSpec,
    pending: dict[str, _Pending],
    to_check: Any,
) -> None:
    """Finished reads: report invalid ones now, queue the others for verification. A failed
    push whose blocks a producer may still write is reported quarantined first, and
    released once none can: the parent reuses its blocks only then."""
    for rid in out.quarantined:
        _send(conn, ("quarantined", spec.role, spec.rank, rid))
    for rid in out.released:
        _send(conn, ("released", spec.role, spec.rank, rid))
    for rid in out.finished_recving:
        local_ids, remote_ids, remote_bs, t = pending.pop(rid)
        latency = time.perf_counter() - t
        if rid in out.invalid_block_ids:
            invalid = sorted(out.invalid_block_ids[rid])
            msg = f"invalid blocks {invalid}"
            _send(conn, ("recv", spec.role, spec.rank, rid, -1, msg, latency, 0))
            continue
        to_check.put((rid, local_ids, remote_ids, remote_bs, latency))


def _bytes_read(worker: Any, n_remote: int) -> int:
    plan = next(iter(worker.consumer.remotes.values())).plan
    return int(plan.request_bytes(n_remote))
