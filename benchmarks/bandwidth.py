"""READ bandwidth: kvrdma against the best raw NIXL setup of this machine, raw NIXL in
kvrdma's own setup, raw NIXL with NIXL's defaults, and torch memcpy, side by side.

Rows: every cache layout (split K/V, blocks-first, cross-layer) × block size (one layer's K
or V of one block) × contiguous / scattered ids of a 4-layer model; a many-layer model (32
layers, split K/V, 64 random 16 KiB blocks per request); and a 1-block request (kvrdma's
fixed cost per request). The target registers 2·n pattern-filled blocks, this process reads
n. Before a row is measured, a calibration sweep reads it with raw NIXL in every setup of
`harness.SWEEP` (threads {0, 2, 4} × batch split {1, default} × merging on/off, no progress
thread); the fastest (median) is the row's baseline, "raw_best". Then every method reads
once per repetition, back to back in a fresh random order, so kvrdma/raw is a paired ratio
(the median over repetitions, with a distribution-free 95 % interval); a row whose interval
still holds 0.95 reads on in pairs (refinement) until it does not or the limit is reached.
Copy threads of every reader are pinned one per CPU (`--no-pin`: not). The first READ of
every method is checked byte by byte at each block's first and last byte. `--control`
reads "kvrdma" with a second raw reader in kvrdma's setup: the noise floor (A/A).

While a 64-block many-layer read runs, one `get_finished()` is timed against one NIXL
`check_xfer_state` of a raw read in kvrdma's setup (same copy threads). The same-ids table
reads the same scattered ids with kvrdma on every layout and raw per-block NIXL on split
K/V: what fewer, larger descriptors gain.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from benchmarks import harness as h
from kvrdma import hugepages as thp

LAYOUTS = ("split_kv", "blocks_first", "cross_layer")
HEADS, HEAD_DIM, LAYERS, MANY_LAYERS = 8, 128, 4, 32  # fp16: 2 KiB per token, layer, K/V
KIB = 1024
BEST, RAW, DEFAULTS = "raw_best", "raw_kvrdma_ucx", "raw_nixl_defaults"
METHODS = ("kvrdma", BEST, RAW, DEFAULTS, "memcpy")
HUGEPAGES = "collapse"  # both sides' caches are written before registration, as an engine's
CONTROL = (
    "A/A calibration (--control): 'kvrdma' is a second raw NIXL reader in kvrdma's setup; "
    "its ratios show how far this machine's noise moves a row (no targets)"
)


# name: (quick, full). Rows read at least `reps` times, more while kvrdma's reads of the row
# took under `min_seconds` (up to `max_reps`); refinement runs to `refine_min_reps` pairs and
# on while undecided, up to `refine_max_reps`: pairs a second apart are not independent
PARAMS = {
    "tokens": ([8], [2, 8, 32, 128, 512, 1024]),
    "request_bytes": (8 << 20, 64 << 20),
    "reps": (3, 9),
    "max_reps": (4, 25),
    "min_seconds": (0.02, 0.3),
    "refine_min_reps": (4, 101),
    "refine_max_reps": (6, 301),
    "calibration_reads": (1, 5),
    "many_layer_blocks": (16, 64),
    "poll_reads": (2, 20),
    "coalesce_tokens": ([8], [2, 8]),
    "coalesce_reps": (3, 25),
}


def shuffled(methods: Sequence[Any], order: Any) -> list[Any]:
    """`methods` in a fresh random order: a fixed alternation favoured one reader's slot."""
    return [methods[i] for i in order.permutation(len(methods))]


class _Config:
    """One geometry: the target's producer, this side's kvrdma consumer and raw readers."""

    def __init__(
        self, ctx: h.Context, g: h.Geometry, key: str, memcpy: Any, setups: list[Any]
    ) -> None:
        self.ctx, self.g, self.key, self.engine = ctx, g, key, f"P-{key}"
        self.memcpy, self.seq, self.twin = memcpy, 0, None
        self.readers: dict[h.RawSetup, h.RawReader] = {}
        self.pinned: dict[str, int] = {}
        extra = {"hugepages": HUGEPAGES}
        made = ctx.peer.call("make_worker", key=key, engine_id=self.engine, geom=g, extra=extra)
        self.pmeta, self.caches = made["meta"], h.make_caches(g)
        with h.pinned_new_threads(ctx.pin_threads) as pinned:
            self.worker = h.new_worker("D", f"D-{key}", g, self.caches, extra=extra)
        self.pinned["kvrdma"] = len(pinned)
        self.huge = [h.huge_page_fraction(t) for t in (self.caches.values(), memcpy)]
        self.huge.insert(1, made["huge_page_fraction"])  # local, remote, memcpy
        try:
            self.worker.add_remote({0: self.pmeta})
            # its standby agent (idle copy threads) must not be counted as a raw reader's
            self.worker.backend.wait_standby(60.0)
            for s in setups:
                self.reader(s)
            if ctx.control:
                self.twin = self.reader(h.kvrdma_setup(), "control_twin")
        except BaseException:
            self.close()
            raise

    def reader(self, setup: h.RawSetup, name: str | None = None) -> h.RawReader:
        """The raw reader of `setup` (a new, unshared one when `name` is given)."""
        if name is None and setup in self.readers:
            return self.readers[setup]
        with h.pinned_new_threads(self.ctx.pin_threads) as pinned:
            r = h.RawReader(self.worker.metadata, self.pmeta, setup)
        self.pinned[name or setup.label] = len(pinned)
        return r if name else self.readers.setdefault(setup, r)

    def once(self, method: str | h.RawSetup, lb: Any, rb: Any) -> float:
        """One read of `method` ("kvrdma", "memcpy" or a raw setup): seconds."""
        if isinstance(method, h.RawSetup):
            return self.readers[method].read(lb, rb)
        if method == "kvrdma" and self.twin is not None:
            return self.twin.read(lb, rb)
        if method == "kvrdma":
            self.seq += 1
            return h.read_blocks(self.worker, self.engine, lb, rb, f"{self.key}-{self.seq}")
        moved = len(lb) * self.g.block_bytes
        d, s = self.memcpy[0][:moved], self.memcpy[1][:moved]
        t0 = time.perf_counter()
        d.copy_(s)
        return time.perf_counter() - t0

    def checked(self, method: str | h.RawSetup, lb: Any, rb: Any) -> int:
        """A warm-up read into cleared caches: the wrong bytes it left."""
        h.clear(self.g, self.caches)
        self.once(method, lb, rb)
        return h.wrong_bytes(self.g, self.caches, lb, rb)

    def calibrate(self, lb: Any, rb: Any, reads: int, order: Any) -> tuple[h.RawSetup, list[float]]:
        """The fastest sweep setup on these ids (median seconds; round robin, shuffled) and
        every setup's median GB/s in SWEEP's order."""
        for s in h.SWEEP:
            self.once(s, lb, rb)  # warm-up: the first read wires up UCX
        times: dict[h.RawSetup, list[float]] = {s: [] for s in h.SWEEP}
        for _ in range(reads):
            for s in shuffled(h.SWEEP, order):
                times[s].append(self.once(s, lb, rb))
        med = {s: statistics.median(ts) for s, ts in times.items()}
        moved = len(lb) * self.g.block_bytes
        return min(med, key=med.__getitem__), [round(moved / med[s] / 1e9, 3) for s in h.SWEEP]

    def measure(self, ids: Any, p: dict[str, Any], order: Any, methods: dict[str, Any]) -> Any:
        """Seconds per read of every method (index i: repetition i); then kvrdma against
        both raw baselines while a paired interval still holds 0.95."""
        self.once("memcpy", *ids)  # warm-up
        times: dict[str, list[float]] = {m: [] for m in methods}
        rep = 0
        while rep < p["reps"] or (rep < p["max_reps"] and sum(times["kvrdma"]) < p["min_seconds"]):
            for m in shuffled(list(methods), order):
                times[m].append(self.once(methods[m], *ids))
            rep += 1
        while rep < p["refine_max_reps"] and (
            rep < p["refine_min_reps"] or _undecided(times, BEST) or _undecided(times, RAW)
        ):
            for m in shuffled(["kvrdma", BEST, RAW], order):
                times[m].append(self.once(methods[m], *ids))
            rep += 1
        return times

    def close(self) -> None:
        for r in [*self.readers.values(), *([self.twin] if self.twin else [])]:
            r.close()
        self.worker.close()
        self.ctx.peer.call("close", key=self.key)


def _undecided(times: dict[str, list[float]], base: str) -> bool:
    ci = h.median_ci95([b / a for a, b in zip(times["kvrdma"], times[base], strict=False)])
    return ci is None or ci[0] <= 0.95 <= ci[1]


def _geometry(layout: str, layers: int, tokens: int, n: int, nbytes: int) -> tuple[h.Geometry, int]:
    """Caches of 2·n blocks; n from `nbytes` when 0."""
    n = n or max(1, nbytes // h.Geometry(layout, layers, HEADS, HEAD_DIM, tokens, 1).block_bytes)
    return h.Geometry(layout, layers, HEADS, HEAD_DIM, tokens, 2 * n), n


def _specs(p: dict[str, Any]) -> list[tuple[str, str, int, int, tuple[str, ...]]]:
    """(model, layout, tokens, blocks per request or 0: from request_bytes, patterns)."""
    both = ("contiguous", "scattered")
    rows = [(f"{LAYERS} layers", lay, t, 0, both) for t in p["tokens"] for lay in LAYOUTS]
    many = (f"{MANY_LAYERS} layers", "split_kv", 8, p["many_layer_blocks"], ("scattered",))
    return [*rows, many, ("1-block request", "split_kv", 8, 1, ("scattered",))]


def run(ctx: h.Context) -> dict[str, Any]:
    p = {k: v[0 if ctx.quick else 1] for k, v in PARAMS.items()}
    rng, order = np.random.default_rng(ctx.seed), np.random.default_rng([ctx.seed, 1])
    nbytes = p["request_bytes"]
    most = max(nbytes, p["many_layer_blocks"] * 2 * MANY_LAYERS * 16 * KIB)
    memcpy = (torch.zeros(most, dtype=torch.uint8), torch.ones(most, dtype=torch.uint8))
    thp.apply_to_tensors(memcpy, HUGEPAGES)  # like the caches
    rows: list[dict[str, Any]] = []
    poll: dict[str, Any] = {}
    best_of: dict[int, h.RawSetup] = {}  # tokens -> best setup of split K/V, scattered
    for model, layout, tokens, blocks, patterns in _specs(p):
        layers = MANY_LAYERS if model.startswith(str(MANY_LAYERS)) else LAYERS
        g, n = _geometry(layout, layers, tokens, blocks, nbytes)
        cfg = _Config(ctx, g, f"bw-{len(rows)}", memcpy, [*h.SWEEP, h.kvrdma_setup()])
        try:
            for pattern in patterns:
                scattered = [rng.choice(2 * n, n, replace=False) for _ in "lr"]
                ids = scattered if pattern == "scattered" else [np.arange(n), np.arange(n)]
                best, sweep_gbps = cfg.calibrate(*ids, p["calibration_reads"], order)
                methods = {"kvrdma": "kvrdma", BEST: best, RAW: h.kvrdma_setup()}
                methods |= {DEFAULTS: h.NIXL_DEFAULTS, "memcpy": "memcpy"}
                bad = {m: cfg.checked(s, *ids) for m, s in methods.items() if m != "memcpy"}
                times = cfg.measure(ids, p, order, methods)
                rows.append(_row(model, g, pattern, n, times, bad, cfg))
                rows[-1] |= {"best_setup": best.label, "calibration_gbps": sweep_gbps}
                rows[-1]["pinned_threads"][BEST] = cfg.pinned[best.label]
                if (model, layout, pattern) == (f"{LAYERS} layers", "split_kv", "scattered"):
                    best_of[tokens] = best
            if layers == MANY_LAYERS and not ctx.control:
                poll = _poll_cost(cfg, rng, n, p["poll_reads"])
        finally:
            cfg.close()
    fixed = _fixed_cost(rows[-1])
    coalescing = [
        _coalescing(ctx, p, rng, order, memcpy, t, best_of.get(t))
        for t in ([] if ctx.control else p["coalesce_tokens"])
    ]
    return {
        "parameters": {
            **p,
            **{"layers": [LAYERS, MANY_LAYERS], "kv_heads": HEADS, "head_dim": HEAD_DIM},
            **{"sweep": [s.label for s in h.SWEEP], RAW: h.kvrdma_setup().label},
            **{DEFAULTS: h.NIXL_DEFAULTS.label, "hugepages": HUGEPAGES, "gb": "1e9 bytes"},
            "copy_threads_pinned": ctx.pin_threads,
        },
        "control": CONTROL if ctx.control else None,
        "results": rows,
        **{"fixed_cost": fixed, "poll_cost": poll, "coalescing": coalescing},
        "targets": [] if ctx.control else _targets(rows, fixed, poll, coalescing),
        "tables": _tables(rows, coalescing),
        "summary": _summary(rows, fixed, poll),
        "notes": [
            "raw_best: the fastest setup of the calibration sweep on this row (median of "
            "calibration_reads reads each); raw_kvrdma_ucx: kvrdma's own UCX setup; "
            "raw_nixl_defaults: nixl_agent_config() defaults; memcpy: an in-process torch "
            "copy_ of the same bytes, the ceiling of any cross-process READ",
        ],
    }


def _row(
    model: str,
    g: h.Geometry,
    pattern: str,
    n: int,
    times: dict[str, list[float]],
    bad: dict[str, int],
    cfg: _Config,
) -> dict[str, Any]:
    moved, k = n * g.block_bytes, times["kvrdma"]
    row: dict[str, Any] = {"model": model, "layout": g.layout, "pattern": pattern, "blocks": n}
    row |= {"block_bytes": g.chunk_bytes, "descriptors": n * g.descriptors_per_block}
    row |= {"bytes": moved, "wrong_bytes": bad, "reps": len(k)}
    row |= {"reps_all_methods": len(times["memcpy"]), "huge_page_fraction": cfg.huge}
    pinned = {RAW: cfg.pinned[h.kvrdma_setup().label], DEFAULTS: cfg.pinned[h.NIXL_DEFAULTS.label]}
    row["pinned_threads"] = {"kvrdma": cfg.pinned["kvrdma"], **pinned}
    if cfg.twin:
        row["pinned_threads"]["control_twin"] = cfg.pinned["control_twin"]
    for m, ts in times.items():
        gbps = h.summarize([moved / t / 1e9 for t in ts], digits=3)
        row[m] = {"seconds": h.summarize(ts, digits=7), "gbps": gbps}
        row[m]["samples_us"] = [round(t * 1e6, 1) for t in ts]  # pair i: the i-th reads
    for base in (BEST, RAW, DEFAULTS, "memcpy"):
        key = "ratio_kvrdma_raw" if base == RAW else f"ratio_kvrdma_{base.removeprefix('raw_')}"
        row[key] = h.paired(k, times[base])
    return row


def _fixed_cost(row: dict[str, Any]) -> dict[str, Any]:
    """kvrdma's fixed cost per request: the 1-block row's per-pair time differences (µs)."""
    out: dict[str, Any] = {"blocks": row["blocks"], "descriptors": row["descriptors"]}
    for base in (BEST, RAW):
        d = [
            a - b
            for a, b in zip(row["kvrdma"]["samples_us"], row[base]["samples_us"], strict=False)
        ]
        ci = h.median_ci95(d)
        ci95 = [round(x, 1) for x in ci] if ci else None
        out[f"over_{base}_us"] = {"median": round(statistics.median(d), 1), "ci95": ci95}
    return out


def _poll_cost(cfg: _Config, rng: Any, n: int, reads: int) -> dict[str, Any]:
    """One `get_finished()` while a kvrdma read runs against one `check_xfer_state` while a
    raw read in kvrdma's setup (the same copy threads) runs: seconds per call."""
    gf: list[float] = []
    cx: list[float] = []
    raw = cfg.reader(h.kvrdma_setup())
    i = 0
    while i < reads or ((not gf or not cx) and i < 10 * reads):  # reads that ran while polled
        i += 1
        lb, rb = (rng.choice(2 * n, n, replace=False) for _ in "lr")
        rid = f"{cfg.key}-poll-{i}"
        cfg.worker.start_read(rid, lb, rb, cfg.engine)
        while True:
            t0 = time.perf_counter()
            if rid in cfg.worker.get_finished().finished_recving:
                break
            gf.append(time.perf_counter() - t0)
            os.sched_yield()
        xfer, state = raw.post(lb, rb)
        while state == "PROC":
            t0 = time.perf_counter()
            if (state := raw.agent.check_xfer_state(xfer)) == "PROC":
                cx.append(time.perf_counter() - t0)
            os.sched_yield()
        raw.agent.release_xfer_handle(xfer)
    a, b = h.summarize(gf, 1e6, 2), h.summarize(cx, 1e6, 2)
    ratio = round(a["median"] / b["median"], 3) if a["median"] and b["median"] else None
    return {"get_finished_us": a, "check_xfer_state_us": b, "ratio": ratio, "blocks": n}


COALESCE_PAIRS = [
    *(
        (f"kvrdma_{lay}", b)
        for lay in ("cross_layer", "blocks_first")
        for b in (BEST, RAW, DEFAULTS)
    ),
    *(("kvrdma_split_kv", BEST), ("memcpy", BEST), ("memcpy", DEFAULTS)),
]


def _coalescing(
    ctx: h.Context, p: dict[str, Any], rng: Any, order: Any, memcpy: Any, tokens: int, best: Any
) -> dict[str, Any]:
    """The same scattered ids read rep by rep by kvrdma on every layout, raw per-block NIXL
    on split K/V (best, kvrdma's and NIXL's default setups) and memcpy; `best` None: the
    split K/V reader calibrates on these ids first."""
    cfgs: dict[str, _Config] = {}
    try:
        for layout in LAYOUTS:
            g, n = _geometry(layout, LAYERS, tokens, 0, p["request_bytes"])
            setups = [*(h.SWEEP if best is None else [best]), h.kvrdma_setup()]
            setups = setups if layout == "split_kv" else []
            cfgs[layout] = _Config(ctx, g, f"co-{layout}-{tokens}", memcpy, setups)
        lb, rb = (rng.choice(2 * n, n, replace=False) for _ in "lr")
        if best is None:
            best = cfgs["split_kv"].calibrate(lb, rb, p["calibration_reads"], order)[0]
        cfgs["split_kv"].reader(h.NIXL_DEFAULTS)
        raws = {BEST: best, RAW: h.kvrdma_setup(), DEFAULTS: h.NIXL_DEFAULTS, "memcpy": "memcpy"}
        methods = {f"kvrdma_{lay}": (cfgs[lay], "kvrdma") for lay in LAYOUTS}
        methods |= {k: (cfgs["split_kv"], m) for k, m in raws.items()}
        bad = {k: c.checked(m, lb, rb) for k, (c, m) in methods.items() if m != "memcpy"}
        times: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(p["coalesce_reps"]):
            for name in shuffled(list(methods), order):
                times[name].append(methods[name][0].once(methods[name][1], lb, rb))
        desc = {f"kvrdma_{lay}": n * cfgs[lay].g.descriptors_per_block for lay in LAYOUTS}
    finally:
        for c in cfgs.values():
            c.close()
    g = cfgs["split_kv"].g
    out = {"block_bytes": g.chunk_bytes, "blocks": n, "reps": p["coalesce_reps"]}
    out |= {"best_setup": best.label, "descriptors": desc, "wrong_bytes": bad}
    out["gbps"] = {
        m: h.summarize([n * g.block_bytes / t / 1e9 for t in ts]) for m, ts in times.items()
    }
    out["ratios"] = {f"{a}/{b}": h.paired(times[a], times[b]) for a, b in COALESCE_PAIRS}
    return out


def _targets(rows: list[Any], fixed: Any, poll: Any, coalescing: list[Any]) -> list[Any]:
    def worst(key: str, smallest: int = 0) -> float | None:
        ok = (r[key]["paired_median"] for r in rows if r["block_bytes"] >= smallest)
        return min((x for x in ok if x is not None), default=None)

    big = worst("ratio_kvrdma_memcpy", 256 * KIB)
    best, raw = worst("ratio_kvrdma_best"), worst("ratio_kvrdma_raw")
    co_what = "kvrdma cross-layer / raw per-block NIXL (NIXL defaults)"
    fixed_what = "1-block request, kvrdma minus best raw (median)"
    fixed_us = fixed[f"over_{BEST}_us"]["median"]
    at16 = next((c["ratios"] for c in coalescing if c["block_bytes"] == 16 * KIB), None)
    co = at16[f"kvrdma_cross_layer/{DEFAULTS}"]["paired_median"] if at16 else None
    every = "every row (worst paired median)"
    return [
        h.target(f"kvrdma / best raw NIXL (calibrated), {every}", best, ">= 0.95 ratio"),
        h.target(f"kvrdma / raw NIXL in kvrdma's UCX setup, {every}", raw, ">= 0.95 ratio"),
        h.target("kvrdma / memcpy, blocks >= 256 KiB (worst paired median)", big, ">= 0.6 ratio"),
        h.target(f"scattered 16 KiB, same ids: {co_what}", co, ">= 2 ratio"),
        h.target(f"per-request fixed cost: {fixed_what}", fixed_us, "<= 50 us"),
        h.target(
            "get_finished() / check_xfer_state while a read runs (median call)",
            poll.get("ratio"),
            "<= 1.2 ratio",
        ),
    ]


BW_TABLE = (
    "model: model; layout: layout; ids: pattern; block: block_bytes|size; "
    "desc/req: descriptors; reps: reps; best raw setup: best_setup; "
    "kvrdma GB/s*: kvrdma.gbps.median; best raw GB/s*: raw_best.gbps.median; "
    "raw, kvrdma's setup GB/s*: raw_kvrdma_ucx.gbps.median; "
    "raw, NIXL defaults GB/s*: raw_nixl_defaults.gbps.median; memcpy GB/s*: memcpy.gbps.median; "
    "kvrdma / best raw: ratio_kvrdma_best|ratio; "
    "kvrdma / raw (kvrdma's setup): ratio_kvrdma_raw|ratio; "
    "kvrdma / NIXL defaults: ratio_kvrdma_nixl_defaults|ratio; "
    "kvrdma / memcpy: ratio_kvrdma_memcpy|ratio"
)


def _tables(rows: list[dict[str, Any]], coalescing: list[dict[str, Any]]) -> list[Any]:
    """The report's tables: rows, the calibration sweep, the same-ids comparison."""
    sweep = "; ".join(f"{s.label}: calibration_gbps.{i}" for i, s in enumerate(h.SWEEP))
    pairs = "; ".join(f"{a} / {b}*: ratios.{a}/{b}|ratio" for a, b in COALESCE_PAIRS)
    return [
        h.table("Bandwidth (GB/s median; ratios: paired median [95 % CI])", rows, BW_TABLE),
        h.table(
            "Calibration sweep (raw NIXL GB/s per setup, median of the calibration reads)",
            rows,
            f"model: model; layout: layout; ids: pattern; block: block_bytes|size; {sweep}",
        ),
        h.table(
            "Same scattered ids on every layout (paired median [95 % CI])",
            coalescing,
            f"block: block_bytes|size; reps: reps; best raw setup: best_setup; {pairs}",
        ),
    ]


def _summary(rows: list[dict[str, Any]], fixed: dict[str, Any], poll: dict[str, Any]) -> list[str]:
    out = []
    for key, what in (
        ("best", "best raw NIXL (calibrated)"),
        ("raw", "raw NIXL in kvrdma's setup"),
        ("nixl_defaults", "raw NIXL with NIXL's defaults"),
    ):
        xs = [x for r in rows if (x := r[f"ratio_kvrdma_{key}"]["paired_median"])]
        gm = math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else math.nan
        out.append(
            f"kvrdma / {what}: geometric mean {gm:.3f} over {len(xs)} rows, worst "
            f"{min(xs, default=math.nan):.3f}, rows >= 0.95: {sum(x >= 0.95 for x in xs)}."
        )
    b, r = fixed[f"over_{BEST}_us"], fixed[f"over_{RAW}_us"]
    out.append(
        f"1-block request, kvrdma minus raw: {b['median']} µs against the best raw "
        f"(95 % CI {b['ci95']}), {r['median']} µs against raw in kvrdma's setup."
    )
    if poll:
        gf, cx = poll["get_finished_us"]["median"], poll["check_xfer_state_us"]["median"]
        out.append(
            f"While a {poll['blocks']}-block read runs: get_finished() {gf} µs per call, "
            f"NIXL check_xfer_state {cx} µs (median)."
        )
    return out
