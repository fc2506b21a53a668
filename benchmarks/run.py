"""Run kvrdma's benchmarks: `python benchmarks/run.py [--quick] [--out DIR] [names...]`.

Also `kvrdma bench …`. Each benchmark writes `DIR/<name>.json` and `DIR/<name>.png`;
`--quick` is the CI smoke (small sizes, few repetitions: numbers not to be quoted). Targets
are reported, never asserted. `benchmarks/report.py` turns a folder into Markdown.
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# the run order (the idle target first, noise-sensitive ones early): name -> module
BENCHMARKS = {"idle_cpu": "latency", "latency": "latency", "posting": "scaling"}
BENCHMARKS |= {"bandwidth": "bandwidth", "scaling": "scaling", "first_contact": "latency"}
BENCHMARKS |= {n: n for n in ("stages", "integrity", "push", "vllm_nixl", "hosts")}
# run only when named: root and minutes of `kvrdma demo --hosts` runs
OPT_IN = ("hosts",)


def _ticks(ctx: Any) -> tuple[float, int, int] | None:
    """(now, all CPUs' busy jiffies, this process's and the target's own) from /proc; own
    includes the children they waited for (the vLLM benchmark's engine processes)."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        pids = [os.getpid(), *([ctx._peer.proc.pid] if ctx._peer else [])]
        stats = [Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split() for p in pids]
        own = sum(int(x) for s in stats for x in s[11:15])  # utime, stime, cutime, cstime
    except (OSError, ValueError, IndexError):
        return None
    return time.monotonic(), sum(f) - f[3] - (f[4] if len(f) > 4 else 0), own


def _machine_load(ctx: Any, before: tuple[float, int, int] | None) -> dict[str, Any]:
    """The CPU *other* processes used during a benchmark (cores): the machine may be shared."""
    after = _ticks(ctx)
    if before is None or after is None:
        return {"other_processes_cores": None}
    other = (after[1] - before[1]) - (after[2] - before[2])
    cores = other / os.sysconf("SC_CLK_TCK") / (after[0] - before[0])
    return {"other_processes_cores": round(max(0.0, cores), 3), "loadavg_1min": os.getloadavg()[0]}


def _run(ctx: Any, name: str, out: Path, env: Any) -> Any:
    """Run one benchmark and write its results; prints its targets."""
    from benchmarks.report import environment, write_result

    mod = importlib.import_module(f"benchmarks.{BENCHMARKS[name]}")
    print(f"[bench] {name} ...", flush=True)
    t0, before = time.perf_counter(), _ticks(ctx)
    result = getattr(mod, f"run_{name}", getattr(mod, "run", None))(ctx)
    env = env or environment()  # after NIXL is loaded: records the UCX in use
    result["machine_load"] = _machine_load(ctx, before)
    seconds = time.perf_counter() - t0
    doc = write_result(out, name, result, env, quick=ctx.quick, seconds=seconds)
    for t in doc["targets"]:
        mark = {True: "pass", False: "MISS", None: "n/a"}[t["pass"]]
        print(f"  {mark:4}  {t['target']}: {t['value']} {t['unit']} ({t['op']} {t['threshold']})")
    print(f"[bench] {name} done in {seconds:.1f} s", flush=True)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="small sizes (CI smoke)")
    add("--out", type=Path, default=ROOT / "benchmarks" / "results")
    add("--seed", type=int, default=0)
    add("--no-pin", action="store_true", help="leave the readers' NIXL copy threads unpinned")
    add("--control", action="store_true", help="bandwidth: A/A, raw NIXL in kvrdma's place")
    add("-v", "--verbose", action="store_true")
    add("names", nargs="*", help=f"benchmarks: {', '.join(BENCHMARKS)} (all but {OPT_IN[0]})")
    args = parser.parse_args(argv)
    if unknown := [n for n in args.names if n not in BENCHMARKS]:
        parser.error(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    # torch's OpenMP threads otherwise spin after each memcpy on a CPU the next READ's copy
    # threads need; read when torch loads, below
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    from benchmarks.harness import Context

    ctx = Context(args.quick, args.seed, not args.no_pin, args.control)
    failed: list[str] = []
    t_all, env = time.perf_counter(), None
    try:
        wanted = args.names or [n for n in BENCHMARKS if n not in OPT_IN]
        for name in (n for n in BENCHMARKS if n in wanted):
            try:
                env = _run(ctx, name, args.out, env)
            except Exception:
                failed.append(name)
                print(f"[bench] {name} FAILED\n{traceback.format_exc()}", file=sys.stderr)
    finally:
        ctx.close()
    print(f"[bench] results in {args.out} ({time.perf_counter() - t_all:.1f} s)")
    if failed:
        print(f"[bench] failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    from kvrdma.hugepages import reexec_with_malloc_hugepages

    reexec_with_malloc_hugepages()  # NIXL's per-transfer allocations (see kvrdma.hugepages)
    sys.exit(main())
