"""A consumer's first contact with a remote engine: handshake, then `add_remote`.

`Connector` owns the worker's `HandshakeClient` (built from the config's `handshake_timeout`,
`handshake_retries` and `enforce_handshake_compat`), asks only the remote ranks this rank
reads from, and re-fetches an engine whose NIXL agent was lost, or refuses connections
(`PeerUnreachable`: its process exited before the restart published), or whose ranks are no
longer published (`HandshakeRefused`), until it publishes a new one or the deadline passes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from kvrdma.config import KVTransferConfig
from kvrdma.consumer import ConsumerSide
from kvrdma.descriptors import ReadPlan
from kvrdma.errors import (
    ConfigError,
    HandshakeError,
    HandshakeRefused,
    HandshakeTimeout,
    KvrdmaError,
    PeerUnreachable,
)
from kvrdma.handshake.auth import CurveKeys
from kvrdma.handshake.client import HandshakeClient
from kvrdma.handshake.wire import RETRYABLE_CODES
from kvrdma.metadata import WorkerMetadata, dp_index_of, other_dp_rank
from kvrdma.topology import TransferTopology
from kvrdma.transfer import Clock
from kvrdma.types import HandshakeOutcome

logger = logging.getLogger(__name__)

# how often a lost engine is asked again while it has not published its new agent
_REPUBLISH_POLL_SECONDS = 0.05


class Connector:
    """Connects one consumer rank to remote engines (see `Worker.connect`)."""

    def __init__(
        self,
        config: KVTransferConfig,
        consumer: ConsumerSide,
        topology: TransferTopology,
        *,
        identity: str,
        compat_hash: str,
        tp_size: int,
        metrics: Any,
        clock: Clock,
    ) -> None:
        self.config = config
        self.consumer = consumer
        self.topology = topology
        self.metrics = metrics
        self.clock = clock
        self.client = HandshakeClient(
            timeout=config.extra.handshake_timeout,
            retries=config.extra.handshake_retries,
            identity=identity,
            compat_hash=compat_hash,
            tp_size=tp_size,
            block_size=topology.block_size,
            enforce_compat=config.extra.enforce_handshake_compat,
            clock=clock,
            curve=CurveKeys.from_env(),
        )
        self._remote_tp: dict[tuple[str, int], int] = {}  # learnt from replies

    def connect(
        self,
        engine_id: str,
        host: str,
        port: int,
        *,
        remote_tp_size: int | None = None,
        dp_index: int = 0,
        refresh: bool = False,
        timeout: float | None = None,
    ) -> ReadPlan:
        known = self.consumer.remotes.get(engine_id)
        known_dp = None if known is None else dp_index_of(known.metas)
        stale = self.consumer.suspect | self.consumer.dropped
        if known is not None and not refresh and engine_id not in stale and known_dp == dp_index:
            return known.plan
        seconds = self.config.extra.handshake_timeout if timeout is None else timeout
        if not seconds > 0:
            raise ConfigError(f"timeout: expected a positive number of seconds, got {seconds!r}")
        t0 = time.perf_counter()
        try:
            if known_dp is not None and known_dp != dp_index:  # refused before a handshake
                raise other_dp_rank(engine_id, known_dp, dp_index)
            plan = self._connect(engine_id, host, port, remote_tp_size, dp_index, seconds)
        except KvrdmaError as exc:
            self._observe(engine_id, outcome_of(exc), time.perf_counter() - t0)
            raise
        self._observe(engine_id, HandshakeOutcome.SUCCESS, time.perf_counter() - t0)
        return plan

    def _connect(
        self,
        engine_id: str,
        host: str,
        port: int,
        remote_tp_size: int | None,
        dp_index: int,
        seconds: float,
    ) -> ReadPlan:
        start = self.clock()
        deadline = start + seconds
        what = f"connecting to engine {engine_id!r} at {host}:{port}"
        remote_tp = remote_tp_size or self._remote_tp.get((engine_id, dp_index))
        if remote_tp is None:  # every engine has a rank 0: its reply says the TP size
            probe = self._fetch(host, port, engine_id, [0], dp_index, deadline, what)
            remote_tp = probe[0].tp_size
        lost = self.consumer.remotes.get(engine_id) if engine_id in self.consumer.suspect else None
        # a lost engine, or one with a dropped rank, may be unpublished until it restarts
        restarting = engine_id in self.consumer.suspect | self.consumer.dropped
        waited: PeerUnreachable | HandshakeRefused | None = None  # the last reason to wait
        refused: tuple[str, str] = ("", "")  # the unreachable agent's (name, metadata checksum)
        while True:
            ranks = self.topology.handshake_target_ranks(remote_tp)
            try:
                metas = self._fetch(host, port, engine_id, ranks, dp_index, deadline, what)
            except HandshakeTimeout:
                if waited is None:
                    raise
                raise _gave_up(waited, what, seconds, self.clock() - start) from None
            except HandshakeRefused as exc:
                # its sidecar dropped the ranks of the lost process (unpublished at a clean
                # shutdown, or past their ttl): the restarted one publishes again soon
                if exc.code not in RETRYABLE_CODES or not (restarting or waited is not None):
                    raise
                waited = exc
                metas = {}
            if metas:
                actual = next(iter(metas.values())).tp_size
                if actual != remote_tp:  # a stale or wrong guess: ask the ranks it really needs
                    logger.info("%s: remote tp_size is %d, not %d", what, actual, remote_tp)
                    remote_tp = actual
                    continue
                self._remote_tp[(engine_id, dp_index)] = remote_tp
                stale = lost is not None and _same_agents(lost.metas, metas)
                # by checksum too: a restarted process may publish its new agent under its name
                dead = refused in _identities(metas)
                if not stale and not dead:
                    try:
                        plan = self.consumer.add_remote(metas)
                        break
                    except PeerUnreachable as exc:
                        if exc.agent is None:
                            raise
                        waited = exc
                        sums = dict(_identities(metas))
                        refused = (exc.agent, sums.get(exc.agent, ""))
            # the agent published is lost (NIXL never talks to a disconnected agent again),
            # refuses connections or is gone: a restarted engine publishes its new one soon
            left = deadline - self.clock()
            if left <= 0:
                if waited is not None:
                    raise _gave_up(waited, what, seconds, self.clock() - start)
                raise HandshakeTimeout(
                    f"{what}: its NIXL agent was lost and it still publishes the same agent "
                    f"({_agents(metas)}) after {seconds:g} s; waiting for the restarted engine"
                )
            time.sleep(min(_REPUBLISH_POLL_SECONDS, left))
        offset = self.client.clock_offsets.get(engine_id)
        if offset is not None:  # lease expiries of its requests are in its producers' clock
            self.consumer.clock_offsets[engine_id] = offset
        return plan

    def _fetch(
        self,
        host: str,
        port: int,
        engine_id: str,
        ranks: list[int],
        dp_index: int,
        deadline: float,
        what: str,
    ) -> dict[int, WorkerMetadata]:
        left = deadline - self.clock()
        if left <= 0:
            raise HandshakeTimeout(f"{what}: no time left for the handshake of rank(s) {ranks}")
        return self.client.fetch(
            host, port, engine_id, ranks, dp_index=dp_index, use_cache=False, timeout=left
        )

    def _observe(self, engine_id: str, outcome: HandshakeOutcome, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.handshake(remote_engine=engine_id, outcome=outcome, seconds=seconds)

    def close(self) -> None:
        self.client.close()


def outcome_of(exc: BaseException) -> HandshakeOutcome:
    """The metrics label of a failed connect: a handshake error's own, `incompatible` for a
    mapping that can never work (a `ConfigError`), else `error`."""
    if isinstance(exc, HandshakeError):
        return exc.outcome
    if isinstance(exc, ConfigError):
        return HandshakeOutcome.INCOMPATIBLE
    return HandshakeOutcome.ERROR


def _same_agents(old: Mapping[int, WorkerMetadata], new: Mapping[int, WorkerMetadata]) -> bool:
    return all(
        r in old
        and old[r].agent_name == m.agent_name
        and old[r].agent_metadata_sha256 == m.agent_metadata_sha256
        for r, m in new.items()
    )


def _gave_up(
    exc: PeerUnreachable | HandshakeRefused, what: str, seconds: float, took: float
) -> HandshakeError:
    """The error of a connect whose deadline passed while it waited for a restarted engine."""
    if isinstance(exc, PeerUnreachable):
        return PeerUnreachable(f"{what}: {exc}; still published after {seconds:g} s", exc.agent)
    return HandshakeRefused(f"{what}: still not published after {took:.3g} s: {exc}", exc.code)


def _identities(metas: Mapping[int, WorkerMetadata]) -> set[tuple[str, str]]:
    """(agent name, metadata checksum) of each rank: what tells a restarted agent apart."""
    return {(m.agent_name, m.agent_metadata_sha256) for m in metas.values()}


def _agents(metas: Mapping[int, WorkerMetadata]) -> str:
    return ", ".join(f"rank {r}: {m.agent_name}" for r, m in sorted(metas.items()))
