"""Shared pieces of the benchmarks: statistics, synthetic caches, kvrdma workers and a raw-NIXL
reader built the same way on both sides, the target ("peer") process client, and JSON/PNG
output (the environment record is `benchmarks._env`).

Every benchmark measures the initiator in this process against a target in another process
(`benchmarks._peer`): READs between processes go over UCX `cma` (process_vm_readv) on this
machine, so `transfer()` copies synchronously (NIXL-NOTES.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import logging
import math
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._env import environment as environment  # re-exported for run.py
from kvrdma import notify

ROOT = Path(__file__).resolve().parent.parent
COMPAT = "b" * 64  # compat hash every benchmark worker shares
logger = logging.getLogger("benchmarks")
_names = itertools.count()


# ---------------------------------------------------------------------------------------
# statistics
def summarize(samples: Sequence[float], scale: float = 1.0, digits: int = 4) -> dict[str, Any]:
    """min / median / max (and n, mean) of `samples` multiplied by `scale`."""
    xs = sorted(float(s) * scale for s in samples)
    if not xs:
        return {"n": 0, "min": None, "median": None, "max": None, "mean": None}
    return {
        "n": len(xs),
        "min": round(xs[0], digits),
        "median": round(statistics.median(xs), digits),
        "max": round(xs[-1], digits),
        "mean": round(statistics.fmean(xs), digits),
    }


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (same rule as handshake_latency.py)."""
    xs = sorted(samples)
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]


def median_ci95(samples: Sequence[float]) -> tuple[float, float] | None:
    """Distribution-free confidence interval of the median, at least 95 %: the order
    statistics x(k), x(n-1-k) (0-based) with the largest k such that a Binomial(n, 1/2)
    count is at most k with probability <= 2.5 %; None below 6 samples."""
    xs = sorted(samples)
    n = len(xs)
    if n < 6:
        return None
    k, tail = -1, 0.0
    while True:
        tail += math.comb(n, k + 1) / 2**n
        if tail > 0.025:
            break
        k += 1
    k = max(k, 0)
    return xs[k], xs[n - 1 - k]


def target(name: str, value: float | None, op: str, threshold: float, unit: str) -> dict[str, Any]:
    """One of issue 7's targets with the measured value and pass/miss."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        ok = None
    else:
        ok = value >= threshold if op == ">=" else value <= threshold
    return {
        "target": name,
        "value": None if value is None else round(float(value), 4),
        "op": op,
        "threshold": threshold,
        "unit": unit,
        "pass": ok,
    }


def cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class OtherLoad:
    """CPU used by *other* processes while a block of measurements ran, in cores: the busy
    time of all CPUs (/proc/stat) minus this process's (all its threads, NIXL's included)
    and `pids`' own (/proc/<pid>/stat), per wall second. On a shared machine this says how
    much of the hardware a measurement had to share; None where /proc is not readable."""

    def __init__(self, pids: Iterable[int] = ()) -> None:
        self.pids = [os.getpid(), *pids]
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._t0: tuple[float, int, int] | None = None

    def _ticks(self) -> tuple[int, int] | None:
        try:
            f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            own = 0
            for pid in self.pids:
                s = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                own += int(s[11]) + int(s[12])  # utime, stime
        except (OSError, ValueError, IndexError):
            return None
        idle = f[3] + (f[4] if len(f) > 4 else 0)
        return sum(f) - idle, own

    def start(self) -> None:
        t = self._ticks()
        self._t0 = None if t is None else (time.monotonic(), *t)

    def stop(self) -> float | None:
        t = self._ticks()
        if self._t0 is None or t is None:
            return None
        wall = time.monotonic() - self._t0[0]
        if wall <= 0:
            return None
        other = (t[0] - self._t0[1]) - (t[1] - self._t0[2])
        return round(max(0.0, other / self.hz / wall), 3)


# ---------------------------------------------------------------------------------------
# synthetic caches
_ORDERS = {  # physical dim order for HND memory, per layout (logical shapes below)
    "split_kv": (0, 1, 3, 2, 4),  # [2, N, B, H, D]
    "blocks_first": (0, 1, 3, 2, 4),  # [N, 2, B, H, D]
    "cross_layer": (0, 1, 2, 4, 3, 5),  # [N, L, 2, B, H, D]
}


@dataclass(frozen=True)
class Geometry:
    """One rank's KV caches. `chunk_bytes` is one layer's K (or V) of one block: the
    "block size" of the bandwidth benchmark; a descriptor is 1, 2 or 2·layers chunks."""

    layout: str  # split_kv | blocks_first | cross_layer
    layers: int
    heads: int  # KV heads held by this rank
    head_dim: int
    block_size: int  # tokens per block
    num_blocks: int
    kv_layout: str = "NHD"
    dtype: str = "float16"

    @property
    def element_size(self) -> int:
        return 1 if self.dtype in ("uint8", "int8", "float8_e4m3fn") else 2

    @property
    def chunk_bytes(self) -> int:
        return self.block_size * self.heads * self.head_dim * self.element_size

    @property
    def block_bytes(self) -> int:
        """All layers' K and V of one block."""
        return 2 * self.layers * self.chunk_bytes

    @property
    def descriptors_per_block(self) -> int:
        return {"split_kv": 2 * self.layers, "blocks_first": self.layers, "cross_layer": 1}[
            self.layout
        ]

    @property
    def descriptor_bytes(self) -> int:
        return self.block_bytes // self.descriptors_per_block

    @property
    def registered_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def make_caches(g: Geometry, *, touch: bool = True) -> dict[str, Any]:
    """Caches for `g` from `torch.empty`, zeroed (as an engine allocates them) unless
    `touch=False`, which leaves the pages unallocated (lazy: many GiB of virtual memory
    cost nothing until read or written)."""
    import torch

    dt = getattr(torch, g.dtype)
    n, b, h, d, L = g.num_blocks, g.block_size, g.heads, g.head_dim, g.layers

    def alloc(logical: Sequence[int]) -> torch.Tensor:
        order = _ORDERS[g.layout] if g.kv_layout == "HND" else tuple(range(len(logical)))
        t = torch.empty([logical[i] for i in order], dtype=dt)
        if touch:
            t.view(torch.uint8).zero_() if t.is_contiguous() else t.zero_()
        return t.permute([order.index(i) for i in range(len(logical))])

    if g.layout == "cross_layer":
        return {"all_layers": alloc((n, L, 2, b, h, d))}
    shape = (2, n, b, h, d) if g.layout == "split_kv" else (n, 2, b, h, d)
    return {f"model.layers.{i}.attn": alloc(shape) for i in range(L)}


def huge_page_fraction(tensors: Iterable[Any]) -> float | None:
    """Share of the tensors' bytes backed by transparent huge pages (AnonHugePages of the
    mappings they lie in, /proc/self/smaps); None where unreadable."""
    spans = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in tensors]
    total = sum(e - a for a, e in spans)
    huge, cur = 0, (0, 0)
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = head.split("-")
                    cur = (int(lo, 16), int(hi, 16))
                elif head == "AnonHugePages:":
                    kb = int(line.split()[1])
                    if kb and any(a < cur[1] and cur[0] < e for a, e in spans):
                        huge += kb * 1024
    except (OSError, ValueError):
        return None
    return round(min(1.0, huge / total), 3) if total else None


def byte_regions(g: Geometry, caches: Mapping[str, Any]) -> list[Any]:
    """uint8 [num_blocks, block_len] views of the registration regions (kvrdma's cut)."""
    from kvrdma.layout import build_regions

    info = build_regions(caches, cache_layout=g.layout, block_size=g.block_size)  # type: ignore[arg-type]
    return [r.data for r in info.regions]


def _pattern(blocks: Any, region: int) -> Any:
    return ((blocks * 7 + region * 13) % 251 + 1).to(dtype=__import__("torch").uint8)


def fill_pattern(g: Geometry, caches: Mapping[str, Any]) -> None:
    """Every byte of block b in region r is (7b + 13r) % 251 + 1 (touches every page)."""
    import torch

    for r, data in enumerate(byte_regions(g, caches)):
        vals = _pattern(torch.arange(data.shape[0]), r)
        data.copy_(vals[:, None].expand(data.shape))


def check_pattern(g: Geometry, caches: Mapping[str, Any], local: Any, remote: Any) -> int:
    """Wrong first/last bytes of the local blocks after reading `remote` into `local`."""
    import torch

    lb = torch.as_tensor(np.asarray(local, dtype=np.int64))
    rb = torch.as_tensor(np.asarray(remote, dtype=np.int64))
    bad = 0
    for r, data in enumerate(byte_regions(g, caches)):
        want = _pattern(rb, r)
        got = data.index_select(0, lb)
        bad += int((got[:, 0] != want).sum()) + int((got[:, -1] != want).sum())
    return bad


def clear(g: Geometry, caches: Mapping[str, Any]) -> None:
    for data in byte_regions(g, caches):
        data.zero_()


# ---------------------------------------------------------------------------------------
# kvrdma workers and raw NIXL
def agent_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def new_worker(
    role: str,
    engine_id: str,
    g: Geometry,
    caches: Mapping[str, Any],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    total_heads: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Any:
    """A kvrdma `Worker` (real NIXL agent, kvrdma defaults) with `caches` registered."""
    from kvrdma.config import load_kv_transfer_config
    from kvrdma.worker import Worker

    cfg = load_kv_transfer_config(
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if role == "P" else "kv_consumer",
            "engine_id": engine_id,
            "kv_connector_extra_config": dict(extra or {}),
        },
        environ={},
    )
    w = Worker.create(
        cfg,
        tp_rank=tp_rank,
        tp_size=tp_size,
        total_num_kv_heads=total_heads if total_heads is not None else g.heads * tp_size,
        agent_name=agent_name(f"{engine_id}-tp{tp_rank}"),
        compat_hash=COMPAT,
    )
    try:
        w.register_kv_caches(caches, cache_layout=g.layout, block_size=g.block_size)  # type: ignore[arg-type]
    except BaseException:
        w.close()
        raise
    return w


def read_blocks(worker: Any, engine: str, local: Any, remote: Any, rid: str) -> float:
    """kvrdma's READ path: `start_read` then `get_finished` until done; seconds taken.

    Every wait loop here (kvrdma and raw) yields the CPU between polls: with UCX
    num_threads > 0 NIXL's own threads do the copy, and a busy poll on a 2-core machine
    would take the CPU they need."""
    t0 = time.perf_counter()
    worker.start_read(rid, local, remote, engine)
    while True:
        out = worker.get_finished()
        if rid in out.finished_recving:
            break
        os.sched_yield()
    dt = time.perf_counter() - t0
    if rid in out.invalid_block_ids:
        raise RuntimeError(f"kvrdma READ {rid} failed: blocks reported invalid")
    return dt


# What kvrdma attaches to a READ ("done" for a request); raw reads carry the same bytes.
NOTIF = notify.encode("done", "req-0001", expected=1, sender_engine="D-0001", sender_rank=0)


def kvrdma_ucx_setup() -> dict[str, Any]:
    """kvrdma's UCX setup with Worker defaults, as `RawReader` keywords: UCX threads,
    `split_batch_size`, and descriptor merging off for descriptors of at least
    `skip_merge_min_bytes` (with 2+ threads)."""
    from kvrdma.backend import BackendConfig
    from kvrdma.config import ExtraConfig
    from kvrdma.nixl_backend import SKIP_MERGE_MIN_BYTES

    nt = ExtraConfig().num_threads
    return {
        "num_threads": nt,
        "split_batch_size": BackendConfig(name="x").split_batch_size if nt else None,
        "skip_merge_min_bytes": SKIP_MERGE_MIN_BYTES if nt > 1 else None,
    }


# NIXL's own defaults (nixl_agent_config(): UCX without threads, merging on)
NIXL_DEFAULTS: dict[str, Any] = {
    "num_threads": 0,
    "split_batch_size": None,
    "skip_merge_min_bytes": None,
}


class RawReader:
    """The hand-written minimal NIXL use: one agent without progress thread, one descriptor
    per (region, block) prepared once as N×3 arrays, `make_prepped_xfer` + `transfer` +
    `check_xfer_state` per read. Ids are region * num_blocks + block (same as kvrdma).
    Reads carry a notification like kvrdma's (a READ with one completes only after the
    target progressed: pass `notif=b""` for the bare copy). The UCX setup is NIXL's
    defaults unless given (`**kvrdma_ucx_setup()`: kvrdma's)."""

    def __init__(
        self,
        local_regions: Sequence[tuple[int, int, int]],
        remote_payload: bytes,
        remote_regions: Sequence[tuple[int, int, int]],
        *,
        num_threads: int = 0,
        split_batch_size: int | None = None,
        skip_merge_min_bytes: int | None = None,
        progress_thread: bool = False,
    ) -> None:
        import nixl

        self.name = agent_name("raw")
        conf = nixl.nixl_agent_config(
            enable_prog_thread=progress_thread, backends=[], num_threads=num_threads
        )
        self.agent = nixl.nixl_agent(self.name, conf)
        init = {"num_threads": str(num_threads)} if num_threads else {}
        if num_threads and split_batch_size is not None:
            init["split_batch_size"] = str(split_batch_size)
        self.agent.create_backend("UCX", init)
        shortest = min(bl for _, _, bl in local_regions)
        self.xfer_kw = (
            {"skip_desc_merge": True}
            if skip_merge_min_bytes is not None and shortest >= skip_merge_min_bytes
            else {}
        )
        table = np.array([(a, n * bl, 0) for a, n, bl in local_regions], dtype=np.uint64)
        self.reg = self.agent.register_memory(table, "DRAM")
        peer = self.agent.add_remote_agent(remote_payload)
        self.peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        self.local_n = local_regions[0][1]
        self.remote_n = remote_regions[0][1]
        self.regions = len(local_regions)
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", per_block_rows(local_regions), "DRAM"
        )
        self.remote = self.agent.prep_xfer_dlist(self.peer, per_block_rows(remote_regions), "DRAM")

    def ids(self, local: Any, remote: Any) -> tuple[Any, Any]:
        r = np.arange(self.regions, dtype=np.int64)[:, None]
        lids = (r * self.local_n + np.asarray(local, dtype=np.int64)[None, :]).reshape(-1)
        rids = (r * self.remote_n + np.asarray(remote, dtype=np.int64)[None, :]).reshape(-1)
        return lids, rids

    def read(self, local: Any, remote: Any, notif: bytes = NOTIF) -> float:
        t0 = time.perf_counter()
        lids, rids = self.ids(local, remote)
        h = self.agent.make_prepped_xfer(
            "READ", self.local, lids, self.remote, rids, notif, **self.xfer_kw
        )
        state = self.agent.transfer(h)
        while state == "PROC":
            os.sched_yield()
            state = self.agent.check_xfer_state(h)
        dt = time.perf_counter() - t0
        self.agent.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ ended in state {state}")
        return dt

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.agent.release_dlist_handle(self.local)
            self.agent.release_dlist_handle(self.remote)
            self.agent.remove_remote_agent(self.peer)
            self.agent.deregister_memory(self.reg)
        self.agent = None


def per_block_rows(regions: Sequence[tuple[int, int, int]]) -> Any:
    """N×3 (addr, len, dev) rows, one per block, region-major."""
    parts = []
    for addr, n, bl in regions:
        rows = np.empty((n, 3), dtype=np.uint64)
        rows[:, 0] = np.uint64(addr) + np.arange(n, dtype=np.uint64) * np.uint64(bl)
        rows[:, 1] = bl
        rows[:, 2] = 0
        parts.append(rows)
    return np.concatenate(parts)


def _thread_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux
        return set()


def _thread_name(tid: int) -> str:
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


@contextlib.contextmanager
def pinned_new_threads(enabled: bool = True) -> Iterator[list[int]]:
    """Pin the threads started inside the block (a NIXL agent's UCX copy threads) one per
    usable CPU in turn, the i-th on the i-th CPU; UCX's event thread ("async") stays free.
    Yields the list of pinned thread ids, filled when the block ends. Where the scheduler
    puts copy threads is the bandwidth benchmark's main noise on 2 cores: two identical raw
    readers' ratio ranged 0.94-1.06 over 50-read stretches unpinned, 0.96-1.03 pinned.
    Nothing is pinned when `enabled` is False or off Linux."""
    pinned: list[int] = []
    before = _thread_ids() if enabled else set()
    yield pinned
    if not before:  # disabled, or no /proc/self/task
        return
    cpus = sorted(os.sched_getaffinity(0))
    new = sorted(t for t in _thread_ids() - before if _thread_name(t) != "async")
    for i, tid in enumerate(new):
        with contextlib.suppress(OSError):  # the thread may have ended
            os.sched_setaffinity(tid, {cpus[i % len(cpus)]})
            pinned.append(tid)


@contextlib.contextmanager
def nixl_progress_delay(delay_us: int | None) -> Any:
    """While the block runs, NIXL agents are built with progress-thread delay `delay_us`
    (NIXL's Python wrapper hard-codes `pthrDelay = 0`: a busy-spinning thread). None: no
    change. Benchmark-only instrumentation of nixl's bindings; restored on exit."""
    if delay_us is None:
        yield
        return
    import nixl

    bind = sys.modules[nixl.nixl_agent.__module__].nixlBind
    orig_cfg, orig_agent = bind.nixlAgentConfig, bind.nixlAgent

    class _Cfg:
        def __init__(self) -> None:
            object.__setattr__(self, "_c", orig_cfg())

        def __setattr__(self, k: str, v: Any) -> None:
            setattr(self._c, k, delay_us if k == "pthrDelay" else v)

    bind.nixlAgentConfig = _Cfg
    bind.nixlAgent = lambda name, cfg: orig_agent(name, cfg._c if isinstance(cfg, _Cfg) else cfg)
    try:
        yield
    finally:
        bind.nixlAgentConfig, bind.nixlAgent = orig_cfg, orig_agent


def region_triples(meta: Any) -> list[tuple[int, int, int]]:
    """(base_addr, num_blocks, block_len) of a WorkerMetadata's regions."""
    return [(r.base_addr, r.num_blocks, r.block_len) for r in meta.regions]


def nixl_payload(meta: Any) -> bytes:
    """The raw NIXL agent blob inside kvrdma's checksummed envelope."""
    from kvrdma.nixl_backend import unwrap_metadata

    return unwrap_metadata(meta.agent_metadata)


class CallTimer:
    """Forwards to `target`, adding the seconds spent in the `names` methods to `.spent`
    (instrumentation: wraps a NIXL agent or a backend without changing kvrdma)."""

    def __init__(self, target: Any, names: Iterable[str]) -> None:
        self._target = target
        self.spent: dict[str, float] = dict.fromkeys(names, 0.0)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if name not in self.spent:
            return attr

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return attr(*a, **k)
            finally:
                self.spent[name] += time.perf_counter() - t0

        return timed

    def reset(self) -> None:
        for k in self.spent:
            self.spent[k] = 0.0


def time_methods(obj: Any, names: Iterable[str]) -> dict[str, float]:
    """Shadow `obj`'s bound methods with timed ones (instance attributes); returns the
    dict of accumulated seconds."""
    spent: dict[str, float] = {}
    for name in names:
        orig = getattr(obj, name)
        spent[name] = 0.0

        def timed(*a: Any, _o: Any = orig, _n: str = name, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _o(*a, **k)
            finally:
                spent[_n] += time.perf_counter() - t0

        setattr(obj, name, timed)
    return spent


# ---------------------------------------------------------------------------------------
# the target process
class PeerError(RuntimeError):
    pass


class Peer:
    """The target process (`benchmarks._peer.serve`): registers memory, serves handshakes and
    keeps progressing its agents (`get_finished`/`get_notifs` every `wait` seconds)."""

    def __init__(self, wait: float = 0.001, timeout: float = 120.0) -> None:
        from benchmarks import _peer

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer.serve, args=(child, wait), name="kvrdma-bench-peer")
        self.proc.start()
        child.close()
        self.timeout = timeout
        self.call("ping", timeout=60.0)

    def call(self, cmd: str, timeout: float | None = None, **kw: Any) -> Any:
        self.conn.send((cmd, kw))
        limit = self.timeout if timeout is None else timeout
        if not self.conn.poll(limit):
            raise PeerError(f"peer: no answer to {cmd!r} within {limit:.0f} s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise PeerError(f"peer died during {cmd!r} (exit {self.proc.exitcode})") from None
        if status != "ok":
            raise PeerError(f"peer failed {cmd!r}: {value}")
        return value

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(("stop", {}))
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self.conn.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def die_with_parent() -> None:
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# ---------------------------------------------------------------------------------------
# running and writing results
@dataclass
class Context:
    """What a benchmark gets: quick mode, the output folder and the shared target process."""

    quick: bool
    out: Path
    seed: int = 0
    pin_threads: bool = True  # bandwidth: readers' copy threads one per CPU (pinned_new_threads)
    control: bool = False  # bandwidth: "kvrdma" read by a second raw reader (A/A calibration)
    _peer: Peer | None = field(default=None, repr=False)

    @property
    def peer(self) -> Peer:
        if self._peer is None:
            self._peer = Peer()
        return self._peer

    def close(self) -> None:
        if self._peer is not None:
            self._peer.close()
            self._peer = None


def plot_to(path: Path, draw: Callable[[Any], None]) -> str | None:
    """Draw with matplotlib (Agg) into `path`; None (and no file) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    try:
        draw(plt)
        plt.tight_layout()
        plt.savefig(path, dpi=110)
    finally:
        plt.close("all")
    return path.name


def write_result(
    out: Path,
    name: str,
    result: dict[str, Any],
    env: Mapping[str, Any],
    draw: Callable[[Any, dict[str, Any]], None] | None,
    *,
    quick: bool,
    seconds: float,
) -> dict[str, Any]:
    """Write `out/<name>.json` (and `<name>.png`) and return the document."""
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "benchmark": name,
        "quick": quick,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_seconds": round(seconds, 2),
        "environment": dict(env),
        "parameters": result.get("parameters", {}),
        "results": result.get("results", []),
        "targets": result.get("targets", []),
        "notes": result.get("notes", []),
    }
    for k, v in result.items():
        doc.setdefault(k, v)
    png = out / f"{name}.png"
    doc["plot"] = None
    if draw is not None:
        try:
            doc["plot"] = plot_to(png, lambda plt: draw(plt, doc))
        except Exception as exc:  # a plot bug must not lose the measurements
            doc["plot_error"] = f"{type(exc).__name__}: {exc}"
        if doc["plot"] is None and "plot_error" not in doc:
            doc["plot_note"] = "matplotlib is not installed: JSON only, no PNG"
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2, default=_json_default) + "\n")
    return doc


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    return str(o)


class Pair:
    """A producer worker in the target process and a consumer worker here, connected, with
    the consumer's NIXL agent and `post` timed (instrumentation only) and optionally a raw
    NIXL reader over the same memory with kvrdma's UCX setup. `read` returns (total, posting,
    transfer) seconds."""

    def __init__(
        self,
        peer: Peer,
        key: str,
        g: Geometry,
        *,
        raw: bool = False,
        fill: bool = False,
    ) -> None:
        self.peer, self.key, self.g = peer, key, g
        self.engine = f"P-{key}"
        self.pmeta = peer.call("make_worker", key=key, engine_id=self.engine, geom=g, fill=fill)[
            "meta"
        ]
        self.caches = make_caches(g)
        self.worker = new_worker("D", f"D-{key}", g, self.caches)
        self.raw: RawReader | None = None
        self._seq = 0
        try:
            self.plan = self.worker.add_remote({0: self.pmeta})
            if raw:
                self.raw = RawReader(
                    region_triples(self.worker.metadata),
                    nixl_payload(self.pmeta),
                    region_triples(self.pmeta),
                    **kvrdma_ucx_setup(),
                )
            b = self.worker.backend
            self.timer = CallTimer(b._agent, ("make_prepped_xfer", "transfer"))
            b._agent = self.timer
        except BaseException:
            self.close()
            raise

    def rid(self) -> str:
        self._seq += 1
        return f"{self.key}-{self._seq}"

    def read(self, local: Any, remote: Any) -> tuple[float, float, float]:
        self.timer.reset()
        rid = self.rid()
        t0 = time.perf_counter()
        self.worker.start_read(rid, local, remote, self.engine)
        t1 = time.perf_counter()
        while True:
            out = self.worker.get_finished()
            if rid in out.finished_recving:
                break
            os.sched_yield()
        t2 = time.perf_counter()
        if rid in out.invalid_block_ids:
            raise RuntimeError(f"kvrdma READ {rid} failed")
        tx = self.timer.spent["transfer"]
        return t2 - t0, (t1 - t0) - tx, tx

    def close(self) -> None:
        if self.raw is not None:
            self.raw.close()
        self.worker.close()
        with contextlib.suppress(Exception):
            self.peer.call("close", key=self.key)

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
