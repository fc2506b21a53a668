"""The state both roles of one worker share: config, agents, the registered layout, metadata.

`Worker` builds it; `ProducerSide` and `ConsumerSide` read it, and the consumer updates the
published metadata when a retirement replaces the agent peers read from.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
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

# seconds a caller sleeps while the backlog thread waits for the lock (see `WorkerLock`)
TURN_SECONDS = 5e-5


class WorkerLock:
    """A worker's re-entrant lock, taken in turns: once the backlog thread waits for it, a
    caller lets it in before taking it again (a caller calling in a tight loop would
    otherwise get it back every time, an unfair lock waking the thread too late)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._waiting = False  # the backlog thread waits to take it

    def __enter__(self) -> None:
        while self._waiting and not self.owned():
            time.sleep(TURN_SECONDS)
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def owned(self) -> bool:
        """Whether the calling thread holds it."""
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """The backlog thread's hold: callers wait from the moment it asks."""
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
        with self._s.lock:
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
        # integrity mode, producers: the checksum table readers READ, and its registration
        self.checksums: ChecksumTable | None = None
        self.checksums_reg: Any = None

    @property
    def regions(self) -> list[torch.Tensor]:
        """Byte views of the registered (possibly host-staging) regions."""
        if self.layout is None:
            raise RegistrationError("register_kv_caches() has not been called")
        return [r.data for r in self.layout.regions]
