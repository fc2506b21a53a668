"""Helpers that run vLLM code in a spawned child process, so the test process never
imports vLLM (the config string a user types, through vLLM's CLI parser and connector
factory), what vLLM's logger process does with an engine's connector stats, the engines'
side-channel ports and kvrdma's warnings in an engine process."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import traceback
from typing import Any


def parse_user_config(conn: Any, text: str) -> None:
    """What `vllm serve --kv-transfer-config TEXT` resolves: vLLM's own CLI parser, then
    `KVConnectorFactory`; sends back the class's module and name, and its HMA support."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        args = parser.parse_args(["--kv-transfer-config", text])
        cls = KVConnectorFactory.get_connector_class(args.kv_transfer_config)
        conn.send(("ok", cls.__module__, cls.__name__, supports_hma(cls)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def run_child(target: Any, *args: Any, timeout: float = 120.0) -> tuple:
    """Run `target(conn, *args)` in a spawned process and return its one message."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    try:
        if not parent.poll(timeout):
            raise TimeoutError(f"{target.__name__} sent nothing within {timeout}s")
        msg = parent.recv()
        if msg[0] == "error":
            raise RuntimeError(msg[1])
        return msg
    finally:
        proc.kill()
        proc.join(10)


def connector_stats(eng: Any) -> tuple[dict, dict, dict]:
    """What the logger process would do with the engine's stats: vLLM's reduced summary, the
    `vllm:kvrdma_*` Prometheus samples, and each worker's `kvrdma_*` samples."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    cls = type(eng.sched.connector)
    acc = None
    for data in eng.stats_seen:
        one = cls.build_kv_connector_stats(data)
        acc = one if acc is None else acc.aggregate(one)
    reg = CollectorRegistry()
    types = {t: _bound(t, reg) for t in (Gauge, Counter, Histogram)}
    prom = cls.build_prom_metrics(eng.cfg, types, ["model_name", "engine"], {0: ["m", "0"]})
    for data in eng.stats_seen:
        prom.observe(data, 0)
    vllm_samples = {
        s.name: s.value for m in reg.collect() for s in m.samples if s.name.endswith("_total")
    }
    kvrdma_samples: dict[str, float] = {}
    for wc in eng.wcs:
        for m in wc.worker_side.registry.collect():
            for s in m.samples:
                if s.name.endswith("_total"):
                    kvrdma_samples[s.name] = kvrdma_samples.get(s.name, 0.0) + s.value
    return (acc.reduce() if acc is not None else {}), vllm_samples, kvrdma_samples


def _bound(metric: Any, registry: Any) -> Any:
    def make(**kw: Any) -> Any:
        return metric(registry=registry, **kw)

    return make


class WarningLog(logging.Handler):
    """kvrdma's warnings in an engine process: the error texts its operator would read."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


WARNINGS = WarningLog()


# what `probe` counts by label: the counter family and the label
_COUNTED = {
    "requests": ("kvrdma_requests", "outcome"),
    "transfers": ("kvrdma_transfers", "outcome"),
    "failed_notifications": ("kvrdma_failed_notifications", "reason"),
}


def probe(eng: Any, what: str) -> Any:
    """One value read off an engine (`_harness.Engine`) for a test."""
    if what == "free_blocks":
        return eng.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    if what == "load_seconds":  # the longest start_load_kv call since the last probe
        value, eng.load_seconds = eng.load_seconds, 0.0
        return value
    if what == "steps":  # steps the engine has run so far
        return eng.steps
    if what == "warnings":  # kvrdma's warnings so far, in the engine's whole process
        return list(WARNINGS.lines)
    if what == "reading":  # requests whose READs are in flight, on any rank
        return sorted({r for wc in eng.wcs for r in wc.worker_side.worker.consumer.inflight})
    if what == "heartbeating":  # requests some rank heartbeats a producer for
        return sorted({r for wc in eng.wcs for r in wc.worker_side.worker.consumer.waiting})
    if what.startswith("held:"):  # whether some rank holds the request's blocks for a reader
        rid = what.removeprefix("held:")
        return any(wc.worker_side.worker.lease_expiry(rid) is not None for wc in eng.wcs)
    if what == "stray_notifs":  # notifications the ranks got for requests they do not hold
        return sum(
            p.ledger.counters.unknown_notifs + len(p.ledger.early)
            for wc in eng.wcs
            if (p := wc.worker_side.worker.producer)
        )
    if what == "push_written":  # segments pushed by kind ("layer", "whole"), over the ranks
        counts: dict[str, int] = {}
        for wc in eng.wcs:
            producer = wc.worker_side.worker.producer
            for kind, n in producer.pusher.written.items() if producer else ():
                counts[kind] = counts.get(kind, 0) + n
        return counts
    if what.startswith("push_early:"):  # ranks told of a push before they had the request
        rid = what.removeprefix("push_early:")
        return sum(
            1
            for wc in eng.wcs
            if (producer := wc.worker_side.worker.producer) and rid in producer.pusher.early
        )
    if what == "blocks_loaded":  # blocks of every successful load so far, over the ranks
        return sum(data.get("num_blocks", 0) for data in eng.stats_seen)
    if what in _COUNTED:  # kvrdma's counters, by label, over ranks
        name, label = _COUNTED[what]
        counts: dict[str, float] = {}
        for wc in eng.wcs:
            for fam in wc.worker_side.registry.collect():
                for s in fam.samples if fam.name == name else ():
                    if s.name.endswith("_total") and s.value:
                        counts[s.labels[label]] = counts.get(s.labels[label], 0) + s.value
        return counts
    if what == "engines":  # remote engines some rank has loaded
        return sorted({e for wc in eng.wcs for e in wc.worker_side.worker.consumer.remotes})
    raise ValueError(f"probe: unknown value {what!r}")


def break_next_post(eng: Any, error: str, push: bool) -> None:
    """Each rank's next READ post (`push`: next notification, a push's `Expect`) raises
    `error`: `RuntimeError` or a `kvrdma.errors` class."""
    import kvrdma.errors

    exc = RuntimeError if error == "RuntimeError" else getattr(kvrdma.errors, error)
    for wc in eng.wcs:
        w = wc.worker_side.worker
        owner, name = (w.backend, "send_notif") if push else (w.consumer.poster, "_post_whole")

        def broken(*args: Any, owner: Any = owner, name: str = name) -> None:
            delattr(owner, name)  # once: the class's own from the next call on
            raise exc("posting broke")

        setattr(owner, name, broken)


def counted_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What a `probe(..., "requests")`-style count by label grew by between two probes."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
