"""The handshake client: fetch, validate and cache a peer engine's per-rank metadata.

A fetch first probes the side channel (so a vLLM NixlConnector listener is named, not
crashed), then asks for the ranks through a `Requester`: replies that may change soon (a rank
not published yet) are retried with backoff within one deadline, everything else fails at once
with a `HandshakeError` naming host, port, engine and ranks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType

import msgspec
import zmq

from kvrdma.defaults import HANDSHAKE_RETRIES, HANDSHAKE_TIMEOUT_SECONDS
from kvrdma.errors import (
    ConfigError,
    HandshakeError,
    HandshakeIncompatible,
    HandshakeRefused,
    HandshakeTimeout,
)
from kvrdma.handshake.auth import CurveKeys
from kvrdma.handshake.endpoints import tcp_endpoint
from kvrdma.handshake.requester import (
    Clock,
    Requester,
    RetryableReply,
    check_timeout,
)
from kvrdma.handshake.vllm_peer import PROBE_FRAMES, probe_reply_kind
from kvrdma.handshake.wire import (
    MAX_ENGINE_ID_LENGTH,
    MAX_FRAME_BYTES,
    RETRYABLE_CODES,
    ErrorReply,
    MetadataRequest,
    MetadataResponse,
    RankDescriptors,
    client_codec,
    descriptor_spans,
    worker_problems,
)
from kvrdma.lease import ClockOffset
from kvrdma.metadata import WorkerMetadata

__all__ = ["HandshakeClient", "PeerChanged", "RefreshResult", "refusal"]

logger = logging.getLogger(__name__)

# error replies that no retry or other request can turn into an answer
_NEVER_MATCH = frozenset({"compat_mismatch", "bad_version"})


def refusal(reply: ErrorReply, what: str) -> HandshakeRefused | HandshakeIncompatible:
    """The error for a peer's final error reply to handshake `what`: incompatible where no
    retry or other request could be answered (hashes, protocol version), else refused."""
    text = f"{what} rejected: peer answered {reply.code}: {reply.message}"
    if reply.code in _NEVER_MATCH:
        return HandshakeIncompatible(text)
    return HandshakeRefused(text, reply.code)


# Called as on_peer_changed(stale, fresh) when a cached rank now answers with another agent:
# the caller removes the stale NIXL remote agent and adds the fresh one.
PeerChanged = Callable[[WorkerMetadata, WorkerMetadata], None]
_Key = tuple[str, int, int]  # (engine_id, dp_index, tp_rank)


@dataclass(frozen=True)
class RefreshResult:
    """What `HandshakeClient.refresh` found: the fresh metadata and which ranks restarted."""

    workers: dict[int, WorkerMetadata]
    changed_ranks: tuple[int, ...] = ()
    # the cached metadata the changed ranks replaced (remove these NIXL remote agents)
    stale: dict[int, WorkerMetadata] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return bool(self.changed_ranks)


class HandshakeClient:
    """Fetches peer metadata and checks it against this worker's own parameters.

    `compat_hash`, `tp_size` and `block_size` describe the local worker; with
    `enforce_compat=False` the compatibility hash is not compared (TP and block size still
    are). `block_size=0` skips the block-size check. `timeout` bounds one whole fetch, over at
    most `1 + retries` attempts; `backoff` is the first pause after a retryable reply (doubled
    each time, capped at 0.5 s). Safe to share between threads: each attempt has its own socket.
    """

    def __init__(
        self,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        timeout: float = HANDSHAKE_TIMEOUT_SECONDS,
        retries: int = HANDSHAKE_RETRIES,
        identity: str = "",
        compat_hash: str = "",
        tp_size: int = 1,
        block_size: int = 0,
        enforce_compat: bool = True,
        on_peer_changed: PeerChanged | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        backoff: float = 0.1,
        clock: Clock = time.monotonic,
        curve: CurveKeys | None = None,
    ) -> None:
        self._own_context = context is None
        self._ctx = context if context is not None else zmq.Context()
        self._req = Requester(
            self._ctx,
            client_codec(max_frame_bytes),
            timeout=timeout,
            retries=retries,
            backoff=backoff,
            clock=clock,
            curve=curve,
        )
        self.identity = identity
        self.compat_hash = compat_hash
        self.tp_size = tp_size
        self.block_size = block_size
        self.enforce_compat = enforce_compat
        self.on_peer_changed = on_peer_changed
        self._lock = threading.Lock()
        self._cache: dict[_Key, tuple[WorkerMetadata, RankDescriptors]] = {}
        # engine id -> its server's clock offset, from the last reply that told its clock
        self.clock_offsets: dict[str, ClockOffset] = {}
        self._closed = False

    # ------------------------------------------------------------------ public API
    def fetch(
        self,
        host: str,
        port: int,
        engine_id: str,
        ranks: Iterable[int],
        *,
        dp_index: int = 0,
        use_cache: bool = True,
        timeout: float | None = None,
    ) -> dict[int, WorkerMetadata]:
        """Metadata of `ranks` of `engine_id` served at `host:port`, validated.

        Cached ranks are not asked again unless `use_cache=False`; a fetched rank whose
        agent changed since it was cached triggers `on_peer_changed`. A `timeout` that is not a
        number of seconds in (0, 3600] raises `ConfigError` before anything is sent.
        """
        if timeout is not None:
            check_timeout(timeout)
        wanted = _rank_list(ranks)
        if use_cache:
            with self._lock:
                hits = {r: self._cache.get((engine_id, dp_index, r)) for r in wanted}
            missing = [r for r, hit in hits.items() if hit is None]
        else:
            hits, missing = {}, wanted
        if missing:
            fresh = self._fetch(host, port, engine_id, missing, dp_index, timeout)
            self._store(engine_id, dp_index, fresh)
            hits.update({r: fresh[r] for r in missing})
        return {r: hit[0] for r, hit in hits.items() if hit is not None}

    def refresh(
        self,
        host: str,
        port: int,
        engine_id: str,
        ranks: Iterable[int],
        *,
        dp_index: int = 0,
        timeout: float | None = None,
    ) -> RefreshResult:
        """Ask again, bypassing the cache, and report ranks now served by a different agent."""
        if timeout is not None:
            check_timeout(timeout)
        wanted = _rank_list(ranks)
        fresh = self._fetch(host, port, engine_id, wanted, dp_index, timeout)
        stale = self._store(engine_id, dp_index, fresh)
        return RefreshResult(
            workers={r: fresh[r][0] for r in wanted},
            changed_ranks=tuple(sorted(stale)),
            stale=stale,
        )

    def get_cached(self, engine_id: str, rank: int, dp_index: int = 0) -> WorkerMetadata | None:
        with self._lock:
            hit = self._cache.get((engine_id, dp_index, rank))
        return None if hit is None else hit[0]

    def get_descriptors(
        self, engine_id: str, rank: int, dp_index: int = 0
    ) -> RankDescriptors | None:
        """The remote descriptor table of a cached rank (see `wire.RankDescriptors`)."""
        with self._lock:
            hit = self._cache.get((engine_id, dp_index, rank))
        return None if hit is None else hit[1]

    def forget(self, engine_id: str, ranks: Iterable[int] | None = None, dp_index: int = 0) -> None:
        """Drop cached ranks (all ranks of the engine/DP index, and the engine's clock offset,
        when `ranks` is None)."""
        with self._lock:
            if ranks is None:
                for key in [k for k in self._cache if k[:2] == (engine_id, dp_index)]:
                    del self._cache[key]
                self.clock_offsets.pop(engine_id, None)
            else:
                for r in ranks:
                    self._cache.pop((engine_id, dp_index, r), None)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._own_context:
                self._ctx.term()

    def __enter__(self) -> HandshakeClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _fetch(
        self,
        host: str,
        port: int,
        engine_id: str,
        ranks: list[int],
        dp_index: int,
        timeout: float | None,
    ) -> dict[int, tuple[WorkerMetadata, RankDescriptors]]:
        what = f"handshake with {host}:{port} for engine {engine_id!r} rank(s) {ranks}"
        if dp_index:
            what += f" dp_index {dp_index}"
        if self._closed:
            raise HandshakeError(f"{what}: the client is closed")
        if not 0 < len(engine_id) <= MAX_ENGINE_ID_LENGTH:
            raise ConfigError(
                f"engine_id: expected 1 to {MAX_ENGINE_ID_LENGTH} characters, got {len(engine_id)}"
            )
        request = MetadataRequest(
            engine_id=engine_id,
            ranks=ranks,
            dp_index=dp_index,
            requester=self.identity,
            compat_hash=self.compat_hash,
            tp_size=self.tp_size,
            block_size=self.block_size,
        )
        try:
            payload = self._req.codec.encode(request)
        except (msgspec.EncodeError, OverflowError) as exc:
            raise HandshakeError(f"{what}: cannot encode the request: {exc}") from exc

        def accept(
            reply: MetadataResponse | ErrorReply,
        ) -> dict[int, tuple[WorkerMetadata, RankDescriptors]]:
            if isinstance(reply, ErrorReply):
                if reply.code in RETRYABLE_CODES:
                    raise RetryableReply(f"peer answered {reply.code}: {reply.message}", reply.code)
                raise refusal(reply, what)
            if reply.server_time is not None:
                self._learn_offset(engine_id, sent, reply.server_time, what)
            return self._validate(reply, engine_id, ranks, dp_index, what)

        endpoint = tcp_endpoint(host, port)
        total = self._req.timeout if timeout is None else timeout
        deadline = self._req.clock() + total
        self._probe(endpoint, what, total)
        sent = self._req.clock()  # before every attempt: a wider, still valid, offset bound
        remaining = deadline - sent
        if remaining <= 0:
            raise HandshakeTimeout(f"{what}: no reply within {total:g} s (after the probe)")
        return self._req.call(endpoint, payload, accept, what, remaining)

    def _learn_offset(self, engine_id: str, sent: float, server_time: float, what: str) -> None:
        try:
            off = ClockOffset.estimate(sent, self._req.clock(), server_time)
        except ValueError as exc:
            raise HandshakeError(f"{what}: bad server_time in the reply: {exc}") from exc
        with self._lock:
            self.clock_offsets[engine_id] = off

    def _probe(self, endpoint: str, what: str, timeout: float) -> None:
        """Make sure a kvrdma agent listens at `endpoint` before sending it a kvrdma request.

        vLLM's NixlConnector listener would die on a kvrdma request; the probe is a message it
        answers like any other, and its answer tells the two apart.
        """
        parts = self._req.exchange(
            endpoint, PROBE_FRAMES, lambda reply: reply, f"{what} (side-channel probe)", timeout
        )
        kind = probe_reply_kind(parts)
        if kind == "kvrdma":
            return
        if kind == "vllm":
            raise HandshakeIncompatible(
                f"{what}: this looks like a vLLM NixlConnector side channel, not a kvrdma "
                f"agent (it answered vLLM's metadata request); the prefill engine must run "
                f"kvrdma (kv_connector KvrdmaConnector, or the kvrdma agent sidecar)"
            )
        raise HandshakeError(
            f"{what}: expected a kvrdma agent's answer to the side-channel probe, got "
            f"{len(parts)} frame(s) that neither kvrdma nor vLLM sends"
        )

    def _validate(
        self,
        resp: MetadataResponse,
        engine_id: str,
        ranks: list[int],
        dp_index: int,
        what: str,
    ) -> dict[int, tuple[WorkerMetadata, RankDescriptors]]:
        def fail(problem: str) -> HandshakeError:
            return HandshakeError(f"{what}: {problem}")

        if resp.engine_id != engine_id:
            raise fail(f"expected engine {engine_id!r}, the peer answered for {resp.engine_id!r}")
        got = [w.tp_rank for w in resp.workers]
        if got != ranks:
            raise fail(f"expected rank(s) {ranks}, the peer answered with {got}")
        if resp.descriptors and len(resp.descriptors) != len(resp.workers):
            raise fail(
                f"expected {len(resp.workers)} descriptor tables, got {len(resp.descriptors)}"
            )
        out: dict[int, tuple[WorkerMetadata, RankDescriptors]] = {}
        for i, w in enumerate(resp.workers):
            rank = f"rank {w.tp_rank}"
            if w.engine_id != engine_id or w.dp_index != dp_index:
                raise fail(
                    f"{rank} describes engine {w.engine_id!r} dp_index {w.dp_index}, expected "
                    f"engine {engine_id!r} dp_index {dp_index}"
                )
            problems = worker_problems(w)
            if problems:
                raise fail(f"{rank} sent invalid metadata: " + "; ".join(problems))
            if w.tp_size != resp.workers[0].tp_size:
                raise fail(f"ranks disagree on tp_size: {resp.workers[0].tp_size} and {w.tp_size}")
            self._check_compatible(w, what)
            table = descriptor_spans(w)
            if resp.descriptors and resp.descriptors[i] != table:
                raise fail(f"{rank} sent descriptor tables that do not match its regions")
            out[w.tp_rank] = (w, table)
        return out

    def _check_compatible(self, w: WorkerMetadata, what: str) -> None:
        def fail(problem: str) -> HandshakeIncompatible:
            return HandshakeIncompatible(f"{what}: {problem}")

        if self.enforce_compat and self.compat_hash and w.compat_hash != self.compat_hash:
            raise fail(
                f"compatibility hash mismatch: local {self.compat_hash}, remote rank {w.tp_rank} "
                f"{w.compat_hash or '(none)'} (enforce_handshake_compat=false skips this check)"
            )
        small, large = sorted((self.tp_size, w.tp_size))
        if small < 1 or large % small:
            raise fail(
                f"TP sizes are not divisible: local tp_size {self.tp_size}, remote tp_size "
                f"{w.tp_size} (one must divide the other)"
            )
        if self.block_size and self.block_size % w.block_size:
            raise fail(
                f"block sizes are incompatible: local block_size {self.block_size}, remote "
                f"block_size {w.block_size} (the remote one must divide the local one)"
            )

    def _store(
        self,
        engine_id: str,
        dp_index: int,
        fresh: dict[int, tuple[WorkerMetadata, RankDescriptors]],
    ) -> dict[int, WorkerMetadata]:
        stale: dict[int, WorkerMetadata] = {}
        with self._lock:
            for rank, entry in fresh.items():
                key = (engine_id, dp_index, rank)
                old = self._cache.get(key)
                if old is not None and _agent_changed(old[0], entry[0]):
                    stale[rank] = old[0]
                self._cache[key] = entry
        for rank, old_meta in stale.items():
            new_meta = fresh[rank][0]
            logger.info(
                "engine %s rank %d restarted: agent %s replaced by %s",
                engine_id,
                rank,
                old_meta.agent_name,
                new_meta.agent_name,
            )
            if self.on_peer_changed is not None:
                self.on_peer_changed(old_meta, new_meta)
        return stale


def _agent_changed(old: WorkerMetadata, new: WorkerMetadata) -> bool:
    return (
        old.agent_name != new.agent_name or old.agent_metadata_sha256 != new.agent_metadata_sha256
    )


def _rank_list(ranks: Iterable[int]) -> list[int]:
    out = [int(r) for r in ranks]
    if not out:
        raise ConfigError("ranks: expected at least one rank, got none")
    if len(set(out)) != len(out) or min(out) < 0:
        raise ConfigError(f"ranks: expected distinct ranks >= 0, got {out}")
    return out
