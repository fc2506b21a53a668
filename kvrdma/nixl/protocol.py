"""The small typed interface every module uses to move bytes; `NixlBackend` implements it.

Nothing here imports nixl: pure logic and unit tests depend on this Protocol only.
Descriptor arrays are NumPy `uint64` arrays of shape (N, 3): (address, length, device id).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

DescArray = npt.NDArray[np.uint64]
IdArray = npt.NDArray[np.int64]  # block ids
BlockIds = IdArray | list[int]  # a small request's as a list (see descriptors.SMALL_REQUEST)
# descriptor indices as NIXL takes them: int32 arrays or lists of ints (wider integer
# arrays are range-checked and cast)
DescIds = npt.NDArray[np.int32]
PostIds = DescIds | IdArray | list[int]


# wall time transfers in flight are progressed before they are cancelled: UCX cannot cancel
# the copies it queued for a READ, nor a connection's wire-up, only run them, and destroying
# an agent that still holds them aborts the process (an `arbiter.c` assertion)
CANCEL_GRACE = 0.05
GRACE_POLL_S = 0.0005  # pause between polls of the grace

_U64, _U32 = np.dtype(np.uint64), np.dtype(np.uint32)
_MAX = np.maximum.reduce  # the ufunc itself: ndarray.max() adds a Python layer


def ids_out_of_range(ids: npt.NDArray[np.signedinteger], n: int) -> bool:
    """Any of the (int32 or int64) `ids` outside [0, n), in one pass over them: viewed as
    unsigned, negative ids are huge. (One NumPy call, because each is costly on the read
    path right after a copy, when NumPy's code is out of the CPU caches.)"""
    return len(ids) > 0 and int(_MAX(ids.view(_U64 if ids.itemsize == 8 else _U32))) >= n


def out_of_range_ids(ids: npt.NDArray[np.signedinteger], n: int) -> npt.NDArray[np.signedinteger]:
    """The `ids` outside [0, n), in order (empty when none: one pass for in-range ids)."""
    if not ids_out_of_range(ids, n):
        return ids[:0]
    return ids[(ids < 0) | (ids >= n)]


class MemType(str, enum.Enum):
    """Where registered memory lives (NIXL's segment types we use)."""

    DRAM = "DRAM"
    VRAM = "VRAM"


class XferState(enum.Enum):
    """State of a posted transfer, NIXL's "DONE"/"PROC"/"ERR" as a type."""

    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"


@dataclass(frozen=True)
class BackendConfig:
    """How to build a transfer agent (from `kv_connector_extra_config` and defaults)."""

    name: str
    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = 0
    # UCX with num_threads > 0: descriptors per piece of a transfer NIXL's thread pool hands
    # one thread (UCX init param `split_batch_size`; NIXL's default 1024 leaves transfers of
    # up to 1024 descriptors on one thread). 1: every transfer of 2+ descriptors is spread
    # over the threads. None: NIXL's default.
    split_batch_size: int | None = 1
    # NIXL's own progress thread busy-spins a core; kvrdma polls instead (see NIXL-NOTES).
    progress_thread: bool = False
    capture_telemetry: bool = True


@dataclass(frozen=True)
class XferTelemetry:
    """What the backend measured for one transfer."""

    post_seconds: float
    xfer_seconds: float
    bytes: int
    descriptors: int


@dataclass(frozen=True)
class XferResult:
    """Final outcome of one posted transfer as seen by `TransferBackend.poll`."""

    state: XferState
    error: str | None = None
    telemetry: XferTelemetry | None = field(default=None)
    # ERR because the remote agent went away (disconnected): the peer must be handshaken
    # again before it is read from
    peer_lost: bool = False
    # ERR because this side gave the transfer up (its agent was retired, or the peer
    # removed), which says nothing about the peer
    abandoned: bool = False
    # PROC, but not handed to NIXL yet (it waits for its peer's connection warm-up): nothing
    # of it can land, so releasing it ends it
    unposted: bool = False


@runtime_checkable
class RegisteredMemory(Protocol):
    """Handle for registered memory; `release()` deregisters and is idempotent."""

    def release(self) -> None: ...


@runtime_checkable
class DescList(Protocol):
    """A prepared descriptor list (local or for one remote agent); `release()` is idempotent."""

    @property
    def size(self) -> int: ...

    def release(self) -> None: ...


@runtime_checkable
class Xfer(Protocol):
    """One posted transfer; `release()` cancels it if still running and is idempotent."""

    def release(self) -> None: ...


class TransferBackend(Protocol):
    """One transfer agent. Implementations raise `TransferError`/`RegistrationError`/
    `HandshakeError` instead of returning None or "ERR" strings."""

    @property
    def agent_name(self) -> str: ...

    def metadata(self) -> bytes:
        """Agent metadata a peer passes to `add_remote`."""
        ...

    def register(self, regions: DescArray, mem_type: MemType) -> RegisteredMemory:
        """Register (addr, len, dev) regions."""
        ...

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name. Raises HandshakeError on bad bytes,
        PeerUnreachable when the peer's agent cannot be connected to."""
        ...

    def remove_remote(self, agent_name: str) -> None:
        """Forget a peer (idempotent); every list prepared for it must be rebuilt."""
        ...

    def remotes(self) -> list[str]:
        """Names of the peers currently loaded."""
        ...

    def prep_local(self, descs: DescArray, mem_type: MemType, scratch: bool = False) -> DescList:
        """Prepare local descriptors (inside registered memory) for later selection by index.
        `scratch`: memory nothing else uses, so a READ into it may land late harmlessly (it
        skips the wait for the peer's connection warm-up)."""
        ...

    def prep_remote(self, agent_name: str, descs: DescArray, mem_type: MemType) -> DescList:
        """Prepare a peer's descriptors (inside the peer's registered memory)."""
        ...

    def post(
        self,
        op: str,
        local: DescList,
        local_ids: PostIds,
        remote: DescList,
        remote_ids: PostIds,
        notif: bytes,
    ) -> Xfer:
        """Build and post a READ or WRITE by descriptor indices (int32 arrays and lists of
        ints as they are; wider integer arrays are range-checked first), with a
        notification."""
        ...

    def poll(self, xfer: Xfer) -> XferResult:
        """Current state; ERR (with the reason) instead of raising for transfer failures."""
        ...

    def send_notif(self, agent_name: str, message: bytes) -> None:
        """Send a notification to a peer without a transfer."""
        ...

    def get_notifs(self) -> dict[str, list[bytes]]:
        """New notifications by sender agent name. Also drives progress on the target side."""
        ...

    def retire(self, reason: str) -> list[str]:
        """Guarantee no transfer in flight writes local memory any more (they end ERR with
        `reason`), then carry on with a fresh agent; handles stay valid, `agent_name` and
        `metadata()` change. For a read abandoned at its deadline: releasing it is not enough.
        Returns the peers the fresh agent has not loaded (it could not reach them): they are
        dropped as by `remove_remote`, to be added again."""
        ...

    def close(self) -> None:
        """Release every handle and the agent (idempotent)."""
        ...


def running_after_grace(
    poll: Callable[[Xfer], XferResult], xfers: Iterable[Xfer], grace: float = CANCEL_GRACE
) -> list[Xfer]:
    """Poll `xfers` (which progresses their agent) until each has ended or `grace` seconds of
    wall time passed (a fake clock would not bound the wait); those still running."""
    running, end = list(xfers), time.monotonic() + grace
    while running:
        running = [x for x in running if poll(x).state is XferState.PROC]
        left = end - time.monotonic()
        if not running or left <= 0:
            break
        # the copies run on UCX's threads or in each poll: a short sleep between polls
        # keeps the wait off the caller's CPU (a step that retires must stay cheap)
        time.sleep(min(GRACE_POLL_S, left))
    return running
