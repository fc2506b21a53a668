"""Markdown tables from a results folder: `python benchmarks/report.py [DIR]`.

Prints issue 7's targets (value, pass/miss) and one table per benchmark, as pasted into
benchmarks/README.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
KIB = 1024


def _load(d: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(d.glob("*.json"))}


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _size(n: int) -> str:
    return f"{n // (1 << 20)} MiB" if n >= 1 << 20 else f"{n // KIB} KiB"


def targets(docs: dict[str, dict[str, Any]]) -> list[str]:
    out = ["| target | measured | wanted | verdict | benchmark |", "|---|---|---|---|---|"]
    for name, d in docs.items():
        for t in d.get("targets", []):
            verdict = {True: "pass", False: "**miss**", None: "not measured"}[t["pass"]]
            out.append(
                f"| {t['target']} | {_fmt(t['value'], 3)} {t['unit']} | {t['op']} "
                f"{t['threshold']:g} | {verdict} | {name} |"
            )
    return out


def comparisons(docs: dict[str, dict[str, Any]]) -> list[str]:
    """Measured ratios reported next to the targets, without a verdict."""
    rows = [(name, c) for name, d in docs.items() for c in d.get("comparisons", [])]
    if not rows:
        return []
    out = ["| comparison (no target) | paired median | 95 % CI | benchmark |", "|---|---|---|---|"]
    for name, c in rows:
        out.append(f"| {c['comparison']} | {_fmt(c['paired_median'], 3)} | {_ci(c)} | {name} |")
    return out


def _paired(ratio: dict[str, Any]) -> str:
    """'0.98 [0.96–1.00]': the paired median and quartiles, or – (results before pairing)."""
    if ratio.get("paired_median") is None:
        return "–"
    return (
        f"{_fmt(ratio['paired_median'])} "
        f"[{_fmt(ratio.get('paired_p25'))}–{_fmt(ratio.get('paired_p75'))}]"
    )


def _ci(ratio: dict[str, Any]) -> str:
    """'0.96–0.99': the ~95 % confidence interval of the paired median, or –."""
    ci = ratio.get("paired_ci95")
    return f"{ci[0]:.3f}–{ci[1]:.3f}" if ci else "–"


RAW, RAW_DEFAULTS = "raw_kvrdma_ucx", "raw_nixl_defaults"  # bandwidth.py's method names


def _huge(r: dict[str, Any]) -> str:
    """Huge-page share of the local / remote caches ('–' where not recorded)."""
    h = r.get("huge_page_fraction") or {}
    return f"{_fmt(h.get('local'))} / {_fmt(h.get('remote'))}"


def bandwidth(d: dict[str, Any]) -> list[str]:
    out = [
        "| layout | ids | block | desc/req | reps (all / kvrdma+raw) | other load (cores) "
        "| huge pages loc / rem "
        "| kvrdma GB/s med (best) | raw, kvrdma's UCX GB/s med (best) "
        "| raw, NIXL defaults GB/s med (best) | memcpy GB/s med "
        "| kvrdma/raw paired med [p25–p75] | its 95 % CI | kvrdma/raw best (med) "
        "| kvrdma/raw NIXL defaults best | kvrdma/memcpy paired med (best) "
        "| kvrdma/raw split K/V best (NIXL defaults) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["results"]:
        g = {m: r[m]["gbps"] for m in ("kvrdma", RAW, RAW_DEFAULTS, "memcpy") if m in r}
        split = r.get("ratio_kvrdma_raw_split_kv") or {}
        split_def = r.get("ratio_kvrdma_raw_split_kv_defaults") or {}
        kr, km = r["ratio_kvrdma_raw"], r["ratio_kvrdma_memcpy"]
        kd = r.get("ratio_kvrdma_raw_nixl_defaults") or {}
        cells = [
            f"{_fmt(g[m]['median'])} ({_fmt(g[m]['max'])})" if m in g else "–"
            for m in ("kvrdma", RAW, RAW_DEFAULTS)
        ]
        out.append(
            f"| {r['layout']} | {r['pattern']} | {_size(r['block_bytes'])} | {r['descriptors']} "
            f"| {r.get('reps_all_methods', '–')} / {r.get('reps', '–')} "
            f"| {_fmt(r.get('other_load_cores'))} | {_huge(r)} | "
            + " | ".join(cells)
            + f" | {_fmt(g['memcpy']['median'])} | {_paired(kr)} | {_ci(kr)} | {_fmt(kr['best'])} "
            f"({_fmt(kr['median'])}) | {_fmt(kd.get('best'))} "
            f"| {_fmt(km.get('paired_median'))} ({_fmt(km['best'])}) "
            f"| {_fmt(split.get('best'))} ({_fmt(split_def.get('best'))}) |"
        )
    return out


def _gm(xs: list[float]) -> str:
    import math

    xs = [x for x in xs if x]
    return f"{math.exp(sum(math.log(x) for x in xs) / len(xs)):.3f}" if xs else "–"


def bandwidth_summary(d: dict[str, Any]) -> list[str]:
    """Geometric means of the per-row ratios (rows disagree mostly through noise)."""
    rows = d["results"]
    kr = [r["ratio_kvrdma_raw"]["best"] for r in rows]
    kd = [(r.get("ratio_kvrdma_raw_nixl_defaults") or {}).get("best") for r in rows]
    big = [r["ratio_kvrdma_memcpy"]["best"] for r in rows if r["block_bytes"] >= 256 * KIB]
    out = [""]
    paired = [
        r["ratio_kvrdma_raw"]["paired_median"]
        for r in rows
        if r["ratio_kvrdma_raw"].get("paired_median") is not None
    ]
    if paired:
        loads = [r["other_load_cores"] for r in rows if r.get("other_load_cores") is not None]
        cis = [r["ratio_kvrdma_raw"].get("paired_ci95") for r in rows]
        below = sum(1 for ci in cis if ci and ci[1] < 0.95)
        worst = min(rows, key=lambda r: r["ratio_kvrdma_raw"].get("paired_median") or 9.0)
        wr = worst["ratio_kvrdma_raw"]
        out.append(
            f"kvrdma / raw NIXL with kvrdma's UCX setup, paired per repetition (median over "
            f"repetitions): geometric mean {_gm(paired)} over {len(paired)} rows, min "
            f"{min(paired):.3f} ({worst['layout']} {worst['pattern']} "
            f"{_size(worst['block_bytes'])}: quartiles {_fmt(wr.get('paired_p25'), 3)}–"
            f"{_fmt(wr.get('paired_p75'), 3)}, 95 % CI {_ci(wr)}), max {max(paired):.3f}; "
            f"rows >= 0.95: {sum(x >= 0.95 for x in paired)}/{len(paired)}; rows whose "
            f"whole 95 % CI lies below 0.95: {below}"
            + (
                f"; other processes used {min(loads):.2f}–{max(loads):.2f} cores during the rows."
                if loads
                else "."
            )
        )
    kd_ok = [x for x in kd if x]
    out.append(
        f"kvrdma / raw NIXL (best of each, kvrdma's UCX setup): geometric mean {_gm(kr)} over "
        f"{len(kr)} rows, min {min(kr):.3f}, max {max(kr):.3f}; rows >= 0.95: "
        f"{sum(x >= 0.95 for x in kr)}/{len(kr)}. "
        + (
            f"kvrdma / raw NIXL with NIXL's defaults (best of each): geometric mean "
            f"{_gm(kd_ok)}, min {min(kd_ok):.3f}, max {max(kd_ok):.3f}. "
            if kd_ok
            else ""
        )
        + f"kvrdma / memcpy for blocks >= 256 KiB (best of each): geometric mean {_gm(big)}"
        + (f", min {min(big):.3f}." if big else ".")
    )
    huge = [
        v
        for r in rows
        for v in (r.get("huge_page_fraction") or {}).values()
        if isinstance(v, (int, float))
    ]
    if huge:
        out.append(
            f"Share of cache and memcpy memory backed by huge pages: {min(huge):.2f}–"
            f"{max(huge):.2f}."
        )
    return out


def posting(d: dict[str, Any]) -> list[str]:
    cols = (
        "posting",
        "make_prepped_xfer",
        "start_read_other",
        "backend_post_other",
        "raw_posting",
        "transfer",
        "until_done",
    )
    out = [
        "| descriptors | " + " | ".join(f"{c} ms (min/med)" for c in cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for r in d["results"]:
        cells = [f"{_fmt(r[c]['min'])}/{_fmt(r[c]['median'])}" if c in r else "–" for c in cols]
        out.append(f"| {r['descriptors']:,} | " + " | ".join(cells) + " |")
    return out


def first_contact(d: dict[str, Any]) -> list[str]:
    out = [
        "| P tp | D tp | P ranks per D rank | handshake ms | NIXL add_remote ms | lists ms "
        "| plan+checks ms | first contact ms | per remote rank ms | first READ ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["results"]:
        med = {k: r[k]["median"] for k in r if isinstance(r[k], dict)}
        out.append(
            f"| {r['p_tp']} | {r['d_tp']} | {r['remote_ranks_per_d_rank']} "
            f"| {_fmt(med['handshake_ms'])} | {_fmt(med['nixl_add_remote_ms'])} "
            f"| {_fmt(med['prep_lists_ms'])} | {_fmt(med['plan_and_checks_ms'])} "
            f"| {_fmt(med['first_contact_ms'])} | {_fmt(med['per_remote_rank_ms'])} "
            f"| {_fmt(med['first_read_ms'])} |"
        )
    b = d.get("per_block_baseline")
    if b:
        out.append("")
        out.append(
            f"Per-block descriptor lists (raw NIXL, P1×D1, {b['descriptors_per_side']:,} "
            f"descriptors per side): add_remote_agent {b['add_remote_agent_ms']} ms, building the "
            f"N×3 arrays {b['build_numpy_rows_ms']} ms, prep remote {b['prep_remote_ms']} ms, "
            f"prep local {b['prep_local_ms']} ms — {b['total_ms']} ms in all."
        )
    return out


def latency(d: dict[str, Any]) -> list[str]:
    out = ["| handshake | p50 ms | p90 ms | p99 ms | max ms |", "|---|---|---|---|---|"]
    for r in d["results"]:
        if r["kind"] == "handshake":
            out.append(
                f"| {r['config']} ({r['regions_per_rank']} regions × {r['ranks_per_handshake']}"
                f" rank) | {r['p50_ms']} | {r['p90_ms']} | {r['p99_ms']} | {r['max_ms']} |"
            )
    out += [
        "",
        "| agents / target loop | notification RTT p50 / p99 µs | 16 KiB READ + "
        "notification p50 / p99 µs | 16 KiB READ p50 / p99 µs |",
        "|---|---|---|---|",
    ]
    for r in d["results"]:
        if r["kind"] == "notification_rtt":
            c = [
                f"{_fmt(r[k]['p50_us'], 1)} / {_fmt(r[k]['p99_us'], 1)}"
                for k in ("rtt", "read_with_notification", "read_without_notification")
            ]
            out.append(f"| {r['variant']} | " + " | ".join(c) + " |")
    return out


def idle(d: dict[str, Any]) -> list[str]:
    out = [
        "| agent | loop every | % of a core (median of windows) | of which get_finished |",
        "|---|---|---|---|",
    ]
    for r in d["results"]:
        w = "–" if r["poll_wait_s"] is None else f"{r['poll_wait_s'] * 1e3:g} ms"
        if r.get("loop") == "adaptive":  # kvrdma.progress.ProgressLoop
            pl = d["parameters"]["progress_loop"]
            busy, idle_s = pl["busy_interval_s"] * 1e3, pl["idle_interval_s"] * 1e3
            w = f"{busy:g} ms busy, ≤ {idle_s:g} ms idle"
        prog = r.get("progress_percent_of_core")
        out.append(
            f"| {r['agent']} | {w} | {_fmt(r['percent_of_core']['median'], 3)} "
            f"| {_fmt(prog['median'], 3) if prog else '–'} |"
        )
    return out


def scaling(d: dict[str, Any]) -> list[str]:
    out = [
        "| series | layout | x | descriptors | kvrdma ms (med) | posting ms (med) "
        "| raw ms (med) | raw without notification ms (med) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in d["results"]:
        if r["series"] == "concurrency":
            continue
        x = r["blocks"] if r["series"] == "blocks" else f"{r['layers']} layers"
        raw = r.get("raw_ms", {}).get("median")
        bare = r.get("raw_without_notification_ms", {}).get("median")
        out.append(
            f"| {r['series']} | {r['layout']} | {x} | {r['descriptors']} "
            f"| {_fmt(r['kvrdma_ms']['median'])} | {_fmt(r['posting_ms']['median'])} "
            f"| {_fmt(raw)} | {_fmt(bare)} |"
        )
    out += [
        "",
        "| concurrent requests (32 blocks each) | all done ms | median request ms "
        "| one request of all blocks ms | aggregate GB/s |",
        "|---|---|---|---|---|",
    ]
    for r in d["results"]:
        if r["series"] == "concurrency":
            out.append(
                f"| {r['requests']} | {_fmt(r['total_ms']['median'])} "
                f"| {_fmt(r['latency_median_ms']['median'])} "
                f"| {_fmt(r['one_request_of_all_blocks_ms']['median'])} "
                f"| {_fmt(r['aggregate_gbps'])} |"
            )
    if d.get("fits"):
        out += ["", f"Fits: `{json.dumps(d['fits'])}`"]
    return out


def coalescing(d: dict[str, Any]) -> list[str]:
    """The same-ids comparison of layouts against raw per-block NIXL (paired)."""
    parts = d.get("coalescing") or []
    if not parts:
        return []
    lays = ("cross_layer", "blocks_first", "split_kv")
    out = [
        "",
        "Same scattered block ids, read rep by rep by every method (kvrdma on each layout, "
        "raw NIXL per block on split K/V, memcpy); GB/s median, ratios as paired median "
        "[95 % CI]:",
        "",
        "| block | reps | desc/req cross-layer / blocks-first / split K/V "
        "| kvrdma cross-layer | kvrdma blocks-first | kvrdma split K/V "
        "| raw split K/V, kvrdma's UCX | raw split K/V, NIXL defaults | memcpy "
        "| cross-layer / raw (kvrdma's UCX) | cross-layer / raw (NIXL defaults) "
        "| blocks-first / raw (kvrdma's UCX) | blocks-first / raw (NIXL defaults) "
        "| memcpy / raw (kvrdma's UCX): the ceiling |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in parts:
        g, rt, dsc = c["gbps"], c["ratios"], c["descriptors"]

        def cell(key: str, rt: dict[str, Any] = rt) -> str:
            r = rt.get(key) or {}
            return f"{_fmt(r.get('paired_median'))} [{_ci(r)}]"

        out.append(
            f"| {_size(c['block_bytes'])} | {c['reps']} "
            f"| {' / '.join(str(dsc.get(f'kvrdma_{x}', '–')) for x in lays)} | "
            + " | ".join(
                _fmt((g.get(m) or {}).get("median"))
                for m in (*(f"kvrdma_{x}" for x in lays), RAW, RAW_DEFAULTS, "memcpy")
            )
            + " | "
            + " | ".join(
                cell(f"{a}/{b}")
                for a in ("kvrdma_cross_layer", "kvrdma_blocks_first")
                for b in (RAW, RAW_DEFAULTS)
            )
            + f" | {cell(f'memcpy/{RAW}')} |"
        )
    return out


SECTIONS = {
    "bandwidth": ("Bandwidth", lambda d: bandwidth(d) + bandwidth_summary(d) + coalescing(d)),
    "posting": ("Posting cost", posting),
    "first_contact": ("First contact", first_contact),
    "latency": ("Handshake and notifications", latency),
    "idle_cpu": ("Idle CPU", idle),
    "scaling": ("Scaling", scaling),
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    d = Path(args[0]) if args else ROOT / "benchmarks" / "results"
    docs = _load(d)
    if not docs:
        print(f"no results in {d}", file=sys.stderr)
        return 1
    env = next(iter(docs.values()))["environment"]
    print(
        f"Machine: {env['cpu_count']} CPUs ({env['cpu_model']}), {env['memory_gib']} GiB, "
        f"Python {env['python']}, torch {env['torch']}, nixl {env['nixl']}, UCX {env['ucx']}."
    )
    loads = {n: doc.get("machine_load", {}) for n, doc in docs.items()}
    print(
        "Machine load during each benchmark (1-min load average before → after; all CPUs busy "
        "fraction): "
        + "; ".join(
            f"{n} {v.get('loadavg_1min_before')}→{v.get('loadavg_1min_after')} "
            f"({v.get('machine_cpu_busy_fraction')})"
            for n, v in loads.items()
        )
        + "."
    )
    control = docs.get("bandwidth", {}).get("control")
    if control:
        print()
        print(f"**Control run**: {control}.")
    print()
    print("### Targets (issue 7)")
    print()
    print("\n".join(targets(docs)))
    more = comparisons(docs)
    if more:
        print()
        print("\n".join(more))
    for name, (title, fn) in SECTIONS.items():
        if name in docs:
            print()
            print(f"### {title}")
            print()
            print("\n".join(fn(docs[name])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
