"""`latency` (handshake p50/p90/p99; notification round trip and 16 KiB READs with and without
one, per agent setup and target loop cadence), `idle_cpu` (an idle target's CPU per progress
scheme), `first_contact` (handshake + `Worker.connect` per D rank of a 64-layer, 100k-block
model never touched, P tp × D tp, the first READ; full runs: per-block raw NIXL lists)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from benchmarks import harness as h
from kvrdma.handshake import HandshakeClient
from kvrdma.nixl import BackendConfig, MemType, NixlBackend, XferState
from kvrdma.progress import DEFAULT_BUSY_INTERVAL as BUSY
from kvrdma.progress import DEFAULT_IDLE_INTERVAL as IDLE
from kvrdma.testing import synthetic

TUNED_DELAY = 100  # µs
KINDS = ("rtt", "read_with_notification", "read_without_notification")
LAYERS, HEADS, BLOCK, BLOCKS = 64, 8, 16, 100_000  # first_contact's model
STEPS = "handshake nixl_add_remote prep_lists plan_and_checks first_contact per_remote_rank"
STEPS_READ = (*STEPS.split(), "first_read")


def _spec(rank: int, tp: int, layers: int = LAYERS, blocks: int = BLOCKS) -> Any:
    """One rank's caches of a bfloat16 HND model with 8 KV heads and 16-token blocks."""
    kw = {"kv_layout": "HND", "dtype": "bfloat16", "tp_rank": rank, "tp_size": tp}
    return h.spec("split_kv", layers, HEADS, BLOCK, blocks, **kw)


def _handshakes(ctx: h.Context, n: int, configs: int) -> list[dict[str, Any]]:
    out, client = [], {"tp_size": 1, "block_size": 16, "compat_hash": h.COMPAT, "timeout": 5.0}
    for what, layers, ranks in [("large model, 1 rank", 64, 1), ("2 ranks", 32, 2)][:configs]:
        specs = {f"hs-{ranks}-{r}": _spec(r, ranks, layers, 1000) for r in range(ranks)}
        samples: list[float] = []
        with ctx.served(f"hs{ranks}", specs) as port, HandshakeClient(**client) as c:
            for i in range(n + 20):  # the first 20 warm up
                t0 = time.perf_counter()
                c.fetch("127.0.0.1", port, f"hs{ranks}", list(range(ranks)), use_cache=False)
                samples += [time.perf_counter() - t0] if i >= 20 else []
        q = {f"p{x}_ms": round(h.percentile(samples, x) * 1e3, 4) for x in (50, 90, 99)}
        row = {"kind": "handshake", "config": what, "regions_per_rank": 2 * layers, "ranks": ranks}
        out.append(row | q | {"ms": h.summarize(samples, 1e3)})
    return out


def _variant(peer: Any, what: str, wait: float, thread: bool, delay: int | None, n: int) -> Any:
    """Notification RTT and 16 KiB READs with/without a notification, agents built alike on
    both sides, the target's loop running every `wait` s: the row of `what`."""
    key, blk, nblk = f"echo-{wait}-{thread}-{delay}", 16 << 10, 64
    kw = {"progress_thread": thread, "pthr_delay_us": delay, "buffer_bytes": blk * nblk}
    got = peer.call("make_backend", key=key, echo=True, **kw)
    with h.nixl_progress_delay(delay):
        local = NixlBackend(BackendConfig(name=h.agent_name("rtt"), progress_thread=thread))
    buf = np.zeros(blk * nblk, dtype=np.uint8)
    addr = buf.ctypes.data
    _reg = local.register(np.array([(addr, buf.nbytes, 0)], np.uint64), MemType.DRAM)  # held
    old = peer.call("set_loop", wait=wait)
    try:
        name = local.add_remote(got["metadata"])
        peer.call("add_remote", key=key, metadata=local.metadata())
        ls, rs = (np.array([(a, blk, 0, blk, nblk)], np.uint64) for a in (addr, got["addr"]))
        ll, rl = local.prep_local(ls, MemType.DRAM), local.prep_remote(name, rs, MemType.DRAM)

        def rtt(i: int) -> float | None:
            msg, t0 = b"ping-%d" % i, time.perf_counter()
            local.send_notif(name, msg)
            while time.perf_counter() - t0 < 2.0:
                if msg in local.get_notifs().get(name, ()):
                    return time.perf_counter() - t0
            return None

        def read(i: int, notif: bytes) -> float | None:
            t0 = time.perf_counter()
            x = local.post("READ", ll, np.array([i % nblk]), rl, np.array([7 * i % nblk]), notif)
            while (r := local.poll(x)).state is XferState.PROC:
                if time.perf_counter() - t0 > 2.0:
                    x.release()
                    return None
            return time.perf_counter() - t0 if r.state is XferState.DONE else None

        out: dict[str, Any] = {"kind": "notification_rtt", "variant": what}
        fns = (rtt, lambda i: read(i, b"d%d" % i), lambda i: read(i, b""))
        for kind, fn in zip(KINDS, fns, strict=True):
            for i in range(10):  # warm-up (wire-up)
                fn(i)
            ok = [x for x in (fn(i) for i in range(n)) if x is not None]
            q = {f"p{x}_us": round(h.percentile(ok, x) * 1e6, 1) if ok else None for x in (50, 99)}
            out[kind] = {"lost": n - len(ok), "us": h.summarize(ok, 1e6, 2), **q}
    finally:
        peer.call("set_loop", wait=old)
        peer.call("close", key=key)
        local.close()  # releases the prepped lists, then the registration
    return out


def run_latency(ctx: h.Context) -> dict[str, Any]:
    n_hs, n_fast, n_slow, n_20 = (200, 200, 30, 0) if ctx.quick else (1000, 2000, 300, 40)
    hs = _handshakes(ctx, n_hs, 1 if ctx.quick else 2)
    thread, tuned = "NIXL progress thread, pthrDelay", f"{TUNED_DELAY} µs"
    variants = [  # (what, target loop every s, progress thread, its pthrDelay, samples or 0)
        ("kvrdma default (no progress thread), target busy loop", 0.0, False, None, n_fast),
        ("kvrdma default, target loop every 1 ms", 0.001, False, None, n_slow),
        ("kvrdma default, target loop every 20 ms", 0.02, False, None, n_20),
        (f"{thread} 0 (nixl's wrapper), target 1 ms", 0.001, True, 0, n_slow),
        (f"{thread} {tuned}, target 1 ms", 0.001, True, TUNED_DELAY, n_slow),
        (f"{thread} {tuned}, target 20 ms", 0.02, True, TUNED_DELAY, n_20),
    ]
    rtts = [_variant(ctx.peer, *v) for v in variants if v[-1]]
    hs_spec = "handshake: config; regions per rank: regions_per_rank; ranks: ranks; "
    hs_spec += "p50*: p50_ms; p90*: p90_ms; p99*: p99_ms; max: ms.max"
    rtt_spec = "agents / target loop: variant; "
    rtt_spec += "; ".join(f"{k} {q}*: {k}.{q}_us" for k in KINDS for q in ("p50", "p99"))
    rtt = "notification round trip p50 (kvrdma default, target busy loop)"
    handshake = h.target("handshake p99 (large model, 1 rank)", hs[0]["p99_ms"], "<= 5 ms")
    return {
        "parameters": {"handshakes": n_hs, "rtts": [n_fast, n_slow, n_20]},
        "results": hs + rtts,
        "targets": [handshake, h.target(rtt, rtts[0]["rtt"]["p50_us"], "<= 100 us")],
        "tables": [
            h.table("Handshake (ms)", hs, hs_spec),
            h.table("Notifications and 16 KiB READs (µs)", rtts, rtt_spec),
        ],
        "notes": [
            "a READ that carries a notification is DONE only once the target's agent "
            "progressed: without a progress thread, the target loop's cadence"
        ],
    }


def run_idle_cpu(ctx: h.Context) -> dict[str, Any]:
    seconds, windows = (0.25, 2) if ctx.quick else (1.0, 5)
    waits = [0.001] if ctx.quick else [0.02, 0.005, 0.001, 0.0005, 0.0]
    peer, rows = ctx.peer, []

    def measure(what: str, wait: float | None, progress: bool, adaptive: bool = False) -> None:
        peer.call("set_loop", wait=0.1 if wait is None else wait, adaptive=adaptive)
        rs = [peer.call("idle", seconds=seconds, progress=progress) for _ in range(windows)]
        rate = [r["loops"] / r["wall"] for r in rs]
        own = [r["progress_cpu_s"] * x for r, x in zip(rs, rate, strict=True)]
        row = {"agent": what, "loop_every_s": wait, "adaptive": adaptive}
        row["percent_of_core"] = h.summarize([r["cpu_per_wall"] for r in rs], 100, 3)
        share = h.summarize(own, 100, 3) if progress else None  # get_finished() alone × loop rate
        row |= {"loops_per_s": h.summarize(rate, 1, 1), "progress_percent_of_core": share}
        rows.append(row)

    old = peer.call("set_loop", wait=0.1)
    try:
        peer.call("idle", seconds=0.2, progress=False)  # warm-up
        measure("process without agent", None, False)
        s = h.spec("split_kv", 4, 8, 16, 64)
        peer.call("make_worker", key="idle", engine_id="P-idle", spec=s, fill=False)
        measure("kvrdma Worker, nobody polls", None, False)
        for wait in waits:
            measure("kvrdma Worker, get_finished loop", wait, True)
        loop = f"ProgressLoop ({BUSY * 1e3:g} ms busy, backs off to {IDLE * 1e3:g} ms idle)"
        measure(f"kvrdma Worker, {loop}", None, True, adaptive=True)
        peer.call("close", key="idle")
        for delay, what in ((None, "default config"), (TUNED_DELAY, f"pthrDelay {TUNED_DELAY} µs")):
            peer.call("make_backend", key="thread", progress_thread=True, pthr_delay_us=delay)
            measure(f"NIXL progress thread ({what}), nobody polls", None, False)
            peer.call("close", key="thread")
    finally:
        peer.call("set_loop", wait=old)
    adaptive = next(r for r in rows if r["adaptive"])["percent_of_core"]["median"]
    spec = "agent: agent; loop every (s): loop_every_s; process*: percent_of_core.median; "
    spec += "of which get_finished*: progress_percent_of_core.median"
    idle = "idle kvrdma agent (ProgressLoop, kvrdma's recommended worker loop)"
    return {
        "parameters": {"seconds": seconds, "windows": windows, "waits": waits},
        "results": rows,
        "targets": [h.target(idle, adaptive, "<= 2 % of a core")],
        "tables": [h.table("Idle CPU (% of a core, median of windows)", rows, spec)],
        "notes": ["the target process's own CPU (getrusage): other load does not add to it"],
    }


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


def run_first_contact(ctx: h.Context) -> dict[str, Any]:
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
    tp1 = BLOCKS * 2 * LAYERS * BLOCK * HEADS * 128 * 2  # bytes per rank at TP 1
    fc = "first contact per remote rank (worst P×D combo, median)"
    spec = "P tp: p_tp; D tp: d_tp; P ranks per D rank: remote_ranks_per_d_rank; "
    spec += "; ".join(f"{k}*: {k}_ms.median" for k in STEPS_READ)
    return {
        "parameters": {"tp": tps, "reps": reps, "layers": LAYERS, "kv_heads": HEADS}
        | {"block_size_tokens": BLOCK, "num_blocks_per_rank": BLOCKS, "layout": "split_kv HND"}
        | {"regions_per_rank": 2 * LAYERS, "bytes_per_rank_tp1": tp1},
        "results": rows,
        "per_block_baseline": base,
        "targets": [h.target(fc, worst, "<= 100 ms")],
        "tables": [h.table("First contact (ms, median per D rank)", rows, spec)],
        "summary": [f"Per-block descriptor lists (raw NIXL, P1×D1), ms: {base}"] if base else [],
        "notes": [
            "first_contact = handshake + add_remote; per_remote_rank divides it by the "
            "P ranks this D rank reads from"
        ],
    }
