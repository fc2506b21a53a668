"""`kvrdma demo`: prefill and decode engines as real processes moving verified KV blocks.

Every TP rank is its own process with its own NIXL agent. The P engine's handshake agent runs
in this (parent) process, sidecar-style: P ranks publish their metadata to it, D ranks fetch
from it. Requests of mixed prompt lengths get scattered P and D block ids; D reads them with
one-sided READs and checks every element against the producer's pattern.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from kvrdma.demo_faults import FAULTS, FaultPlan, RequestResult
from kvrdma.errors import ConfigError, KvrdmaError
from kvrdma.metadata import KV_CACHE_ORDERS

LAYOUT_ALIASES = {
    "split": "split_kv",
    "split_kv": "split_kv",
    "blocks_first": "blocks_first",
    "blocks-first": "blocks_first",
    "mla": "mla",
    "cross_layer": "cross_layer",
    "cross-layer": "cross_layer",
    "mamba": "mamba",
    "unified": "unified",
    **{f"unified:{o}": f"unified:{o}" for o in KV_CACHE_ORDERS},
}


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


@dataclass
class _Req:
    rid: str
    index: int
    tokens: int
    p_blocks: list[int]
    d_blocks: list[int]
    started: float = 0.0
    dispatched_at: float = 0.0
    recv: dict[int, tuple[int, str, float, int]] = field(default_factory=dict)
    sent: set[int] = field(default_factory=set)


@dataclass
class Summary:
    layout: str
    p_tp: int
    d_tp: int
    requests: int = 0
    ok: int = 0
    failed: int = 0
    wrong_elements: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    invalid_blocks: int = 0
    setup_seconds: float = 0.0
    endpoints: list[str] = field(default_factory=list)
    handshake_ms: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    results: list[RequestResult] = field(default_factory=list)
    devices: dict[str, str] = field(default_factory=dict)

    def table(self) -> str:
        lat = np.array(self.latencies or [0.0]) * 1e3
        gbs = self.bytes / self.seconds / 1e9 if self.seconds else 0.0
        rate = float(np.median(self.rates or [0.0])) / 1e9
        rows = [
            ("layout", f"{self.layout}  (P tp {self.p_tp} -> D tp {self.d_tp})"),
            ("caches", f"P on {self.devices.get('P', 'cpu')}, D on {self.devices.get('D', 'cpu')}"),
            ("requests", f"{self.requests} ({self.ok} verified, {self.failed} failed)"),
            ("blocks read", f"{self.blocks}"),
            ("bytes read", f"{self.bytes / 2**20:.1f} MiB"),
            ("throughput", f"{gbs:.2f} GB/s over {self.seconds:.2f} s (with verification)"),
            ("per-request read", f"{rate:.2f} GB/s median (READ posted -> done)"),
            ("latency p50", f"{np.percentile(lat, 50):.2f} ms per request"),
            ("latency p99", f"{np.percentile(lat, 99):.2f} ms per request"),
            ("wrong elements", f"{self.wrong_elements}"),
            ("invalid blocks", f"{self.invalid_blocks}"),
            ("setup", f"{self.setup_seconds:.2f} s (handshake {', '.join(self.handshake_ms)} ms)"),
        ]
        width = max(len(k) for k, _ in rows)
        line = "+" + "-" * (width + 2) + "+" + "-" * 48 + "+"
        out = [line] + [f"| {k:<{width}} | {v:<46} |" for k, v in rows] + [line]
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        lat = np.array(self.latencies or [0.0])
        return {
            "layout": self.layout,
            "p_tp": self.p_tp,
            "d_tp": self.d_tp,
            "devices": self.devices,
            "requests": self.requests,
            "verified": self.ok,
            "failed": self.failed,
            "wrong_elements": self.wrong_elements,
            "blocks": self.blocks,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "gb_per_s": self.bytes / self.seconds / 1e9 if self.seconds else 0.0,
            "per_request_gb_per_s_p50": float(np.median(self.rates or [0.0])) / 1e9,
            "latency_p50_ms": float(np.percentile(lat, 50) * 1e3),
            "latency_p99_ms": float(np.percentile(lat, 99) * 1e3),
            "invalid_blocks": self.invalid_blocks,
            "errors": self.errors,
        }


def _validate(args: argparse.Namespace) -> None:
    for name in ("p_tp", "d_tp", "p_block_size", "d_block_size", "requests", "concurrency"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_block_size % args.p_block_size:
        raise ConfigError(
            f"--d-block-size {args.d_block_size} must be a multiple of --p-block-size "
            f"{args.p_block_size} (only a smaller producer block size is supported)"
        )
    _devices(args.device)
    if not 1 <= args.min_tokens <= args.max_tokens:
        raise ConfigError(
            f"need 1 <= --min-tokens ({args.min_tokens}) <= --max-tokens ({args.max_tokens})"
        )


def _devices(text: str) -> dict[str, str]:
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


def run(args: argparse.Namespace) -> int:
    from kvrdma.handshake import HandshakeServer
    from kvrdma.metadata import compat_hash
    from kvrdma.synthetic import CacheSpec, ModelShape, split_layout

    _validate(args)
    layout, order = split_layout(LAYOUT_ALIASES[args.layout])
    shape = ModelShape.parse(args.model_shape)
    if layout == "mla" and args.p_kv_layout != args.d_kv_layout:
        args.d_kv_layout = args.p_kv_layout
    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(args.min_tokens, args.max_tokens + 1, size=args.requests)
    p_need = -(-int(tokens.max()) // args.p_block_size) * args.concurrency
    d_need = -(-int(tokens.max()) // args.d_block_size) * args.concurrency
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
    p_engine, d_engine = f"prefill-{run_id}", f"decode-{run_id}"
    devices = _devices(args.device)
    summary = Summary(args.layout, args.p_tp, args.d_tp, devices=devices)
    fault = (
        FaultPlan(
            args.fault,
            at=max(1, int(args.requests * args.fault_at)),
            read_deadline=args.read_deadline,
        )
        if args.fault
        else None
    )
    ctx = mp.get_context("spawn")
    server = HandshakeServer("127.0.0.1", 0, publish_address="tcp://127.0.0.1:0")
    hs_port = fault.handshake_port(server.port) if fault else server.port
    lease = fault.lease_seconds() if fault else max(30.0, args.read_deadline * 3)
    procs: list[tuple[Any, Connection, str, int]] = []
    metrics_server: Any = None
    agg: Any = None
    t_setup = time.perf_counter()
    from kvrdma.demo_proc import ProcSpec, run_rank

    def spawn(role: str, rank: int) -> None:
        is_p = role == "P"
        spec = ProcSpec(
            role=role,
            rank=rank,
            tp_size=args.p_tp if is_p else args.d_tp,
            engine_id=p_engine if is_p else d_engine,
            cache_layout=layout,
            kv_cache_order=order,
            kv_layout=args.p_kv_layout if is_p else args.d_kv_layout,
            block_size=args.p_block_size if is_p else args.d_block_size,
            num_blocks=p_blocks if is_p else d_blocks,
            shape=shape,
            kv_transfer_config={
                "kv_connector": "NixlConnector",
                "kv_role": "kv_producer" if is_p else "kv_consumer",
                "engine_id": p_engine if is_p else d_engine,
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "read_deadline": args.read_deadline,
                    "kv_lease_duration": lease,
                },
            },
            handshake_host="127.0.0.1",
            handshake_port=hs_port,
            publish_address=server.publish_address or "",
            peer_engine=p_engine,
            peer_tp_size=args.p_tp,
            read_deadline=args.read_deadline,
            host_staging=args.host_staging,
            device=devices[role],
            compat_hash=chash,
            log_level=str(getattr(args, "log_level", "WARNING")).upper(),
            drop_notifications=bool(fault and fault.kind == "drop-notifications"),
            metrics=args.metrics_port is not None,
        )
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=run_rank, args=(spec, child), name=f"kvrdma-{role}{rank}")
        saved = dict(os.environ)
        os.environ.update(fault.child_env() if fault else {})
        try:
            proc.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        child.close()
        procs[:] = [e for e in procs if not (e[2] == role and e[3] == rank)]
        procs.append((proc, parent, role, rank))

    try:
        deadline = time.monotonic() + args.timeout
        for r in range(args.p_tp):
            spawn("P", r)
        _await_ready(procs, "P", summary, deadline)
        for r in range(args.d_tp):
            spawn("D", r)
        _await_ready(procs, "D", summary, deadline)
        summary.setup_seconds = time.perf_counter() - t_setup
        if args.metrics_port is not None:
            metrics_server, agg = _serve_metrics(args.metrics_port, summary.endpoints, server)
        _drive(
            args,
            procs,
            tokens,
            p_blocks,
            d_blocks,
            summary,
            deadline,
            rng,
            fault,
            lambda: spawn("P", 0),
            agg.add_endpoint if agg is not None else None,
        )
        if args.linger > 0:
            _linger(procs, args.linger)
    except KvrdmaError as exc:
        summary.errors.append(str(exc))
    finally:
        if fault:
            fault.release(procs)
        _stop_all(procs, fault)
        server.close()
        if metrics_server is not None:
            metrics_server.close()
    print(summary.table())
    verdict = True
    if fault:
        verdict, lines = fault.judge(summary.results, args.p_tp, args.concurrency)
        print("\n".join(lines))
    else:
        for e in summary.errors[:10]:
            print(f"error: {e}", file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            out = summary.to_json()
            out["fault"] = args.fault
            out["fault_verdict"] = verdict
            json.dump(out, f, indent=2)
    if fault:
        setup_failed = summary.requests != args.requests
        return 0 if verdict and not setup_failed else 1
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

    from kvrdma.sidecar import AgentCollector
    from kvrdma.telemetry import WorkerAggregator, start_http_server

    own = CollectorRegistry(auto_describe=False)
    own.register(AgentCollector(handshake, lambda: (True, {})))
    registry = CollectorRegistry(auto_describe=False)
    agg = WorkerAggregator(endpoints, local=own)
    registry.register(agg)
    try:
        server, bound = start_http_server(registry, "127.0.0.1", port)
    except OSError as exc:
        raise ConfigError(
            f"--metrics-port {port}: cannot serve metrics on 127.0.0.1: {exc}"
        ) from exc
    print(f"metrics: http://127.0.0.1:{bound}/metrics", file=sys.stderr, flush=True)
    return server, agg


def _linger(procs: list[tuple[Any, Connection, str, int]], seconds: float) -> None:
    """Keep the ranks up (their metrics scrapeable) for a while after the run."""
    end = time.monotonic() + seconds
    live: list[Any] = [c for p, c, _, _ in procs if p.is_alive()]
    while time.monotonic() < end:
        ready: list[Any] = wait(live, timeout=0.5)
        for conn in ready:
            try:
                conn.recv()  # late reports are not needed any more
            except (OSError, EOFError):
                live.remove(conn)


def _stop_all(procs: list[tuple[Any, Connection, str, int]], fault: FaultPlan | None) -> None:
    """Ask every rank to stop, collect producer stats, and reap (kill if it will not go)."""
    for _, conn, _, _ in procs:
        with contextlib.suppress(OSError, EOFError, ValueError):
            conn.send(("stop",))
    end = time.monotonic() + 5
    for proc, conn, role, rank in procs:
        while role == "P" and time.monotonic() < end:
            try:
                if not conn.poll(0.1):
                    if not proc.is_alive():
                        break
                    continue
                msg = conn.recv()
            except (OSError, EOFError, ValueError):
                break
            if msg[0] == "stats":
                if fault:
                    fault.producer_stats[rank] = (msg[3], msg[4], msg[5])
                break
        proc.join(timeout=max(0.1, end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2)
        conn.close()


def _await_ready(
    procs: list[tuple[Any, Connection, str, int]], role: str, summary: Summary, deadline: float
) -> None:
    waiting = {(r, k): c for _, c, r, k in procs if r == role}
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise KvrdmaError(f"{role} ranks {sorted(k for _, k in waiting)} not ready in time")
        for conn in wait(list(waiting.values()), timeout=min(left, 1.0)):
            msg = _recv(conn, procs)
            if msg[0] == "error":
                raise KvrdmaError(f"{msg[1]} rank {msg[2]} failed to start: {msg[3]}\n{msg[4]}")
            if msg[0] == "ready":
                waiting.pop((msg[1], msg[2]), None)
                if len(msg) > 5 and msg[5]:
                    summary.endpoints.append(msg[5])
                if msg[4]:
                    summary.handshake_ms.append(msg[4])
        _check_alive(procs)


def _recv(conn: Any, procs: list[tuple[Any, Connection, str, int]]) -> tuple[Any, ...]:
    try:
        msg: tuple[Any, ...] = conn.recv()
        return msg
    except (EOFError, OSError):
        who = next((f"{r}{k}" for _, c, r, k in procs if c is conn), "?")
        raise KvrdmaError(f"rank process {who} exited unexpectedly") from None


def _check_alive(procs: list[tuple[Any, Connection, str, int]]) -> None:
    for proc, _, role, rank in procs:
        if not proc.is_alive():
            raise KvrdmaError(f"{role} rank {rank} died (exit code {proc.exitcode})")


def _drive(
    args: argparse.Namespace,
    procs: list[tuple[Any, Connection, str, int]],
    tokens: np.ndarray,
    p_blocks: int,
    d_blocks: int,
    summary: Summary,
    deadline: float,
    rng: np.random.Generator,
    fault: FaultPlan | None = None,
    respawn: Any = None,
    on_endpoint: Any = None,
) -> None:
    p_free = [int(b) for b in rng.permutation(p_blocks)]
    d_free = [int(b) for b in rng.permutation(d_blocks)]
    queue = list(range(len(tokens)))
    live: dict[str, _Req] = {}
    done_reqs = 0
    show = not args.no_progress
    t0 = time.perf_counter()
    last_bar = 0.0
    next_arrival = time.monotonic()

    def alive(role: str, rank: int) -> bool:
        return not (fault and fault.is_dead(role, rank))

    def conns(role: str) -> list[Connection]:
        return [c for _, c, r, k in procs if r == role and alive(r, k)]

    def handle(conn: Any) -> None:
        nonlocal done_reqs
        msg = _recv(conn, procs)
        if msg[0] == "error":
            raise KvrdmaError(f"{msg[1]} rank {msg[2]} failed: {msg[3]}\n{msg[4]}")
        if msg[0] == "ready":
            if fault:
                fault.on_ready(msg[1], msg[2])
            if on_endpoint is not None and len(msg) > 5 and msg[5]:
                on_endpoint(msg[5])
            return
        req = live.get(msg[3])
        if req is None:
            return
        if msg[0] == "sent":
            req.sent.add(msg[2])
        elif msg[0] == "recv" and msg[2] not in req.recv:
            req.recv[msg[2]] = (msg[4], msg[5], msg[6], msg[7])
            if len(req.recv) == args.d_tp:
                d_free.extend(req.d_blocks)
                done_reqs += 1
                _account(req, summary)
                if fault:  # a faulted producer may never report: reuse its blocks now
                    p_free.extend(req.p_blocks)
        if len(req.recv) == args.d_tp and (
            len(req.sent) >= len(conns("P")) or (fault and not fault.waits_for_producers)
        ):
            if not fault:
                p_free.extend(req.p_blocks)
            del live[req.rid]

    while done_reqs < len(tokens):
        if time.monotonic() > deadline:
            raise KvrdmaError(f"demo did not finish in {args.timeout:.0f}s ({done_reqs} done)")
        in_flight = sum(1 for r in live.values() if len(r.recv) < args.d_tp)
        while queue and in_flight < args.concurrency and not (fault and fault.pausing):
            n_tok = int(tokens[queue[0]])
            n_p = -(-n_tok // args.p_block_size)
            n_d = -(-n_tok // args.d_block_size)
            if len(p_free) < n_p or len(d_free) < n_d:
                break
            if fault and fault.due(queue[0]) and in_flight:
                break  # inject with nothing in flight: earlier requests settle first
            if time.monotonic() < next_arrival:
                break
            next_arrival = time.monotonic() + args.request_interval
            i = queue.pop(0)
            if fault:
                fault.before_dispatch(i, procs, respawn)
                fault.on_dispatch(i)
            req = _Req(f"req-{i}", i, n_tok, p_free[:n_p], d_free[:n_d])
            del p_free[:n_p], d_free[:n_d]
            req.started = time.perf_counter()
            req.dispatched_at = time.monotonic()
            live[req.rid] = req
            in_flight += 1
            for c in conns("P"):
                c.send(("hold", req.rid, req.p_blocks))
            for c in conns("D"):
                c.send(("read", req.rid, req.d_blocks, req.p_blocks, args.p_block_size))
        wait_s = 0.5 if not args.request_interval else min(0.5, args.request_interval)
        for conn in wait(conns("P") + conns("D"), timeout=wait_s):
            handle(conn)
        _check_alive([e for e in procs if alive(e[2], e[3])])
        if show and time.perf_counter() - last_bar > 0.1:
            last_bar = time.perf_counter()
            _bar(done_reqs, len(tokens))
    summary.seconds = time.perf_counter() - t0
    # let producers report the last finished-sending (lease expiries with a fault) first
    grace = 2.0 if not (fault and fault.waits_for_producers) else fault.lease_seconds() + 3.0
    end = time.monotonic() + grace
    while live and time.monotonic() < end:
        for conn in wait(conns("P"), timeout=0.1):
            handle(conn)
    if show:
        _bar(done_reqs, len(tokens))
        print(file=sys.stderr)


def _account(req: _Req, summary: Summary) -> None:
    result = RequestResult(req.rid, req.index, req.d_blocks, req.dispatched_at, time.monotonic())
    for count, err, _, _ in req.recv.values():
        if count > 0:
            result.wrong += count
        elif count < 0:
            result.errors.append(err)
            if err.startswith("invalid blocks"):
                result.invalid = sorted(set(result.invalid) | set(_ids_in(err)))
            else:  # rejected before any READ: the whole request is invalid
                result.invalid = sorted(req.d_blocks)
    result.ok = result.wrong == 0 and not result.errors
    summary.results.append(result)
    summary.requests += 1
    bad = [(k, v) for k, v in req.recv.items() if v[0] != 0]
    if bad:
        summary.failed += 1
        for rank, (count, err, _, _) in bad:
            if count > 0:
                summary.wrong_elements += count
                summary.errors.append(f"{req.rid} D rank {rank}: {count} wrong elements")
            else:
                summary.invalid_blocks += len(req.d_blocks)
                summary.errors.append(f"{req.rid} D rank {rank}: {err}")
    else:
        summary.ok += 1
    summary.blocks += len(req.d_blocks)
    summary.bytes += sum(v[3] for v in req.recv.values())
    latency = max(v[2] for v in req.recv.values())
    summary.latencies.append(latency)
    if latency > 0 and not bad:
        summary.rates.append(sum(v[3] for v in req.recv.values()) / latency)


def _ids_in(text: str) -> list[int]:
    inside = text[text.find("[") + 1 : text.find("]")]
    return [int(x) for x in inside.split(",") if x.strip()]


def _bar(done: int, total: int) -> None:
    width = 30
    fill = int(width * done / total) if total else width
    sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} requests")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrdma demo")
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
