"""`NixlBackend`: one NIXL agent behind the `TransferBackend` protocol (registration,
descriptor lists, posting and polling transfers, notifications, lifetime).

What callers must know (NIXL 1.5 with UCX; see NIXL-NOTES.md):

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
- Warm-up. The first transfers to a peer (and after a `retire`) wait as PROC (`unposted`) until
  every UCX worker has read from that peer into scratch (`kvrdma.nixl.warm`); `poll` then
  posts them, or fails them if the warm-up failed.
- Descriptors are (N, 3) `uint64` arrays (addr, len, dev). `prep_*` also takes the strided
  (N, 5) form (addr, len, dev, stride, count): `count` blocks of `len` bytes every `stride`
  bytes, indexed block by block in row order (`size` is the sum of counts). `prep_remote`
  with this agent's own name prepares a loopback list (copies within this process).
- Handles (`RegisteredMemory`, `DescList`, `Xfer`) have an idempotent `release()`; one dropped
  unreleased is logged as a leak and released (so keep a `RegisteredMemory` for as long as
  peers may read it). `close()` releases all that remain (copy threads swept first).
  A finished transfer's NIXL handle is freed as soon as `poll` sees DONE or ERR.
- Threads: the agent uses NIXL's default sync mode (none), or `NIXL_THREAD_SYNC_RW` with copy
  threads (`kvrdma.nixl.create`); either way, use one backend from one thread at a time.
  Once it has posted a transfer, a background thread builds the agent `retire` will swap in
  (`kvrdma.nixl.standby`); that thread touches only the agent it builds.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from kvrdma.errors import ConfigError, HandshakeError, RegistrationError, TransferError
from kvrdma.nixl.checks import (
    DIGEST,
    MD_MAGIC,
    as_desc_array,
    as_ids,
    describe,
    failure_reason,
    is_peer_lost,
    load_error,
    peek_agent_name,
    refused_ids,
    unwrap_metadata,
    wrap_metadata,
)
from kvrdma.nixl.create import copy_threads, new_agent
from kvrdma.nixl.handles import (
    LOCAL_AGENT,
    Handle,
    NixlDescList,
    NixlXfer,
    Registration,
    release_nixl,
)
from kvrdma.nixl.merging import plan_post
from kvrdma.nixl.protocol import (
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
from kvrdma.nixl.retire import Retiring
from kvrdma.nixl.standby import build
from kvrdma.nixl.warm import Warmup

logger = logging.getLogger(__name__)
_H = TypeVar("_H", bound=Handle)

_OPS = ("READ", "WRITE")
_RUNNING = XferResult(XferState.PROC)  # what poll returns for a transfer still running
_WAITING = XferResult(XferState.PROC, unposted=True)  # ... one waiting for a warm-up
_DONE = XferResult(XferState.DONE)  # ... and one done (no telemetry)


class NixlBackend(Retiring):
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
        built = build(lambda: new_agent(config, config.name), copy_threads(config))
        self._agent = built.agent
        self._threads = built.threads
        self._standby = None
        # skip_desc_merge where merging would idle copy threads (`kvrdma.nixl.merging`);
        # False once NIXL turned the keyword down (an older nixl)
        self._can_unmerge = True
        self._config = config
        self._name = config.name
        self._generation = 0
        self._remotes: dict[str, bytes] = {}  # agent name -> checksum of its metadata
        self._remote_md: dict[str, bytes] = {}  # agent name -> NIXL payload (for retire)
        self._live = weakref.WeakSet()
        self._parked = []
        self._warm = Warmup(self, copy_threads(config), config.split_batch_size)
        self._posted = 0  # transfers posted (a warm-up round checks none ran beside it)

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
            raise load_error(exc, name, len(payload)) from exc
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self._remotes[loaded_name] = digest
        self._remote_md[loaded_name] = payload
        self._standby_load(loaded_name, payload)
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

    def _forget_remote(self, agent_name: str, reason: str, settle: bool = True) -> None:
        """Drop a peer: transfers end ERR, lists go stale, parked agents stop waiting (`settle`)."""
        self._remotes.pop(agent_name, None)
        self._remote_md.pop(agent_name, None)
        self._warm.forget(agent_name)
        if settle:
            self._peer_settled(agent_name)
        for h in list(self._live):
            if isinstance(h, NixlXfer) and h.agent_name == agent_name:
                why = f"{h.op} with agent {agent_name!r}: agent removed"  # by this side
                h._finish(XferResult(XferState.ERR, why, abandoned=True))
            elif isinstance(h, NixlDescList) and h.agent_name == agent_name:
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
        return self._track(Registration(self, reg, arr, mem))

    def prep_local(self, descs: DescArray, mem_type: MemType, scratch: bool = False) -> DescList:
        dl = self._prep(None, descs, MemType(mem_type))
        dl.scratch = scratch
        return dl

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

    def _prep(self, peer: str | None, descs: DescArray, mem: MemType) -> NixlDescList:
        agent = self._open()
        whose = "local memory" if peer is None else f"agent {peer!r}"
        arr = as_desc_array(descs, f"descriptors for {whose}", (3, 5))
        size = int(arr[:, 4].sum()) if arr.shape[1] == 5 else arr.shape[0]
        try:
            h = agent.prep_xfer_dlist(peer or LOCAL_AGENT, arr, mem.value)
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
        return self._track(NixlDescList(self, h, size, peer, arr, mem))

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
        self._open()
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
        cold = not lo.scratch and not self._warm.ready(peer)
        if peer != self._name and (cold or self._warm.holding()):
            # no data READ on a connection not wired up yet, nothing beside a warm-up round
            # (kvrdma.nixl.warm): poll posts it once the peer is warm and the round ended
            wrong = _wrong_ids(lids, lo, rids, ro)  # what NIXL would refuse at posting
            if wrong is not None:
                raise TransferError(wrong)
            if cold:
                self._warm.start(peer, ro)
            x = self._track(NixlXfer(self, None, op, peer))
            x.held = (lo, lids, ro, rids, bytes(notif))
            return x
        return self._post_now(op, lo, lids, ro, rids, bytes(notif))

    def _post_now(
        self, op: str, lo: NixlDescList, lids: Any, ro: NixlDescList, rids: Any, notif: bytes
    ) -> NixlXfer:
        """Post a checked transfer on the current agent."""
        agent, peer = self._open(), ro.agent_name or ""
        self._posted += 1
        try:
            min_len, threads = min(lo.min_len, ro.min_len), self._config.num_threads
            plan = plan_post(min_len, lids, rids, threads, can_unmerge=self._can_unmerge)
            lids, rids = plan.lids, plan.rids
            if plan.unmerged:
                h = self._make_unmerged(op, lo._h, lids, ro._h, rids, notif)
            else:
                h = agent.make_prepped_xfer(op, lo._h, lids, ro._h, rids, notif)
        except Exception as exc:
            if is_peer_lost(exc):
                x = self._track(NixlXfer(self, None, op, peer))
                x._finish(_failed(exc, op, peer))
                return x
            wrong = _wrong_ids(lids, lo, rids, ro)
            if wrong is not None:
                raise TransferError(wrong) from exc
            raise TransferError(
                f"post {op} of {len(lids)} descriptors with agent {peer!r}: NIXL refused "
                f"the request: {describe(exc)}"
            ) from exc
        try:
            state = agent.transfer(h)  # the bytes move from here: the wrapper comes after
        except Exception as exc:  # the peer or the transport failed: an outcome, not a raise
            x = self._track(NixlXfer(self, h, op, peer))
            x._finish(_failed(exc, op, peer))
            return x
        except BaseException:  # interrupted: nobody will ever poll it, so cancel it
            release_nixl(h, f"an interrupted {op} with agent {peer!r}")
            raise
        x = self._track(NixlXfer(self, h, op, peer))
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
            self._can_unmerge = False
            return self._agent.make_prepped_xfer(op, lo, lids, ro, rids, notif)

    def poll(self, xfer: Xfer) -> XferResult:
        if not isinstance(xfer, NixlXfer) or xfer._owner is not self:
            raise TransferError(f"poll: {xfer!r} was not posted by agent {self.agent_name!r}")
        if xfer.result is not None:
            return xfer.result
        if xfer.held is not None and not self._post_held(xfer):
            return xfer.result or _WAITING
        h, check = xfer._h, self._check
        if h is None or check is None:
            return xfer._finish(XferResult(XferState.ERR, f"{xfer.op} cancelled"))
        try:
            state = check(h)
        except Exception as exc:
            return xfer._finish(_failed(exc, xfer.op, xfer.agent_name))
        if state == "PROC":
            return _RUNNING
        if state == "DONE":
            result = xfer._finish(self._done(h))
            if self._parked:
                self._peer_settled(xfer.agent_name)
            return result
        return xfer._finish(
            XferResult(XferState.ERR, f"{xfer.op} with agent {xfer.agent_name!r}: NIXL state ERR")
        )

    def _post_held(self, xfer: NixlXfer) -> bool:
        """Advance the warm-up `xfer` waits for and post it once its peer is warm and no round
        holds posts back; False while it still waits (or ended: see its result)."""
        assert xfer.held is not None
        lo, lids, ro, rids, notif = xfer.held
        if not lo.scratch:
            failed = self._warm.advance(xfer.agent_name, ro)
            if failed is not None:
                why, lost = f"{xfer.op}: {failed.error}", failed.peer_lost
                xfer._finish(XferResult(XferState.ERR, why, peer_lost=lost))
                return False
            if not self._warm.ready(xfer.agent_name):
                return False
        if self._warm.holding():
            return False
        xfer.held = None
        try:
            posted = self._post_now(xfer.op, lo, lids, ro, rids, notif)
        except TransferError as exc:
            xfer._finish(XferResult(XferState.ERR, str(exc)))
            return False
        # the posted transfer's NIXL handle (or outcome) moves into the caller's handle
        xfer._h, posted._h = posted._h, None
        if posted.result is not None:
            xfer._finish(posted.result)
        posted.release()
        return xfer.result is None

    def _done(self, h: Any) -> XferResult:
        """The result of a transfer done, with NIXL's telemetry of it where captured."""
        if not self._config.capture_telemetry:
            return _DONE
        try:
            t = self._agent.get_xfer_telemetry(h)
            seconds = t.postDuration / 1e6, t.xferDuration / 1e6
            telemetry = XferTelemetry(*seconds, int(t.totalBytes), int(t.descCount))
        except Exception as exc:
            logger.debug("no telemetry for a transfer: %s", describe(exc))
            return _DONE
        return XferResult(XferState.DONE, telemetry=telemetry)

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

    # ---- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        if self._agent is None:
            return
        self._destroy_retired()
        for x in [h for h in self._live if isinstance(h, NixlXfer)]:
            x.release()  # cancelled before the sweep: a cancelled one leaves pieces queued too
        if self._cut_short:  # a transfer ended early may leave pieces queued on copy threads
            self._warm.sweep()
        for h in sorted(self._live, key=lambda h: h.order):
            h.release()  # then lists, then memory
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

    def _usable(self, dl: DescList, side: str) -> NixlDescList:
        if not isinstance(dl, NixlDescList) or dl._owner is not self:
            raise TransferError(f"post: {side} list {dl!r} was not prepared by {self.agent_name!r}")
        if dl.stale is not None:
            raise TransferError(f"post: {side} list {dl!r} is stale: {dl.stale}")
        if dl._h is None:
            raise TransferError(f"post: {side} list {dl!r} was released")
        return dl


def _wrong_ids(lids: Any, lo: NixlDescList, rids: Any, ro: NixlDescList) -> str | None:
    """What is wrong with a transfer's ids, if anything."""
    return refused_ids(lids, "local_ids", lo.size, "local memory") or refused_ids(
        rids, "remote_ids", ro.size, f"agent {ro.agent_name!r}"
    )


def _failed(exc: BaseException, op: str, peer: str) -> XferResult:
    """The ERR result of a transfer NIXL failed with `exc`."""
    return XferResult(XferState.ERR, failure_reason(exc, op, peer), peer_lost=is_peer_lost(exc))
