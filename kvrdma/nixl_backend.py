"""`TransferBackend` over NIXL: the only module that imports nixl (lazily, in `NixlBackend`).

What callers must know (measured on nixl 1.5.1 / UCX, see NIXL-NOTES.md):

- Progress. The agent is built without NIXL's progress thread by default (it busy-spins a core).
  The initiator progresses in `post`/`poll`; the *target* progresses only in `get_notifs`, so
  a worker whose memory is read must keep calling `get_notifs` (every few ms), or connection
  wire-up never completes and readers fail with a disconnect. On a fresh connection a
  `send_notif` goes out only while its *sender* keeps progressing too (`get_notifs`/`poll`).
- Metadata. `metadata()` is NIXL's agent blob inside a checksummed envelope, and `add_remote`
  only accepts that envelope: NIXL loads some corrupted blobs silently, poisons the agent name
  for good on others (even after removal), and segfaults on a few. Fetch `metadata()` after the
  last `register()`: it carries the registered regions.
- Peers. `add_remote` of a known name with the same bytes is a no-op; with other bytes (a
  restarted peer, or new registrations) it removes the old entry first. Removing a peer (or
  replacing it) fails its in-flight transfers with ERR and makes every list prepared for it
  stale: `post` rejects stale lists with `TransferError`, rebuild them with `prep_remote`.
- Outcomes. `post` raises `TransferError` for requests that cannot be valid (bad ids, stale or
  foreign lists, descriptors NIXL refuses); a failure of the peer or the transport found while
  posting or polling is `XferResult(ERR, error)` from `poll`; one caused by a lost peer has
  `peer_lost` set. Over cma (same host) `post` copies synchronously.
- Descriptors are (N, 3) `uint64` arrays (addr, len, dev). `prep_*` also takes the strided
  (N, 5) form (addr, len, dev, stride, count): `count` blocks of `len` bytes every `stride`
  bytes, indexed block by block in row order (`size` is the sum of counts). `prep_remote`
  with this agent's own name prepares a loopback list (copies within this process).
- Handles (`RegisteredMemory`, `DescList`, `Xfer`) have an idempotent `release()`; one dropped
  unreleased is logged as a leak and released (so keep a `RegisteredMemory` for as long as
  peers may read it). `close()` releases all that remain.
  A finished transfer's NIXL handle is freed as soon as `poll` sees DONE or ERR.
- Threads: the agent uses NIXL's default sync mode (none); use one backend from one thread at
  a time. Once it has posted a transfer, a background thread builds the agent `retire` will
  swap in (`kvrdma.standby`); that thread touches only the agent it builds.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from types import TracebackType
from typing import Any, ClassVar, TypeVar

import numpy as np
import numpy.typing as npt

from kvrdma.backend import (
    BackendConfig,
    DescArray,
    DescList,
    MemType,
    PostIds,
    RegisteredMemory,
    Xfer,
    XferResult,
    XferState,
    XferTelemetry,
)
from kvrdma.errors import ConfigError, HandshakeError, RegistrationError, TransferError
from kvrdma.nixl_checks import (
    DIGEST,
    MD_MAGIC,
    as_desc_array,
    as_ids,
    describe,
    failure_reason,
    is_peer_lost,
    peek_agent_name,
    refused_ids,
    unwrap_metadata,
    wrap_metadata,
)
from kvrdma.standby import Built, Standby, build, threads_quiet

logger = logging.getLogger(__name__)
_H = TypeVar("_H", bound="_Handle")

_LOCAL = "NIXL_INIT_AGENT"
_OPS = ("READ", "WRITE")
_RUNNING = XferResult(XferState.PROC)  # what poll returns for a transfer still running
# With 2+ UCX threads, transfers whose descriptors are all at least this long are posted
# with NIXL's descriptor merging off: merged, a contiguous run becomes one descriptor that
# one thread copies alone; unmerged, its pieces spread over the threads. Below this size
# the per-descriptor cost (~3 µs) outweighs the parallel copy.
SKIP_MERGE_MIN_BYTES = 64 * 1024
# The init key NIXL's own Python API uses for `num_threads`, per backend plugin.
_THREAD_KEYS = {
    "UCX": "num_threads",
    "OBJ": "num_threads",
    "LIBFABRIC": "num_threads",
    "GDS_MT": "thread_count",
    "UCCL": "num_cpus",
}


def _release_nixl(h: Any, owner: object) -> None:
    """Release (for a running transfer: cancel) a NIXL handle; a failure is only logged
    (NIXL keeps a transfer it could not cancel on its agent's leak list)."""
    if h is not None:
        try:
            h.release()
        except Exception as exc:
            logger.warning("releasing %r failed: %s", owner, describe(exc))


class _Handle:
    """An idempotent `release()` and a `__del__` that reports (and fixes) a leak."""

    order: ClassVar[int] = 0  # close() releases lower orders first

    def __init__(self, owner: NixlBackend) -> None:
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


class _Registration(_Handle):
    order = 2

    def __init__(self, owner: NixlBackend, reg: Any, arr: npt.NDArray[np.uint64], mem: MemType):
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


class _NixlDescList(_Handle):
    order = 1

    def __init__(
        self,
        owner: NixlBackend,
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

    @property
    def size(self) -> int:
        return self._size

    def _free(self) -> None:
        h, self._h = self._h, None
        _release_nixl(h, self)

    def _make_stale(self, reason: str) -> None:
        self.stale = reason
        self._free()

    def _holds_nixl(self) -> bool:
        return self._h is not None

    def __repr__(self) -> str:
        return f"<DescList {self._size} descriptors of {self.agent_name or 'local memory'}>"


class _NixlXfer(_Handle):
    order = 0

    def __init__(self, owner: NixlBackend, h: Any, op: str, peer: str) -> None:
        super().__init__(owner)
        self._h = h
        self.op = op
        self.agent_name = peer
        self.result: XferResult | None = None

    def _finish(self, result: XferResult) -> XferResult:
        """Record the final outcome and free (or cancel) the NIXL handle."""
        if self.result is None:
            self.result = result
        h, self._h = self._h, None
        _release_nixl(h, self)
        return self.result

    def _free(self) -> None:
        if self.result is not None:  # ended: only the NIXL handle is left to free
            h, self._h = self._h, None
            _release_nixl(h, self)
        else:
            self._finish(XferResult(XferState.ERR, f"{self.op} cancelled by release()"))

    def _holds_nixl(self) -> bool:
        return self._h is not None

    def __repr__(self) -> str:
        return f"<Xfer {self.op} with {self.agent_name!r}>"


class NixlBackend:
    """One NIXL agent behind the `TransferBackend` protocol; a context manager."""

    def __init__(self, config: BackendConfig) -> None:
        if (
            not config.name
            or not config.backends
            or config.num_threads < 0
            or (config.split_batch_size is not None and config.split_batch_size < 1)
        ):
            raise ConfigError(
                f"BackendConfig: expected a non-empty agent name and backends, num_threads >= 0 "
                f"and split_batch_size None or >= 1; got {config!r}"
            )
        built = build(lambda: _new_agent(config, config.name), _copy_threads(config))
        self._agent: Any = built.agent
        self._threads = built.threads  # the agent's copy threads (see kvrdma.standby)
        # the next agent and the peers it loaded, built ahead (see retire)
        self._standby: Standby[tuple[Any, dict[str, bytes]]] | None = None
        # skip_desc_merge for long descriptors (see SKIP_MERGE_MIN_BYTES); False once NIXL
        # turned the keyword down (an older nixl)
        self._skip_merge = config.num_threads > 1
        self._config = config
        self._name = config.name
        self._generation = 0
        self._remotes: dict[str, bytes] = {}  # agent name -> checksum of its metadata
        self._remote_md: dict[str, bytes] = {}  # agent name -> NIXL payload (for retire)
        self._live: weakref.WeakSet[_Handle] = weakref.WeakSet()
        self._parked: list[_Parked] = []

    # ---- identity and peers -------------------------------------------------------------
    @property
    def agent_name(self) -> str:
        """The current NIXL agent's name: the configured name, then `name.rN` after the
        N-th `retire()`."""
        return self._name

    @property
    def closed(self) -> bool:
        return self._agent is None

    def metadata(self) -> bytes:
        return wrap_metadata(bytes(self._open().get_agent_metadata()))

    def add_remote(self, metadata: bytes) -> str:
        agent = self._open()
        payload = unwrap_metadata(metadata)
        digest = bytes(metadata[len(MD_MAGIC) : len(MD_MAGIC) + DIGEST])
        name = peek_agent_name(payload)
        if name == self.agent_name:
            raise HandshakeError(f"agent {name!r}: got our own metadata, expected a peer's")
        if name is not None and name in self._remotes:
            if self._remotes[name] == digest:
                return name
            logger.info("agent %r sent new metadata (restart?): removing the old entry", name)
            self.remove_remote(name)
        try:
            loaded = agent.add_remote_agent(payload)
        except Exception as exc:
            if name is not None:  # best effort: do not leave a half-loaded entry behind
                with contextlib.suppress(Exception):
                    agent.remove_remote_agent(name)
            raise HandshakeError(
                f"NIXL rejected the metadata of agent {name or '(unknown name)'!r} "
                f"({len(payload)} bytes): {describe(exc)}"
            ) from exc
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self._remotes[loaded_name] = digest
        self._remote_md[loaded_name] = payload
        return loaded_name

    def remove_remote(self, agent_name: str) -> None:
        if agent_name not in self._remotes:
            return
        self._forget_remote(
            agent_name, f"agent {agent_name!r} was removed or replaced; prepare this list again"
        )
        if self._agent is not None:
            try:
                self._agent.remove_remote_agent(agent_name)
            except Exception as exc:
                logger.debug("removing agent %r: %s", agent_name, describe(exc))

    def _forget_remote(self, agent_name: str, reason: str) -> None:
        """Drop our records of a peer: its transfers end ERR, its lists become stale."""
        self._remotes.pop(agent_name, None)
        self._remote_md.pop(agent_name, None)
        self._peer_settled(agent_name)  # a removed peer cannot answer a parked agent
        for h in list(self._live):
            if isinstance(h, _NixlXfer) and h.agent_name == agent_name:
                h._finish(
                    XferResult(XferState.ERR, f"{h.op} with agent {agent_name!r}: agent removed")
                )
            elif isinstance(h, _NixlDescList) and h.agent_name == agent_name:
                h._make_stale(reason)

    def remotes(self) -> list[str]:
        """Names of the peers currently loaded."""
        return sorted(self._remotes)

    # ---- memory and descriptor lists ----------------------------------------------------
    def register(self, regions: DescArray, mem_type: MemType) -> RegisteredMemory:
        agent = self._open()
        mem = MemType(mem_type)
        try:
            arr = as_desc_array(regions, "register regions", (3,))
        except TransferError as exc:
            raise RegistrationError(str(exc)) from None
        if (arr[:, 1] == 0).any():
            row = int(np.argmin(arr[:, 1]))
            raise RegistrationError(f"register regions: region {row} has length 0")
        try:
            reg = agent.register_memory(arr, mem.value)
        except Exception as exc:
            raise RegistrationError(
                f"agent {self.agent_name!r}: NIXL could not register {arr.shape[0]} "
                f"{mem.value} regions (first at 0x{int(arr[0, 0]):x}, {int(arr[0, 1])} bytes, "
                f"device {int(arr[0, 2])}): {describe(exc)}"
            ) from exc
        return self._track(_Registration(self, reg, arr, mem))

    def prep_local(self, descs: DescArray, mem_type: MemType) -> DescList:
        return self._prep(None, descs, MemType(mem_type))

    def prep_remote(self, agent_name: str, descs: DescArray, mem_type: MemType) -> DescList:
        if agent_name not in self._remotes and agent_name != self.agent_name:
            raise TransferError(
                f"prep_remote: unknown agent {agent_name!r} (loaded: {self.remotes()}); "
                f"add_remote its metadata first"
            )
        dl = self._prep(agent_name, descs, MemType(mem_type))
        if self._standby is None:  # a reader from now on (its peers loaded): get a replacement
            self._start_standby()  # ready before the first READ
        return dl

    def _prep(self, peer: str | None, descs: DescArray, mem: MemType) -> _NixlDescList:
        agent = self._open()
        whose = "local memory" if peer is None else f"agent {peer!r}"
        arr = as_desc_array(descs, f"descriptors for {whose}", (3, 5))
        size = int(arr[:, 4].sum()) if arr.shape[1] == 5 else arr.shape[0]
        try:
            h = agent.prep_xfer_dlist(peer or _LOCAL, arr, mem.value)
        except Exception as exc:
            lo, hi = int(arr[:, 0].min()), int((arr[:, 0] + arr[:, 1]).max())
            hint = (
                "are they inside memory registered by this agent?"
                if peer is None
                else "are they inside memory that agent registered before its metadata()?"
            )
            raise TransferError(
                f"NIXL refused {arr.shape[0]} {mem.value} descriptors for {whose} "
                f"(0x{lo:x}..0x{hi:x}; {hint}): {describe(exc)}"
            ) from exc
        return self._track(_NixlDescList(self, h, size, peer, arr, mem))

    # ---- transfers --------------------------------------------------------------------------
    def post(
        self,
        op: str,
        local: DescList,
        local_ids: PostIds,
        remote: DescList,
        remote_ids: PostIds,
        notif: bytes,
    ) -> Xfer:
        agent = self._open()
        if self._standby is None:  # a reader (of itself, at least): have a replacement ready
            self._start_standby()
        if op not in _OPS:
            raise TransferError(f"post: op must be 'READ' or 'WRITE', got {op!r}")
        lo, ro = self._usable(local, "local"), self._usable(remote, "remote")
        if lo.agent_name is not None or ro.agent_name is None:
            raise TransferError(
                f"post: expected a prep_local list then a prep_remote list, got {lo!r} and {ro!r}"
            )
        peer = ro.agent_name
        lids = as_ids(local_ids, "local_ids", lo.size, "local memory")
        rids = as_ids(remote_ids, "remote_ids", ro.size, f"agent {peer!r}")
        if len(lids) != len(rids):
            raise TransferError(
                f"post {op} with agent {peer!r}: {len(lids)} local ids but {len(rids)} remote ids"
            )
        try:
            if self._skip_merge and min(lo.min_len, ro.min_len) >= SKIP_MERGE_MIN_BYTES:
                h = self._make_unmerged(op, lo._h, lids, ro._h, rids, bytes(notif))
            else:
                h = agent.make_prepped_xfer(op, lo._h, lids, ro._h, rids, bytes(notif))
        except Exception as exc:
            if is_peer_lost(exc):
                x = self._track(_NixlXfer(self, None, op, peer))
                x._finish(_failed(exc, op, peer))
                return x
            for ids, dl, what, whose in (
                (lids, lo, "local_ids", "local memory"),
                (rids, ro, "remote_ids", f"agent {peer!r}"),
            ):
                wrong = refused_ids(ids, what, dl.size, whose)
                if wrong is not None:
                    raise TransferError(wrong) from exc
            raise TransferError(
                f"post {op} of {len(lids)} descriptors with agent {peer!r}: NIXL refused "
                f"the request: {describe(exc)}"
            ) from exc
        try:
            state = agent.transfer(h)  # the bytes move from here: the wrapper comes after
        except Exception as exc:  # the peer or the transport failed: an outcome, not a raise
            x = self._track(_NixlXfer(self, h, op, peer))
            x._finish(_failed(exc, op, peer))
            return x
        except BaseException:  # interrupted: nobody will ever poll it, so cancel it
            _release_nixl(h, f"an interrupted {op} with agent {peer!r}")
            raise
        x = self._track(_NixlXfer(self, h, op, peer))
        if state == "ERR":
            x._finish(XferResult(XferState.ERR, f"{op} with agent {peer!r}: NIXL posted ERR"))
        return x

    def _make_unmerged(self, op: str, lo: Any, lids: Any, ro: Any, rids: Any, notif: bytes) -> Any:
        try:
            return self._agent.make_prepped_xfer(
                op, lo, lids, ro, rids, notif, skip_desc_merge=True
            )
        except TypeError as exc:  # a nixl without the keyword: merge as before
            if "skip_desc_merge" not in str(exc):
                raise
            logger.info("agent %r: NIXL has no skip_desc_merge (%s)", self._name, describe(exc))
            self._skip_merge = False
            return self._agent.make_prepped_xfer(op, lo, lids, ro, rids, notif)

    def poll(self, xfer: Xfer) -> XferResult:
        if not isinstance(xfer, _NixlXfer) or xfer._owner is not self:
            raise TransferError(f"poll: {xfer!r} was not posted by agent {self.agent_name!r}")
        if xfer.result is not None:
            return xfer.result
        h, agent = xfer._h, self._agent
        if h is None or agent is None:
            return xfer._finish(XferResult(XferState.ERR, f"{xfer.op} cancelled"))
        try:
            state = agent.check_xfer_state(h)
        except Exception as exc:
            return xfer._finish(_failed(exc, xfer.op, xfer.agent_name))
        if state == "PROC":
            return _RUNNING
        if state == "DONE":
            result = xfer._finish(XferResult(XferState.DONE, telemetry=self._telemetry(h)))
            if self._parked:
                self._peer_settled(xfer.agent_name)
            return result
        return xfer._finish(
            XferResult(XferState.ERR, f"{xfer.op} with agent {xfer.agent_name!r}: NIXL state ERR")
        )

    def _telemetry(self, h: Any) -> XferTelemetry | None:
        if not self._config.capture_telemetry:
            return None
        try:
            t = self._agent.get_xfer_telemetry(h)
            return XferTelemetry(
                post_seconds=t.postDuration / 1e6,
                xfer_seconds=t.xferDuration / 1e6,
                bytes=int(t.totalBytes),
                descriptors=int(t.descCount),
            )
        except Exception as exc:
            logger.debug("no telemetry for a transfer: %s", describe(exc))
            return None

    # ---- notifications ------------------------------------------------------------------
    def send_notif(self, agent_name: str, message: bytes) -> None:
        agent = self._open()
        if agent_name not in self._remotes:
            raise TransferError(
                f"send_notif: unknown agent {agent_name!r} (loaded: {self.remotes()}); a "
                f"target that notifies its reader needs the reader's metadata too"
            )
        try:
            agent.send_notif(agent_name, bytes(message))
        except Exception as exc:
            raise TransferError(
                f"send_notif to {agent_name!r}: {failure_reason(exc, 'notification', agent_name)}"
            ) from exc

    def get_notifs(self) -> dict[str, list[bytes]]:
        agent = self._open()
        try:
            notifs: dict[str, list[bytes]] = agent.get_new_notifs()
        except Exception as exc:
            raise TransferError(f"agent {self.agent_name!r}: get_notifs: {describe(exc)}") from exc
        return notifs

    # ---- retiring the agent -------------------------------------------------------------
    def retire(self, reason: str) -> None:
        """Make sure no transfer in flight can still write local memory, without waiting
        for the peers.

        Releasing a running NIXL transfer does not stop its data: over UCX/TCP a READ from a
        stopped peer lands whenever the peer resumes, if anything still progresses the
        agent that posted it. So that agent is *parked*: its transfers are released (the
        UCX copy threads of `num_threads` drop their pieces), retire waits until those
        threads are seen idle (`kvrdma.standby.threads_quiet`), and the agent is never
        called again; a fresh agent named `name.rN`, built ahead in the background, takes
        over transparently: same registrations, peers and prepared lists (every handle
        stays valid). Every transfer in flight ends ERR with `reason`. A parked agent is
        destroyed once each peer it had a transfer with has completed one with the new
        agent (it has answered the old one by then: destroying earlier makes a stopped
        UCX/TCP peer abort when it resumes, its reply to the destroyed agent failing) or
        was removed; at most `MAX_PARKED` are kept (the oldest is destroyed first),
        `close()` destroys the rest. Raises `TransferError` (and keeps the old agent) if
        the new one cannot be built.
        """
        old = self._open()
        gen = self._generation + 1
        name = f"{self._config.name}.r{gen}"
        built = self._next_agent(name, reason)
        new, loaded = built.agent
        live = list(self._live)
        try:
            regs, lists, unreachable = self._replay(new, name, live, loaded)
        except Exception as exc:
            box = [new]
            del new, built
            _destroy_agent(box, [])
            raise TransferError(
                f"agent {self._name!r}: could not build a replacement agent {name!r} "
                f"({reason}): {describe(exc)}"
            ) from exc
        parked = _Parked(old, self._name, reason)
        del old  # the parked record holds the old agent alone: it is freed with it
        abandoned: list[Any] = []
        for h in live:
            if isinstance(h, _NixlXfer) and h._h is not None:
                parked.at_risk.add(h.agent_name)
                abandoned.append(h._h)
                h._h = None
                h.result = XferResult(
                    XferState.ERR, f"{h.op} with agent {h.agent_name!r} abandoned: {reason}"
                )
        for hr, reg in regs:
            parked.handles.append(hr._reg)
            hr._reg = reg
        for h in live:  # lists left on the old agent (unreachable peers): never release there
            if isinstance(h, _NixlDescList) and h.agent_name in unreachable and h._h is not None:
                parked.handles.append(h._h)
                h._h = None
        for hl, dl in lists:
            parked.handles.append(hl._h)
            hl._h = dl
            if hl.agent_name == self._name:
                hl.agent_name = name
        self._fence(abandoned)
        logger.warning(
            "agent %r retired (%s): %s takes over; %d transfers in flight abandoned",
            self._name,
            reason,
            name,
            len(abandoned),
        )
        self._agent, self._name, self._generation = new, name, gen
        self._threads = built.threads
        self._parked.append(parked)
        for peer, why in unreachable.items():
            logger.warning("agent %r dropped: %s could not load it (%s)", peer, name, why)
            self._forget_remote(peer, f"agent {peer!r} could not be reached by {name!r}: {why}")
        if not parked.at_risk:
            self._destroy_parked(parked)
        while len(self._parked) > MAX_PARKED:
            oldest = self._parked[0]
            logger.warning(
                "more than %d retired agents: destroying %r although %s never answered since",
                MAX_PARKED,
                oldest.name,
                sorted(oldest.at_risk),
            )
            self._destroy_parked(oldest)
        self._start_standby()

    def _fence(self, abandoned: list[Any]) -> None:
        """Cancel the retiring agent's transfers and wait until its copy threads, which
        drop a cancelled piece at their next look, are idle: nothing of it runs after."""
        for raw in abandoned:
            _release_nixl(raw, f"a transfer abandoned by agent {self._name!r}")
        if not threads_quiet(self._threads):
            logger.error(
                "agent %r: its copy threads still ran after its transfers were cancelled; "
                "late writes are possible",
                self._name,
            )

    def _replay(
        self, new: Any, name: str, live: list[_Handle], loaded: dict[str, bytes]
    ) -> tuple[list[tuple[_Registration, Any]], list[tuple[_NixlDescList, Any]], dict[str, str]]:
        """Register, load and prepare on agent `new` (which has `loaded` peers already)
        what the current one has; returns the new registrations and lists (not yet swapped
        in) and the peers it could not load."""
        regs: list[tuple[_Registration, Any]] = []
        lists: list[tuple[_NixlDescList, Any]] = []
        unreachable: dict[str, str] = {}
        for h in live:
            if isinstance(h, _Registration) and h._reg is not None:
                regs.append((h, new.register_memory(h._arr, h._mem.value)))
        for peer, payload in loaded.items():  # removed or replaced since the standby loaded it
            if self._remote_md.get(peer) != payload:
                with contextlib.suppress(Exception):
                    new.remove_remote_agent(peer)
        for peer, payload in self._remote_md.items():
            if loaded.get(peer) == payload:
                continue
            try:
                new.add_remote_agent(payload)
            except Exception as exc:  # e.g. a dead peer: UCX cannot connect to it
                unreachable[peer] = describe(exc)
        for h in live:
            if (
                isinstance(h, _NixlDescList)
                and h._h is not None
                and h.stale is None
                and h.agent_name not in unreachable
            ):
                target = name if h.agent_name == self._name else h.agent_name
                lists.append((h, new.prep_xfer_dlist(target or _LOCAL, h._arr, h._mem.value)))
        return regs, lists, unreachable

    def _start_standby(self) -> None:
        """Build the next agent in the background, with the peers known now loaded (UCX
        connects to each: the slow part of a replacement)."""
        config, name = self._config, f"{self._config.name}.r{self._generation + 1}"
        peers = dict(self._remote_md)

        def make() -> tuple[Any, dict[str, bytes]]:
            agent = _new_agent(config, name)
            loaded: dict[str, bytes] = {}
            for peer, payload in peers.items():
                try:
                    agent.add_remote_agent(payload)
                    loaded[peer] = payload
                except Exception as exc:  # retried at the retirement
                    logger.debug("standby %r: loading agent %r: %s", name, peer, describe(exc))
            return agent, loaded

        self._standby = Standby(make, _copy_threads(config))

    def _next_agent(self, name: str, reason: str) -> Built[tuple[Any, dict[str, bytes]]]:
        """The standby agent (and the peers it loaded), or one built now if there is none
        or it failed."""
        standby, self._standby = self._standby, None
        if standby is not None:
            try:
                return standby.take(timeout=STANDBY_WAIT_S)
            except Exception as exc:
                logger.warning("agent %r: no standby agent (%s); building one", name, exc)
        config = self._config
        try:
            return build(lambda: (_new_agent(config, name), {}), _copy_threads(config))
        except Exception as exc:
            raise TransferError(
                f"agent {self._name!r}: could not build a replacement agent {name!r} "
                f"({reason}): {describe(exc)}"
            ) from exc

    @property
    def parked(self) -> list[str]:
        """Names of retired agents not destroyed yet."""
        return [p.name for p in self._parked]

    def _peer_settled(self, peer: str) -> None:
        for p in list(self._parked):
            p.at_risk.discard(peer)
            if not p.at_risk:
                self._destroy_parked(p)

    def _destroy_parked(self, p: _Parked) -> None:
        if p in self._parked:
            self._parked.remove(p)
        box = [p.agent]
        p.agent = None
        _destroy_agent(box, p.handles)
        p.handles.clear()

    # ---- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        if self._agent is None:
            return
        standby, self._standby = self._standby, None
        if standby is not None:
            try:
                _destroy_agent([standby.take(timeout=STANDBY_WAIT_S).agent[0]], [])
            except Exception as exc:
                logger.warning("agent %r: standby agent: %s", self._name, describe(exc))
        for p in list(self._parked):
            if p.at_risk:
                logger.warning(
                    "closing: destroying retired agent %r; %s never answered since",
                    p.name,
                    sorted(p.at_risk),
                )
            self._destroy_parked(p)
        for h in sorted(self._live, key=lambda h: h.order):
            h.release()  # transfers first (cancelled), then lists, then memory
        for name in list(self._remotes):
            self.remove_remote(name)
        self._agent = None
        self._live.clear()

    def __enter__(self) -> NixlBackend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._agent is None else f"{len(self._remotes)} peers"
        return f"<NixlBackend {self.agent_name!r} {state}>"

    # ---- internals ----------------------------------------------------------------------
    def _open(self) -> Any:
        if self._agent is None:
            raise TransferError(f"agent {self.agent_name!r} is closed")
        return self._agent

    def _track(self, h: _H) -> _H:
        self._live.add(h)
        return h

    def _usable(self, dl: DescList, side: str) -> _NixlDescList:
        if not isinstance(dl, _NixlDescList) or dl._owner is not self:
            raise TransferError(f"post: {side} list {dl!r} was not prepared by {self.agent_name!r}")
        if dl.stale is not None:
            raise TransferError(f"post: {side} list {dl!r} is stale: {dl.stale}")
        if dl._h is None:
            raise TransferError(f"post: {side} list {dl!r} was released")
        return dl


MAX_PARKED = 4  # retired agents kept at most (see NixlBackend.retire)
STANDBY_WAIT_S = 60.0  # longest wait for the standby agent's construction to finish


def _copy_threads(config: BackendConfig) -> int:
    """UCX copy threads an agent built from `config` starts (see `kvrdma.standby`)."""
    return config.num_threads if "UCX" in config.backends else 0


class _Parked:
    """A retired NIXL agent, kept (never called) until its peers can no longer write."""

    def __init__(self, agent: Any, name: str, reason: str) -> None:
        self.agent: Any = agent
        self.name = name
        self.reason = reason
        self.at_risk: set[str] = set()  # peers it had transfers in flight with
        self.handles: list[Any] = []  # its NIXL handles: never released through it


def _new_agent(config: BackendConfig, name: str) -> Any:
    try:
        import nixl
    except ImportError as exc:
        raise TransferError(
            f"cannot create agent {name!r}: the nixl package is not installed or "
            f"failed to load ({exc})"
        ) from exc
    conf = nixl.nixl_agent_config(
        enable_prog_thread=config.progress_thread,
        capture_telemetry=config.capture_telemetry,
        num_threads=config.num_threads,
        backends=[],
    )
    try:
        agent = nixl.nixl_agent(name, conf)
        plugins = list(agent.get_plugin_list())
    except Exception as exc:
        raise TransferError(f"cannot create NIXL agent {name!r}: {exc}") from exc
    for b in config.backends:
        if b not in plugins:
            raise TransferError(
                f"cannot create agent {name!r}: NIXL backend plugin {b!r} not found "
                f"(available: {sorted(plugins)}; NIXL_PLUGIN_DIR may point elsewhere)"
            )
        _create_backend(agent, name, b, config)
    return agent


def _destroy_agent(box: list[Any], handles: list[Any]) -> None:
    """Drop the NIXL agent in `box` (its only holder) without calling it: its handles are
    marked released first (a release could progress the agent's transport and land data),
    then the agent goes."""
    for h in handles:
        if hasattr(h, "_released"):
            with contextlib.suppress(Exception):
                h._released = True
    handles.clear()
    if not box or box[0] is None:  # destroyed already
        return
    alive = weakref.ref(box[0])
    box.clear()
    if alive() is not None:  # in a reference cycle: only a full collection (slow) frees it
        gc.collect()


def _create_backend(agent: Any, name: str, backend: str, config: BackendConfig) -> None:
    """Create one backend plugin, falling back rather than failing where a setting is only
    an optimisation: UCX with threads also gets `split_batch_size` (started without it if
    the plugin turns it down); UCX without a transport that can detect peer failure (e.g.
    `UCX_TLS` without tcp) only starts with error handling off."""
    init: dict[str, str] = {}
    if config.num_threads > 0 and backend in _THREAD_KEYS:
        init[_THREAD_KEYS[backend]] = str(config.num_threads)
    split: dict[str, str] = {}
    if backend == "UCX" and config.num_threads > 0 and config.split_batch_size is not None:
        # read by UCX's thread-pool engine; get_plugin_params("UCX") lists neither this
        # nor num_threads, so there is nothing to check it against before trying
        split = {"split_batch_size": str(config.split_batch_size)}
    attempts: list[tuple[dict[str, str], str | None]] = [({**init, **split}, None)]
    if split:
        attempts.append((init, "without split_batch_size (NIXL's default split)"))
    if backend == "UCX":
        lax = {"ucx_error_handling_mode": "none"}
        note = "ucx_error_handling_mode=none (a dead peer shows as PROC until your deadline)"
        attempts.append(({**init, **split, **lax}, note))
        if split:
            attempts.append(({**init, **lax}, f"{note}, without split_batch_size"))
    errors: list[str] = []
    for params, fallback in attempts:
        try:
            agent.create_backend(backend, params)
        except Exception as exc:
            errors.append(f"{fallback or 'as configured'}: {describe(exc)}")
            continue
        if fallback is not None:
            logger.warning(
                "agent %r: NIXL backend %s failed to start as configured (%s); started %s",
                name,
                backend,
                errors[0],
                fallback,
            )
        return
    hint = (
        "; check UCX_TLS (on a host with NVIDIA GPUs NIXL also wants a CUDA transport in it, "
        "e.g. cuda_copy)"
        if backend == "UCX"
        else ""
    )
    raise TransferError(
        f"agent {name!r}: NIXL backend {backend!r} failed to start ({'; '.join(errors)}){hint}"
    )


def _failed(exc: BaseException, op: str, peer: str) -> XferResult:
    """The ERR result of a transfer NIXL failed with `exc`."""
    return XferResult(XferState.ERR, failure_reason(exc, op, peer), peer_lost=is_peer_lost(exc))
