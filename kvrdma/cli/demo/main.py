"""`kvrdma demo`: prefill and decode engines as real processes moving verified KV blocks.

Every TP rank is its own process with its own NIXL agent. The P engine's handshake agent runs
in this (parent) process, sidecar-style: P ranks publish their metadata to it, D ranks fetch
from it. Requests of mixed prompt lengths get scattered P and D block ids; D reads them with
one-sided READs and checks every element against the producer's pattern.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvrdma.cli.demo.drive import Driver
from kvrdma.cli.demo.faults import FaultPlan
from kvrdma.cli.demo.options import configure_parser, devices, validate
from kvrdma.cli.demo.rank_process import ProcSpec
from kvrdma.cli.demo.ranks import Procs, await_ready, linger, spawn_rank, stop_all
from kvrdma.cli.demo.report import Summary
from kvrdma.cli.layouts import LAYOUT_ALIASES
from kvrdma.errors import ConfigError, KvrdmaError

__all__ = ["configure_parser", "main", "run"]

_HANDSHAKE_TIMEOUT_S = 2.0  # a D rank's connect; a failed one is retried, the run goes on


@dataclass(frozen=True)
class _Setup:
    """What a run derives from its options before any process starts."""

    layout: str
    order: str
    shape: Any  # synthetic.ModelShape
    tokens: np.ndarray  # one prompt length per request
    p_blocks: int
    d_blocks: int
    compat_hash: str
    p_engine: str
    d_engine: str
    devices: dict[str, str]
    rng: np.random.Generator


@dataclass(frozen=True)
class _Link:
    """How the ranks reach the P engine's handshake agent, and the timings they run with."""

    handshake_port: int
    publish_address: str
    read_deadline: float
    lease: float
    hosts: Any = None  # hosts.DemoHosts with --hosts: where each rank runs


def run(args: argparse.Namespace) -> int:
    if args.stages:
        from kvrdma.cli.demo.stages import run as run_stages

        return run_stages(args.stages, args.requests)
    from kvrdma.handshake import HandshakeServer

    setup = _plan(args)
    mode = f"{args.mode}{', layer-wise' if args.layerwise else ''}"
    summary = Summary(args.layout, args.p_tp, args.d_tp, devices=setup.devices, mode=mode)
    fault = (
        FaultPlan(
            args.fault,
            at=max(1, int(args.requests * args.fault_at)),
            read_deadline=args.read_deadline,
        )
        if args.fault
        else None
    )
    server: Any
    if args.hosts:
        from kvrdma.cli.demo.hosts import DemoHosts

        server = DemoHosts(args.hosts, setup.p_engine, args.p_tp, args.netem, args.loss)
        print(server.describe(), file=sys.stderr, flush=True)
        if fault:
            fault.set_link = server.set_p_link
    else:
        server = HandshakeServer("127.0.0.1", 0, publish_address="tcp://127.0.0.1:0")
    link = _Link(
        handshake_port=fault.handshake_port(server.port) if fault else server.port,
        publish_address=server.publish_address or "",
        read_deadline=fault.read_deadline if fault else args.read_deadline,
        lease=fault.lease_seconds() if fault else max(30.0, args.read_deadline * 3),
        hosts=server if args.hosts else None,
    )
    fatal = _run_ranks(args, setup, link, summary, server, fault)
    return _report(args, summary, fault, fatal)


def _plan(args: argparse.Namespace) -> _Setup:
    """Check the options and size both engines for the requests (ConfigError if they do not
    describe a valid pair)."""
    from kvrdma.metadata import compat_hash
    from kvrdma.testing.synthetic import CacheSpec, ModelShape, split_layout

    validate(args)
    layout, order = split_layout(LAYOUT_ALIASES[args.layout])
    shape = ModelShape.parse(args.model_shape)
    if layout == "mla" and args.p_kv_layout != args.d_kv_layout:
        args.d_kv_layout = args.p_kv_layout
    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(args.min_tokens, args.max_tokens + 1, size=args.requests)
    p_need = -(-int(tokens.max()) // args.p_block_size) * args.concurrency
    d_need = -(-int(tokens.max()) // args.d_block_size) * args.concurrency
    if args.mode == "push" and args.fault:  # failed pushes keep their blocks while a
        d_need = int(sum(-(-int(t) // args.d_block_size) for t in tokens))  # producer could write
    p_blocks = max(args.num_blocks, p_need + 8)
    d_blocks = max(args.num_blocks // max(1, args.d_block_size // args.p_block_size), d_need + 8)
    for _role, tp, bs, kvl in (
        ("P", args.p_tp, args.p_block_size, args.p_kv_layout),
        ("D", args.d_tp, args.d_block_size, args.d_kv_layout),
    ):
        CacheSpec(shape, layout, kvl, 0, tp, bs, 1).validate()
    chash = compat_hash(
        version="kvrdma-demo",
        model=args.model_shape,
        dtype=shape.dtype,
        total_num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        num_layers=shape.num_layers,
        attn_backend=layout,
        cache_dtype=shape.dtype,
        cross_layer=layout == "cross_layer",
    )
    run_id = uuid.uuid4().hex[:8]
    return _Setup(
        layout,
        order,
        shape,
        tokens,
        p_blocks,
        d_blocks,
        chash,
        f"prefill-{run_id}",
        f"decode-{run_id}",
        devices(args.device),
        rng,
    )


def _spec(
    args: argparse.Namespace,
    setup: _Setup,
    link: _Link,
    fault: FaultPlan | None,
    role: str,
    rank: int,
) -> ProcSpec:
    """What rank `rank` of engine `role` ("P" or "D") is started with."""
    is_p = role == "P"
    return ProcSpec(
        role=role,
        rank=rank,
        tp_size=args.p_tp if is_p else args.d_tp,
        engine_id=setup.p_engine if is_p else setup.d_engine,
        cache_layout=setup.layout,
        kv_cache_order=setup.order,
        kv_layout=args.p_kv_layout if is_p else args.d_kv_layout,
        block_size=args.p_block_size if is_p else args.d_block_size,
        num_blocks=setup.p_blocks if is_p else setup.d_blocks,
        shape=setup.shape,
        kv_transfer_config={
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if is_p else "kv_consumer",
            "engine_id": setup.p_engine if is_p else setup.d_engine,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "read_deadline": link.read_deadline,
                "kv_lease_duration": link.lease,
                "handshake_timeout": _HANDSHAKE_TIMEOUT_S,
                "handshake_retries": 1,
            },
        },
        handshake_host=link.hosts.p_host.address if link.hosts else "127.0.0.1",
        handshake_port=link.handshake_port,
        publish_address=link.publish_address,
        peer_engine=setup.p_engine,
        peer_tp_size=args.p_tp,
        read_deadline=link.read_deadline,
        host_staging=args.host_staging,
        device=setup.devices[role],
        compat_hash=setup.compat_hash,
        log_level=str(getattr(args, "log_level", "WARNING")).upper(),
        drop_notifications=bool(fault and fault.kind == "drop-notifications"),
        metrics=args.metrics_port is not None,
        netns=link.hosts.host_of(role, rank).netns if link.hosts else "",
    )


def _run_ranks(
    args: argparse.Namespace,
    setup: _Setup,
    link: _Link,
    summary: Summary,
    server: Any,
    fault: FaultPlan | None,
) -> str:
    """Start the ranks, drive the requests through them and stop them; returns why the run is
    void ("" when it is not). Closes `server` (the handshake server, or the hosts)."""
    ctx = mp.get_context("spawn")
    procs: Procs = []
    env = fault.child_env() if fault else {}
    metrics_server: Any = None
    agg: Any = None
    fatal = ""
    t_setup = time.perf_counter()

    def spawn(role: str, rank: int) -> None:
        where = link.hosts.env(role, rank) if link.hosts else {}
        spawn_rank(ctx, procs, _spec(args, setup, link, fault, role, rank), {**env, **where})

    try:
        deadline = time.monotonic() + args.timeout
        for r in range(args.p_tp):
            spawn("P", r)
        await_ready(procs, "P", summary, deadline)
        for r in range(args.d_tp):
            spawn("D", r)
        await_ready(procs, "D", summary, deadline)
        summary.setup_seconds = time.perf_counter() - t_setup
        if args.metrics_port is not None:
            metrics_server, agg = _serve_metrics(args.metrics_port, summary.endpoints, server)
        Driver(
            args,
            procs,
            setup.tokens,
            (setup.p_blocks, setup.d_blocks),
            summary,
            setup.rng,
            lambda: spawn("P", 0),
            fault,
            agg.add_endpoint if agg is not None else None,
        ).run(deadline)
        if args.linger > 0:
            linger(procs, args.linger)
    except KvrdmaError as exc:  # a rank failed, died or never came up: the run is void
        fatal = str(exc)
        summary.errors.append(fatal)
    finally:
        if fault:
            fault.release(procs)
        stop_all(procs, fault)
        server.close()
        if metrics_server is not None:
            metrics_server.close()
    return fatal


def _report(args: argparse.Namespace, summary: Summary, fault: FaultPlan | None, fatal: str) -> int:
    """Print the summary (and the fault's verdict), write the JSON; the exit code."""
    print(summary.table())
    verdict = True
    if fault:
        push = (summary.quarantined, summary.released) if args.mode == "push" else None
        verdict, lines = fault.judge(summary.results, args.p_tp, args.concurrency, push)
        print("\n".join(lines))
    else:
        for e in [e for e in summary.errors if e != fatal][:10]:
            print(f"error: {e}", file=sys.stderr)
    if fatal:
        print(f"error: {fatal}", file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            out = summary.to_json()
            out["fault"] = args.fault
            out["fault_verdict"] = verdict
            out["fault_detected_seconds"] = (
                fault.detection_seconds(summary.results) if fault else None
            )
            json.dump(out, f, indent=2)
    if fault:
        setup_failed = summary.requests != args.requests
        return 0 if verdict and not setup_failed and not fatal else 1
    ok = (
        not summary.errors
        and summary.wrong_elements == 0
        and summary.ok == summary.requests == args.requests
    )
    return 0 if ok else 1


def _serve_metrics(port: int, endpoints: list[str], handshake: Any) -> tuple[Any, Any]:
    """Serve the ranks' metrics merged into one endpoint, as the sidecar does in a pod (this
    process also plays the sidecar's handshake agent, so its series come along)."""
    from prometheus_client import CollectorRegistry

    from kvrdma.cli.agent import AgentCollector
    from kvrdma.scrape import WorkerAggregator
    from kvrdma.telemetry import start_http_server

    own = CollectorRegistry(auto_describe=False)
    own.register(AgentCollector(handshake, lambda: (True, {})))
    registry = CollectorRegistry(auto_describe=False)
    agg = WorkerAggregator(endpoints, local=own)
    registry.register(agg)
    try:
        server, bound = start_http_server(registry, "127.0.0.1", port)
    except (OSError, OverflowError) as exc:  # bind() raises OverflowError past port 65535
        raise ConfigError(
            f"--metrics-port {port}: cannot serve metrics on 127.0.0.1: {exc}"
        ) from exc
    print(f"metrics: http://127.0.0.1:{bound}/metrics", file=sys.stderr, flush=True)
    return server, agg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrdma demo")
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
