"""A reading worker "D" connected to a producer "P", both in this process on real NIXL, over
synthetic caches (P's filled with the pattern, D's zeroed), closed after the block."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from kvrdma.config import load_kv_transfer_config
from kvrdma.testing.synthetic import CacheSpec, fill, make_caches
from kvrdma.worker import Worker


def local_worker(
    spec: CacheSpec, engine: str, role: str, clock: Callable[[], float], **extra: object
) -> tuple[Worker, dict[str, torch.Tensor]]:
    """Rank `spec.tp_rank` of `spec.tp_size` of `engine` over caches made for `spec`;
    `extra` is its `kv_connector_extra_config`."""
    caches, _ = make_caches(spec)
    if role == "kv_producer":
        fill(spec, caches)
    raw = {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine}
    config = load_kv_transfer_config(raw | {"kv_connector_extra_config": extra}, environ={})
    w = Worker.create(
        config,
        tp_rank=spec.tp_rank,
        tp_size=spec.tp_size,
        total_num_kv_heads=spec.shape.num_kv_heads,
        clock=clock,
    )
    w.register_kv_caches(caches, cache_layout=spec.cache_layout, block_size=spec.block_size)
    return w, caches  # type: ignore[return-value]


@contextlib.contextmanager
def reader_pair(
    spec: CacheSpec, clock: Callable[[], float] = time.monotonic, **extra: object
) -> Iterator[tuple[Worker, Worker, dict[str, torch.Tensor]]]:
    """(D, P, D's caches): D on `clock` with `extra` config, P on the defaults and the
    monotonic clock; D knows P as rank 0 of engine "P", and nothing has been read yet."""
    d, caches = local_worker(spec, "D", "kv_consumer", clock, **extra)
    p, _ = local_worker(spec, "P", "kv_producer", time.monotonic)
    try:
        d.add_remote({0: p.metadata})
        yield d, p, caches
    finally:
        d.close()
        p.close()


def step_until(p: Worker, d: Worker, until: Callable[[], bool], timeout: float = 10.0) -> None:
    """Progress both workers, as their engines' steps would, until `until()` holds."""
    end = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < end, "not within the timeout"
        p.get_finished()
        d.get_finished()
