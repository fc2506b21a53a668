"""The handles `NixlBackend` gives out: registered memory, prepared descriptor lists and
posted transfers, each with an idempotent `release()` and a `__del__` that reports a leak.

A handle keeps what `retire` needs to rebuild it on a fresh agent (the regions, the
descriptors) and can have its NIXL handle swapped underneath it, so callers' handles stay
valid across a retirement.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from kvrdma.nixl.checks import describe
from kvrdma.nixl.protocol import MemType, XferResult, XferState

logger = logging.getLogger(__name__)

LOCAL_AGENT = "NIXL_INIT_AGENT"  # the peer name NIXL prepares this agent's own descriptors under


def release_nixl(h: Any, owner: object) -> None:
    """Release (for a running transfer: cancel) a NIXL handle; a failure is only logged
    (NIXL keeps a transfer it could not cancel on its agent's leak list)."""
    if h is not None:
        try:
            h.release()
        except Exception as exc:
            logger.warning("releasing %r failed: %s", owner, describe(exc))


class HandleOwner(Protocol):
    """What a handle needs of the backend that gave it out: the NIXL agent it lives on, and
    whether a transfer handed to that agent ended other than DONE (see `NixlBackend.close`)."""

    _agent: Any
    _cut_short: bool


class Handle:
    """An idempotent `release()` and a `__del__` that reports (and fixes) a leak."""

    order: ClassVar[int] = 0  # close() releases lower orders first

    def __init__(self, owner: HandleOwner) -> None:
        self._owner = owner
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._free()

    def _free(self) -> None:
        raise NotImplementedError

    def _holds_nixl(self) -> bool:
        return not self._released

    def __del__(self) -> None:
        try:
            if self._holds_nixl():
                logger.warning("%r was never released; releasing it now (a leak)", self)
                self.release()
        except Exception:
            pass


class Registration(Handle):
    """Registered memory (`RegisteredMemory`): deregistered on release."""

    order = 2

    def __init__(self, owner: HandleOwner, reg: Any, arr: npt.NDArray[np.uint64], mem: MemType):
        super().__init__(owner)
        self._reg = reg
        self._arr = arr  # kept to register again on a fresh agent (retire)
        self._mem = mem
        self._what = f"{arr.shape[0]} {mem.value} regions"

    def _free(self) -> None:
        reg, self._reg, agent = self._reg, None, self._owner._agent
        if reg is not None and agent is not None:
            try:
                agent.deregister_memory(reg)
            except Exception as exc:
                logger.warning("deregistering %r failed: %s", self, describe(exc))

    def __repr__(self) -> str:
        return f"<RegisteredMemory {self._what}>"


class NixlDescList(Handle):
    """A prepared descriptor list (`DescList`), local or for one peer; stale once that peer
    is removed."""

    order = 1

    def __init__(
        self,
        owner: HandleOwner,
        h: Any,
        size: int,
        peer: str | None,
        arr: npt.NDArray[np.uint64],
        mem: MemType,
    ) -> None:
        super().__init__(owner)
        self._h = h
        self._size = size
        self.agent_name = peer  # None: local list
        self.stale: str | None = None
        self._arr = arr  # kept to prepare again on a fresh agent (retire)
        self._mem = mem
        self.min_len = int(arr[:, 1].min())  # shortest descriptor (bytes)
        self.scratch = False  # local memory a late write may hit (see prep_local)

    @property
    def size(self) -> int:
        return self._size

    def _free(self) -> None:
        h, self._h = self._h, None
        release_nixl(h, self)

    def _make_stale(self, reason: str) -> None:
        self.stale = reason
        self._free()

    def _holds_nixl(self) -> bool:
        return self._h is not None

    def __repr__(self) -> str:
        return f"<DescList {self._size} descriptors of {self.agent_name or 'local memory'}>"


class NixlXfer(Handle):
    """A posted transfer (`Xfer`) and its final result once known; released while running,
    it is cancelled."""

    order = 0

    def __init__(self, owner: HandleOwner, h: Any, op: str, peer: str) -> None:
        super().__init__(owner)
        self._h = h
        self.op = op
        self.agent_name = peer
        self.result: XferResult | None = None
        # what `post` was given, while it waits for the peer's warm-up (kvrdma.nixl.warm)
        self.held: tuple[Any, ...] | None = None

    def _finish(self, result: XferResult) -> XferResult:
        """Record the final outcome and free (or cancel) the NIXL handle."""
        if self.result is None:
            self.result = result
        self.held = None
        h, self._h = self._h, None
        if h is not None and self.result.state is not XferState.DONE:
            self._owner._cut_short = True  # pieces of it may stay queued on copy threads
        release_nixl(h, self)
        return self.result

    def _free(self) -> None:
        if self.result is not None:  # ended: only the NIXL handle is left to free
            h, self._h = self._h, None
            release_nixl(h, self)
        else:
            self._finish(XferResult(XferState.ERR, f"{self.op} cancelled by release()"))

    def _holds_nixl(self) -> bool:
        return self._h is not None

    def __repr__(self) -> str:
        return f"<Xfer {self.op} with {self.agent_name!r}>"
