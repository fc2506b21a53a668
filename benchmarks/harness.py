"""The benchmark harness: statistics, synthetic caches, kvrdma workers and raw NIXL readers
built alike, the target process client, and the JSON + PNG output every benchmark shares.

Every benchmark measures an initiator in this process against a target in another process
(`benchmarks._peer`): READs between processes go over UCX `cma` (process_vm_readv) on one
host, notifications and wire-up over TCP on `lo`.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvrdma import notify

ROOT = Path(__file__).resolve().parent.parent
COMPAT = "b" * 64  # compat hash every benchmark worker shares
_names = itertools.count()


# --- statistics ------------------------------------------------------------------------
STATS = ("min", "median", "max", "mean")


def summarize(samples: Sequence[float], scale: float = 1.0, digits: int = 4) -> dict[str, Any]:
    """n / min / median / max / mean of `samples` times `scale`."""
    xs = sorted(float(s) * scale for s in samples)
    if not xs:
        return {"n": 0, **dict.fromkeys(STATS)}
    vals = (xs[0], statistics.median(xs), xs[-1], statistics.fmean(xs))
    return {"n": len(xs), **{k: round(v, digits) for k, v in zip(STATS, vals, strict=True)}}


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile."""
    xs = sorted(samples)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def median_ci95(samples: Sequence[float]) -> tuple[float, float] | None:
    """Distribution-free confidence interval (>= 95 %) of the median: the order statistics
    x(k), x(n-1-k) with the largest k whose Binomial(n, 1/2) tail is <= 2.5 %; None below 6."""
    xs, n = sorted(samples), len(samples)
    if n < 6:
        return None
    k, tail = -1, 0.0
    while (tail := tail + math.comb(n, k + 1) / 2**n) <= 0.025:
        k += 1
    return xs[max(k, 0)], xs[n - 1 - max(k, 0)]


def paired(t_a: Sequence[float], t_b: Sequence[float]) -> dict[str, Any]:
    """Speed of a over speed of b per repetition (b's seconds over a's, same bytes): median,
    quartiles and the 95 % interval of the median, over the repetitions both ran."""
    rs = [tb / ta for ta, tb in zip(t_a, t_b, strict=False) if ta > 0]
    if not rs:
        return {"paired_median": None, "paired_ci95": None, "paired_n": 0}
    ci = median_ci95(rs)
    return {
        "paired_median": round(statistics.median(rs), 3),
        "paired_p25": round(percentile(rs, 25), 3),
        "paired_p75": round(percentile(rs, 75), 3),
        "paired_ci95": [round(ci[0], 3), round(ci[1], 3)] if ci else None,
        "paired_n": len(rs),
    }


def target(name: str, value: float | None, want: str) -> dict[str, Any]:
    """A target, `want` as "<op> <threshold> <unit>", with the measured value and its
    verdict (reported, never asserted)."""
    op, threshold, unit = want.split(" ", 2)
    t, ok = float(threshold), None
    if value is not None and not math.isnan(value):
        ok = value >= t if op == ">=" else value <= t
    v = None if value is None else round(float(value), 4)
    return {"target": name, "value": v, "op": op, "threshold": t, "unit": unit, "pass": ok}


def cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _busy_ticks(pids: Iterable[int]) -> tuple[int, int] | None:
    """(all CPUs' busy jiffies, `pids`' own jiffies) from /proc."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        own = 0
        for pid in pids:
            s = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            own += int(s[11]) + int(s[12])
    except (OSError, ValueError, IndexError):
        return None
    return sum(f) - f[3] - (f[4] if len(f) > 4 else 0), own


# --- synthetic caches ------------------------------------------------------------------
_ORDERS = {  # physical dim order of HND memory per layout
    "split_kv": (0, 1, 3, 2, 4),
    "blocks_first": (0, 1, 3, 2, 4),
    "cross_layer": (0, 1, 2, 4, 3, 5),
}
PER_BLOCK = {"split_kv": lambda L: 2 * L, "blocks_first": lambda L: L, "cross_layer": lambda L: 1}


@dataclass(frozen=True)
class Geometry:
    """One rank's KV caches; `chunk_bytes` (one layer's K or V of one block) is the "block
    size" of the bandwidth rows; a descriptor is 1, 2 or 2·layers chunks."""

    layout: str  # split_kv | blocks_first | cross_layer
    layers: int
    heads: int
    head_dim: int
    block_size: int  # tokens per block
    num_blocks: int
    kv_layout: str = "NHD"
    dtype: str = "float16"

    @property
    def chunk_bytes(self) -> int:
        return self.block_size * self.heads * self.head_dim * 2

    @property
    def block_bytes(self) -> int:
        return 2 * self.layers * self.chunk_bytes

    @property
    def descriptors_per_block(self) -> int:
        return int(PER_BLOCK[self.layout](self.layers))

    @property
    def registered_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def make_caches(g: Geometry, *, touch: bool = True) -> dict[str, Any]:
    """Caches for `g` from `torch.empty`, zeroed as an engine allocates them unless
    `touch=False` (pages stay unallocated: many GiB of address space cost nothing)."""
    import torch

    n, b, h, d, L = g.num_blocks, g.block_size, g.heads, g.head_dim, g.layers

    def alloc(logical: Sequence[int]) -> torch.Tensor:
        order = _ORDERS[g.layout] if g.kv_layout == "HND" else tuple(range(len(logical)))
        t = torch.empty([logical[i] for i in order], dtype=getattr(torch, g.dtype))
        if touch:
            t.view(torch.uint8).zero_()
        return t.permute([order.index(i) for i in range(len(logical))])

    if g.layout == "cross_layer":
        return {"all_layers": alloc((n, L, 2, b, h, d))}
    shape = (2, n, b, h, d) if g.layout == "split_kv" else (n, 2, b, h, d)
    return {f"model.layers.{i}.attn": alloc(shape) for i in range(L)}


def huge_page_fraction(tensors: Iterable[Any]) -> float | None:
    """Share of the tensors' bytes in transparent huge pages (/proc/self/smaps)."""
    spans = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in tensors]
    total, huge, cur = sum(e - a for a, e in spans), 0, (0, 0)
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = head.split("-")
                    cur = (int(lo, 16), int(hi, 16))
                elif head == "AnonHugePages:" and any(a < cur[1] and cur[0] < e for a, e in spans):
                    huge += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return round(min(1.0, huge / total), 3) if total else None


def _regions(g: Geometry, caches: Mapping[str, Any]) -> list[Any]:
    """uint8 [num_blocks, block_len] views of the registration regions (kvrdma's cut)."""
    from kvrdma.layout import build_regions

    info = build_regions(caches, cache_layout=g.layout, block_size=g.block_size)  # type: ignore[arg-type]
    return [r.data for r in info.regions]


def _pattern(blocks: Any, region: int) -> Any:
    import torch

    return ((blocks * 7 + region * 13) % 251 + 1).to(dtype=torch.uint8)


def fill_pattern(g: Geometry, caches: Mapping[str, Any]) -> None:
    """Every byte of block b in region r is (7b + 13r) % 251 + 1."""
    import torch

    for r, data in enumerate(_regions(g, caches)):
        data.copy_(_pattern(torch.arange(data.shape[0]), r)[:, None].expand(data.shape))


def wrong_bytes(g: Geometry, caches: Mapping[str, Any], local: Any, remote: Any) -> int:
    """Wrong first/last bytes of the local blocks after `remote` was read into `local`."""
    import torch

    lb, rb = (torch.as_tensor(np.asarray(x, dtype=np.int64)) for x in (local, remote))
    bad = 0
    for r, data in enumerate(_regions(g, caches)):
        got, want = data.index_select(0, lb), _pattern(rb, r)
        bad += int((got[:, 0] != want).sum()) + int((got[:, -1] != want).sum())
    return bad


def clear(g: Geometry, caches: Mapping[str, Any]) -> None:
    for data in _regions(g, caches):
        data.zero_()


# --- kvrdma workers and raw NIXL -------------------------------------------------------
def agent_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def new_worker(role: str, engine_id: str, g: Geometry, caches: Mapping[str, Any], **kw: Any) -> Any:
    """A kvrdma `Worker` (real NIXL agent, defaults but `extra`) with `caches` registered;
    keywords: tp_rank, tp_size, total_heads, extra."""
    from kvrdma.config import load_kv_transfer_config
    from kvrdma.worker import Worker

    rank, size = kw.get("tp_rank", 0), kw.get("tp_size", 1)
    role = "kv_producer" if role == "P" else "kv_consumer"
    cfg = {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id}
    cfg["kv_connector_extra_config"] = dict(kw.get("extra") or {})
    heads = kw.get("total_heads") or g.heads * size
    w = Worker.create(
        load_kv_transfer_config(cfg, environ={}),
        tp_rank=rank,
        tp_size=size,
        total_num_kv_heads=heads,
        agent_name=agent_name(f"{engine_id}-tp{rank}"),
        compat_hash=COMPAT,
    )
    try:
        w.register_kv_caches(caches, cache_layout=g.layout, block_size=g.block_size)  # type: ignore[arg-type]
    except BaseException:
        w.close()
        raise
    return w


def read_blocks(worker: Any, engine: str, local: Any, remote: Any, rid: str) -> float:
    """kvrdma's READ: `start_read`, then `get_finished` until done; seconds. Every wait loop
    yields the CPU between polls: NIXL's copy threads need it on a small machine."""
    t0 = time.perf_counter()
    worker.start_read(rid, local, remote, engine)
    while rid not in (out := worker.get_finished()).finished_recving:
        os.sched_yield()
    dt = time.perf_counter() - t0
    if rid in out.invalid_block_ids:
        raise RuntimeError(f"kvrdma READ {rid} failed: blocks reported invalid")
    return dt


# what kvrdma attaches to a READ; raw reads carry the same bytes
NOTIF = notify.encode("done", "req-0001", expected=1, sender_engine="D-0001", sender_rank=0)


@dataclass(frozen=True)
class RawSetup:
    """How a raw NIXL reader is configured: UCX copy threads, `split_batch_size` (None:
    NIXL's default), descriptor merging ("on", "off", or "kvrdma": off for descriptors of
    at least 64 KiB, kvrdma's rule). The progress thread is off in every setup."""

    num_threads: int = 0
    split_batch_size: int | None = None
    merge: str = "on"

    @property
    def label(self) -> str:
        split = "default" if self.split_batch_size is None else self.split_batch_size
        return f"threads {self.num_threads}, split {split}, merge {self.merge}"


def kvrdma_setup() -> RawSetup:
    """kvrdma's own UCX setup with Worker defaults."""
    from kvrdma.config import ExtraConfig
    from kvrdma.nixl import BackendConfig

    nt = ExtraConfig().num_threads
    split = BackendConfig(name="x").split_batch_size if nt else None
    return RawSetup(nt, split, "kvrdma" if nt > 1 else "on")


NIXL_DEFAULTS = RawSetup()
# the calibration sweep: threads {0, 2, 4} x batch split {1, default} x merging {on, off}
SWEEP = [RawSetup(0, None, m) for m in ("on", "off")] + [
    RawSetup(t, s, m) for t in (2, 4) for s in (1, None) for m in ("on", "off")
]


def per_block_rows(regions: Sequence[tuple[int, int, int]]) -> Any:
    """N×3 (addr, len, dev) rows, one per block, region-major."""
    parts = []
    for addr, n, bl in regions:
        rows = np.zeros((n, 3), dtype=np.uint64)
        rows[:, 0] = np.uint64(addr) + np.arange(n, dtype=np.uint64) * np.uint64(bl)
        rows[:, 1] = bl
        parts.append(rows)
    return np.concatenate(parts)


def region_triples(meta: Any) -> list[tuple[int, int, int]]:
    """(base_addr, num_blocks, block_len) of a WorkerMetadata's regions."""
    return [(r.base_addr, r.num_blocks, r.block_len) for r in meta.regions]


def nixl_payload(meta: Any) -> bytes:
    """The raw NIXL agent blob inside kvrdma's checksummed envelope."""
    from kvrdma.nixl.checks import unwrap_metadata

    return unwrap_metadata(meta.agent_metadata)


class RawReader:
    """The hand-written minimal NIXL use: one agent, one descriptor per (region, block)
    prepped once as N×3 arrays, `make_prepped_xfer` + `transfer` + `check_xfer_state` per
    read; ids are region * num_blocks + block, as kvrdma's."""

    def __init__(self, local_meta: Any, remote_meta: Any, setup: RawSetup = NIXL_DEFAULTS) -> None:
        import nixl

        local, remote = region_triples(local_meta), region_triples(remote_meta)
        self.setup, self.name = setup, agent_name("raw")
        conf = nixl.nixl_agent_config(
            enable_prog_thread=False, backends=[], num_threads=setup.num_threads
        )
        self.agent = nixl.nixl_agent(self.name, conf)
        init = {"num_threads": str(setup.num_threads)} if setup.num_threads else {}
        if setup.num_threads and setup.split_batch_size is not None:
            init["split_batch_size"] = str(setup.split_batch_size)
        self.agent.create_backend("UCX", init)
        shortest = min(bl for _, _, bl in local)
        skip = setup.merge == "off" or (setup.merge == "kvrdma" and shortest >= 64 * 1024)
        self.xfer_kw = {"skip_desc_merge": True} if skip else {}
        table = np.array([(a, n * bl, 0) for a, n, bl in local], dtype=np.uint64)
        self.reg = self.agent.register_memory(table, "DRAM")
        peer = self.agent.add_remote_agent(nixl_payload(remote_meta))
        self.peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        self.local_n, self.remote_n, self.regions = local[0][1], remote[0][1], len(local)
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", per_block_rows(local), "DRAM")
        self.remote = self.agent.prep_xfer_dlist(self.peer, per_block_rows(remote), "DRAM")

    def ids(self, local: Any, remote: Any) -> tuple[Any, Any]:
        r = np.arange(self.regions, dtype=np.int64)[:, None]
        lids = (r * self.local_n + np.asarray(local, dtype=np.int64)[None, :]).reshape(-1)
        rids = (r * self.remote_n + np.asarray(remote, dtype=np.int64)[None, :]).reshape(-1)
        return lids, rids

    def prep(self, local: Any, remote: Any, notif: bytes = NOTIF) -> Any:
        lids, rids = self.ids(local, remote)
        args = ("READ", self.local, lids, self.remote, rids, notif)
        return self.agent.make_prepped_xfer(*args, **self.xfer_kw)

    def post(self, local: Any, remote: Any, notif: bytes = NOTIF) -> tuple[Any, str]:
        xfer = self.prep(local, remote, notif)
        return xfer, self.agent.transfer(xfer)

    def read(self, local: Any, remote: Any, notif: bytes = NOTIF) -> float:
        t0 = time.perf_counter()
        h, state = self.post(local, remote, notif)
        while state == "PROC":
            os.sched_yield()
            state = self.agent.check_xfer_state(h)
        dt = time.perf_counter() - t0
        self.agent.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ ({self.setup.label}) ended in state {state}")
        return dt

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.agent.release_dlist_handle(self.local)
            self.agent.release_dlist_handle(self.remote)
            self.agent.remove_remote_agent(self.peer)
            self.agent.deregister_memory(self.reg)
        self.agent = None


def time_methods(
    obj: Any, names: Iterable[str], spent: dict[str, float] | None = None
) -> dict[str, float]:
    """Shadow `obj`'s methods with timed ones (instance attributes, instrumentation only);
    returns `spent` (a new dict by default): seconds per name, which the caller may reset."""
    spent = {} if spent is None else spent

    def timed(fn: Any, name: str) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0

        return call

    for name in names:
        spent[name] = 0.0
        setattr(obj, name, timed(getattr(obj, name), name))
    return spent


def _thread_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _thread_name(tid: int) -> str:
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


@contextlib.contextmanager
def pinned_new_threads(enabled: bool = True) -> Iterator[list[int]]:
    """Pin the threads started inside the block (a NIXL agent's UCX copy threads) one per
    usable CPU in turn; UCX's event thread ("async") stays free. Yields the pinned ids,
    filled when the block ends: where the scheduler puts copy threads is the main noise of
    a reader-against-reader ratio on a small machine. Nothing is pinned when disabled."""
    pinned: list[int] = []
    before = _thread_ids() if enabled else set()
    yield pinned
    if not before:
        return
    cpus = sorted(os.sched_getaffinity(0))
    new = sorted(t for t in _thread_ids() - before if _thread_name(t) != "async")
    for i, tid in enumerate(new):
        with contextlib.suppress(OSError):  # the thread may have ended
            os.sched_setaffinity(tid, {cpus[i % len(cpus)]})
            pinned.append(tid)


@contextlib.contextmanager
def nixl_progress_delay(delay_us: int | None) -> Iterator[None]:
    """NIXL agents built inside the block get progress-thread delay `delay_us` (nixl's
    Python wrapper hard-codes 0, a busy-spinning thread); None changes nothing."""
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


# --- the target process ----------------------------------------------------------------
class PeerError(RuntimeError):
    pass


class Peer:
    """Client of the target process (`benchmarks._peer.serve`); every call has a deadline."""

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


def die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Context:
    """What a benchmark gets: quick mode, seed, bandwidth options, the shared target."""

    quick: bool
    out: Path
    seed: int = 0
    pin_threads: bool = True  # bandwidth: copy threads pinned one per CPU
    control: bool = False  # bandwidth: a second raw reader in kvrdma's place (A/A)
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


# --- result shaping -------------------------------------------------------------------
def table(title: str, rows: Iterable[Mapping[str, Any]], spec: str) -> dict[str, Any]:
    """A table for the report and the PNG: `spec` is "header[*]: path[|format]; ..." where a
    path walks dicts and lists by dotted keys, format is `size` (bytes) or `ratio` (a paired
    ratio with its interval), and `*` puts the column in the plot; cells are formatted
    here, the report prints them as they are."""
    cols = [c.split(": ", 1) for c in spec.split("; ")]
    plotted = [i for i, (head, _) in enumerate(cols) if head.endswith("*")]
    heads = [head.removesuffix("*") for head, _ in cols]
    cells = [[_cell(r, path) for _, path in cols] for r in rows]
    return {"title": title, "columns": heads, "rows": cells, "plot": plotted}


def _cell(row: Any, path: str) -> str:
    path, _, fmt = path.partition("|")
    v = row
    for key in path.split(".") if "/" not in path else path.split(".", 1):
        v = v[int(key)] if isinstance(v, list) else (v or {}).get(key)
    if v is None or (fmt == "ratio" and v.get("paired_median") is None):
        return "–"
    if fmt == "size":
        return f"{v >> 20} MiB" if v >= 1 << 20 else f"{v // 1024} KiB"
    if fmt == "ratio":
        ci = v.get("paired_ci95")
        return f"{v['paired_median']:.3f}" + (f" [{ci[0]:.3f}–{ci[1]:.3f}]" if ci else "")
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)
