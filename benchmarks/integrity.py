"""Integrity mode's cost: READ throughput with and without `integrity_checksums` over the
same blocks, and what `hold` costs the producer (it checksums the blocks it holds).

Two producer/decoder pairs of kvrdma Workers (one mode each, split K/V HND, default config
otherwise) read the same block ids in alternation, repetition by repetition, so both modes
see the same machine load; "on" READs carry the checksum rows and are checked on landing.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks import harness as h
from kvrdma.testing import synthetic


def _pair(g: Any, on: bool) -> tuple[Any, Any]:
    extra = {"integrity_checksums": on}
    caches, _ = synthetic.make_caches(g)
    synthetic.fill(g, caches)
    p = h.new_worker("P", f"P-integrity-{on}", g, caches, extra=extra)
    d = h.new_worker("D", f"D-integrity-{on}", g, synthetic.make_caches(g)[0], extra=extra)
    d.keep_caches = caches  # the producer's memory lives as long as the pair
    d.add_remote({0: p.metadata})
    return p, d


def _rep(p: Any, d: Any, ids: list[int], rid: str) -> tuple[float, float]:
    """(hold seconds, READ seconds) of one request of `ids`."""
    t0 = time.perf_counter()
    p.hold(rid, ids)
    t1 = time.perf_counter()
    return t1 - t0, h.read_blocks(d, p.metadata.engine_id, ids, ids, rid, producer=p)[0]


def run(ctx: h.Context) -> dict[str, Any]:
    layers, blocks, n, reps = (2, 32, 16, 5) if ctx.quick else (8, 256, 128, 21)
    g = h.spec("split_kv", layers, 8, 16, blocks, kv_layout="HND", dtype="bfloat16")
    pairs = {on: _pair(g, on) for on in (False, True)}
    nbytes = n * h.sizes(pairs[False][0].metadata)[1]
    t: dict[bool, tuple[list[float], list[float]]] = {False: ([], []), True: ([], [])}
    try:
        for i in range(reps + 1):
            for on, (p, d) in pairs.items():
                hold, read = _rep(p, d, list(range(i % 2, blocks, 2))[:n], f"r{i}")
                if i:  # the first repetition wires the agents up
                    t[on][0].append(hold)
                    t[on][1].append(read)
    finally:
        for p, d in pairs.values():
            d.close()
            p.close()
    rows = [
        {
            "mode": "integrity on" if on else "off (default)",
            "read_gbps": h.summarize([nbytes / s / 1e9 for s in t[on][1]]),
            "hold_ms": h.summarize(t[on][0], 1e3),
        }
        for on in (False, True)
    ]
    ratio = h.paired(t[True][1], t[False][1])
    spec = "mode: mode; READ GB/s*: read_gbps.median; hold ms*: hold_ms.median"
    return {
        "parameters": {"layers": layers, "kv_heads": 8, "head_dim": 128, "block_tokens": 16}
        | {"blocks_per_read": n, "bytes_per_read": nbytes, "reps": reps, "layout": "split_kv HND"},
        "results": rows,
        "integrity_over_off_read_speed": ratio,
        # verifying is one more pass over the landed bytes, about one more copy of them
        "targets": [h.target("READ speed, integrity on / off", ratio["paired_median"], ">= 0.5 x")],
        "tables": [h.table("Integrity mode: READ throughput and hold cost", rows, spec)],
        "notes": ["hold ms: the producer's `hold` (checksums of the held blocks when on)"],
    }
