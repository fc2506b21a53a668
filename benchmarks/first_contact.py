"""`first_contact`: handshake + `Worker.connect` per D rank of a 64-layer, 100k-block model
(registered for real, never touched), P tp × D tp, and the first READ; full runs add what
per-block descriptor lists would cost (raw NIXL, P1×D1). benchmarks/README.md."""

from __future__ import annotations

import time
from typing import Any

from benchmarks import harness as h
from kvrdma.testing import synthetic

LAYERS, HEADS, BLOCK, BLOCKS = 64, 8, 16, 100_000
STEPS = "handshake nixl_add_remote prep_lists plan_and_checks first_contact per_remote_rank"
STEPS_READ = (*STEPS.split(), "first_read")


def _spec(rank: int, tp: int) -> Any:
    kw = {"kv_layout": "HND", "dtype": "bfloat16", "tp_rank": rank, "tp_size": tp}
    return h.spec("split_kv", LAYERS, HEADS, BLOCK, BLOCKS, **kw)


def _d_rank(ptp: int, rank: int, dtp: int, port: int, rid: str) -> tuple[float, ...]:
    """One fresh D rank (registered untimed), then timed: `Worker.connect` (its handshake:
    connect minus the consumer's `add_remote`; NIXL's `add_remote`; list preps; the rest),
    and the first READ; then the number of P ranks it reads from."""
    s = _spec(rank, dtp)
    w = h.new_worker("D", f"D{dtp}", s, synthetic.make_caches(s, zeroed=False)[0])
    try:
        nixl = h.time_methods(w.backend, ["add_remote", "prep_local", "prep_remote"])
        added = h.time_methods(w.consumer, ["add_remote"])
        t0 = time.perf_counter()
        plan = w.connect(f"P{ptp}", "127.0.0.1", port, remote_tp_size=ptp, timeout=10.0)
        total = time.perf_counter() - t0
        first = h.read_blocks(w, f"P{ptp}", [0], [plan.remote_num_blocks - 1], rid)[0]
    finally:
        w.close()
    n = len({src.remote_rank for src in plan.sources})
    hs, prep = total - added["add_remote"], nixl["prep_local"] + nixl["prep_remote"]
    rest = total - hs - nixl["add_remote"] - prep
    return hs, nixl["add_remote"], prep, rest, total, total / n, first, n


def _per_block_baseline(ctx: h.Context) -> dict[str, Any]:
    """Raw NIXL with one descriptor per (region, block) on both sides, P1×D1 (ms)."""
    s = _spec(0, 1)
    kw = {"spec": s, "fill": False, "zeroed": False}
    made = ctx.peer.call("make_worker", key="fc-base", engine_id="Pb", **kw)
    w = h.new_worker("D", "Db", s, synthetic.make_caches(s, zeroed=False)[0])
    try:
        raw = h.RawReader(w.metadata, made["meta"])
        steps = {k: round(v * 1e3, 2) for k, v in raw.steps.items()}
        raw.close()
    finally:
        w.close()
        ctx.peer.call("close", key="fc-base")
    return {"descriptors_per_side": BLOCKS * 2 * LAYERS, **steps, "total": sum(steps.values())}


def run(ctx: h.Context) -> dict[str, Any]:
    tps, reps = ([1, 2], 1) if ctx.quick else ([1, 2, 4], 3)  # TP 3 cannot split 8 KV heads
    rows = []
    for ptp in tps:
        with ctx.served(f"P{ptp}", {f"fc-P{ptp}-{r}": _spec(r, ptp) for r in range(ptp)}) as port:
            for dtp in tps:
                ranks = [(i, r) for i in range(reps) for r in range(dtp)]
                got = [_d_rank(ptp, r, dtp, port, f"fc-{ptp}-{dtp}-{i}-{r}") for i, r in ranks]
                *steps, remote_ranks = zip(*got, strict=True)
                row = {"p_tp": ptp, "d_tp": dtp, "remote_ranks_per_d_rank": max(remote_ranks)}
                ms = zip(STEPS_READ, steps, strict=True)
                rows.append(row | {f"{k}_ms": h.summarize(v, 1e3, 3) for k, v in ms})
    base = None if ctx.quick else _per_block_baseline(ctx)
    worst = max(r["per_remote_rank_ms"]["median"] for r in rows)
    spec = "P tp: p_tp; D tp: d_tp; P ranks per D rank: remote_ranks_per_d_rank; "
    spec += "; ".join(f"{k}*: {k}_ms.median" for k in STEPS_READ)
    return {
        "parameters": {"tp": tps, "reps": reps, "layers": LAYERS, "kv_heads": HEADS}
        | {"block_size_tokens": BLOCK, "num_blocks_per_rank": BLOCKS, "layout": "split_kv HND"}
        | {
            "regions_per_rank": 2 * LAYERS,
            "bytes_per_rank_tp1": BLOCKS * 2 * LAYERS * BLOCK * HEADS * 128 * 2,
        },
        "results": rows,
        "per_block_baseline": base,
        "targets": [
            h.target("first contact per remote rank (worst P×D combo, median)", worst, "<= 100 ms")
        ],
        "tables": [h.table("First contact (ms, median per D rank)", rows, spec)],
        "summary": [f"Per-block descriptor lists (raw NIXL, P1×D1), ms: {base}"] if base else [],
        "notes": [
            "first_contact = handshake + add_remote; per_remote_rank divides it by the "
            "P ranks this D rank reads from"
        ],
    }
