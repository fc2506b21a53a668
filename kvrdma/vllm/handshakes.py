"""Handshakes with producer engines off the engine's step path.

A consumer rank meets a producer engine for the first time inside `start_load_kv`, on the
thread that runs the forward step; a handshake there would stall every running request
for as long as the producer takes to answer (up to `handshake_timeout`). `HandshakeJobs`
runs each handshake on a small thread pool instead, at most one per engine at a time,
each bounded by the client's deadline; the step thread collects finished ones with
`take_done()` and adds the engines to NIXL itself, so NIXL state is only touched there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvrdma.errors import HandshakeTimeout, KvrdmaError
from kvrdma.types import FailureReason, Outcome

if TYPE_CHECKING:  # no vLLM import: the pool itself is plain threads
    from kvrdma.handshake.client import RefreshResult
    from kvrdma.vllm.params import RemoteEngine

    # fetch(remote, ranks, timeout) -> the remote ranks' metadata; raises KvrdmaError
    Fetch = Callable[[RemoteEngine, list[int], float], RefreshResult]

logger = logging.getLogger(__name__)

# a handful of producers answer at once; more engines queue behind them, each still bounded
MAX_CONCURRENT_HANDSHAKES = 4


@dataclass(frozen=True)
class HandshakeDone:
    """A finished handshake: the fetched metadata, or the error that ended it."""

    remote: RemoteEngine
    result: RefreshResult | None
    error: KvrdmaError | None
    seconds: float


class HandshakeJobs:
    """At most one handshake per producer engine in flight, on a bounded pool of threads."""

    def __init__(
        self, fetch: Fetch, *, timeout: float, max_workers: int = MAX_CONCURRENT_HANDSHAKES
    ) -> None:
        self._fetch = fetch
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kvrdma-handshake")
        self._lock = threading.Lock()
        self._running: dict[str, Future[HandshakeDone]] = {}
        self._closed = False
        self._closing: list[Future[HandshakeDone]] = []  # running when close() was called

    def in_flight(self, engine_id: str) -> bool:
        with self._lock:
            return engine_id in self._running

    def submit(self, remote: RemoteEngine, ranks: list[int]) -> bool:
        """Start a handshake with `remote`'s `ranks` unless one is already under way;
        returns whether this call started one."""
        with self._lock:
            if self._closed:
                raise RuntimeError("HandshakeJobs: submit() after close()")
            if remote.engine_id in self._running:
                return False
            self._running[remote.engine_id] = self._pool.submit(self._run, remote, list(ranks))
        return True

    def _run(self, remote: RemoteEngine, ranks: list[int]) -> HandshakeDone:
        t0 = time.perf_counter()
        try:
            result = self._fetch(remote, ranks, self.timeout)
        except KvrdmaError as exc:
            return HandshakeDone(remote, None, exc, time.perf_counter() - t0)
        except Exception as exc:  # a bug, or the client closed under it: reported, not raised
            if not self._closed:
                logger.exception("handshake with engine %r crashed", remote.engine_id)
            err = KvrdmaError(f"handshake with engine {remote.engine_id!r} crashed: {exc!r}")
            return HandshakeDone(remote, None, err, time.perf_counter() - t0)
        return HandshakeDone(remote, result, None, time.perf_counter() - t0)

    def take_done(self) -> list[HandshakeDone]:
        """The handshakes that finished since the last call (never waits)."""
        with self._lock:
            done = [e for e, f in self._running.items() if f.done()]
            futures = [self._running.pop(e) for e in done]
        return [f.result() for f in futures]

    def close(self) -> None:
        """Drop queued handshakes and take no more; running ones end by their deadline
        (or sooner, once the caller closes their client): see `join`."""
        with self._lock:
            self._closed = True
            self._closing = [f for f in self._running.values() if not f.cancel()]
            self._running.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def join(self, timeout: float | None = None) -> None:
        """Wait (at most `timeout`, default the handshake deadline) for running handshakes."""
        if self._closing:
            _, still = wait_futures(self._closing, self.timeout if timeout is None else timeout)
            if still:
                logger.warning("%d handshake(s) still running at shutdown", len(still))
            self._closing = []


def handshake_failure(remote: RemoteEngine, exc: KvrdmaError) -> FailureReason:
    """Why the reads waiting for `remote`'s handshake failed."""
    outcome = Outcome.TIMEOUT if isinstance(exc, HandshakeTimeout) else Outcome.FAILED
    where = f"{remote.host}:{remote.port}"
    text = f"connecting to engine {remote.engine_id!r} at {where} failed: {exc}"
    return FailureReason(outcome, remote.engine_id, text)
