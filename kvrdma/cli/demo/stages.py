"""`kvrdma demo --stages thinker:tp2,talker:tp1`: a pipeline of stage processes moving
verified KV from each stage to the next over NIXL.

Every rank of every stage is a process. The first stage makes each request's KV (a function
of the request id, so anyone can check it), keeps its heads and sends them on; every later
stage receives its heads from the ranks the mapping names, checks every byte, and — unless
it is the last — sends them on to the next stage under that pair's mapping.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import re
import statistics
import threading
import time
import zlib
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvrdma.errors import ConfigError, KvrdmaError

HEADS, LAYERS, BLOCKS, TOKENS, DIM = 8, 4, 8, 16, 64
_SLAB: dict[str, Any] = {"slot_bytes": 1 << 18, "num_slots": 64}
_SPEC = re.compile(r"^([A-Za-z][A-Za-z0-9_-]*):tp([1-9][0-9]*)$")


def parse_stages(text: str) -> list[tuple[str, int]]:
    """`name:tpN,name:tpN,...` -> [(name, N), ...] (at least two, distinct names)."""
    stages = []
    for part in text.split(","):
        match = _SPEC.match(part.strip())
        if match is None:
            raise ConfigError(
                f"--stages: expected NAME:tpN items, got {part.strip()!r} in {text!r}"
            )
        stages.append((match.group(1), int(match.group(2))))
    names = [n for n, _ in stages]
    if len(stages) < 2 or len(set(names)) != len(names):
        raise ConfigError(f"--stages: expected at least two distinct stage names, got {text!r}")
    if any(HEADS % size for _, size in stages):
        raise ConfigError(f"--stages: every TP size must divide the demo's {HEADS} KV heads")
    return stages


def full_kv(request_id: str, layer: int) -> torch.Tensor:
    """The whole `[2, blocks, tokens, heads, dim]` KV of one layer of a request."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{request_id}/{layer}".encode()))
    return torch.randn(2, BLOCKS, TOKENS, HEADS, DIM, generator=g).to(torch.bfloat16)


def _heads(rank: int, size: int) -> slice:
    return slice(rank * HEADS // size, (rank + 1) * HEADS // size)


def _rank(
    stages: list[tuple[str, int]], index: int, rank: int, requests: list[str], conn: Connection
) -> None:
    """One rank of stage `index`: receive from the stage before, send to the stage after."""
    from kvrdma.stages import StageEndpoint, StageMapping, StageReceiver, StageSender

    name, size = stages[index]
    inbox = outbox = None
    sender: StageSender | None = None
    receiver: StageReceiver | None = None
    try:
        if index > 0:
            inbox = StageEndpoint(
                pipeline="demo", stage=f"{name}-in", rank=rank, size=size, **_SLAB
            )
        if index < len(stages) - 1:
            outbox = StageEndpoint(pipeline="demo", stage=name, rank=rank, size=size, **_SLAB)
        conn.send(("ports", inbox.port if inbox else 0, outbox.port if outbox else 0))
        peers = conn.recv()  # {"in": {rank: port} of the stage before, "out": ... after}
        if outbox is not None:
            nxt, nsize = stages[index + 1]
            sender = StageSender(outbox, StageMapping(size, nsize), stage_index=index)
            sender.connect(f"{nxt}-in", {r: ("127.0.0.1", p) for r, p in peers["out"].items()})
        if inbox is not None:
            prev, psize = stages[index - 1]
            receiver = StageReceiver(inbox, StageMapping(psize, size), from_stage_index=index - 1)
            receiver.connect(prev, {r: ("127.0.0.1", p) for r, p in peers["in"].items()})
        conn.send(("connected",))
        conn.recv()  # everyone is connected
        conn.send(("done", *_move(requests, rank, size, sender, receiver)))
    except (KvrdmaError, OSError) as exc:
        conn.send(("error", f"{name} rank {rank}: {type(exc).__name__}: {exc}"))
    finally:
        for ep in (inbox, outbox):
            if ep is not None:
                ep.close()


def _move(
    requests: list[str],
    rank: int,
    size: int,
    sender: Any,
    receiver: Any,
) -> tuple[int, int, list[float]]:
    """(mismatched layers, bytes received, seconds per received request)."""
    bad, nbytes, seconds = 0, 0, []
    mine = _heads(rank, size)
    lock = threading.Lock()  # the sending agent is stepped from a thread of its own
    stop = threading.Event()
    if sender is not None:
        threading.Thread(target=_pump, args=(sender, lock, stop), daemon=True).start()
    try:
        for rid in requests:
            if receiver is None:
                layers = [full_kv(rid, layer)[:, :, :, mine] for layer in range(LAYERS)]
            else:
                t0 = time.perf_counter()
                got = receiver.receive(rid, timeout=30.0)
                seconds.append(time.perf_counter() - t0)
                layers = [torch.stack(pair) for pair in got.layers]
                for layer, kv in enumerate(layers):
                    nbytes += kv.numel() * kv.element_size()
                    bad += not torch.equal(kv, full_kv(rid, layer)[:, :, :, mine])
            if sender is not None:
                _send(sender, lock, rid, layers)
        deadline = time.monotonic() + 30.0
        while sender is not None and sender.pending and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        stop.set()
    return bad, nbytes, seconds


def _pump(sender: Any, lock: threading.Lock, stop: threading.Event) -> None:
    while not stop.is_set():
        with lock:
            sender.step()
        time.sleep(0.0005)


def _send(sender: Any, lock: threading.Lock, rid: str, layers: list[torch.Tensor]) -> None:
    """Send, waiting (bounded) for slab room while earlier shards are still being read."""
    deadline = time.monotonic() + 30.0
    while True:
        with lock:
            try:
                sender.send(rid, layers)
                return
            except KvrdmaError as exc:
                if "free slots" not in str(exc) or time.monotonic() > deadline:
                    raise
        time.sleep(0.001)


def run(stages_text: str, requests: int) -> int:
    stages = parse_stages(stages_text)
    ids = [f"req-{i}" for i in range(requests)]
    ctx = mp.get_context("spawn")
    procs: list[tuple[Any, Connection, int, int]] = []
    t0 = time.perf_counter()
    try:
        for index, (_, size) in enumerate(stages):
            for rank in range(size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_rank, args=(stages, index, rank, ids, child))
                proc.start()
                procs.append((proc, parent, index, rank))
        ports = {(i, r): _expect(conn, "ports", 120) for _, conn, i, r in procs}
        for _, conn, i, _r in procs:
            conn.send(
                {
                    "in": {r: ports[(i - 1, r)][2] for r in range(stages[i - 1][1])} if i else {},
                    "out": {r: ports[(i + 1, r)][1] for r in range(stages[i + 1][1])}
                    if i < len(stages) - 1
                    else {},
                }
            )
        for _, conn, *_ in procs:
            _expect(conn, "connected", 120)
        for _, conn, *_ in procs:
            conn.send("go")
        results = {(i, r): _expect(conn, "done", 300) for _, conn, i, r in procs}
    finally:
        for proc, *_ in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return _report(stages, results, requests, time.perf_counter() - t0)


def _expect(conn: Connection, what: str, timeout: float) -> tuple[Any, ...]:
    if not conn.poll(timeout):
        raise KvrdmaError(f"a stage rank sent no {what!r} within {timeout:g} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise KvrdmaError(msg[1])
    if msg[0] != what:
        raise KvrdmaError(f"a stage rank sent {msg[0]!r} where {what!r} was expected")
    return tuple(msg)


def _report(
    stages: list[tuple[str, int]],
    results: dict[tuple[int, int], tuple[Any, ...]],
    requests: int,
    elapsed: float,
) -> int:
    print(f"{'from':>14} -> {'to':<14} {'requests':>8} {'MiB':>8} {'MB/s*':>7} "
          f"{'p50 ms':>7} {'p99 ms':>7} {'mismatched':>10}")  # fmt: skip
    mismatched = 0
    for index in range(1, len(stages)):
        rows = [results[(index, r)] for r in range(stages[index][1])]
        bad = sum(row[1] for row in rows)
        nbytes = sum(row[2] for row in rows)
        seconds = sorted(s for row in rows for s in row[3])
        p50 = statistics.median(seconds) * 1e3
        p99 = seconds[min(len(seconds) - 1, int(len(seconds) * 0.99))] * 1e3
        rate = nbytes / elapsed / 1e6
        src, dst = (f"{n}:tp{s}" for n, s in (stages[index - 1], stages[index]))
        print(f"{src:>14} -> {dst:<14} {requests:>8} {nbytes / 2**20:>8.1f} {rate:>7.1f} "
              f"{p50:>7.2f} {p99:>7.2f} {bad:>10}")  # fmt: skip
        mismatched += bad
    print("* bytes received over the whole run's wall time, process start-up included")
    verdict = "OK: every byte as sent" if mismatched == 0 else f"MISMATCH in {mismatched} layers"
    print(f"verdict: {verdict} ({elapsed:.1f} s)")
    return 0 if mismatched == 0 else 1


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", required=True, help="e.g. thinker:tp2,talker:tp1")
    p.add_argument("--requests", type=int, default=16)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrdma demo --stages")
    configure_parser(p)
    args = p.parse_args(argv)
    return run(args.stages, args.requests)
