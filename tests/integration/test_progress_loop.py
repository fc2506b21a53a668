"""ProgressLoop with real NIXL agents in two processes: a producer whose loop has backed off
to a long idle wait still serves a new request's first READ (+ notification, which needs
the producer's agent to progress: wire-up, then the "done" message) promptly once `hold()`
happened and `wake()` was signalled; heartbeats sent to an idle producer still renew the
lease once it holds, and an unread lease still expires on time.

Each rank process runs the documented pattern: a listener thread queues the parent's
commands and calls `loop.wake()`; the worker's thread only runs `loop.step()` and executes
queued commands between steps — so nothing but `wake()` can end a backed-off wait early.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

import pytest

pytest.importorskip("nixl")

BLOCK = 16
BLOCKS = 32
P_IDLE = 1.0  # the producer's idle_interval: a wake-up that does not work costs ~1 s
PROMPT_S = 0.5  # hold sent -> P saw the reader's "done": half of P_IDLE, which a missed wake costs
RAMP_S = 10.0  # P reaching its idle interval: 2 ms doubling to 1 s ≈ 2 s, room for load


def rank(
    conn: Connection, role: str, engine: str, extra: dict[str, Any], busy: float, idle: float
) -> dict[str, int]:
    """A rank process (spawned): build a worker, then serve commands around `loop.step()`."""
    import logging
    import os
    import queue
    import threading

    import msgspec

    from kvrdma.config import load_kv_transfer_config
    from kvrdma.metadata import WorkerMetadata
    from kvrdma.progress import ProgressLoop
    from kvrdma.testing.synthetic import CacheSpec, ModelShape, fill, make_caches, verify
    from kvrdma.worker import Worker

    logging.basicConfig(level=logging.WARNING)
    spec = CacheSpec(ModelShape(2, 4, 8), "split_kv", "HND", 0, 1, BLOCK, BLOCKS)
    caches, mamba = make_caches(spec)
    if role == "P":
        fill(spec, caches)
    cfg = load_kv_transfer_config(
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if role == "P" else "kv_consumer",
            "engine_id": engine,
            "kv_connector_extra_config": extra,
        },
        environ={},
    )
    worker = Worker.create(
        cfg, tp_rank=0, tp_size=1, total_num_kv_heads=4, agent_name=f"{engine}-{os.getpid()}"
    )
    loop = ProgressLoop(worker, busy_interval=busy, idle_interval=idle)
    inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()

    def listen() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = ("stop",)
            inbox.put(msg)
            loop.wake()
            if msg[0] == "stop":
                return

    try:
        meta = worker.register_kv_caches(
            caches, cache_layout="split_kv", block_size=BLOCK, mamba_layers=mamba
        )
        conn.send(("meta", msgspec.msgpack.encode(meta)))
        threading.Thread(target=listen, name="listen", daemon=True).start()
        started: dict[str, tuple[float, list[int], list[int]]] = {}
        peer = ""
        told_backed_off = False
        while True:
            out = loop.step()
            now = time.monotonic()
            for rid in sorted(out.finished_sending):
                conn.send(("sent", rid, now))
            for rid in sorted(out.finished_recving):
                t0, local, remote = started.pop(rid)
                bad = -1
                if rid not in out.invalid_block_ids:
                    bad = verify(spec, caches, local, remote, BLOCK)
                conn.send(("recv", rid, now - t0, bad))
            backed_off = role == "P" and loop.idle and loop.interval >= idle
            if backed_off and not told_backed_off:
                conn.send(("backed_off", loop.interval))
            told_backed_off = backed_off
            while not inbox.empty():
                cmd, *args = inbox.get()
                if cmd == "stop":
                    c = worker.producer.ledger.counters if worker.producer is not None else None
                    return {k: int(v) for k, v in vars(c).items()} if c is not None else {}
                if cmd == "add_remote":
                    meta_p = msgspec.msgpack.decode(args[0], type=WorkerMetadata)
                    peer = worker.add_remote({0: meta_p}).remote_engine_id
                elif cmd == "hold":
                    worker.hold(args[0], args[1])
                    conn.send(("held", args[0], time.monotonic()))
                elif cmd == "keep_alive":
                    worker.keep_alive(args[0], peer)
                elif cmd == "read":
                    started[args[0]] = (time.monotonic(), args[1], args[2])
                    worker.start_read(args[0], args[1], args[2], peer)
    finally:
        loop.close()
        worker.close()


def expect(child: Any, kind: str, timeout: float) -> tuple[Any, ...]:
    """The child's next message, which must be of `kind`."""
    msg = child.recv(timeout)
    assert msg[0] == kind, f"expected {kind!r} from {child.name}, got {msg!r}"
    return tuple(msg)


def start_pair(spawn_child: Any, extra: dict[str, Any]) -> tuple[Any, Any]:
    p = spawn_child(rank, "P", "P-prog", extra, 0.001, P_IDLE, deadline=90.0, name="P")
    d = spawn_child(rank, "D", "D-prog", extra, 0.0, 0.05, deadline=90.0, name="D")
    _, p_meta = expect(p, "meta", 60.0)
    expect(d, "meta", 60.0)
    d.send(("add_remote", p_meta))
    return p, d


def test_backed_off_producer_serves_first_read_promptly_after_hold_and_wake(
    spawn_child: Any,
) -> None:
    p, d = start_pair(spawn_child, {})
    (_, interval) = expect(p, "backed_off", RAMP_S)
    assert interval == P_IDLE
    # P has just begun a 1 s wait: only wake() can end it before the READ needs P
    t0 = time.monotonic()
    p.send(("hold", "r1", [3, 7, 30]))
    _, _, held_at = expect(p, "held", 5.0)
    d.send(("read", "r1", [0, 1, 2], [3, 7, 30]))
    _, rid, read_s, bad = expect(d, "recv", 5.0)
    assert (rid, bad) == ("r1", 0), "the READ failed or read wrong data"
    _, rid, sent_at = expect(p, "sent", 5.0)
    assert rid == "r1"
    assert held_at - t0 < PROMPT_S / 2, f"hold took {held_at - t0:.3f}s: wake() did not wake"
    assert sent_at - t0 < PROMPT_S, (
        f"P saw the reader's notification {sent_at - t0:.3f}s after hold (READ {read_s:.3f}s)"
    )
    # nothing held any more: P backs off again
    expect(p, "backed_off", RAMP_S)
    p.send(("stop",))
    counters = p.result(10.0)
    assert (counters["notified"], counters["expired"]) == (1, 0), counters
    d.send(("stop",))
    d.result(10.0)


def test_heartbeats_to_an_idle_producer_renew_the_lease_and_unread_leases_expire(
    spawn_child: Any,
) -> None:
    lease = 1.0
    p, d = start_pair(spawn_child, {"kv_lease_duration": lease, "read_deadline": 0.5})
    expect(p, "backed_off", RAMP_S)
    # the reader heartbeats (every lease/6) before P holds: P is idle, backed off to 1 s
    d.send(("keep_alive", "r2"))
    time.sleep(0.5)
    p.send(("hold", "r2", [1, 2]))
    expect(p, "held", 5.0)
    # 2.5 leases without a READ: only the heartbeats keep the blocks held
    assert not p.conn.poll(2.5 * lease), f"P said {p.recv(1.0)!r} while r2 was heartbeated"
    d.send(("read", "r2", [5, 6], [1, 2]))
    _, rid, _, bad = expect(d, "recv", 5.0)
    assert (rid, bad) == ("r2", 0)
    _, rid, _ = expect(p, "sent", PROMPT_S + 1.0)
    assert rid == "r2"
    # a request nobody reads or heartbeats: freed when its lease expires, on time
    p.send(("hold", "r3", [9]))
    _, _, held_at = expect(p, "held", 5.0)
    _, rid, sent_at = expect(p, "sent", lease + 3.0)
    assert rid == "r3"
    assert lease - 0.05 <= sent_at - held_at <= lease + 0.3, sent_at - held_at
    expect(p, "backed_off", RAMP_S)
    p.send(("stop",))
    c = p.result(10.0)
    assert (c["notified"], c["expired"]) == (1, 1), c
    # 6 per lease when on time; renewing needs one per lease, and the silence above proved it
    assert c["heartbeats"] >= 2 * 3, c
    d.send(("stop",))
    d.result(10.0)
