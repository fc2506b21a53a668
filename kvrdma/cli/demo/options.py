"""The command line of `kvrdma demo`: its options and their checks."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from kvrdma.cli.demo.faults import FAULTS
from kvrdma.cli.demo.hosts import check_options
from kvrdma.cli.layouts import LAYOUT_ALIASES
from kvrdma.errors import ConfigError


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", default="split_kv", choices=sorted(LAYOUT_ALIASES))
    p.add_argument("--p-tp", type=int, default=2, help="prefill TP size (default 2)")
    p.add_argument("--d-tp", type=int, default=1, help="decode TP size (default 1)")
    p.add_argument("--p-block-size", type=int, default=16)
    p.add_argument("--d-block-size", type=int, default=16, help="a multiple of --p-block-size")
    p.add_argument("--p-kv-layout", choices=["HND", "NHD"], default="HND")
    p.add_argument("--d-kv-layout", choices=["HND", "NHD"], default="HND")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument(
        "--request-interval",
        type=float,
        default=0.0,
        help="seconds between request arrivals (0: as fast as possible)",
    )
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--num-blocks", type=int, default=0, help="blocks per engine (0: enough)")
    p.add_argument(
        "--model-shape",
        default="layers=4,heads=8,head_dim=64,dtype=float16",
        help="comma list: layers, heads, head_dim, dtype, latent, mamba_layers, mamba_state",
    )
    p.add_argument(
        "--mode",
        choices=["pull", "push"],
        default="pull",
        help="pull: D READs after prefill (default); push: P WRITEs into the blocks D expects",
    )
    p.add_argument(
        "--layerwise", action="store_true", help="with --mode push: WRITE each layer as it is done"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--read-deadline", type=float, default=10.0, help="seconds per READ")
    p.add_argument("--host-staging", action="store_true", help="stage through host buffers")
    p.add_argument(
        "--device",
        default="cpu",
        help="where every rank's KV caches live: cpu (default), cuda, cuda:N, or per role "
        "P=cuda,D=cpu",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="overall deadline (seconds)")
    p.add_argument("--json", dest="json_out", default="", help="also write the summary here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--fault",
        choices=FAULTS,
        default=None,
        help="inject a fault and check that what is reported matches it",
    )
    p.add_argument("--fault-at", type=float, default=0.4, help="fraction of requests before it")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve every rank's Prometheus metrics, aggregated, on 127.0.0.1:PORT/metrics",
    )
    p.add_argument(
        "--linger", type=float, default=0.0, help="keep serving metrics this long after the run"
    )
    _host_options(p)
    p.add_argument(
        "--stages",
        default="",
        help="instead of P/D: a pipeline of stages, e.g. thinker:tp2,talker:tp1 "
        "(see kvrdma.cli.demo.stages; --requests applies)",
    )


def _host_options(p: argparse.ArgumentParser) -> None:
    """Across hosts (network namespaces): how many, and what their links suffer."""
    p.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="run the engines on N hosts made of network namespaces (root): P and its sidecar "
        "on the first, D ranks on the others, UCX over TCP between them (0: one host)",
    )
    p.add_argument(
        "--netem",
        default="",
        help='with --hosts: shape every host link with tc netem, e.g. "delay 5ms loss 1%%"',
    )
    p.add_argument(
        "--loss",
        type=int,
        default=0,
        metavar="PCT",
        help="with --hosts: lose PCT %% of the packets reaching each host, at random (nftables; "
        "works where the kernel has no netem)",
    )


# The ranks' lease is three times the read deadline: bounded, it stays finite (a rank refuses an
# infinite one), and a demo READ still running after an hour has failed anyway.
MAX_READ_DEADLINE = 3600.0
# The float options: what each accepts (argparse takes nan and inf as floats too).
_NUMBERS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "read_deadline": (f"in (0, {MAX_READ_DEADLINE:g}]", lambda v: 0 < v <= MAX_READ_DEADLINE),
    "timeout": ("> 0", lambda v: v > 0),
    "request_interval": (">= 0", lambda v: v >= 0),
    "fault_at": ("in 0..1", lambda v: 0 <= v <= 1),
    "linger": (">= 0", lambda v: v >= 0),
}


def validate(args: argparse.Namespace) -> None:
    for name in ("p_tp", "d_tp", "p_block_size", "d_block_size", "requests", "concurrency"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name, (expected, accepts) in _NUMBERS.items():
        value = getattr(args, name)
        if not (math.isfinite(value) and accepts(value)):
            flag = f"--{name.replace('_', '-')}"
            raise ConfigError(f"{flag}: expected a finite number {expected}, got {value}")
    port = args.metrics_port
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"--metrics-port: expected an integer in 0..65535, got {port}")
    if args.d_block_size % args.p_block_size:
        raise ConfigError(
            f"--d-block-size {args.d_block_size} must be a multiple of --p-block-size "
            f"{args.p_block_size} (only a smaller producer block size is supported)"
        )
    if args.layerwise and args.mode != "push":
        raise ConfigError("--layerwise is for --mode push")
    if args.mode == "push" and args.fault == "drop-notifications":
        raise ConfigError("--fault drop-notifications is a pull fault (D's done notifications)")
    if args.mode == "push" and args.stages:
        raise ConfigError("--stages runs its own transfers: leave out --mode push")
    devices(args.device)
    check_options(args)
    if not 1 <= args.min_tokens <= args.max_tokens:
        raise ConfigError(
            f"need 1 <= --min-tokens ({args.min_tokens}) <= --max-tokens ({args.max_tokens})"
        )


def devices(text: str) -> dict[str, str]:
    """`--device` → {"P": device, "D": device}; raises ConfigError naming what is wrong."""
    import torch

    raw = text.strip() or "cpu"
    if "=" in raw:
        per_role = {}
        for part in raw.split(","):
            role, sep, dev = part.partition("=")
            if not sep or role.strip() not in ("P", "D"):
                raise ConfigError(f"--device item {part!r}: expected P=DEVICE or D=DEVICE")
            per_role[role.strip()] = dev.strip()
        out = {"P": per_role.get("P", "cpu"), "D": per_role.get("D", "cpu")}
    else:
        out = {"P": raw, "D": raw}
    for role, dev in out.items():
        try:
            kind = torch.device(dev).type
        except (RuntimeError, ValueError):
            raise ConfigError(
                f"--device {role}: {dev!r} is not a device (cpu, cuda, cuda:N)"
            ) from None
        if kind not in ("cpu", "cuda"):
            raise ConfigError(f"--device {role}: {dev!r}: expected cpu or cuda[:N]")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {role}: {dev!r} asked for, but no CUDA device is visible")
        index = torch.device(dev).index
        if kind == "cuda" and index is not None and index >= torch.cuda.device_count():
            raise ConfigError(
                f"--device {role}: {dev!r}: only {torch.cuda.device_count()} CUDA device(s)"
            )
    return out
