"""Retiring a NIXL agent: the `retire` half of `NixlBackend`, as a base class it inherits.

A retired agent is parked (never called again) until its peers can no longer write through
it, and a fresh agent built ahead in the background (the standby) takes over its handles.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from kvrdma.errors import TransferError
from kvrdma.nixl.checks import describe
from kvrdma.nixl.create import copy_threads, destroy_agent, new_agent
from kvrdma.nixl.handles import (
    LOCAL_AGENT,
    Handle,
    NixlDescList,
    NixlXfer,
    Registration,
    release_nixl,
)
from kvrdma.nixl.protocol import BackendConfig, XferResult, XferState, running_after_grace
from kvrdma.nixl.standby import Built, Standby, build, threads_quiet
from kvrdma.nixl.status import state_check
from kvrdma.nixl.warm import Warmup

logger = logging.getLogger(__name__)


MAX_PARKED = 4  # retired agents kept at most (see NixlBackend.retire)
# scratch memory of closed backends whose peers may still write it (a warm-up READ served
# late): never unmapped, so such a write cannot land in memory reused for something else
_KEPT_SCRATCH: list[Any] = []
STANDBY_WAIT_S = 10.0  # longest close() waits for the standby before leaving it to itself
# longest a retirement waits for a standby still being built: loading a peer the network
# cannot reach blocks until TCP gives up, far past any read deadline
STANDBY_GRACE_S = 1.0


class _Parked:
    """A retired NIXL agent, kept (never called) until its peers can no longer write."""

    def __init__(self, agent: Any, name: str, reason: str) -> None:
        self.agent: Any = agent
        self.name = name
        self.reason = reason
        self.at_risk: set[str] = set()  # peers it had transfers in flight with
        self.handles: list[Any] = []  # its NIXL handles: never released through it


class Retiring:
    """`retire()` and what it keeps: the standby agent and the parked ones. `NixlBackend`
    sets the state below and provides `_open` and `_forget_remote`."""

    _name: str
    _config: BackendConfig
    _generation: int
    _threads: frozenset[int]  # the current agent's copy threads (see kvrdma.nixl.standby)
    # the next agent and the peers it loaded, built ahead (see retire)
    _standby: Standby[tuple[Any, dict[str, bytes]]] | None
    _parked: list[_Parked]
    _live: weakref.WeakSet[Handle]
    _remote_md: dict[str, bytes]  # agent name -> NIXL payload
    _warm: Warmup  # which peers data READs may go to (see kvrdma.nixl.warm)

    _current: Any
    _check: Callable[[Any], str] | None  # a transfer's NIXL state (kvrdma.nixl.status)
    _cut_short: bool  # a transfer posted on the current agent ended other than DONE

    @property
    def _agent(self) -> Any:
        """The NIXL agent calls go to; None once closed."""
        return self._current

    @_agent.setter
    def _agent(self, agent: Any) -> None:
        # set together: no state check outlives (or keeps alive) the agent it reads, and a
        # new agent has cut no transfer short
        self._current = agent
        self._check = None if agent is None else state_check(agent)
        self._cut_short = False

    def _open(self) -> Any:
        raise NotImplementedError

    def _forget_remote(self, agent_name: str, reason: str, settle: bool = True) -> None:
        raise NotImplementedError

    def poll(self, xfer: Any) -> XferResult:
        raise NotImplementedError

    def retire(self, reason: str) -> list[str]:
        """Make sure no transfer in flight can still write local memory, without waiting
        for the peers.

        Releasing a running NIXL transfer does not stop its data: over UCX/TCP a READ from a
        stopped peer lands whenever the peer resumes, if anything still progresses the
        agent that posted it. So that agent is *parked*: its transfers, once given
        `CANCEL_GRACE` of progress to end, are released (the UCX copy threads of
        `num_threads` drop their pieces), retire waits until those threads are seen idle
        (`kvrdma.nixl.standby.threads_quiet`), and the agent is never called again; a
        fresh agent named `name.rN`, built ahead in the background, takes over
        transparently: same registrations, peers and prepared lists (every handle
        stays valid). A peer the new agent has not loaded (the standby could not reach it,
        or was still trying) is dropped as if removed, never connected to here: retiring
        waits for no peer. Every transfer in flight ends ERR with `reason`. A parked agent is
        destroyed once each peer it had a transfer with has completed one with the new
        agent (it has answered the old one by then: destroying earlier makes a stopped
        UCX/TCP peer abort when it resumes, its reply to the destroyed agent failing) or
        was removed; at most `MAX_PARKED` are kept (the oldest is destroyed first),
        `close()` destroys the rest. Raises `TransferError` (and keeps the old agent) if
        the new one cannot be built.
        """
        old = self._open()
        # a READ cancelled with copies queued would keep them on the parked agent for good
        running_after_grace(self.poll, self._running_xfers())
        gen, name = self._generation + 1, self._next_name
        built = self._next_agent(name, reason)
        new, loaded = built.agent
        live = list(self._live)
        try:
            regs, lists, unreachable = self._replay(new, name, live, loaded)
        except Exception as exc:
            box = [new]
            del new, built
            destroy_agent(box, [])
            raise TransferError(
                f"agent {self._name!r}: could not build a replacement agent {name!r} "
                f"({reason}): {describe(exc)}"
            ) from exc
        parked = _Parked(old, self._name, reason)
        del old  # the parked record holds the old agent alone: it is freed with it
        abandoned = self._hand_over(parked, live, regs, lists, unreachable, name, reason)
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
        self._warm.reset()  # the new agent's connections are all cold
        self._parked.append(parked)
        for peer, why in unreachable.items():
            logger.warning("agent %r dropped: %s could not load it (%s)", peer, name, why)
            # the parked agent keeps waiting for it: destroying that agent would close its
            # connections to a peer that may only be stopped, which makes UCX abort the peer
            # when it resumes; it answers once loaded again, or the agent is destroyed later
            dropped = f"agent {peer!r} could not be reached by {name!r}: {why}"
            self._forget_remote(peer, dropped, settle=False)
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
        return sorted(unreachable)

    def _running_xfers(self) -> Iterator[NixlXfer]:
        """The transfers handed to NIXL and not ended: they may still run on the copy
        threads (one waiting for its peer's warm-up was not handed over)."""
        for h in list(self._live):
            if isinstance(h, NixlXfer) and h._h is not None and h.result is None:
                yield h

    def _in_flight(self, but: NixlXfer | None) -> bool:
        """A posted transfer other than `but` may still run on the copy threads (polled: one
        that ended counts not, though its owner has not polled it yet)."""
        running = [h for h in self._running_xfers() if h is not but]
        return any(self.poll(h).state is XferState.PROC for h in running)

    def _held_back(self) -> bool:
        """A transfer waits only for a warm-up round's hold to end (its peer is warm): the
        next round must wait until its poll has posted it."""
        return any(
            isinstance(h, NixlXfer)
            and h.held is not None
            and h.result is None
            and (h.held[0].scratch or self._warm.ready(h.agent_name))
            for h in list(self._live)
        )

    def _hand_over(
        self,
        parked: _Parked,
        live: list[Handle],
        regs: list[tuple[Registration, Any]],
        lists: list[tuple[NixlDescList, Any]],
        unreachable: dict[str, str],
        name: str,
        reason: str,
    ) -> list[Any]:
        """Point the handles at the new agent `name`'s registrations and lists, leaving the
        old agent's to `parked`; transfers in flight end ERR with `reason`. Returns their
        NIXL handles, still to be cancelled."""
        abandoned: list[Any] = []
        for h in live:
            if isinstance(h, NixlXfer) and h.held is not None:  # never posted: nothing at risk
                h._finish(
                    XferResult(
                        XferState.ERR,
                        f"{h.op} with agent {h.agent_name!r} "
                        f"abandoned before it was posted: {reason}",
                        abandoned=True,
                    )
                )
            elif isinstance(h, NixlXfer) and h._h is not None:
                parked.at_risk.add(h.agent_name)
                abandoned.append(h._h)
                h._h = None
                h.result = XferResult(
                    XferState.ERR,
                    f"{h.op} with agent {h.agent_name!r} abandoned: {reason}",
                    abandoned=True,
                )
        for hr, reg in regs:
            parked.handles.append(hr._reg)
            hr._reg = reg
        for h in live:  # lists left on the old agent (unreachable peers): never release there
            if isinstance(h, NixlDescList) and h.agent_name in unreachable and h._h is not None:
                parked.handles.append(h._h)
                h._h = None
        for hl, dl in lists:
            parked.handles.append(hl._h)
            hl._h = dl
            if hl.agent_name == self._name:
                hl.agent_name = name
        return abandoned

    def _fence(self, abandoned: list[Any]) -> None:
        """Cancel the retiring agent's transfers and wait until its copy threads, which
        drop a cancelled piece at their next look, are idle: nothing of it runs after."""
        for raw in abandoned:
            release_nixl(raw, f"a transfer abandoned by agent {self._name!r}")
        if not threads_quiet(self._threads):
            logger.error(
                "agent %r: its copy threads still ran after its transfers were cancelled; "
                "late writes are possible",
                self._name,
            )

    def _replay(
        self, new: Any, name: str, live: list[Handle], loaded: dict[str, bytes]
    ) -> tuple[list[tuple[Registration, Any]], list[tuple[NixlDescList, Any]], dict[str, str]]:
        """Register, load and prepare on agent `new` (which has `loaded` peers already)
        what the current one has; returns the new registrations and lists (not yet swapped
        in) and the peers it could not load."""
        regs: list[tuple[Registration, Any]] = []
        lists: list[tuple[NixlDescList, Any]] = []
        unreachable: dict[str, str] = {}
        for h in live:
            if isinstance(h, Registration) and h._reg is not None:
                regs.append((h, new.register_memory(h._arr, h._mem.value)))
        for peer, payload in loaded.items():  # removed or replaced since the standby loaded it
            if self._remote_md.get(peer) != payload:
                with contextlib.suppress(Exception):
                    new.remove_remote_agent(peer)
        for peer, payload in self._remote_md.items():
            if loaded.get(peer) != payload:
                unreachable[peer] = "the replacement agent had not loaded it"
        for h in live:
            if (
                isinstance(h, NixlDescList)
                and h._h is not None
                and h.stale is None
                and h.agent_name not in unreachable
            ):
                target = name if h.agent_name == self._name else h.agent_name
                lists.append((h, new.prep_xfer_dlist(target or LOCAL_AGENT, h._arr, h._mem.value)))
        return regs, lists, unreachable

    def wait_standby(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the standby agent built in the background (e.g. before
        measuring this process's threads); True when none is being built any more."""
        standby, end = self._standby, time.monotonic() + timeout
        while standby is not None and not standby.ready and time.monotonic() < end:
            time.sleep(0.005)
        return standby is None or standby.ready

    @property
    def _next_name(self) -> str:
        """The name the next agent (after the next retirement) takes."""
        return f"{self._config.name}.r{self._generation + 1}"

    def _start_standby(self) -> None:
        """Build the next agent in the background, with the peers known now loaded (UCX
        connects to each: the slow part of a replacement); peers added later are loaded into
        it as they come (`_standby_load`). A peer it could not load is dropped by a
        retirement (see `retire`)."""
        config, name = self._config, self._next_name
        peers = dict(self._remote_md)

        def load(agent: Any) -> tuple[Any, dict[str, bytes]]:
            loaded: dict[str, bytes] = {}
            for peer, payload in peers.items():
                _load_peer(name, (agent, loaded), peer, payload)
            return agent, loaded

        self._standby = Standby(lambda: new_agent(config, name), copy_threads(config), load)

    def _standby_load(self, peer: str, payload: bytes) -> None:
        """Load a peer just added into the standby too, so a retirement keeps it (heartbeats
        and reads to it go on) instead of dropping it."""
        if self._standby is None:
            return
        name = self._next_name
        self._standby.also(lambda built: _load_peer(name, built, peer, payload))

    def _next_agent(self, name: str, reason: str) -> Built[tuple[Any, dict[str, bytes]]]:
        """The standby agent (and the peers it loaded), or one built now if there is none
        or it failed."""
        standby, self._standby = self._standby, None
        if standby is not None and not standby.wait(STANDBY_GRACE_S):
            logger.warning(
                "agent %r: the standby agent is still being built (connecting to a peer?); "
                "building one without peers",
                name,
            )
            standby.abandon(_destroy_standby)
        elif standby is not None:
            try:
                return standby.take(timeout=0)
            except Exception as exc:
                logger.warning("agent %r: no standby agent (%s); building one", name, exc)
        config = self._config
        try:
            return build(lambda: (new_agent(config, name), {}), copy_threads(config))
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
        destroy_agent(box, p.handles)
        p.handles.clear()

    def _destroy_retired(self) -> None:
        """Destroy the standby agent and every parked one (at `close()`)."""
        standby, self._standby = self._standby, None
        if standby is not None:  # destroyed once built: a peer it is connecting to may hang
            standby.wait(STANDBY_WAIT_S)
            standby.abandon(_destroy_standby)
        if any(p.at_risk for p in self._parked):
            _KEPT_SCRATCH.append(self._warm.keep_scratch())
        for p in list(self._parked):
            if p.at_risk:
                logger.warning(
                    "closing: destroying retired agent %r; %s never answered since",
                    p.name,
                    sorted(p.at_risk),
                )
            self._destroy_parked(p)


def _destroy_standby(built: tuple[Any, dict[str, bytes]]) -> None:
    destroy_agent([built[0]], [])


def _load_peer(name: str, built: tuple[Any, dict[str, bytes]], peer: str, payload: bytes) -> None:
    """Load `peer` into standby agent `name`, recording it in the standby's loaded peers."""
    agent, loaded = built
    try:
        if loaded.get(peer, payload) != payload:  # restarted: NIXL refuses a second entry
            del loaded[peer]
            agent.remove_remote_agent(peer)
        agent.add_remote_agent(payload)
        loaded[peer] = payload
    except Exception as exc:  # dropped at the retirement
        logger.debug("standby %r: loading agent %r: %s", name, peer, describe(exc))
