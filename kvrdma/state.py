"""The state both roles of one worker share: config, agents, the registered layout, metadata.

`Worker` builds it; `ProducerSide` and `ConsumerSide` read it, and the consumer updates the
published metadata when a retirement replaces the agent peers read from.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from kvrdma.config import KVTransferConfig
from kvrdma.errors import RegistrationError
from kvrdma.integrity import ChecksumTable
from kvrdma.layout import KVLayoutInfo
from kvrdma.metadata import WorkerMetadata
from kvrdma.nixl.protocol import TransferBackend
from kvrdma.postprocess import HostStager
from kvrdma.topology import TransferTopology
from kvrdma.transfer import Clock

F = TypeVar("F", bound=Callable[..., Any])

# seconds one side sleeps while the other waits for the lock (see `WorkerLock`)
TURN_SECONDS = 5e-5
# the backlog thread yields to waiting callers at most this long (callers in a tight loop on
# several threads could otherwise keep it out)
MAX_YIELD_SECONDS = 0.05


def _forked(ref: weakref.ReferenceType[WorkerLock]) -> None:
    """In a forked child no backlog thread waits for the lock (nor another caller thread)."""
    lock = ref()
    if lock is not None:
        lock._waiting, lock._callers, lock._count = False, 0, threading.Lock()
        if not lock.owned():  # held by a thread that is not in the child: never released
            lock._lock = threading.RLock()


class WorkerLock:
    """A worker's re-entrant lock, taken in turns by its callers and the backlog thread:
    once one side waits for it, the other lets it in before taking it again (an unfair lock
    goes back to whoever releases it and asks again at once, however long the other side
    has waited)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._waiting = False  # the backlog thread waits to take it
        self._callers = 0  # callers waiting to take it
        self._count = threading.Lock()  # for `_callers`: callers may be several threads
        os.register_at_fork(after_in_child=functools.partial(_forked, weakref.ref(self)))

    def __enter__(self) -> None:
        if not self._waiting and self._lock.acquire(False):  # free, or already this thread's
            return
        if self.owned():
            self._lock.acquire()
            return
        while self._waiting:
            time.sleep(TURN_SECONDS)
        with self._count:
            self._callers += 1
        try:
            self._lock.acquire()
        finally:
            with self._count:
                self._callers -= 1

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def owned(self) -> bool:
        """Whether the calling thread holds it."""
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """The backlog thread's hold: it waits while a caller does, and callers wait from
        the moment it asks."""
        ends = time.monotonic() + MAX_YIELD_SECONDS
        while self._callers and time.monotonic() < ends:
            time.sleep(TURN_SECONDS)
        self._waiting = True
        try:
            self._lock.acquire()
        finally:
            self._waiting = False
        try:
            yield
        finally:
            self._lock.release()


def locked(method: F) -> F:
    """A method of an object with a `_s: WorkerState`, run holding that state's lock."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        lock = self._s.lock
        if not lock._waiting and lock._lock.acquire(False):  # `WorkerLock.__enter__`'s fast
            try:  # path, inline: every `get_finished` call pays it
                return method(self, *args, **kwargs)
            finally:
                lock._lock.release()
        with lock:
            return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


class WorkerState:
    """State both roles use: the backend, the registered layout, the metadata."""

    def __init__(
        self,
        config: KVTransferConfig,
        backend: TransferBackend,
        *,
        reader: TransferBackend | None,
        tp_rank: int,
        tp_size: int,
        total_num_kv_heads: int,
        dp_index: int,
        compat_hash: str,
        metrics: Any,
        clock: Clock,
    ) -> None:
        self.config = config
        self.backend = backend  # the published agent (producer side)
        # reads go through `reader`: the same agent, or (kv_both) a second one, because a
        # read past its deadline retires the reading agent (see ConsumerSide._abandon)
        self.reader = reader or backend
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.total_num_kv_heads = total_num_kv_heads
        self.dp_index = dp_index
        self.compat_hash = compat_hash
        self.metrics = metrics
        self.clock = clock
        # held by every call into the worker and by the backlog thread while it posts
        # (`kvrdma.posting.Backlog`): NIXL agents and the read state are not thread-safe
        self.lock = WorkerLock()
        self.layout: KVLayoutInfo | None = None
        self.metadata: WorkerMetadata | None = None
        self.topology: TransferTopology | None = None
        self.stager: HostStager | None = None
        self.registered: Any = None
        # a few registered host bytes that ack READs land in (see Remote.ack_lists)
        self.scratch = torch.zeros(64, dtype=torch.uint8)
        self.scratch_reg: Any = None
        self.ack_local: Any = None
        self.reader_registered: Any = None  # kv_both: the regions registered with `reader`
        self.retirements = 0
        # sha256 of the agent metadata this worker published before retirements replaced
        # it, newest last: a push expectation names them so a producer can tell one sent
        # from a replaced agent, which no longer listens, from a restarted decoder's
        self.former_agents: collections.deque[str] = collections.deque(maxlen=8)
        # integrity mode, producers: the checksum table readers READ, and its registration
        self.checksums: ChecksumTable | None = None
        self.checksums_reg: Any = None

    @property
    def regions(self) -> list[torch.Tensor]:
        """Byte views of the registered (possibly host-staging) regions."""
        if self.layout is None:
            raise RegistrationError("register_kv_caches() has not been called")
        return [r.data for r in self.layout.regions]
