"""What every benchmark shares: statistics, kvrdma workers and raw NIXL readers built alike,
the run's context (its target process: `benchmarks._peer`) and result tables
(benchmarks/README.md: how they measure)."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvrdma import notify
from kvrdma.config import ExtraConfig, load_kv_transfer_config
from kvrdma.nixl import BackendConfig
from kvrdma.nixl.checks import unwrap_metadata
from kvrdma.nixl.merging import plan_post
from kvrdma.testing.synthetic import CacheSpec, ModelShape, make_caches
from kvrdma.worker import Worker

COMPAT = "b" * 64  # compat hash every benchmark worker shares
_names = itertools.count()
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


def repeat(names: Sequence[str], reps: int, fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """`fn(*args)` once to warm up, then `reps` times: its seconds in ms, named by `names`."""
    fn(*args)
    runs = zip(*(fn(*args) for _ in range(reps)), strict=True)
    return {k: summarize(v, 1e3) for k, v in zip(names, runs, strict=True)}


def target(name: str, value: float | None, want: str) -> dict[str, Any]:
    """A target (`want`: "<op> <threshold> <unit>") with its value and verdict (not asserted)."""
    op, threshold, unit = want.split(" ", 2)
    t, ok = float(threshold), None
    if value is not None and not math.isnan(value):
        ok = value >= t if op == ">=" else value <= t
    v = None if value is None else round(float(value), 4)
    return {"target": name, "value": v, "op": op, "threshold": t, "unit": unit, "pass": ok}


def spec(layout: str, layers: int, heads: int, tokens: int, blocks: int, **kw: Any) -> CacheSpec:
    """One rank's caches of `heads` KV heads (the whole model's), head dim 128 unless
    `head_dim`; keywords: head_dim, dtype (float16), kv_layout (NHD), tp_rank, tp_size."""
    shape = ModelShape(layers, heads, kw.get("head_dim", 128), kw.get("dtype", "float16"))
    tp = kw.get("tp_rank", 0), kw.get("tp_size", 1)
    return CacheSpec(shape, layout, kw.get("kv_layout", "NHD"), *tp, tokens, blocks)  # type: ignore[arg-type]


def sizes(meta: Any) -> tuple[int, int, int]:
    """(one layer's K or V of one block, one block, descriptors per block) of a worker's
    registered regions, in bytes: the chunk is the "block size" of the bandwidth rows."""
    r = meta.regions
    return r[0].block_len // r[0].fragments, sum(x.block_len for x in r), len(r)


def huge_page_fraction(tensors: Iterable[Any]) -> float | None:
    """Share of the tensors' bytes in transparent huge pages (/proc/self/smaps)."""
    spans = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in tensors]
    total, huge, cur = sum(e - a for a, e in spans), 0, (0, 0)
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and not head.endswith(":"):
                    cur = tuple(int(x, 16) for x in head.split("-"))
                elif head == "AnonHugePages:" and any(a < cur[1] and cur[0] < e for a, e in spans):
                    huge += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return round(min(1.0, huge / total), 3) if total else None


def agent_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def new_worker(role: str, engine_id: str, s: CacheSpec, caches: Any, extra: Any = None) -> Any:
    """kvrdma `Worker` ("P" or "D", real NIXL agent, defaults but `extra`) over `caches` of `s`."""
    cfg = {"kv_connector": "NixlConnector", "engine_id": engine_id}
    cfg |= {"kv_role": "kv_producer" if role == "P" else "kv_consumer"}
    cfg["kv_connector_extra_config"] = dict(extra or {})
    tp = {"tp_rank": s.tp_rank, "tp_size": s.tp_size, "total_num_kv_heads": s.shape.num_kv_heads}
    name = agent_name(f"{engine_id}-tp{s.tp_rank}")
    config = load_kv_transfer_config(cfg, environ={})
    w = Worker.create(config, **tp, agent_name=name, compat_hash=COMPAT)
    try:
        w.register_kv_caches(caches, **s.layout_args)  # type: ignore[arg-type]
    except BaseException:
        w.close()
        raise
    return w


def read_blocks(
    worker: Any, engine: str, local: Any, remote: Any, rid: str, producer: Any = None
) -> tuple[float, float]:
    """kvrdma's READ: `start_read`, then `get_finished` until done (the `producer`'s too when it
    runs here), yielding the CPU to NIXL's copy threads; (seconds in all, in `start_read`)."""
    t0 = time.perf_counter()
    worker.start_read(rid, local, remote, engine)
    t1 = time.perf_counter()
    while rid not in (out := worker.get_finished()).finished_recving:
        if producer is not None:
            producer.get_finished()
        os.sched_yield()
    dt = time.perf_counter() - t0
    if rid in out.invalid_block_ids:
        raise RuntimeError(f"kvrdma READ {rid} failed: {out.failures.get(rid)}")
    return dt, t1 - t0


# what kvrdma attaches to a READ; raw reads carry the same bytes
NOTIF = notify.encode("done", "req-0001", expected=1, sender_engine="D-0001", sender_rank=0)


@dataclass(frozen=True)
class RawSetup:
    """How a raw NIXL reader is configured: UCX copy threads, `split_batch_size` (None:
    NIXL's default), descriptor merging ("on", "off", or "kvrdma": per request, by kvrdma's
    rules in `kvrdma.nixl.merging`: off, or a large request cut in a share per copy thread).
    `rw_sync`: the agent is made under NIXL_THREAD_SYNC_RW (thread-safe UCX workers), as
    kvrdma makes one with copy threads so that peers can come and go while they copy. The
    progress thread is off in every setup."""

    num_threads: int = 0
    split_batch_size: int | None = None
    merge: str = "on"
    rw_sync: bool = False

    @property
    def label(self) -> str:
        split = "default" if self.split_batch_size is None else self.split_batch_size
        sync = ", RW sync" if self.rw_sync else ""
        return f"threads {self.num_threads}, split {split}, merge {self.merge}{sync}"


def kvrdma_setup() -> RawSetup:
    """kvrdma's own UCX setup with Worker defaults."""
    nt = ExtraConfig().num_threads
    split = BackendConfig(name="x").split_batch_size if nt else None
    return RawSetup(nt, split, "kvrdma" if nt > 1 else "on", rw_sync=nt > 0)


NIXL_DEFAULTS = RawSetup()
# the calibration sweep: (UCX copy threads, batch split; None: NIXL's default) x merging
_THREADS_SPLIT = [(0, None), (2, 1), (2, None), (4, 1), (4, None)]
SWEEP = [RawSetup(t, s, m) for t, s in _THREADS_SPLIT for m in ("on", "off")]


def per_block_rows(meta: Any) -> Any:
    """N×3 (addr, len, dev) rows of a WorkerMetadata's regions, one per block, region-major."""
    parts = []
    for r in meta.regions:
        step = np.arange(r.num_blocks, dtype=np.uint64) * np.uint64(r.block_len)
        addrs = np.uint64(r.base_addr) + step
        parts.append(np.stack([addrs, np.full_like(addrs, r.block_len), np.zeros_like(addrs)], 1))
    return np.concatenate(parts)


class RawReader:
    """The hand-written minimal NIXL use: one agent, one descriptor per (region, block)
    prepped once as N×3 arrays, `make_prepped_xfer` + `transfer` + `check_xfer_state` per
    read (a WRITE of local into remote with `op="WRITE"`); ids are region * num_blocks +
    block, as kvrdma's. `steps`: seconds of wire-up."""

    def __init__(
        self, local_meta: Any, remote_meta: Any, setup: RawSetup = NIXL_DEFAULTS, op: str = "READ"
    ) -> None:
        import nixl

        self.setup, self.name, self.op = setup, agent_name("raw"), op
        nt, t = setup.num_threads, time.perf_counter
        sync = {"sync_mode": nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW} if setup.rw_sync else {}
        conf = nixl.nixl_agent_config(enable_prog_thread=False, backends=[], num_threads=nt, **sync)
        self.agent = nixl.nixl_agent(self.name, conf)
        init = {"num_threads": str(nt)} if nt else {}
        if nt and setup.split_batch_size is not None:
            init["split_batch_size"] = str(setup.split_batch_size)
        self.agent.create_backend("UCX", init)
        local, remote = local_meta.regions, remote_meta.regions
        table = [(r.base_addr, r.num_blocks * r.block_len, 0) for r in local]
        self.reg = self.agent.register_memory(np.array(table, dtype=np.uint64), "DRAM")
        t0 = t()
        peer = self.agent.add_remote_agent(unwrap_metadata(remote_meta.agent_metadata))
        self.peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        t1 = t()
        self.remote = self.agent.prep_xfer_dlist(self.peer, per_block_rows(remote_meta), "DRAM")
        t2, rows = t(), per_block_rows(local_meta)
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, "DRAM")
        self.steps = {"add_remote_agent": t1 - t0, "prep_remote": t2 - t1, "prep_local": t() - t2}
        self.min_len = min(r.block_len for r in (*local, *remote))  # for kvrdma's merging rule
        self.local_n, self.remote_n = local[0].num_blocks, remote[0].num_blocks
        self.regions = len(local)

    def prep(self, local: Any, remote: Any, notif: bytes = NOTIF) -> Any:
        r = np.arange(self.regions, dtype=np.int64)[:, None]
        lids = (r * self.local_n + np.asarray(local, dtype=np.int64)[None, :]).reshape(-1)
        rids = (r * self.remote_n + np.asarray(remote, dtype=np.int64)[None, :]).reshape(-1)
        merge, nt = self.setup.merge, self.setup.num_threads
        skip = merge == "off"
        if merge == "kvrdma":
            skip, lids, rids = plan_post(self.min_len, lids, rids, nt)
        args = (self.op, self.local, lids, self.remote, rids, notif)
        return self.agent.make_prepped_xfer(*args, skip_desc_merge=skip)

    def post(self, local: Any, remote: Any, notif: bytes = NOTIF) -> tuple[Any, str]:
        return (xfer := self.prep(local, remote, notif)), self.agent.transfer(xfer)

    def read(self, local: Any, remote: Any, notif: bytes = NOTIF) -> float:
        t0 = time.perf_counter()
        h, state = self.post(local, remote, notif)
        while state == "PROC":
            os.sched_yield()
            state = self.agent.check_xfer_state(h)
        dt = time.perf_counter() - t0
        self.agent.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL {self.op} ({self.setup.label}) ended in state {state}")
        return dt

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.agent.release_dlist_handle(self.local)
            self.agent.release_dlist_handle(self.remote)
            self.agent.remove_remote_agent(self.peer)
            self.agent.deregister_memory(self.reg)
        self.agent = None


class Pair:
    """A producer worker of `s` in the target (pattern-filled unless `fill=False`) and a
    kvrdma consumer of the same caches here, connected; raw readers of `readers` ((setup,
    name or None) pairs), more on demand. Every reader's copy threads are pinned when the
    context says so (`pinned`: how many); `huge`: the local and remote huge page fractions."""

    def __init__(
        self, ctx: Context, key: str, s: CacheSpec, *readers: Any, fill: bool = True, **extra: Any
    ):
        self.ctx, self.spec, self.key, self.engine, self.seq = ctx, s, key, f"P-{key}", 0
        made = ctx.peer.call("make_worker", key=key, engine_id=self.engine, spec=s, fill=fill)
        self.pmeta, self.caches, self.readers = made["meta"], make_caches(s)[0], {}
        with pinned_new_threads(ctx.pin_threads) as pinned:
            self.worker = new_worker("D", f"D-{key}", s, self.caches, extra)
        self.pinned = {"kvrdma": len(pinned)}
        self.chunk, self.block_bytes, self.per_block = sizes(self.worker.metadata)
        try:
            self.worker.add_remote({0: self.pmeta})
            # its standby agent (idle copy threads) must not be counted as a raw reader's
            self.worker.backend.wait_standby(60.0)
            self.huge = [huge_page_fraction(self.caches.values()), made["huge_page_fraction"]]
            for setup, name in readers:
                self.reader(setup, name)
        except BaseException:
            self.close()
            raise

    def reader(self, setup: RawSetup, name: str | None = None) -> RawReader:
        """The raw reader of `setup` (a new one under `name` when given)."""
        key = name or setup.label
        if key not in self.readers:
            with pinned_new_threads(self.ctx.pin_threads) as pinned:
                self.readers[key] = RawReader(self.worker.metadata, self.pmeta, setup)
            self.pinned[key] = len(pinned)
        return self.readers[key]

    def read(self, lb: Any, rb: Any) -> tuple[float, float]:
        """kvrdma's READ (`read_blocks`)."""
        self.seq += 1
        return read_blocks(self.worker, self.engine, lb, rb, f"{self.key}-{self.seq}")

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.worker.close()
        self.ctx.peer.call("close", key=self.key)


def time_methods(obj: Any, names: Iterable[str], spent: Any = None) -> dict[str, float]:
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


def _threads() -> dict[int, str]:
    """This process's thread ids and kernel names."""
    out = {}
    with contextlib.suppress(OSError):
        for t in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                out[int(t)] = Path(f"/proc/self/task/{t}/comm").read_text().strip()
    return out


@contextlib.contextmanager
def pinned_new_threads(enabled: bool = True) -> Iterator[list[int]]:
    """Pin the threads started inside the block (a NIXL agent's UCX copy threads) one per
    usable CPU in turn; UCX's event thread ("async") stays free. Yields the pinned ids,
    filled when the block ends: where the scheduler puts copy threads is the main noise of
    a reader-against-reader ratio on a small machine. Nothing is pinned when disabled."""
    pinned: list[int] = []
    before = _threads() if enabled else {}
    yield pinned
    if not before:
        return
    cpus = sorted(os.sched_getaffinity(0))
    new = sorted(t for t, name in _threads().items() if t not in before and name != "async")
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
    orig = bind.nixlAgent

    def agent(name: str, cfg: Any) -> Any:
        cfg.pthrDelay = delay_us  # over the wrapper's 0
        return orig(name, cfg)

    bind.nixlAgent = agent
    try:
        yield
    finally:
        bind.nixlAgent = orig


@dataclass
class Context:
    """What a benchmark gets: quick mode, seed, reader options, the shared target."""

    quick: bool
    seed: int = 0
    pin_threads: bool = True  # every reader's copy threads pinned one per CPU
    control: bool = False  # bandwidth: a second raw reader in kvrdma's place (A/A)
    _peer: Any = field(default=None, repr=False)  # the target's client, made on first use

    @property
    def peer(self) -> Any:
        if self._peer is None:
            from benchmarks._peer import Peer

            self._peer = Peer()
        return self._peer

    def pick(self, params: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
        """A benchmark's parameters, {name: (quick, full)}, for this run."""
        return {k: v[0 if self.quick else 1] for k, v in params.items()}

    @contextlib.contextmanager
    def served(self, engine: str, specs: Mapping[str, CacheSpec]) -> Iterator[int]:
        """Producer workers of `engine` ({key: spec}, memory never touched) in the target,
        their handshake served on the port yielded; all closed after the block."""
        for k, s in specs.items():
            self.peer.call("make_worker", key=k, engine_id=engine, spec=s, fill=False, zeroed=False)
        try:
            yield self.peer.call("handshake", keys=list(specs))
        finally:
            self.peer.call("handshake", keys=[])
            for k in specs:
                self.peer.call("close", key=k)

    def close(self) -> None:
        if self._peer is not None:
            self._peer.close()
            self._peer = None


def table(title: str, rows: Iterable[Mapping[str, Any]], spec: str) -> dict[str, Any]:
    """A table for the report and the PNG, its cells formatted here: `spec` is "header[*]:
    path[|format]; ..." where a path walks dicts and lists by dotted keys, format is `size`
    (bytes) or `ratio` (a paired ratio with its interval), and `*` plots the column."""
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
