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

import itertools
import time
from typing import Any

import numpy as np

from benchmarks import harness as h

LAYERS, HEADS, BLOCK, BLOCKS = 64, 8, 16, 100_000
STEPS = "handshake nixl_add_remote prep_lists plan_and_checks first_contact per_remote_rank"
STEPS_READ = (*STEPS.split(), "first_read")
LAZY = {"touch": False, "fill": False}  # address space only: no page is ever touched


def geometry(tp: int) -> h.Geometry:
    return h.Geometry("split_kv", LAYERS, HEADS // tp, 128, BLOCK, BLOCKS, "HND", "bfloat16")


def connect(w: Any, host: str, port: int, engine: str, p_tp: int) -> tuple[Any, float]:
    """The library's handshake and `add_remote` for one D rank (the one place this
    benchmark connects); returns the read plan and the handshake's share in seconds."""
    from kvrdma.handshake import HandshakeClient

    kw = {"block_size": BLOCK, "compat_hash": h.COMPAT, "identity": w.metadata.agent_name}
    with HandshakeClient(tp_size=w.metadata.tp_size, timeout=10.0, **kw) as client:
        t0 = time.perf_counter()
        ranks = w.topology.handshake_target_ranks(p_tp)
        metas = client.fetch(host, port, engine, ranks, use_cache=False)
        t1 = time.perf_counter()
    return w.add_remote(metas), t1 - t0


def _combo(ptp: int, dtp: int, port: int, reps: int) -> dict[str, Any]:
    m: dict[str, list[float]] = {k: [] for k in STEPS_READ}
    contacted, g = 0, geometry(dtp)
    for rep in range(reps):
        for rank in range(dtp):
            tp = {"tp_rank": rank, "tp_size": dtp, "total_heads": HEADS}
            w = h.new_worker("D", f"D{dtp}", g, h.make_caches(g, touch=False), **tp)
            try:
                spent = h.time_methods(w.backend, ["add_remote", "prep_local", "prep_remote"])
                t0 = time.perf_counter()
                plan, hs = connect(w, "127.0.0.1", port, f"P{ptp}", ptp)
                total = time.perf_counter() - t0
                last = [plan.remote_num_blocks - 1]
                first = h.read_blocks(w, f"P{ptp}", [0], last, f"fc-{ptp}-{dtp}-{rep}-{rank}")
            finally:
                w.close()
            n_remote = len({s.remote_rank for s in plan.sources})
            contacted = max(contacted, n_remote)
            nixl, prep = spent["add_remote"], spent["prep_local"] + spent["prep_remote"]
            got = (hs, nixl, prep, total - hs - nixl - prep, total, total / n_remote, first)
            for k, v in zip(STEPS_READ, got, strict=True):
                m[k].append(v)
    row = {"p_tp": ptp, "d_tp": dtp, "remote_ranks_per_d_rank": contacted}
    return row | {f"{k}_ms": h.summarize(v, 1e3, 3) for k, v in m.items()}


def _per_block_baseline(ctx: h.Context) -> dict[str, Any]:
    """Raw NIXL with one descriptor per (region, block) on both sides, P1×D1."""
    import nixl

    g = geometry(1)
    pm = ctx.peer.call("make_worker", key="fc-base", engine_id="Pbase", geom=g, **LAZY)["meta"]
    w = h.new_worker("D", "Dbase", g, h.make_caches(g, touch=False))  # for its region table
    try:
        local = h.region_triples(w.metadata)
        conf = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        agent = nixl.nixl_agent(h.agent_name("base"), conf)
        table = np.array([(a, n * bl, 0) for a, n, bl in local], dtype=np.uint64)
        reg = agent.register_memory(table, "DRAM")
        t = [time.perf_counter()]
        name = agent.add_remote_agent(h.nixl_payload(pm))
        t.append(time.perf_counter())
        rrows, lrows = h.per_block_rows(h.region_triples(pm)), h.per_block_rows(local)
        t.append(time.perf_counter())
        hr = agent.prep_xfer_dlist(
            name.decode() if isinstance(name, bytes) else name, rrows, "DRAM"
        )
        t.append(time.perf_counter())
        hl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", lrows, "DRAM")
        t.append(time.perf_counter())
        for handle in (hr, hl):
            agent.release_dlist_handle(handle)
        agent.deregister_memory(reg)
    finally:
        w.close()
        ctx.peer.call("close", key="fc-base")
    steps = ("add_remote_agent", "build_numpy_rows", "prep_remote", "prep_local", "total")
    ms = [round((b - a) * 1e3, 2) for a, b in [*itertools.pairwise(t), (t[0], t[-1])]]
    return {"descriptors_per_side": g.num_blocks * 2 * g.layers} | dict(zip(steps, ms, strict=True))


def run(ctx: h.Context) -> dict[str, Any]:
    tps, reps = ([1, 2], 1) if ctx.quick else ([1, 2, 4], 3)  # TP 3 cannot split 8 KV heads
    rows = []
    for ptp in tps:
        keys = [f"fc-P{ptp}-{r}" for r in range(ptp)]
        for r, k in enumerate(keys):
            tp = {"tp_rank": r, "tp_size": ptp, "total_heads": HEADS, **LAZY}
            ctx.peer.call("make_worker", key=k, engine_id=f"P{ptp}", geom=geometry(ptp), **tp)
        port = ctx.peer.call("handshake_start", keys=keys)
        try:
            rows += [_combo(ptp, dtp, port, reps) for dtp in tps]
        finally:
            ctx.peer.call("handshake_stop")
            for k in keys:
                ctx.peer.call("close", key=k)
    base = None if ctx.quick else _per_block_baseline(ctx)
    worst = max(r["per_remote_rank_ms"]["median"] for r in rows)
    spec = "P tp: p_tp; D tp: d_tp; P ranks per D rank: remote_ranks_per_d_rank; "
    spec += "; ".join(f"{k}*: {k}_ms.median" for k in STEPS_READ)
    return {
        "parameters": {"tp": tps, "reps": reps, "layers": LAYERS, "kv_heads": HEADS}
        | {"block_size_tokens": BLOCK, "num_blocks_per_rank": BLOCKS, "layout": "split_kv HND"}
        | {"regions_per_rank": 2 * LAYERS, "bytes_per_rank_tp1": geometry(1).registered_bytes},
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
