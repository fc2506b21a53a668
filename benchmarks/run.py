"""Run kvrdma's benchmarks: `python benchmarks/run.py [--quick] [--out DIR] [names...]`.

Also `kvrdma bench …`. Each benchmark writes `DIR/<name>.json` (environment, parameters,
min/median/max over repetitions, issue 7's targets with pass/miss) and `DIR/<name>.png`.
`--quick` is the CI smoke: small sizes, few repetitions, under a minute on 2 cores; its
numbers are not the ones to quote. Targets are reported, never asserted.
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

# name -> module under benchmarks/; the order is the run order (cheap, noisy-sensitive first)
BENCHMARKS = {
    "idle_cpu": "benchmarks.idle_cpu",
    "latency": "benchmarks.latency",
    "posting": "benchmarks.posting",
    "bandwidth": "benchmarks.bandwidth",
    "scaling": "benchmarks.scaling",
    "first_contact": "benchmarks.first_contact",
}


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0]
        fields = [int(x) for x in first.split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def _load(load0: tuple[float, float, float], stat0: tuple[int, int] | None) -> dict[str, object]:
    """How busy the whole machine was during a benchmark (other sessions share it)."""
    stat1 = _cpu_ticks()
    busy = None
    if stat0 and stat1 and stat1[1] > stat0[1]:
        busy = round((stat1[0] - stat0[0]) / (stat1[1] - stat0[1]), 3)
    return {
        "loadavg_1min_before": round(load0[0], 2),
        "loadavg_1min_after": round(os.getloadavg()[0], 2),
        "machine_cpu_busy_fraction": busy,
        "note": "all processes, this run included; the machine may be shared",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke, < 60 s)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="bandwidth: leave the readers' NIXL copy threads where the scheduler puts them",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="bandwidth: A/A calibration, 'kvrdma' read by a second raw NIXL reader in "
        "kvrdma's UCX setup (the noise floor of the kvrdma/raw ratios; no targets)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("names", nargs="*", help=f"benchmarks to run: {', '.join(BENCHMARKS)}")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
    names = [n for n in BENCHMARKS if not args.names or n in args.names]
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent at INFO
    # torch's OpenMP threads (memcpy's copy_) otherwise spin ~5 ms after each copy, on a CPU
    # the next READ's copy threads need; read when torch loads, which is below
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    from benchmarks._common import Context, environment, write_result

    ctx = Context(
        quick=args.quick,
        out=args.out,
        seed=args.seed,
        pin_threads=not args.no_pin,
        control=args.control,
    )
    failed: list[str] = []
    t_all = time.perf_counter()
    env = None
    try:
        for name in names:
            mod = importlib.import_module(BENCHMARKS[name])
            t0 = time.perf_counter()
            print(f"[bench] {name} ...", flush=True)
            load0, stat0 = os.getloadavg(), _cpu_ticks()
            try:
                result = mod.run(ctx)
            except Exception:
                failed.append(name)
                print(f"[bench] {name} FAILED\n{traceback.format_exc()}", file=sys.stderr)
                continue
            if env is None:
                env = environment()  # after NIXL is loaded: records the UCX in use
            result["machine_load"] = _load(load0, stat0)
            doc = write_result(
                args.out,
                name,
                result,
                env,
                getattr(mod, "draw", None),
                quick=args.quick,
                seconds=time.perf_counter() - t0,
            )
            for t in doc["targets"]:
                mark = {True: "pass", False: "MISS", None: "n/a"}[t["pass"]]
                print(f"  {mark:4}  {t['target']}: {t['value']} ({t['op']} {t['threshold']})")
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
