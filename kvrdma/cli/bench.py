"""`kvrdma bench`: run the benchmarks under benchmarks/ (JSON + PNG results)."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small sizes (CI smoke)")
    p.add_argument("--out", default="benchmarks/results", help="output directory")
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="leave the readers' NIXL copy threads where the scheduler puts them",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="bandwidth: A/A calibration, a second raw NIXL reader in kvrdma's place",
    )
    p.add_argument("names", nargs="*", help="benchmarks to run (default: all)")


def run(args: argparse.Namespace) -> int:
    root = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"
    if not root.exists():
        print(f"benchmarks not found at {root} (run from a source checkout)", file=sys.stderr)
        return 2
    flags = [
        f
        for f, on in (
            ("--quick", args.quick),
            ("--no-pin", args.no_pin),
            ("--control", args.control),
        )
        if on
    ]
    argv = ["run.py", "--out", args.out, *flags, *args.names]
    old = sys.argv
    try:
        sys.argv = argv
        runpy.run_path(str(root), run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        sys.argv = old
    return 0
