"""Handshake latency on loopback: p50/p99 of full `HandshakeClient.fetch` round trips.

Each handshake is what a decode worker does on first contact: a fresh DEALER, one
`MetadataRequest` for `--ranks` ranks, the server's answer (agent metadata blob of
`--metadata-bytes`, `--regions` regions per rank), and full validation of the reply
(checksums, compat hash, TP/block size, descriptor tables). The server runs in its own
process unless `--same-process`.

    python benchmarks/handshake_latency.py --n 500 --out benchmarks/results/handshake.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvrdma.handshake import HandshakeClient, HandshakeServer
from kvrdma.metadata import RegionMeta, WorkerMetadata, sha256_hex

ENGINE = "bench-prefill"
COMPAT = "e" * 64


def make_worker(rank: int, tp: int, regions: int, metadata_bytes: int) -> WorkerMetadata:
    blob = (b"%d" % rank) * metadata_bytes
    blob = blob[:metadata_bytes]
    return WorkerMetadata(
        engine_id=ENGINE,
        agent_name=f"{ENGINE}-{rank}",
        agent_metadata=blob,
        tp_rank=rank,
        tp_size=tp,
        block_size=16,
        num_blocks=4096,
        cache_layout="split_kv",
        kv_layout="HND",
        total_num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        element_size=2,
        regions=[
            RegionMeta(0x7F00_0000_0000 + (rank * regions + i) * 0x1_0000_0000, 4096, 32768)
            for i in range(regions)
        ],
        compat_hash=COMPAT,
        agent_metadata_sha256=sha256_hex(blob),
    )


def serve(conn: Connection, ranks: int, regions: int, metadata_bytes: int) -> None:
    with HandshakeServer("127.0.0.1", 0) as server:
        for r in range(ranks):
            server.publish(make_worker(r, ranks, regions, metadata_bytes))
        conn.send(server.port)
        conn.recv()  # until told to stop


def percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


def run(args: argparse.Namespace) -> dict[str, Any]:
    child: Any = None
    server: HandshakeServer | None = None
    parent_conn: Connection | None = None
    if args.same_process:
        server = HandshakeServer("127.0.0.1", 0)
        for r in range(args.ranks):
            server.publish(make_worker(r, args.ranks, args.regions, args.metadata_bytes))
        port = server.port
    else:
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe()
        child = ctx.Process(
            target=serve, args=(child_conn, args.ranks, args.regions, args.metadata_bytes)
        )
        child.start()
        if not parent_conn.poll(30):
            child.kill()
            raise SystemExit("the server process did not start within 30 s")
        port = parent_conn.recv()
    zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    wanted = list(range(args.ranks))
    samples: list[float] = []
    payload = 0
    try:
        with HandshakeClient(
            context=zctx, tp_size=1, block_size=16, compat_hash=COMPAT, timeout=5.0
        ) as client:
            for i in range(args.warmup + args.n):
                t0 = time.perf_counter()
                got = client.fetch("127.0.0.1", port, ENGINE, wanted, use_cache=False)
                elapsed = time.perf_counter() - t0
                if i >= args.warmup:
                    samples.append(elapsed)
            payload = sum(len(msgspec.msgpack.encode(w)) for w in got.values())
    finally:
        zctx.destroy(linger=0)
        if server is not None:
            server.close()
        if child is not None and parent_conn is not None:
            parent_conn.send("stop")
            child.join(timeout=10)
    ordered = sorted(samples)
    ms = 1e3
    return {
        "benchmark": "handshake_latency",
        "handshakes": len(samples),
        "ranks_per_handshake": args.ranks,
        "regions_per_rank": args.regions,
        "agent_metadata_bytes": args.metadata_bytes,
        "response_payload_bytes": payload,
        "server": "same process" if args.same_process else "separate process",
        "p50_ms": round(percentile(ordered, 50) * ms, 4),
        "p90_ms": round(percentile(ordered, 90) * ms, 4),
        "p99_ms": round(percentile(ordered, 99) * ms, 4),
        "mean_ms": round(statistics.fmean(ordered) * ms, 4),
        "min_ms": round(ordered[0] * ms, 4),
        "max_ms": round(ordered[-1] * ms, 4),
        "python": platform.python_version(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgspec": msgspec.__version__,
        "machine": platform.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="measured handshakes (>= 200)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2, help="ranks asked per handshake")
    parser.add_argument("--regions", type=int, default=64, help="regions per rank")
    parser.add_argument("--metadata-bytes", type=int, default=8192, help="NIXL metadata size")
    parser.add_argument("--same-process", action="store_true", help="server on a thread here")
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    args = parser.parse_args(argv)
    if args.n < 200:
        parser.error("--n must be >= 200 for a meaningful p99")
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
