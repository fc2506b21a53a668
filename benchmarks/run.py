"""Run kvrdma's benchmarks: `python benchmarks/run.py [--quick] [--out DIR] [names...]`.

Also `kvrdma bench …`. Each benchmark writes `DIR/<name>.json` (environment, parameters,
min/median/max over repetitions, targets with pass/miss, tables) and `DIR/<name>.png`.
`--quick` is the CI smoke: small sizes, few repetitions; its numbers are not to be quoted.
Targets are reported, never asserted. `benchmarks/report.py` turns a folder into Markdown.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# the run order: the idle target first (nothing in it yet), noise-sensitive ones early
BENCHMARKS = ("idle_cpu", "latency", "posting", "bandwidth", "scaling", "first_contact")
MODULES = {
    "idle_cpu": "latency",
    "latency": "latency",
    "posting": "scaling",
    "scaling": "scaling",
    "bandwidth": "bandwidth",
    "first_contact": "first_contact",
}


def _machine_load(before: tuple[float, int, int] | None) -> dict[str, object]:
    """How busy the whole machine was (all processes; it may be shared)."""
    from benchmarks.harness import _busy_ticks

    now = _busy_ticks([])
    frac = None
    if before and now:
        wall = time.monotonic() - before[0]
        frac = round((now[0] - before[1]) / os.sysconf("SC_CLK_TCK") / wall / os.cpu_count(), 3)
    return {"loadavg_1min_after": round(os.getloadavg()[0], 2), "machine_cpu_busy_fraction": frac}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="bandwidth: leave the readers' NIXL copy threads to the scheduler",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="bandwidth: A/A calibration, a second raw NIXL reader in kvrdma's "
        "place (the noise floor of the ratios; no targets)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("names", nargs="*", help=f"benchmarks to run: {', '.join(BENCHMARKS)}")
    args = parser.parse_args(argv)
    if unknown := [n for n in args.names if n not in BENCHMARKS]:
        parser.error(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    # torch's OpenMP threads otherwise spin after each memcpy on a CPU the next READ's copy
    # threads need; read when torch loads, below
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    from benchmarks.harness import Context, _busy_ticks, environment, write_result

    ctx = Context(args.quick, args.out, args.seed, not args.no_pin, args.control)
    failed: list[str] = []
    t_all, env = time.perf_counter(), None
    try:
        for name in (n for n in BENCHMARKS if not args.names or n in args.names):
            mod = importlib.import_module(f"benchmarks.{MODULES[name]}")
            print(f"[bench] {name} ...", flush=True)
            t0, ticks = time.perf_counter(), _busy_ticks([])
            before = (time.monotonic(), *ticks) if ticks else None
            try:
                result = getattr(mod, f"run_{name}", getattr(mod, "run", None))(ctx)
            except Exception:
                failed.append(name)
                print(f"[bench] {name} FAILED\n{traceback.format_exc()}", file=sys.stderr)
                continue
            env = env or environment()  # after NIXL is loaded: records the UCX in use
            result["machine_load"] = _machine_load(before)
            doc = write_result(
                args.out, name, result, env, quick=args.quick, seconds=time.perf_counter() - t0
            )
            for t in doc["targets"]:
                mark = {True: "pass", False: "MISS", None: "n/a"}[t["pass"]]
                want = f"{t['op']} {t['threshold']}"
                print(f"  {mark:4}  {t['target']}: {t['value']} {t['unit']} ({want})")
            print(f"[bench] {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        ctx.close()
    print(f"[bench] results in {args.out} ({time.perf_counter() - t_all:.1f} s)")
    if failed:
        print(f"[bench] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from kvrdma.hugepages import reexec_with_malloc_hugepages

    reexec_with_malloc_hugepages()  # NIXL's per-transfer allocations (see kvrdma.hugepages)
    sys.exit(main())
