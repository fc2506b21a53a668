"""Long-lived "rank host" processes for the data-path tests: one real `Worker` per case each.

A new process costs ~1.5 s of imports and ~0.4 s for its first NIXL agent, so the tests start
a pool of hosts once per session and reuse them: every case sets up fresh workers (fresh NIXL
agents with unique names, fresh caches), runs, and tears them down again.

Child side: `serve(conn, name, log_path)` runs a command loop over a pipe. Requests are
`(seq, command, args)`; replies are `(seq, "ok", value)` or `(seq, "err", type, text, tb)`.
While a worker is set up the loop polls the pipe with a 1 ms timeout and keeps calling
`get_finished()`, as an engine's step loop would: NIXL runs without a progress thread, so a
producer that stops polling stalls its readers' wire-up and never sees their notifications.
What `get_finished()` reports is recorded (finished sending / receiving, invalid ids) for
the commands to read. A consumer can be set up with `idle_progress=False` to show what
happens when a reader stops stepping.

Parent side: `RankHost` (one process) and `HostPool` (the session's hosts). Every receive has a
deadline; a host that dies, raises or stays silent fails the test with its traceback and the
tail of its log, and is replaced before the next case. kvrdma exceptions raised in a host are
raised again in the parent as the same class, so `pytest.raises(ConfigError)` works across
the pipe. `EnginePair` sets up one P engine and one D engine on the pool for one case.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from kvrdma.testing import die_with_parent

logger = logging.getLogger(__name__)

_POLL_S = 0.001  # how long a host with a worker waits for a command before stepping
_READER_POLL_S = 0.005  # the same for a reader (it steps while reading; idle it only flushes)
_SPIN_S = 0.0002  # between steps while a host waits for its own reads
_READY_S = 90.0  # a fresh host: imports and a warm-up agent (8 of them on 2 cores)


# ==== child side ===============================================================================
def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _resources() -> dict[str, float]:
    """RSS (MiB), open file descriptors and threads of this process."""
    return {
        "rss_mb": _rss_mb(),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
    }


def _ids(values: Iterable[int]) -> list[int]:
    return [int(v) for v in values]


@dataclass
class _Setup:
    worker: Any
    spec: Any  # synthetic.CacheSpec
    caches: Any
    mamba: list[str]
    role: str
    engine_id: str
    idle_progress: bool = True
    remote_engine: str = ""
    held_at: dict[str, float] = field(default_factory=dict)
    sent: dict[str, float] = field(default_factory=dict)  # request id -> seconds held
    sent_log: list[str] = field(default_factory=list)  # every finished-sending report
    recvd: dict[str, tuple[float, list[int]]] = field(default_factory=dict)  # (when, invalid)
    outcomes: dict[str, str] = field(default_factory=dict)  # failed reads: their Outcome value
    push_t0: dict[str, float] = field(default_factory=dict)  # expected pushes: when
    quarantined: set[str] = field(default_factory=set)  # pushes given up, still quarantined
    released: list[str] = field(default_factory=list)


class _Host:
    """The state of one host process and its commands (`cmd_<name>`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.s: _Setup | None = None
        self.cases = 0
        self.after: list[dict[str, float]] = []  # resources after each teardown
        self._warm_up()

    @staticmethod
    def _warm_up() -> None:
        """Pay for imports and the first agent (plugin loading) before the first case."""
        import kvrdma.testing.synthetic
        import kvrdma.worker  # noqa: F401
        from kvrdma.nixl import BackendConfig, NixlBackend

        NixlBackend(BackendConfig(name=f"warmup-{os.getpid()}")).close()
        logging.getLogger("nixl").setLevel(logging.WARNING)  # one INFO line per agent

    # ---- loop --------------------------------------------------------------------------
    @property
    def poll_s(self) -> float:
        return _POLL_S if self.s is not None and self.s.role == "P" else _READER_POLL_S

    @property
    def stepping(self) -> bool:
        return self.s is not None and self.s.idle_progress

    def progress(self) -> None:
        """One engine step: `get_finished()`, its report recorded."""
        s = self.s
        if s is None:
            return
        out = s.worker.get_finished()
        now = time.monotonic()
        for rid in out.finished_sending:
            s.sent[rid] = now - s.held_at.get(rid, now)
            s.sent_log.append(rid)
        for rid in out.finished_recving:
            s.recvd[rid] = (now, sorted(out.invalid_block_ids.get(rid, ())))
            failure = out.failures.get(rid)
            s.outcomes[rid] = "success" if failure is None else failure.outcome.value
        s.quarantined |= out.quarantined
        s.quarantined -= out.released
        s.released.extend(out.released)

    def serve(self, conn: Connection) -> None:
        while True:
            if self.stepping and not conn.poll(self.poll_s):
                self.progress()
                continue
            try:
                seq, cmd, args = conn.recv()
            except EOFError:
                return
            if cmd == "stop":
                self._close_worker()
                conn.send((seq, "ok", None))
                return
            try:
                reply: tuple[Any, ...] = (seq, "ok", getattr(self, f"cmd_{cmd}")(*args))
            except Exception as exc:
                logger.info("%s: %s failed: %s", self.name, cmd, exc)
                reply = (seq, "err", type(exc).__name__, str(exc), traceback.format_exc())
            conn.send(reply)
            if self.stepping:
                self.progress()

    def _need(self) -> _Setup:
        if self.s is None:
            raise RuntimeError(f"host {self.name}: no worker set up (call setup first)")
        return self.s

    def _close_worker(self) -> None:
        s, self.s = self.s, None
        if s is not None:
            s.worker.close()

    # ---- commands ----------------------------------------------------------------------
    def cmd_setup(self, cfg: dict[str, Any]) -> bytes:
        """Fresh caches and a fresh worker (agent) as `cfg` says; returns the metadata."""
        import msgspec

        from kvrdma.config import load_kv_transfer_config
        from kvrdma.testing.synthetic import CacheSpec, ModelShape, fill, make_caches
        from kvrdma.worker import Worker

        if self.s is not None:
            logger.warning("%s: a worker of the last case was left; closing it", self.name)
            self._close_worker()
        role = cfg["role"]
        spec = CacheSpec(
            ModelShape(**cfg["shape"]),
            cfg["cache_layout"],
            cfg["kv_layout"],
            cfg["rank"],
            cfg["tp_size"],
            cfg["block_size"],
            cfg["num_blocks"],
            cfg.get("device", "cpu"),
            cfg.get("kv_cache_order", "LBHNC"),
            bool(cfg.get("hybrid", False)),
        )
        caches, mamba = make_caches(spec)
        if role == "P":
            fill(spec, caches)
        config = load_kv_transfer_config(
            {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_producer" if role == "P" else "kv_consumer",
                "engine_id": cfg["engine_id"],
                "kv_load_failure_policy": "recompute",
                "kv_buffer_device": cfg.get("kv_buffer_device", "cuda"),
                "kv_connector_extra_config": cfg["extra"],
            },
            environ={},
        )
        worker = Worker.create(
            config,
            tp_rank=cfg["rank"],
            tp_size=cfg["tp_size"],
            total_num_kv_heads=spec.shape.num_kv_heads,
            agent_name=cfg["agent_name"],
        )
        try:
            meta = worker.register_kv_caches(
                caches,
                mamba_layers=mamba,
                **spec.layout_args,  # type: ignore[arg-type]
            )
        except BaseException:
            worker.close()
            raise
        idle = role == "P" or bool(cfg.get("idle_progress", True))  # producers always step
        self.s = _Setup(worker, spec, caches, mamba, role, cfg["engine_id"], idle)
        self.cases += 1
        return msgspec.msgpack.encode(meta)

    def cmd_connect(self, engine_id: str, host: str, port: int) -> dict[str, Any]:
        """`Worker.connect` to the engine served by the handshake agent at host:port, as a
        real decode worker does (it fetches only the ranks it reads from)."""
        return self._plan_summary(self._need().worker.connect(engine_id, host, port))

    def cmd_add_remote(self, metas: dict[int, bytes]) -> dict[str, Any]:
        """Decode every remote rank's metadata and add the engine with all of them."""
        import msgspec

        from kvrdma.metadata import WorkerMetadata

        s = self._need()
        decoded = {int(r): msgspec.msgpack.decode(b, type=WorkerMetadata) for r, b in metas.items()}
        return self._plan_summary(s.worker.add_remote(decoded))

    def _plan_summary(self, plan: Any) -> dict[str, Any]:
        self._need().remote_engine = plan.remote_engine_id
        return {
            "sources": [src.remote_rank for src in plan.sources],
            "notify_ranks": list(plan.notify_ranks),
            "notify_expected": plan.notify_expected,
            "entries": plan.num_entries,
        }

    def cmd_remotes(self) -> dict[str, list[str]]:
        s = self._need()
        consumer = s.worker.consumer
        return {
            "engines": sorted(consumer.remotes) if consumer is not None else [],
            "agents": s.worker.backend.remotes(),
        }

    def cmd_hold(self, requests: Sequence[tuple[str, Sequence[int]]]) -> dict[str, float]:
        """Hold each request's blocks; returns when each lease ends (the worker's clock)."""
        s = self._need()
        expiries = {}
        for rid, ids in requests:
            s.held_at[rid] = time.monotonic()
            expiries[rid] = s.worker.hold(rid, _ids(ids))
        return expiries

    def cmd_reuse(self, pairs: Sequence[tuple[int, int]]) -> None:
        """A producer reusing freed blocks: each (dst, src) copies block src over block dst in
        every registered region, so dst holds another request's KV."""
        from kvrdma.layout import build_regions

        s = self._need()
        info = build_regions(s.caches, mamba_layers=s.mamba, **s.spec.layout_args)
        for r in info.regions:
            for dst, src in pairs:
                r.data[dst] = r.data[src]

    def cmd_corrupt(self, block: int, region: int = 0, offset: int = 0) -> None:
        """Flip the byte at `offset` of block `block` of registered region `region`: a fault
        in memory or a stray write after the block was held."""
        from kvrdma.layout import build_regions

        s = self._need()
        info = build_regions(s.caches, mamba_layers=s.mamba, **s.spec.layout_args)
        row = info.regions[region].data[block]
        row[offset] = row[offset] ^ 0xFF

    def cmd_start_read(self, rid: str, local_ids: Sequence[int], remote_ids: Sequence[int]) -> None:
        s = self._need()
        s.worker.start_read(rid, _ids(local_ids), _ids(remote_ids), s.remote_engine)

    def cmd_inflight(self) -> list[str]:
        consumer = self._need().worker.consumer
        return sorted(consumer.inflight) + [op.request_id for op in consumer.ready]

    def cmd_read(
        self,
        requests: Sequence[tuple[str, Sequence[int], Sequence[int]]],
        remote_block_size: int,
        deadline: float,
        expires: Mapping[str, float] | None = None,
    ) -> list[dict[str, Any]]:
        """Post every request (with its lease expiry from `expires`, if any), drive
        `get_finished()` until all finished (at most `deadline` seconds), then verify each:
        wrong elements (-1: not checked), invalid ids, latency, outcome."""
        s = self._need()
        t0: dict[str, float] = {}
        for rid, local_ids, remote_ids in requests:
            s.recvd.pop(rid, None)
            t0[rid] = time.monotonic()
            s.worker.start_read(
                rid,
                _ids(local_ids),
                _ids(remote_ids),
                s.remote_engine,
                remote_expires_at=(expires or {}).get(rid),
            )
        return self._await(requests, remote_block_size, deadline, t0)

    def cmd_expect_push(
        self, requests: Sequence[tuple[str, Sequence[int], Sequence[int]]], deadline: float
    ) -> None:
        """Expect every request pushed into its local blocks (the producer's id is `rid`)."""
        s = self._need()
        s.push_t0 = {}
        for rid, local_ids, _ in requests:
            s.recvd.pop(rid, None)
            s.push_t0[rid] = time.monotonic()
            s.worker.expect_push(rid, _ids(local_ids), s.remote_engine, deadline=deadline)

    def cmd_push(
        self, requests: Sequence[tuple[str, Sequence[int]]], layerwise: bool, layers: int = -1
    ) -> None:
        """Push each request from its blocks: whole, or layer by layer (the first `layers`
        only, -1: every one and the rest)."""
        s = self._need()
        for rid, ids in requests:
            s.held_at[rid] = time.monotonic()
            s.worker.push(rid, _ids(ids), layerwise=layerwise)
            if not layerwise:
                continue
            names = list(s.worker._s.layout.layer_index)  # type: ignore[union-attr]
            for name in names if layers < 0 else names[:layers]:
                s.worker.push_layer(rid, name)
                self.progress()
            if layers < 0:
                s.worker.end_push(rid)

    def cmd_push_rest(self, rid: str) -> None:
        """Layer-wise push: mark every layer final and end the request."""
        s = self._need()
        for name in s.worker._s.layout.layer_index:  # type: ignore[union-attr]
            s.worker.push_layer(rid, name)
        s.worker.end_push(rid)

    def cmd_abort_push(self, rid: str) -> None:
        self._need().worker.abort_push(rid)

    def cmd_forget(self, rid: str) -> None:
        self._need().worker.forget(rid)

    def cmd_push_state(self) -> dict[str, Any]:
        """What the decoder reported of pushed requests so far; a producer: the requests
        decoders expect that it has not begun."""
        s = self._need()
        return {
            "recvd": {r: (inv, s.outcomes.get(r)) for r, (_, inv) in s.recvd.items()},
            "quarantined": sorted(s.quarantined),
            "released": list(s.released),
            "sent": list(s.sent_log),
            "expected": sorted(p.pusher.early) if (p := s.worker.producer) is not None else [],
        }

    def cmd_zero(self, block_ids: Sequence[int]) -> None:
        """Zero these local blocks in every registered region (a decoder reusing them)."""
        from kvrdma.layout import build_regions

        s = self._need()
        info = build_regions(s.caches, mamba_layers=s.mamba, **s.spec.layout_args)
        for r in info.regions:
            r.data[_ids(block_ids)] = 0

    def cmd_await_push(
        self,
        requests: Sequence[tuple[str, Sequence[int], Sequence[int]]],
        remote_block_size: int,
        deadline: float,
    ) -> list[dict[str, Any]]:
        """`read`'s wait and checks for requests expected with `expect_push`."""
        s = self._need()
        return self._await(requests, remote_block_size, deadline, s.push_t0)

    def _await(
        self,
        requests: Sequence[tuple[str, Sequence[int], Sequence[int]]],
        remote_block_size: int,
        deadline: float,
        t0: Mapping[str, float],
    ) -> list[dict[str, Any]]:
        from kvrdma.testing.synthetic import verify

        s = self._need()
        end = time.monotonic() + deadline
        while not set(t0) <= set(s.recvd):
            if time.monotonic() > end:
                missing = sorted(set(t0) - set(s.recvd))
                raise TimeoutError(
                    f"host {self.name}: reads {missing} not finished {deadline:.1f}s after "
                    f"posting; in flight: {sorted(s.worker.consumer.inflight)}"
                )
            self.progress()
            time.sleep(_SPIN_S)  # leave the CPU to the producers for a moment (2 cores)
        results = []
        for rid, local_ids, remote_ids in requests:
            done_at, invalid = s.recvd[rid]
            wrong = -1
            if not invalid:
                wrong = verify(
                    s.spec, s.caches, _ids(local_ids), _ids(remote_ids), remote_block_size
                )
            results.append(
                {
                    "rid": rid,
                    "wrong": wrong,
                    "invalid": invalid,
                    "latency": done_at - t0[rid],
                    "outcome": s.outcomes.get(rid),
                }
            )
        return results

    def cmd_untouched_nonzero(self, block_ids: Sequence[int]) -> int:
        """Nonzero bytes in these local blocks, over every registered region."""
        from kvrdma.layout import build_regions

        s = self._need()
        if not block_ids:
            return 0
        info = build_regions(s.caches, mamba_layers=s.mamba, **s.spec.layout_args)
        ids = _ids(block_ids)
        return sum(int(r.data[ids].count_nonzero()) for r in info.regions)

    def cmd_tail_nonzero(
        self,
        requests: Sequence[tuple[str, Sequence[int], Sequence[int]]],
        remote_block_size: int,
    ) -> int:
        """Nonzero attention elements in the unfilled tail tokens of each request's last local
        block (a partly filled block must get only the tokens that were read)."""
        from kvrdma.testing.synthetic import attention_views

        s = self._need()
        spec = s.spec
        ratio = spec.block_size // remote_block_size
        bad = 0
        for _, local_ids, remote_ids in requests:
            filled = (len(remote_ids) - (len(local_ids) - 1) * ratio) * remote_block_size
            if filled >= spec.block_size:
                continue
            last = int(local_ids[-1])
            if spec.cache_layout == "mla":
                views = [s.caches[f"model.layers.{i}.attn"] for i in range(spec.shape.num_layers)]
            else:
                views = [v for _, _, v in attention_views(spec, s.caches)]
            bad += sum(int(v[last, filled:].count_nonzero()) for v in views)
        return bad

    def cmd_wait_sent(self, rids: Sequence[str], timeout: float) -> dict[str, float]:
        """Drive progress until every request in `rids` was reported finished-sending, or
        `timeout` passes; returns those seen (request id -> seconds held)."""
        s = self._need()
        end = time.monotonic() + timeout
        while True:
            self.progress()
            if set(rids) <= set(s.sent) or time.monotonic() >= end:
                return {r: s.sent[r] for r in rids if r in s.sent}
            time.sleep(_POLL_S)

    def cmd_counters(self) -> dict[str, Any]:
        """The producer ledger's counters, how many requests it holds, and every
        finished-sending report so far (in order)."""
        s = self._need()
        ledger = s.worker.producer.ledger
        return {**asdict(ledger.counters), "held": ledger.num_held, "reports": list(s.sent_log)}

    def cmd_teardown(self) -> dict[str, float]:
        """Close the worker (its agent, registrations and lists); returns `_resources()`."""
        t0 = time.perf_counter()
        self._close_worker()
        res = _resources()
        self.after.append(res)
        logger.debug("%s: teardown %.3fs, %s", self.name, time.perf_counter() - t0, res)
        return res

    def cmd_stats(self) -> dict[str, Any]:
        """Cases run, resources after each teardown, and (after a full GC) how many NIXL
        agents and kvrdma workers are still alive in this process."""
        import gc

        gc.collect()
        alive: dict[str, int] = {"nixl_agent": 0, "Worker": 0, "NixlBackend": 0}
        for obj in gc.get_objects():
            name = type(obj).__name__
            if name in alive:
                alive[name] += 1
        return {"cases": self.cases, "after": list(self.after), "now": _resources(), **alive}

    def cmd_progress(self, seconds: float) -> None:
        """Keep calling `get_finished()` for `seconds` (what an engine's step loop does)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.progress()
            time.sleep(_POLL_S)

    def cmd_pending_notifications(self) -> int:
        return int(self.s.worker.pending_notifications)

    def cmd_ping(self) -> int:
        return os.getpid()


def serve(conn: Connection, name: str, log_path: str) -> None:
    """Process entry point: serve commands until "stop" or the parent goes away."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)  # NIXL and UCX log to the process's stdout/stderr
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"
    )
    try:
        host = _Host(name)
    except Exception as exc:
        conn.send((0, "err", type(exc).__name__, str(exc), traceback.format_exc()))
        return
    conn.send((0, "ok", os.getpid()))
    host.serve(conn)


# ==== parent side ==============================================================================
class HostError(AssertionError):
    """A host died, stayed silent past a deadline, or raised something that is not kvrdma's."""


def _as_exception(host: str, cmd: str, kind: str, text: str, tb: str) -> BaseException:
    from kvrdma import errors

    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.KvrdmaError):
        exc: BaseException = cls(text)
        exc.__cause__ = HostError(f"in host {host}, command {cmd!r}:\n{tb}")
        return exc
    return HostError(f"host {host}: {cmd!r} raised {kind}: {text}\n{tb}")


class RankHost:
    """One host process and the parent's end of its pipe."""

    def __init__(self, name: str, log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.broken = False
        self._seq = itertools.count(1)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process: BaseProcess = ctx.Process(
            target=serve,
            args=(child, name, str(self.log_path)),
            name=f"rank-host-{name}",
            daemon=True,
        )
        # The child unpickles `serve` by module name: make this directory importable there.
        saved = list(sys.path)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        try:
            self.process.start()
        finally:
            sys.path[:] = saved
        child.close()
        self._pending: list[int] = [0]  # the ready message

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def send(self, cmd: str, *args: Any) -> int:
        seq = next(self._seq)
        try:
            self.conn.send((seq, cmd, args))
        except (BrokenPipeError, OSError) as exc:
            self.broken = True
            self.process.join(1.0)
            raise HostError(
                f"host {self.name} died (exit code {self.process.exitcode}): cannot send "
                f"{cmd!r} ({exc}); log tail:\n{self.log_tail()}"
            ) from None
        return seq

    def reply(self, seq: int, timeout: float, cmd: str = "?") -> Any:
        """The reply to request `seq` (older replies are dropped); raises on error or timeout."""
        end = time.monotonic() + timeout
        while True:
            if not self.conn.poll(min(0.05, max(0.0, end - time.monotonic()))):
                if not self.alive and not self.conn.poll(0):
                    self.broken = True
                    raise HostError(
                        f"host {self.name} died (exit code {self.process.exitcode}) while "
                        f"running {cmd!r}; log tail:\n{self.log_tail()}"
                    )
                if time.monotonic() >= end:
                    self.broken = True
                    raise HostError(
                        f"host {self.name}: no reply to {cmd!r} within {timeout:.1f}s; "
                        f"log tail:\n{self.log_tail()}"
                    )
                continue
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.broken = True
                self.process.join(1.0)
                raise HostError(
                    f"host {self.name} died (exit code {self.process.exitcode}) while running "
                    f"{cmd!r}: its pipe closed; log tail:\n{self.log_tail()}"
                ) from None
            if msg[0] != seq:
                continue  # the late reply of a request that timed out
            if msg[1] == "ok":
                return msg[2]
            raise _as_exception(self.name, cmd, *msg[2:])

    def call(self, cmd: str, *args: Any, timeout: float = 15.0) -> Any:
        return self.reply(self.send(cmd, *args), timeout, cmd)

    def wait_ready(self, timeout: float = _READY_S) -> None:
        self.reply(self._pending.pop(), timeout, "start")

    def stop(self, grace: float = 2.0) -> None:
        """Ask to stop, then SIGKILL; always joined and the pipe closed."""
        if self.alive and not self.broken:
            with contextlib.suppress(Exception):
                self.call("stop", timeout=grace)
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid or 0, signal.SIGKILL)
        self.process.join(5)
        self.conn.close()


Call = tuple[RankHost, str, tuple[Any, ...]]


class HostPool:
    """The session's P hosts and D hosts; broken ones are replaced before each case."""

    def __init__(self, num_p: int, num_d: int, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.p: list[RankHost] = []
        self.d: list[RankHost] = []
        self._case = itertools.count()
        self.replaced = 0
        try:
            self.p = [RankHost(f"P{i}", log_dir) for i in range(num_p)]
            self.d = [RankHost(f"D{i}", log_dir) for i in range(num_d)]
            for h in self.hosts:
                h.wait_ready()
        except BaseException:
            self.close()
            raise

    @property
    def hosts(self) -> list[RankHost]:
        return [*self.p, *self.d]

    def next_case(self) -> int:
        return next(self._case)

    def ensure_healthy(self) -> None:
        """Replace every host that died, timed out or got out of step."""
        for group in (self.p, self.d):
            for i, h in enumerate(group):
                if h.broken or not h.alive:
                    logger.warning("replacing host %s (exit code %s)", h.name, h.process.exitcode)
                    h.stop()
                    group[i] = fresh = RankHost(h.name, self.log_dir)
                    fresh.wait_ready()
                    self.replaced += 1

    @staticmethod
    def gather(calls: Sequence[Call], timeout: float = 15.0, *, errors: bool = True) -> list[Any]:
        """Send every call first (the hosts run them in parallel), then collect the replies
        under one deadline. `errors=False`: a kvrdma exception is returned, not raised (a
        dead or silent host still raises)."""
        sent = [(h, h.send(cmd, *args), cmd) for h, cmd, args in calls]
        end = time.monotonic() + timeout
        out: list[Any] = []
        for h, seq, cmd in sent:
            try:
                out.append(h.reply(seq, max(0.0, end - time.monotonic()), cmd))
            except HostError:
                raise
            except Exception as exc:
                if errors:
                    raise
                out.append(exc)
        return out

    def stats(self) -> dict[str, dict[str, Any]]:
        """`stats` of every usable host, by name."""
        live = [h for h in self.hosts if not h.broken and h.alive]
        stats = self.gather([(h, "stats", ()) for h in live])
        return dict(zip([h.name for h in live], stats, strict=True))

    def close(self) -> None:
        for h in self.hosts:
            h.stop()


# ==== one case: a P engine and a D engine on the pool ==========================================
@dataclass(frozen=True)
class EngineSpec:
    """One engine of a case, in plain values."""

    tp: int
    block_size: int
    num_blocks: int
    cache_layout: str
    kv_layout: str
    shape: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config
    idle_progress: bool = True  # readers: keep stepping between commands (producers always do)
    device: str = ""  # where the caches live; "": `case_device(role)`
    kv_buffer_device: str = "cuda"  # "cpu" with device caches: host staging
    kv_cache_order: str = "LBHNC"  # cache_layout "unified": the physical order
    hybrid: bool = False  # cache_layout "unified": Mamba layers follow the attention ones


def case_device(role: str) -> str:
    """Where a case's caches live when its spec names no device: `KVRDMA_TEST_DEVICE` is
    `cpu` (default), `cuda` (both roles), or per role, e.g. `P=cuda,D=cpu`."""
    raw = os.environ.get("KVRDMA_TEST_DEVICE", "cpu").strip() or "cpu"
    if "=" not in raw:
        return raw
    per_role = dict(part.split("=", 1) for part in raw.split(",") if part)
    return per_role.get(role, "cpu")


class EnginePair:
    """Fresh P and D workers on the pool's first `tp` hosts; torn down (D first) on exit."""

    def __init__(self, pool: HostPool, p: EngineSpec, d: EngineSpec, *, label: str = "") -> None:
        if p.tp > len(pool.p) or d.tp > len(pool.d):
            raise ValueError(f"pool has {len(pool.p)} P and {len(pool.d)} D hosts")
        self.pool = pool
        self.p_spec, self.d_spec = p, d
        n = pool.next_case()
        self.p_engine, self.d_engine = f"P{n}{label}", f"D{n}{label}"
        self.p_meta: list[bytes] = []
        self.d_meta: list[bytes] = []
        self._up: list[RankHost] = []
        self._server: Any = None  # the P engine's handshake agent, once a D rank connects

    @property
    def p(self) -> list[RankHost]:
        return self.pool.p[: self.p_spec.tp]

    @property
    def d(self) -> list[RankHost]:
        return self.pool.d[: self.d_spec.tp]

    def _cfg(self, role: str, rank: int, spec: EngineSpec, engine: str) -> dict[str, Any]:
        return {
            "role": role,
            "rank": rank,
            "tp_size": spec.tp,
            "engine_id": engine,
            "agent_name": f"{engine}-tp{rank}",
            "cache_layout": spec.cache_layout,
            "kv_layout": spec.kv_layout,
            "block_size": spec.block_size,
            "num_blocks": spec.num_blocks,
            "shape": spec.shape,
            "extra": {"num_threads": 0, **spec.extra},
            "idle_progress": spec.idle_progress,
            "device": spec.device or case_device(role),
            "kv_buffer_device": spec.kv_buffer_device,
            "kv_cache_order": spec.kv_cache_order,
            "hybrid": spec.hybrid,
        }

    def __enter__(self) -> EnginePair:
        self.pool.ensure_healthy()
        self._up = [*self.d, *self.p]
        try:
            metas = self.pool.gather(
                [(h, "setup", (self._cfg("P", r, self.p_spec, self.p_engine),))
                 for r, h in enumerate(self.p)]
                + [(h, "setup", (self._cfg("D", r, self.d_spec, self.d_engine),))
                   for r, h in enumerate(self.d)],
                timeout=30.0,
            )  # fmt: skip
        except BaseException:
            self._teardown(quiet=True)
            raise
        self.p_meta, self.d_meta = metas[: self.p_spec.tp], metas[self.p_spec.tp :]
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._teardown(quiet=exc_type is not None)

    def _teardown(self, *, quiet: bool) -> None:
        """Close the readers first, then the producers they read from."""
        if self._server is not None:
            self._server.close()
            self._server = None
        up, self._up = self._up, []
        live = [h for h in up if not h.broken and h.alive]
        try:
            for role in (self.pool.d, self.pool.p):
                group = [h for h in live if h in role]
                self.pool.gather([(h, "teardown", ()) for h in group], timeout=15.0)
        except Exception:
            for h in live:  # whatever state it is in, do not reuse it
                h.broken = True
            if not quiet:
                raise

    def connect(self, *, only_targets: bool = True, errors: bool = True) -> list[Any]:
        """Every D rank connects to the P engine; plan summaries by D rank. `only_targets`:
        through a handshake agent serving the P ranks (`Worker.connect`), else `add_remote`
        with every P rank's metadata."""
        if not only_targets:
            metas = dict(enumerate(self.p_meta))
            return self.pool.gather([(h, "add_remote", (metas,)) for h in self.d], errors=errors)
        if self._server is None:
            import msgspec

            from kvrdma.handshake import HandshakeServer
            from kvrdma.metadata import WorkerMetadata

            self._server = HandshakeServer("127.0.0.1", 0)
            for b in self.p_meta:
                self._server.publish(msgspec.msgpack.decode(b, type=WorkerMetadata))
        args = (self.p_engine, "127.0.0.1", self._server.port)
        return self.pool.gather([(h, "connect", args) for h in self.d], errors=errors)

    def hold(self, requests: Sequence[tuple[str, Sequence[int]]]) -> list[dict[str, float]]:
        """Every P rank holds the requests; each rank's lease expiries by request."""
        return self.pool.gather([(h, "hold", (list(requests),)) for h in self.p])

    def read(
        self,
        requests: Sequence[tuple[str, Sequence[int], Sequence[int]]],
        ranks: Sequence[int] | None = None,
        *,
        deadline: float = 10.0,
        expires: Mapping[str, float] | None = None,
    ) -> list[list[dict[str, Any]]]:
        """Every (or the given) D rank reads every request; results by rank, then request."""
        hosts = self.d if ranks is None else [self.d[r] for r in ranks]
        args = (list(requests), self.p_spec.block_size, deadline, dict(expires or {}))
        return self.pool.gather([(h, "read", args) for h in hosts], timeout=deadline + 10.0)

    def push(
        self,
        requests: Sequence[tuple[str, Sequence[int], Sequence[int]]],
        *,
        layerwise: bool = False,
        deadline: float = 10.0,
    ) -> list[list[dict[str, Any]]]:
        """Every D rank expects every request, every P rank pushes it; results as `read`."""
        reqs = list(requests)
        self.pool.gather([(h, "expect_push", (reqs, deadline)) for h in self.d])
        pushes = [(rid, remote) for rid, _, remote in reqs]
        self.pool.gather([(h, "push", (pushes, layerwise)) for h in self.p])
        args = (reqs, self.p_spec.block_size, deadline)
        return self.pool.gather([(h, "await_push", args) for h in self.d], timeout=deadline + 10)

    def wait_sent(self, rids: Sequence[str], timeout: float = 10.0) -> list[dict[str, float]]:
        return self.pool.gather(
            [(h, "wait_sent", (list(rids), timeout)) for h in self.p], timeout=timeout + 10.0
        )

    def counters(self) -> list[dict[str, int]]:
        return self.pool.gather([(h, "counters", ()) for h in self.p])


@contextlib.contextmanager
def host_pool(num_p: int, num_d: int, log_dir: Path) -> Iterator[HostPool]:
    """A pool that is always stopped (every process killed and joined) on exit."""
    pool = HostPool(num_p, num_d, log_dir)
    try:
        yield pool
    finally:
        pool.close()
