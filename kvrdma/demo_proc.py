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
    metrics_dir: str = ""
    compat_hash: str = ""
    log_level: str = "WARNING"


def _send(conn: Connection, msg: tuple[Any, ...]) -> None:
    try:
        conn.send(msg)
    except (BrokenPipeError, EOFError, OSError):
        os._exit(3)  # the parent is gone: nothing left to report to


def run_rank(spec: ProcSpec, conn: Connection) -> None:
    """Process entry point."""
    logging.basicConfig(
        level=spec.log_level, format=f"%(asctime)s {spec.role}{spec.rank} %(name)s: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    if spec.metrics_dir:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = spec.metrics_dir
    try:
        _run(spec, conn)
    except Exception as exc:  # report, never hang the parent
        _send(
            conn,
            ("error", spec.role, spec.rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()),
        )
    finally:
        conn.close()


def _make_worker(spec: ProcSpec) -> tuple[Any, Any, Any]:
    from kvrdma.config import load_kv_transfer_config
    from kvrdma.synthetic import CacheSpec, fill, make_caches
    from kvrdma.worker import Worker

    cspec = CacheSpec(
        spec.shape,
        spec.cache_layout,  # type: ignore[arg-type]
        spec.kv_layout,  # type: ignore[arg-type]
        spec.rank,
        spec.tp_size,
        spec.block_size,
        spec.num_blocks,
    )
    caches, mamba = make_caches(cspec)
    if spec.role == "P":
        fill(cspec, caches)
    config = load_kv_transfer_config(spec.kv_transfer_config, environ={})
    metrics = None
    if spec.metrics_dir:
        from prometheus_client import CollectorRegistry

        from kvrdma.telemetry import KvrdmaMetrics

        metrics = KvrdmaMetrics(
            registry=CollectorRegistry(),
            engine_id=spec.engine_id,
            role="producer" if spec.role == "P" else "consumer",
            tp_rank=spec.rank,
        )
    worker = Worker.create(
        config,
        tp_rank=spec.rank,
        tp_size=spec.tp_size,
        total_num_kv_heads=spec.shape.num_kv_heads,
        agent_name=f"{spec.engine_id}-tp{spec.rank}-{os.getpid()}",
        compat_hash=spec.compat_hash,
        metrics=metrics,
    )
    worker.register_kv_caches(
        caches,
        cache_layout=spec.cache_layout,  # type: ignore[arg-type]
        block_size=spec.block_size,
        mamba_layers=mamba,
        host_staging=spec.host_staging,
    )
    return worker, cspec, caches


def _run(spec: ProcSpec, conn: Connection) -> None:
    from kvrdma.handshake import HandshakeClient, SidecarPublisher

    t0 = time.perf_counter()
    worker, cspec, caches = _make_worker(spec)
    if spec.role == "P":
        pub = SidecarPublisher(spec.publish_address, timeout=5.0)
        try:
            pub.publish(worker.metadata)
        finally:
            pub.close()
        _send(conn, ("ready", spec.role, spec.rank, time.perf_counter() - t0, ""))
        _producer_loop(worker, conn, spec)
    else:
        client = HandshakeClient(
            timeout=5.0,
            identity=worker.metadata.agent_name,
            compat_hash=spec.compat_hash,
            tp_size=spec.tp_size,
            block_size=spec.block_size,
        )
        try:
            t1 = time.perf_counter()
            ranks = worker.topology.handshake_target_ranks(spec.peer_tp_size)
            metas = client.fetch(spec.handshake_host, spec.handshake_port, spec.peer_engine, ranks)
            hs = time.perf_counter() - t1
            worker.add_remote(metas)
        finally:
            client.close()
        _send(conn, ("ready", spec.role, spec.rank, time.perf_counter() - t0, f"{hs * 1e3:.1f}"))
        _consumer_loop(worker, conn, spec, cspec, caches)
    worker.close()


def _producer_loop(worker: Any, conn: Connection, spec: ProcSpec) -> None:
    while True:
        while conn.poll(0.0005):
            msg = conn.recv()
            if msg[0] == "stop":
                return
            if msg[0] == "hold":
                worker.hold(msg[1], msg[2])
        out = worker.get_finished()
        for rid in out.finished_sending:
            _send(conn, ("sent", spec.role, spec.rank, rid))


def _consumer_loop(worker: Any, conn: Connection, spec: ProcSpec, cspec: Any, caches: Any) -> None:
    """Post reads as asked; verify finished ones on a helper thread so reads keep flowing."""
    import queue
    import threading

    from kvrdma.errors import KvrdmaError
    from kvrdma.synthetic import verify

    pending: dict[str, tuple[list[int], list[int], int, float]] = {}
    to_check: queue.Queue[tuple[str, list[int], list[int], int, float] | None] = queue.Queue()
    results: queue.Queue[tuple[Any, ...]] = queue.Queue()

    def checker() -> None:
        while (item := to_check.get()) is not None:
            rid, local_ids, remote_ids, remote_bs, latency = item
            try:
                bad = verify(cspec, caches, local_ids, remote_ids, remote_bs)
                nbytes = _bytes_read(worker, len(remote_ids))
                results.put(("recv", spec.role, spec.rank, rid, bad, "", latency, nbytes))
            except Exception as exc:  # a verification bug must surface, not hang
                results.put(("recv", spec.role, spec.rank, rid, -1, f"verify: {exc}", latency, 0))

    thread = threading.Thread(target=checker, name="kvrdma-demo-verify", daemon=True)
    thread.start()
    try:
        while True:
            while conn.poll(0.0005 if not pending else 0):
                msg = conn.recv()
                if msg[0] == "stop":
                    return
                if msg[0] == "read":
                    _, rid, local_ids, remote_ids, remote_bs = msg
                    t = time.perf_counter()
                    try:
                        worker.start_read(rid, local_ids, remote_ids, spec.peer_engine)
                    except KvrdmaError as exc:
                        _send(conn, ("recv", spec.role, spec.rank, rid, -1, str(exc), 0.0, 0))
                        continue
                    pending[rid] = (local_ids, remote_ids, remote_bs, t)
            out = worker.get_finished()
            for rid in out.finished_recving:
                local_ids, remote_ids, remote_bs, t = pending.pop(rid)
                latency = time.perf_counter() - t
                if rid in out.invalid_block_ids:
                    invalid = sorted(out.invalid_block_ids[rid])
                    msg = f"invalid blocks {invalid}"
                    _send(conn, ("recv", spec.role, spec.rank, rid, -1, msg, latency, 0))
                    continue
                to_check.put((rid, local_ids, remote_ids, remote_bs, latency))
            while not results.empty():
                _send(conn, results.get())
    finally:
        to_check.put(None)
        thread.join(timeout=30)


def _bytes_read(worker: Any, n_remote: int) -> int:
    plan = next(iter(worker.consumer.remotes.values())).plan
    return int(plan.bytes_per_local_block * n_remote // plan.block_ratio)
