"""First contact: handshake + remote agent registration + descriptor lists, large model.

The model: 64 layers, 8 KV heads, head dim 128, bfloat16, 16-token blocks, 100k blocks per
rank, split K/V in HND (128 regions per rank, 420 GB per rank at TP 1), from `torch.empty`
and never touched: no pages, but the regions NIXL registers and the descriptors prepared over
them are the real ones. For P tp × D tp the target runs the P ranks and a `HandshakeServer`;
here each D rank is a fresh Worker (registered untimed), then timed: the handshake of the P
ranks it reads from, `Worker.add_remote` (read plan, NIXL `add_remote_agent`, strided
lists), and the first one-block READ (UCX wire-up; not part of the target). Full runs add
what per-block descriptor lists would cost for the same shape (raw NIXL, P1×D1).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from benchmarks.harness import (
    COMPAT,
    Context,
    Geometry,
    agent_name,
    make_caches,
    new_worker,
    nixl_payload,
    per_block_rows,
    plot,
    read_blocks,
    region_triples,
    summarize,
    table,
    target,
    time_methods,
)

LAYERS, HEADS, BLOCK, BLOCKS = 64, 8, 16, 100_000
STEPS = (
    "handshake",
    "nixl_add_remote",
    "prep_lists",
    "plan_and_checks",
    "first_contact",
    "per_remote_rank",
    "first_read",
)


def geometry(tp: int) -> Geometry:
    return Geometry("split_kv", LAYERS, HEADS // tp, 128, BLOCK, BLOCKS, "HND", "bfloat16")


def connect(w: Any, host: str, port: int, engine: str, p_tp: int) -> tuple[Any, float]:
    """The library's handshake and `add_remote` for one D rank (the one place this
    benchmark connects); returns the read plan and the handshake's share in seconds."""
    from kvrdma.handshake import HandshakeClient

    with HandshakeClient(
        tp_size=w.metadata.tp_size,
        block_size=BLOCK,
        compat_hash=COMPAT,
        timeout=10.0,
        identity=w.metadata.agent_name,
    ) as client:
        t0 = time.perf_counter()
        metas = client.fetch(
            host, port, engine, w.topology.handshake_target_ranks(p_tp), use_cache=False
        )
        t1 = time.perf_counter()
    return w.add_remote(metas), t1 - t0


def _combo(ptp: int, dtp: int, port: int, reps: int) -> dict[str, Any]:
    m: dict[str, list[float]] = {k: [] for k in STEPS}
    contacted = 0
    for rep in range(reps):
        for rank in range(dtp):
            gd = geometry(dtp)
            w = new_worker(
                "D",
                f"D{dtp}",
                gd,
                make_caches(gd, touch=False),
                tp_rank=rank,
                tp_size=dtp,
                total_heads=HEADS,
            )
            try:
                spent = time_methods(w.backend, ["add_remote", "prep_local", "prep_remote"])
                t0 = time.perf_counter()
                plan, hs = connect(w, "127.0.0.1", port, f"P{ptp}", ptp)
                total = time.perf_counter() - t0
                first = read_blocks(
                    w, f"P{ptp}", [0], [plan.remote_num_blocks - 1], f"fc-{ptp}-{dtp}-{rep}-{rank}"
                )
            finally:
                w.close()
            n_remote = len({s.remote_rank for s in plan.sources})
            contacted = max(contacted, n_remote)
            prep = spent["prep_local"] + spent["prep_remote"]
            for k, v in zip(
                STEPS,
                (
                    hs,
                    spent["add_remote"],
                    prep,
                    total - hs - spent["add_remote"] - prep,
                    total,
                    total / n_remote,
                    first,
                ),
                strict=True,
            ):
                m[k].append(v)
    return {
        "p_tp": ptp,
        "d_tp": dtp,
        "remote_ranks_per_d_rank": contacted,
        **{f"{k}_ms": summarize(v, 1e3, 3) for k, v in m.items()},
    }


def _per_block_baseline(ctx: Context) -> dict[str, Any]:
    """Raw NIXL with one descriptor per (region, block) on both sides, P1×D1."""
    import nixl

    g = geometry(1)
    pm = ctx.peer.call(
        "make_worker", key="fc-base", engine_id="Pbase", geom=g, touch=False, fill=False
    )["meta"]
    w = new_worker("D", "Dbase", g, make_caches(g, touch=False))  # for its region table
    try:
        local = region_triples(w.metadata)
        agent = nixl.nixl_agent(
            agent_name("base"), nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        reg = agent.register_memory(
            np.array([(a, n * bl, 0) for a, n, bl in local], dtype=np.uint64), "DRAM"
        )
        t = [time.perf_counter()]
        name = agent.add_remote_agent(nixl_payload(pm))
        t.append(time.perf_counter())
        rrows, lrows = per_block_rows(region_triples(pm)), per_block_rows(local)
        t.append(time.perf_counter())
        hr = agent.prep_xfer_dlist(
            name.decode() if isinstance(name, bytes) else name, rrows, "DRAM"
        )
        t.append(time.perf_counter())
        hl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", lrows, "DRAM")
        t.append(time.perf_counter())
        for h in (hr, hl):
            agent.release_dlist_handle(h)
        agent.deregister_memory(reg)
    finally:
        w.close()
        ctx.peer.call("close", key="fc-base")
    steps = ("add_remote_agent", "build_numpy_rows", "prep_remote", "prep_local")
    return {
        "descriptors_per_side": g.num_blocks * 2 * g.layers,
        **{f"{s}_ms": round((b - a) * 1e3, 2) for s, a, b in zip(steps, t, t[1:], strict=False)},
        "total_ms": round((t[-1] - t[0]) * 1e3, 2),
    }


def run(ctx: Context) -> dict[str, Any]:
    tps, reps = ([1, 2], 1) if ctx.quick else ([1, 2, 4], 3)  # TP 3 cannot split 8 KV heads
    rows = []
    for ptp in tps:
        keys = [f"fc-P{ptp}-{r}" for r in range(ptp)]
        for r, k in enumerate(keys):
            ctx.peer.call(
                "make_worker",
                key=k,
                engine_id=f"P{ptp}",
                geom=geometry(ptp),
                tp_rank=r,
                tp_size=ptp,
                total_heads=HEADS,
                touch=False,
                fill=False,
            )
        port = ctx.peer.call("handshake_start", keys=keys)
        try:
            rows += [_combo(ptp, dtp, port, reps) for dtp in tps]
        finally:
            ctx.peer.call("handshake_stop")
            for k in keys:
                ctx.peer.call("close", key=k)
    base = None if ctx.quick else _per_block_baseline(ctx)
    worst = max(r["per_remote_rank_ms"]["median"] for r in rows)
    return {
        "parameters": {
            "tp": tps,
            "reps": reps,
            "layers": LAYERS,
            "kv_heads": HEADS,
            "block_size_tokens": BLOCK,
            "num_blocks_per_rank": BLOCKS,
            "layout": "split_kv, HND, bfloat16",
            "regions_per_rank": 2 * LAYERS,
            "registered_bytes_per_rank_tp1": geometry(1).registered_bytes,
        },
        "results": rows,
        "per_block_baseline": base,
        "targets": [
            target(
                "first contact per remote rank (worst P×D combo, median)", worst, "<=", 100.0, "ms"
            )
        ],
        "tables": [
            table(
                "First contact (ms, median per D rank)",
                rows,
                "P tp: p_tp; D tp: d_tp; P ranks per D rank: remote_ranks_per_d_rank; "
                + "; ".join(f"{k}: {k}_ms.median" for k in STEPS),
            )
        ],
        "summary": [f"Per-block descriptor lists (raw NIXL, P1×D1): {base}"] if base else [],
        "plots": [
            plot(
                "first contact (ms, median)",
                "P×D",
                "ms",
                {
                    k: [[f"P{r['p_tp']}×D{r['d_tp']}", r[f"{k}_ms"]["median"]] for r in rows]
                    for k in ("handshake", "nixl_add_remote", "first_contact", "first_read")
                },
            )
        ],
        "notes": [
            "first_contact = handshake + add_remote; per_remote_rank divides it by the P "
            "ranks this D rank reads from"
        ],
    }
