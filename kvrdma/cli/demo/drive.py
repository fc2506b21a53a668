"""The request loop of `kvrdma demo`: hands requests to the ranks, collects their reports.

Requests arrive at `--request-interval`, up to `--concurrency` at once, each with block ids
drawn from the free lists of both engines; a request is done when every D rank has reported
it and its blocks go back to the free lists.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from kvrdma.cli.demo.faults import FaultPlan, RequestResult
from kvrdma.cli.demo.ranks import Procs, check_alive, recv
from kvrdma.cli.demo.report import Summary
from kvrdma.errors import KvrdmaError


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


class Driver:
    """Runs `tokens` (one prompt length per request) through the ranks in `procs`."""

    def __init__(
        self,
        args: argparse.Namespace,
        procs: Procs,
        tokens: np.ndarray,
        blocks: tuple[int, int],
        summary: Summary,
        rng: np.random.Generator,
        respawn: Callable[[], None],
        fault: FaultPlan | None = None,
        on_endpoint: Callable[[str], None] | None = None,
    ) -> None:
        self.args = args
        self.procs = procs
        self.tokens = tokens
        self.summary = summary
        self.fault = fault
        self.respawn = respawn
        self.on_endpoint = on_endpoint
        self.p_free = [int(b) for b in rng.permutation(blocks[0])]
        self.d_free = [int(b) for b in rng.permutation(blocks[1])]
        self.queue = list(range(len(tokens)))
        self.live: dict[str, _Req] = {}
        # push: D ranks that hold a failed request's blocks out of use, and those blocks
        self.quarantine: dict[str, set[int]] = {}
        self.withheld: dict[str, list[int]] = {}
        self.done_reqs = 0
        self.next_arrival = time.monotonic()

    def run(self, deadline: float) -> None:
        """Until every request is done (KvrdmaError past `deadline`), then a grace period for
        the producers' last reports."""
        args, fault = self.args, self.fault
        show = not args.no_progress
        t0 = time.perf_counter()
        last_bar = 0.0
        while self.done_reqs < len(self.tokens):
            if time.monotonic() > deadline:
                raise KvrdmaError(
                    f"demo did not finish in {args.timeout:.0f}s ({self.done_reqs} done)"
                )
            self._dispatch()
            wait_s = 0.5 if not args.request_interval else min(0.5, args.request_interval)
            for conn in wait(self._conns("P") + self._conns("D"), timeout=wait_s):
                self._handle(conn)
            check_alive([e for e in self.procs if self._alive(e[2], e[3])])
            if show and time.perf_counter() - last_bar > 0.1:
                last_bar = time.perf_counter()
                _bar(self.done_reqs, len(self.tokens))
        self.summary.seconds = time.perf_counter() - t0
        # let producers report the last finished-sending (lease expiries with a fault) first
        grace = 2.0 if not (fault and fault.waits_for_producers) else fault.lease_seconds() + 3.0
        end = time.monotonic() + grace
        while self.live and time.monotonic() < end:
            for conn in wait(self._conns("P"), timeout=0.1):
                self._handle(conn)
        if show:
            _bar(self.done_reqs, len(self.tokens))
            print(file=sys.stderr)

    def _alive(self, role: str, rank: int) -> bool:
        return not (self.fault and self.fault.is_dead(role, rank))

    def _conns(self, role: str) -> list[Connection]:
        return [c for _, c, r, k in self.procs if r == role and self._alive(r, k)]

    def _dispatch(self) -> None:
        """Start the requests that are due and fit in the free blocks and the concurrency."""
        args, fault = self.args, self.fault
        in_flight = sum(1 for r in self.live.values() if len(r.recv) < args.d_tp)
        while self.queue and in_flight < args.concurrency and not (fault and fault.pausing):
            n_tok = int(self.tokens[self.queue[0]])
            n_p = -(-n_tok // args.p_block_size)
            n_d = -(-n_tok // args.d_block_size)
            if len(self.p_free) < n_p or len(self.d_free) < n_d:
                break
            if fault and fault.due(self.queue[0]) and in_flight:
                break  # inject with nothing in flight: earlier requests settle first
            if time.monotonic() < self.next_arrival:
                break
            self.next_arrival = time.monotonic() + args.request_interval
            i = self.queue.pop(0)
            if fault:
                fault.before_dispatch(i, self.procs, self.respawn)
                fault.on_dispatch(i)
            req = _Req(f"req-{i}", i, n_tok, self.p_free[:n_p], self.d_free[:n_d])
            del self.p_free[:n_p], self.d_free[:n_d]
            req.started = time.perf_counter()
            req.dispatched_at = time.monotonic()
            self.live[req.rid] = req
            in_flight += 1
            read = (req.rid, req.d_blocks, req.p_blocks, args.p_block_size)
            if args.mode == "push":  # D expects it before P may write it
                for c in self._conns("D"):
                    c.send(("expect", *read))
                for c in self._conns("P"):
                    c.send(("push", req.rid, req.p_blocks, args.layerwise))
                continue
            for c in self._conns("P"):
                c.send(("hold", req.rid, req.p_blocks))
            for c in self._conns("D"):
                c.send(("read", *read))

    def _handle(self, conn: Any) -> None:
        """One message from a rank: an error, a (re)started rank, or a request report."""
        fault, d_tp = self.fault, self.args.d_tp
        msg = recv(conn, self.procs)
        if msg[0] == "error":
            raise KvrdmaError(f"{msg[1]} rank {msg[2]} failed: {msg[3]}\n{msg[4]}")
        if msg[0] == "ready":
            if fault:
                fault.on_ready(msg[1], msg[2])
            if self.on_endpoint is not None and len(msg) > 5 and msg[5]:
                self.on_endpoint(msg[5])
            return
        if msg[0] in ("quarantined", "released"):
            self._quarantine(msg[0], msg[2], msg[3])
            return
        req = self.live.get(msg[3])
        if req is None:
            return
        if msg[0] == "sent":
            req.sent.add(msg[2])
        elif msg[0] == "recv" and msg[2] not in req.recv:
            req.recv[msg[2]] = (msg[4], msg[5], msg[6], msg[7])
            if len(req.recv) == d_tp:
                if req.rid in self.quarantine:  # a producer may still write them
                    self.withheld[req.rid] = req.d_blocks
                else:
                    self.d_free.extend(req.d_blocks)
                self.done_reqs += 1
                _account(req, self.summary)
                if fault:  # a faulted producer may never report: reuse its blocks now
                    self.p_free.extend(req.p_blocks)
        if len(req.recv) == d_tp and (
            len(req.sent) >= len(self._conns("P")) or (fault and not fault.waits_for_producers)
        ):
            if not fault:
                self.p_free.extend(req.p_blocks)
            del self.live[req.rid]

    def _quarantine(self, kind: str, rank: int, rid: str) -> None:
        """A D rank holds a failed push's blocks out of use, or lets them go."""
        if kind == "quarantined":
            self.quarantine.setdefault(rid, set()).add(rank)
            self.summary.quarantined += 1
            return
        self.summary.released += 1
        ranks = self.quarantine.get(rid, set())
        ranks.discard(rank)
        if not ranks:
            self.quarantine.pop(rid, None)
            self.d_free.extend(self.withheld.pop(rid, []))


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
