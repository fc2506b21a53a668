"""The `kvrdma` command: a thin dispatcher over sub-command modules.

Each sub-command module exposes `configure_parser(parser)` and `run(args) -> int` and keeps
its top-level imports light (no torch/nixl at import time), so `kvrdma --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from kvrdma import __version__
from kvrdma.errors import KvrdmaError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_ALIASES = {"WARN": "WARNING", "FATAL": "CRITICAL"}  # Python's logging takes them too

# sub-command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("kvrdma.cli.inspect", "print the transfer plan for a config and TP mix"),
    "demo": ("kvrdma.cli.demo", "run P and D workers as processes and move verified KV blocks"),
    "agent": ("kvrdma.cli.agent", "run the handshake agent as a sidecar process"),
    "bench": ("kvrdma.cli.bench", "run the benchmarks (JSON + PNG under benchmarks/results)"),
    "keygen": ("kvrdma.cli.keygen", "make the CURVE keys that secure the side channel"),
}


def log_level(value: str) -> str:
    """`--log-level`'s type: one of `LOG_LEVELS` (or WARN, FATAL), in any case (the agent
    image passes `$KVRDMA_LOG_LEVEL` as it); argparse reports anything else naming the flag."""
    level = _ALIASES.get(value.upper(), value.upper())
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(LOG_LEVELS)} (any case), got {value!r}"
        )
    return level


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrdma",
        description="KV-cache transfer for disaggregated LLM serving over NIXL one-sided READs.",
    )
    parser.add_argument("--version", action="version", version=f"kvrdma {__version__}")
    parser.add_argument(
        "--log-level",
        type=log_level,
        default="WARNING",
        help=f"logging level: {', '.join(LOG_LEVELS)} (default WARNING)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.configure_parser(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # the `kvrdma` program, not a call from Python
        from kvrdma.hugepages import reexec_with_malloc_hugepages

        reexec_with_malloc_hugepages()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args))
    except KvrdmaError as exc:
        print(f"kvrdma {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
