"""`bandwidth`: kvrdma's READ against the calibrated best raw NIXL, raw NIXL in kvrdma's setup,
NIXL's defaults and memcpy, paired per repetition; the same-ids layout comparison; per-request
costs (benchmarks/README.md, "How it measures")."""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

from benchmarks import harness as h
from kvrdma import hugepages as thp
from kvrdma.testing import synthetic

LAYOUTS = ("split_kv", "blocks_first", "cross_layer")
HEADS, LAYERS, MANY_LAYERS = 8, 4, 32  # fp16, head dim 128: 2 KiB per token, layer, K/V
KIB = 1024
BEST, RAW, DEFAULTS = "raw_best", "raw_kvrdma_ucx", "raw_nixl_defaults"
RAWS = (BEST, RAW, DEFAULTS)
HUGEPAGES = "collapse"  # both sides' caches are written before registration, as an engine's
CONTROL = "A/A calibration (--control): 'kvrdma' is a second raw NIXL reader in kvrdma's setup; "
CONTROL += "its ratios show how far this machine's noise moves a row (no targets)"
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


class _Config(h.Pair):
    """A `Pair` that reads with a method: "kvrdma", "memcpy" or a `RawSetup`."""

    def __init__(self, ctx: h.Context, s: Any, key: str, memcpy: Any, setups: list[Any]) -> None:
        twin = [(h.kvrdma_setup(), "control_twin")] if ctx.control else []
        super().__init__(ctx, key, s, *[(x, None) for x in setups], *twin, hugepages=HUGEPAGES)
        self.memcpy, self.twin = memcpy, self.readers.get("control_twin")
        self.huge.append(h.huge_page_fraction(memcpy))

    def once(self, method: Any, lb: Any, rb: Any) -> float:
        """One read of `lb` from `rb` with `method`: seconds."""
        if isinstance(method, h.RawSetup):
            return self.readers[method.label].read(lb, rb)
        if method == "kvrdma":
            return self.twin.read(lb, rb) if self.twin else self.read(lb, rb)[0]
        moved = len(lb) * self.block_bytes
        d, s = self.memcpy[0][:moved], self.memcpy[1][:moved]
        t0 = time.perf_counter()
        d.copy_(s)
        return time.perf_counter() - t0

    def checked(self, method: Any, lb: Any, rb: Any) -> int:
        """A warm-up read into cleared caches: the wrong elements it left."""
        for t in self.caches.values():
            t.zero_()
        self.once(method, lb, rb)
        return synthetic.verify(self.spec, self.caches, lb, rb, self.spec.block_size)

    def calibrate(self, ids: Any, reads: int, order: Any) -> tuple[h.RawSetup, list[float]]:
        """The fastest sweep setup on these ids (median seconds) and every setup's GB/s."""
        for s in h.SWEEP:
            self.once(s, *ids)  # warm-up: the first read wires up UCX
        t = _rounds({s.label: (self, s) for s in h.SWEEP}, ids, reads, order)
        med = [statistics.median(t[s.label]) for s in h.SWEEP]
        gbps = [round(len(ids[0]) * self.block_bytes / m / 1e9, 3) for m in med]
        return h.SWEEP[med.index(min(med))], gbps

    def measure(self, ids: Any, p: dict[str, Any], order: Any, methods: dict[str, Any]) -> Any:
        """Seconds per read of every method (index i: repetition i); then kvrdma against
        both raw baselines while a paired interval still holds 0.95."""
        self.once("memcpy", *ids)  # warm-up
        ms = {m: (self, s) for m, s in methods.items()}
        times = _rounds(ms, ids, p["reps"], order)
        while len(times["kvrdma"]) < p["max_reps"] and sum(times["kvrdma"]) < p["min_seconds"]:
            _rounds(ms, ids, 1, order, times)
        pair = {m: ms[m] for m in ("kvrdma", BEST, RAW)}
        while (n := len(times["kvrdma"])) < p["refine_max_reps"] and (
            n < p["refine_min_reps"] or _undecided(times, BEST) or _undecided(times, RAW)
        ):
            _rounds(pair, ids, 1, order, times)
        return times


def _rounds(methods: dict[str, Any], ids: Any, reps: int, order: Any, out: Any = None) -> Any:
    """`reps` rounds of one read per method ({name: (config, method)}), each in a fresh random
    order (a fixed one favoured a reader's slot): seconds, appended to `out` when given."""
    out = {m: [] for m in methods} if out is None else out
    for _ in range(reps):
        for i in order.permutation(len(methods)):
            name = list(methods)[i]
            out[name].append(methods[name][0].once(methods[name][1], *ids))
    return out


def _undecided(times: dict[str, list[float]], base: str) -> bool:
    ci = h.median_ci95([b / a for a, b in zip(times["kvrdma"], times[base], strict=False)])
    return ci is None or ci[0] <= 0.95 <= ci[1]


def _spec(layout: str, layers: int, tokens: int, n: int, nbytes: int) -> tuple[Any, int]:
    """Caches of 2·n blocks; n from `nbytes` when 0."""
    n = n or max(1, nbytes // (2 * layers * tokens * HEADS * 128 * 2))
    return h.spec(layout, layers, HEADS, tokens, 2 * n), n


def run(ctx: h.Context) -> dict[str, Any]:
    p = ctx.pick(PARAMS)
    rng, order = np.random.default_rng(ctx.seed), np.random.default_rng([ctx.seed, 1])
    most = max(p["request_bytes"], p["many_layer_blocks"] * 2 * MANY_LAYERS * 16 * KIB)
    memcpy = (torch.zeros(most, dtype=torch.uint8), torch.ones(most, dtype=torch.uint8))
    thp.apply_to_tensors(memcpy, HUGEPAGES)  # like the caches
    rows: list[dict[str, Any]] = []
    poll: dict[str, Any] = {}
    best_of: dict[int, h.RawSetup] = {}  # tokens -> best setup of split K/V, scattered
    # (model, layout, tokens, blocks per request or 0: from request_bytes, patterns)
    both = ("contiguous", "scattered")
    plan = [(f"{LAYERS} layers", lay, t, 0, both) for t in p["tokens"] for lay in LAYOUTS]
    plan += [(f"{MANY_LAYERS} layers", "split_kv", 8, p["many_layer_blocks"], both[1:])]
    plan += [("1-block request", "split_kv", 8, 1, both[1:])]
    for model, layout, tokens, blocks, patterns in plan:
        layers = MANY_LAYERS if model.startswith(str(MANY_LAYERS)) else LAYERS
        s, n = _spec(layout, layers, tokens, blocks, p["request_bytes"])
        cfg = _Config(ctx, s, f"bw-{len(rows)}", memcpy, [*h.SWEEP, h.kvrdma_setup()])
        try:
            for pattern in patterns:
                scattered = [rng.choice(2 * n, n, replace=False) for _ in "lr"]
                ids = scattered if pattern == "scattered" else [np.arange(n), np.arange(n)]
                best, sweep_gbps = cfg.calibrate(ids, p["calibration_reads"], order)
                methods = {"kvrdma": "kvrdma", BEST: best, RAW: h.kvrdma_setup()}
                methods |= {DEFAULTS: h.NIXL_DEFAULTS, "memcpy": "memcpy"}
                bad = {m: cfg.checked(s, *ids) for m, s in methods.items() if m != "memcpy"}
                times = cfg.measure(ids, p, order, methods)
                rows.append(_row(model, pattern, n, times, bad, cfg))
                rows[-1] |= {"best_setup": best.label, "calibration_gbps": sweep_gbps}
                rows[-1]["pinned_threads"][BEST] = cfg.pinned[best.label]
                if (model, layout, pattern) == (f"{LAYERS} layers", "split_kv", "scattered"):
                    best_of[tokens] = best
            if layers == MANY_LAYERS and not ctx.control:
                poll = _poll_cost(cfg, rng, n, p["poll_reads"])
        finally:
            cfg.close()
    fixed = _fixed_cost(rows[-1])
    tokens = [] if ctx.control else p["coalesce_tokens"]
    coalescing = [_coalescing(ctx, p, rng, order, memcpy, t, best_of.get(t)) for t in tokens]
    return {
        "parameters": p
        | {"layers": [LAYERS, MANY_LAYERS], "kv_heads": HEADS, "head_dim": 128}
        | {"sweep": [s.label for s in h.SWEEP], RAW: h.kvrdma_setup().label}
        | {DEFAULTS: h.NIXL_DEFAULTS.label, "hugepages": HUGEPAGES, "gb": "1e9 bytes"}
        | {"copy_threads_pinned": ctx.pin_threads},
        "control": CONTROL if ctx.control else None,
        "results": rows,
        **{"fixed_cost": fixed, "poll_cost": poll, "coalescing": coalescing},
        "targets": [] if ctx.control else _targets(rows, fixed, poll, coalescing),
        "tables": _tables(rows, coalescing),
        "summary": _summary(rows, fixed),
        "notes": [
            "raw_best: the fastest setup of the calibration sweep on this row (median of "
            "calibration_reads reads each); raw_kvrdma_ucx: kvrdma's own UCX setup; "
            "raw_nixl_defaults: nixl_agent_config() defaults; memcpy: an in-process torch "
            "copy_ of the same bytes, the ceiling of any cross-process READ",
        ],
    }


def _row(model: str, pattern: str, n: int, times: Any, bad: Any, cfg: _Config) -> dict[str, Any]:
    moved, k = n * cfg.block_bytes, times["kvrdma"]
    row: dict[str, Any] = {"model": model, "layout": cfg.spec.cache_layout, "pattern": pattern}
    row |= {"blocks": n, "block_bytes": cfg.chunk, "descriptors": n * cfg.per_block}
    row |= {"bytes": moved, "wrong_elements": bad, "reps": len(k)}
    row |= {"reps_all_methods": len(times["memcpy"]), "huge_page_fraction": cfg.huge}
    pinned = {RAW: cfg.pinned[h.kvrdma_setup().label], DEFAULTS: cfg.pinned[h.NIXL_DEFAULTS.label]}
    twin = {"control_twin": cfg.pinned["control_twin"]} if cfg.twin else {}
    row["pinned_threads"] = {"kvrdma": cfg.pinned["kvrdma"], **pinned, **twin}
    for m, ts in times.items():
        gbps = h.summarize([moved / t / 1e9 for t in ts], digits=3)
        row[m] = {"seconds": h.summarize(ts, digits=7), "gbps": gbps}
        row[m]["samples_us"] = [round(t * 1e6, 1) for t in ts]  # pair i: the i-th reads
    for base in (*RAWS, "memcpy"):
        key = "ratio_kvrdma_raw" if base == RAW else f"ratio_kvrdma_{base.removeprefix('raw_')}"
        row[key] = h.paired(k, times[base])
    return row


def _fixed_cost(row: dict[str, Any]) -> dict[str, Any]:
    """kvrdma's fixed cost per request: the 1-block row's per-pair time differences (µs)."""
    out: dict[str, Any] = {"blocks": row["blocks"], "descriptors": row["descriptors"]}
    for base in (BEST, RAW):
        pairs = zip(row["kvrdma"]["samples_us"], row[base]["samples_us"], strict=True)
        ci = h.median_ci95(d := [a - b for a, b in pairs])
        ci95 = [round(x, 1) for x in ci] if ci else None
        out[f"over_{base}_us"] = {"median": round(statistics.median(d), 1), "ci95": ci95}
    return out


def _poll_cost(cfg: _Config, rng: Any, n: int, reads: int) -> dict[str, Any]:
    """One `get_finished()` while a kvrdma read runs against one `check_xfer_state` while a
    raw read in kvrdma's setup (the same copy threads) runs: seconds per call."""
    gf: list[float] = []  # seconds per get_finished() call
    cx: list[float] = []  # seconds per check_xfer_state call
    raw, i = cfg.reader(h.kvrdma_setup()), 0
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


COALESCE_PAIRS = [(f"kvrdma_{lay}", b) for lay in ("cross_layer", "blocks_first") for b in RAWS]
COALESCE_PAIRS += [("kvrdma_split_kv", BEST), ("memcpy", BEST), ("memcpy", DEFAULTS)]


def _coalescing(
    ctx: h.Context, p: dict[str, Any], rng: Any, order: Any, memcpy: Any, tokens: int, best: Any
) -> dict[str, Any]:
    """The same scattered ids read rep by rep by kvrdma on every layout, raw per-block NIXL
    on split K/V (best, kvrdma's and NIXL's default setups) and memcpy; `best` None: the
    split K/V reader calibrates on these ids first."""
    cfgs: dict[str, _Config] = {}
    setups = [*(h.SWEEP if best is None else [best]), h.kvrdma_setup(), h.NIXL_DEFAULTS]
    try:
        for layout in LAYOUTS:
            s, n = _spec(layout, LAYERS, tokens, 0, p["request_bytes"])
            cfgs[layout] = _Config(ctx, s, f"co-{layout}", memcpy, setups * (layout == "split_kv"))
        split = cfgs["split_kv"]
        ids = [rng.choice(2 * n, n, replace=False) for _ in "lr"]
        if best is None:
            best = split.calibrate(ids, p["calibration_reads"], order)[0]
        raws = {BEST: best, RAW: h.kvrdma_setup(), DEFAULTS: h.NIXL_DEFAULTS, "memcpy": "memcpy"}
        methods = {f"kvrdma_{lay}": (cfgs[lay], "kvrdma") for lay in LAYOUTS}
        methods |= {k: (split, m) for k, m in raws.items()}
        bad = {k: c.checked(m, *ids) for k, (c, m) in methods.items() if m != "memcpy"}
        times = _rounds(methods, ids, p["coalesce_reps"], order)
        desc = {f"kvrdma_{lay}": n * cfgs[lay].per_block for lay in LAYOUTS}
    finally:
        for c in cfgs.values():
            c.close()
    out = {"block_bytes": split.chunk, "blocks": n, "reps": p["coalesce_reps"]}
    out |= {"best_setup": best.label, "descriptors": desc, "wrong_elements": bad}
    moved = n * split.block_bytes
    out["gbps"] = {m: h.summarize([moved / t / 1e9 for t in ts]) for m, ts in times.items()}
    out["ratios"] = {f"{a}/{b}": h.paired(times[a], times[b]) for a, b in COALESCE_PAIRS}
    return out


EVERY, CO = "every row (worst paired median)", "kvrdma cross-layer / raw per-block NIXL"
FIXED = "per-request fixed cost: 1-block request, kvrdma minus best raw (median)"
TARGETS = [  # (what, which measurement, wanted)
    (f"kvrdma / best raw NIXL (calibrated), {EVERY}", "best", ">= 0.95 ratio"),
    (f"kvrdma / raw NIXL in kvrdma's UCX setup, {EVERY}", "raw", ">= 0.95 ratio"),
    ("kvrdma / memcpy, blocks >= 256 KiB (worst paired median)", "memcpy", ">= 0.6 ratio"),
    (f"scattered 16 KiB, same ids: {CO} (NIXL defaults)", "co", ">= 2 ratio"),
    (FIXED, "fixed", "<= 50 us"),
    ("get_finished() / check_xfer_state while a read runs (median call)", "poll", "<= 1.2 ratio"),
]


def _targets(rows: list[Any], fixed: Any, poll: Any, coalescing: list[Any]) -> list[Any]:
    def worst(key: str, least: int = 0) -> float | None:
        xs = [r[f"ratio_kvrdma_{key}"]["paired_median"] for r in rows if r["block_bytes"] >= least]
        return min((x for x in xs if x is not None), default=None)

    at16 = next((c["ratios"] for c in coalescing if c["block_bytes"] == 16 * KIB), None)
    got = {"best": worst("best"), "raw": worst("raw"), "memcpy": worst("memcpy", 256 * KIB)}
    got["co"] = at16[f"kvrdma_cross_layer/{DEFAULTS}"]["paired_median"] if at16 else None
    got |= {"fixed": fixed[f"over_{BEST}_us"]["median"], "poll": poll.get("ratio")}
    return [h.target(what, got[key], want) for what, key, want in TARGETS]


ROW = "model: model; layout: layout; ids: pattern; block: block_bytes|size"
BW_TABLE = (
    f"{ROW}; desc/req: descriptors; reps: reps; best raw setup: best_setup; "
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
    same = "block: block_bytes|size; reps: reps; best raw setup: best_setup; "
    same += "; ".join(f"{a} / {b}*: ratios.{a}/{b}|ratio" for a, b in COALESCE_PAIRS)
    return [
        h.table("Bandwidth (GB/s median; ratios: paired median [95 % CI])", rows, BW_TABLE),
        h.table("Calibration sweep (raw NIXL GB/s per setup, median)", rows, f"{ROW}; {sweep}"),
        h.table("Same scattered ids on every layout (paired median [95 % CI])", coalescing, same),
    ]


def _summary(rows: list[dict[str, Any]], fixed: dict[str, Any]) -> list[str]:
    out = []
    names = {"best": "best raw", "raw": "raw, kvrdma's setup", "nixl_defaults": "NIXL defaults"}
    for key, what in names.items():
        xs = [x for r in rows if (x := r[f"ratio_kvrdma_{key}"]["paired_median"])]
        gm = statistics.geometric_mean(xs) if xs else math.nan
        out.append(
            f"kvrdma / {what}: geometric mean {gm:.3f} over {len(xs)} rows, worst "
            f"{min(xs, default=math.nan):.3f}, rows >= 0.95: {sum(x >= 0.95 for x in xs)}."
        )
    b, r = fixed[f"over_{BEST}_us"], fixed[f"over_{RAW}_us"]
    out.append(
        f"1-block request, kvrdma minus raw: {b['median']} µs against the best raw "
        f"(95 % CI {b['ci95']}), {r['median']} µs against raw in kvrdma's setup."
    )
    return out
