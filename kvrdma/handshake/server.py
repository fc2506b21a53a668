"""The handshake server: one ZMQ ROUTER answering peers' metadata requests.

It serves the `WorkerMetadata` of every TP rank published to it (in-process through
`publish()`, or by workers over the optional publish socket in sidecar mode), for one or
several engines. A bad frame never stops it: the peer gets an `ErrorReply` and a counter
moves. One background thread owns the sockets; `close()` stops it within a second.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from types import TracebackType

import msgspec
import zmq

from kvrdma.errors import ConfigError, HandshakeError, ProtocolError
from kvrdma.handshake.auth import CurveGate, CurveKeys, secure_server
from kvrdma.handshake.endpoints import ensure_ipc_dir, ipc_file_id, tcp_endpoint
from kvrdma.handshake.entries import Entry, hold, servable_entry
from kvrdma.handshake.monitors import SocketMonitors
from kvrdma.handshake.replies import answer_request
from kvrdma.handshake.replies_queue import ReplyQueue
from kvrdma.handshake.vllm_peer import VLLM_GET_META, answer_frames, parse_request
from kvrdma.handshake.wire import (
    MAX_FRAME_BYTES,
    MAX_PUBLISH_BYTES,
    MAX_REQUEST_BYTES,
    Codec,
    ErrorReply,
    MetadataRequest,
    ProtocolViolation,
    PublishAck,
    PublishMessage,
    PublishRequest,
    check_publish_ttl,
    publish_server_codec,
    server_codec,
    with_checksum,
)
from kvrdma.metadata import WorkerMetadata
from kvrdma.types import ConnectionDrop, ServerSocket

__all__ = ["CONNECTION_DROPS", "OUTCOMES", "HandshakeServer", "Observer"]

logger = logging.getLogger(__name__)

_POLL_MS = 50  # how often the loop looks at the stop flag when idle
_DRAIN = 256  # messages handled per socket per wake before looking at the other one
_DRAIN_S = 0.02  # and at most this long: the connection guards run between drains
# Per-peer queue bounds, in messages: a client has one request in flight per socket; replies
# a peer's queue cannot take wait in a `ReplyQueue` (bounded too). A full inbound queue stops
# libzmq reading the connection, which holds a message of many small frames at far more than
# its bytes: a few per peer.
_SNDHWM = 16
_RCVHWM = 4

# TCP connections a socket's guard shut down, by socket and why (see `guard`): their message
# never arrived, so they are counted apart from the requests.
CONNECTION_DROPS = {(s, why): f"{s}_dropped_{why}" for s in ServerSocket for why in ConnectionDrop}
# Outcomes counted in `stats` (and passed to the observer hook).
OUTCOMES = (
    "requests_ok",  # metadata served
    "requests_bad",  # undecodable / malformed / wrong version / oversized
    "requests_rejected",  # valid request, refused (unknown engine or rank, compat mismatch)
    "requests_internal_error",  # a bug; the peer got an "internal" error reply
    "requests_unauthenticated",  # CURVE on: a client whose key is not authorized, refused
    "publish_ok",
    "publish_bad",
    "unpublish_ok",
    "publish_expired",  # a rank published with a ttl and not published again in time
    *CONNECTION_DROPS.values(),
)

Observer = Callable[[str, float], None]
_Handler = Callable[[bytes, str], tuple[str | None, msgspec.Struct]]
_Key = tuple[str, int]  # (engine_id, dp_index)


class HandshakeServer:
    """Answers `MetadataRequest`s for the ranks published to it.

    `port=0` binds a free port (see `.port`). `publish_address` (e.g. `ipc:///var/run/kvrdma/
    publish.sock` or `tcp://127.0.0.1:0`) adds the socket workers publish to in sidecar mode.
    `observer(outcome, seconds)` is called from the server thread once per handled message.
    `curve` (see `kvrdma.handshake.auth`) encrypts both sockets and admits only clients with
    an authorized key; it needs a context of its own (no `context` argument).
    `engine_id` and `dp_index` restrict publishing to that engine and DP rank (a sidecar's
    own); None admits any. All ranks published hold at most `MAX_PUBLISHED_BYTES` of replies.
    `clock` is read into every reply: readers convert the producers' lease expiries with it, so
    it must be the producers' clock (the default, `time.monotonic`, is one per host).
    Request frames above `MAX_REQUEST_BYTES` and publish frames above `MAX_PUBLISH_BYTES` (or
    `max_frame_bytes`, if smaller) are dropped by ZMQ before they are buffered; a reply above
    `max_frame_bytes` is refused. A TCP peer that sends a few frames' worth of bytes without
    ending a message loses its connection (libzmq would hold every frame; see `guard`), and
    past a bound of open connections the idlest do: `stats` counts both (`CONNECTION_DROPS`).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        enforce_compat: bool = True,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        publish_address: str | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        observer: Observer | None = None,
        curve: CurveKeys | None = None,
        engine_id: str | None = None,
        dp_index: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if curve is not None and context is not None:
            raise HandshakeError("a CURVE handshake server needs a ZMQ context of its own")
        if curve is not None and curve.server_secret is None:
            raise ConfigError(
                f"curve key directory {curve.directory!r} has no server.key_secret: the "
                "handshake server needs the servers' secret key"
            )
        self.host, self.engine_id, self.dp_index = host, engine_id, dp_index
        self.enforce_compat, self._observer = enforce_compat, observer
        self._own_context = context is None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = (
            context if context is not None else zmq.Context()
        )
        self._codec = server_codec(min(max_frame_bytes, MAX_REQUEST_BYTES))
        self._pub_codec: Codec[PublishMessage] = publish_server_codec(
            min(max_frame_bytes, MAX_PUBLISH_BYTES)
        )
        self._max_frame = max_frame_bytes
        self._lock = threading.Lock()
        self._workers: dict[_Key, dict[int, Entry]] = {}
        self._held = 0  # reply bytes (`Entry.size`) of every published rank, locked with them
        self._stats = dict.fromkeys(OUTCOMES, 0)
        self._stop = threading.Event()
        self._replies = ReplyQueue()  # used by the server thread only
        self._closed = False
        self._sock: zmq.Socket[bytes] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._ipc_file: tuple[str, int] | None = None
        self._curve = curve
        self._clock = clock  # sent with each reply: the producers' lease expiries are in it
        self._gate: CurveGate | None = None
        binding = tcp_endpoint(host, port)
        try:
            if curve is not None:
                self._gate = CurveGate(self._ctx, curve)
            self._sock = self._router(self._codec.max_frame_bytes)
            if ":" in host:
                self._sock.setsockopt(zmq.IPV6, 1)
            self._sock.bind(tcp_endpoint(host, port if port else "*"))
            self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.port = int(self.address.rsplit(":", 1)[1])
            self.publish_address: str | None = None
            if publish_address is not None:
                binding = publish_address
                ensure_ipc_dir(publish_address)
                self._pub = self._router(self._pub_codec.max_frame_bytes)
                bind_to = publish_address
                if bind_to.startswith("tcp://") and bind_to.endswith(":0"):
                    bind_to = bind_to[:-2] + ":*"
                self._pub.bind(bind_to)
                self.publish_address = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
                self._ipc_file = ipc_file_id(self.publish_address)
        except (zmq.ZMQError, OSError) as exc:
            self._close_sockets()
            if self._gate is not None:
                self._gate.stop()
            if self._own_context:
                self._ctx.term()
            raise HandshakeError(f"cannot bind the handshake server to {binding}: {exc}") from exc
        self._thread = threading.Thread(
            target=self._run, name=f"kvrdma-handshake-{self.port}", daemon=True
        )
        self._thread.start()
        logger.info("handshake server listening on %s", self.address)

    # ------------------------------------------------------------------ public API
    def publish(self, meta: WorkerMetadata, *, ttl: float | None = None) -> None:
        """Serve `meta` from now on (replacing what this engine/DP/rank published before), for
        `ttl` seconds unless published again (None: until unpublished).

        Raises `ProtocolError` (a `ProtocolViolation` with its `ErrorCode`) when `meta` could
        not be served: invalid, too large to send or to hold, or for an engine (or DP rank) this
        server does not serve;
        `ConfigError` for a `ttl` outside (0, `MAX_PUBLISH_TTL_S`].
        """
        check_publish_ttl(ttl)  # NaN would never expire, a negative one publish nothing
        try:
            entry = servable_entry(
                with_checksum(meta),
                codec=self._codec,
                max_frame=self._max_frame,
                engine_id=self.engine_id,
                dp_index=self.dp_index,
            )
            expires = None if ttl is None else self._clock() + ttl
            with self._lock:
                previous, self._held = hold(self._workers, self._held, entry, expires)
        except ProtocolViolation:
            self._count("publish_bad", 0.0)
            raise
        if previous is not None and previous.meta.agent_name != meta.agent_name:
            logger.info(
                "engine %s rank %d re-published by a new agent %s (was %s)",
                meta.engine_id,
                meta.tp_rank,
                meta.agent_name,
                previous.meta.agent_name,
            )
        self._count("publish_ok", 0.0)

    def unpublish(self, engine_id: str, tp_rank: int, dp_index: int = 0) -> bool:
        """Stop serving one rank; True when it was published."""
        with self._lock:
            ranks = self._workers.get((engine_id, dp_index))
            if ranks is None or tp_rank not in ranks:
                return False
            self._held -= ranks.pop(tp_rank).size
            if not ranks:
                del self._workers[(engine_id, dp_index)]
        self._count("unpublish_ok", 0.0)
        return True

    def _drop_expired(self) -> None:
        """Stop serving the ranks not published again within their ttl."""
        now, dropped = self._clock(), []
        with self._lock:
            for key, ranks in list(self._workers.items()):
                for rank, e in list(ranks.items()):
                    if e.expires is not None and e.expires <= now:
                        dropped.append(e.meta)
                        self._held -= ranks.pop(rank).size
                if not ranks:
                    del self._workers[key]
        for meta in dropped:
            logger.warning(
                "engine %s rank %d was not published again within its ttl: no longer served "
                "(its worker stopped without unpublishing?)",
                meta.engine_id,
                meta.tp_rank,
            )
            self._count("publish_expired", 0.0)

    def published_ranks(self, engine_id: str, dp_index: int = 0) -> list[int]:
        self._drop_expired()
        with self._lock:
            return sorted(self._workers.get((engine_id, dp_index), {}))

    def published_metadata(self, engine_id: str, dp_index: int = 0) -> dict[int, WorkerMetadata]:
        """The metadata served for each published TP rank of one engine and DP index."""
        self._drop_expired()
        with self._lock:
            return {r: e.meta for r, e in self._workers.get((engine_id, dp_index), {}).items()}

    def published(self) -> dict[tuple[str, int], list[int]]:
        """Every (engine_id, dp_index) served, with its ranks."""
        self._drop_expired()
        with self._lock:
            return {key: sorted(ranks) for key, ranks in self._workers.items()}

    @property
    def alive(self) -> bool:
        """True while the serving thread runs (False once it died or `close()` stopped it)."""
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def stats(self) -> dict[str, int]:
        """A snapshot of the outcome counters (see `OUTCOMES`)."""
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        """Stop the thread and close the sockets (linger 0); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=2.0)
        if self._thread.is_alive():  # pragma: no cover - a handler stuck for seconds
            logger.error("handshake server thread did not stop within 2 s")
            return
        self._close_sockets()
        if self._gate is not None:
            self._gate.stop()
        if self._own_context:
            self._ctx.term()

    def __enter__(self) -> HandshakeServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _router(self, max_message_bytes: int) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _SNDHWM)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        # An oversized frame drops that peer's connection before anything is buffered.
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        # a reply the peer's queue cannot take yet waits in `_replies` instead of vanishing
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # no reply is copied, however small: `ReplyQueue` tracks each until it is written out
        sock.copy_threshold = 0
        if self._curve is not None:
            secure_server(sock, self._curve)
        return sock

    def _close_sockets(self) -> None:
        for sock in (self._sock, self._pub):
            if sock is not None:
                sock.close(linger=0)
        # ZMQ leaves the ipc socket file behind; remove it unless someone else re-bound it.
        if self._ipc_file is not None and ipc_file_id(f"ipc://{self._ipc_file[0]}") == (
            self._ipc_file
        ):
            with contextlib.suppress(OSError):
                os.unlink(self._ipc_file[0])

    def _count(self, outcome: str, seconds: float) -> None:
        with self._lock:
            self._stats[outcome] += 1
        if self._observer is not None:
            try:
                self._observer(outcome, seconds)
            except Exception:  # an observer bug must not stop the server
                logger.exception("handshake observer failed")

    def _run(self) -> None:
        assert self._sock is not None  # set before the thread starts
        sockets = {self._sock: self._codec.max_frame_bytes}
        if self._pub is not None:
            sockets[self._pub] = self._pub_codec.max_frame_bytes
        watch = SocketMonitors(sockets, curve=self._curve is not None)
        poller = zmq.Poller()
        for sock in [*sockets, *watch.monitors]:
            poller.register(sock, zmq.POLLIN)
        try:
            self._loop(poller, watch)
        finally:
            watch.close()

    def _loop(self, poller: zmq.Poller, watch: SocketMonitors) -> None:
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(1 if self._replies.pending else _POLL_MS))
            except zmq.ZMQError as exc:  # pragma: no cover - context terminated under us
                logger.error("handshake server poll failed: %s", exc)
                return
            for monitor in watch.monitors:
                for _ in watch.read(monitor) if monitor in ready else ():
                    self._count("requests_unauthenticated", 0.0)
            for sock, handler in ((self._sock, self._serve), (self._pub, self._serve_publish)):
                if sock is not None and sock in ready:
                    self._drain(sock, handler, watch)
            self._replies.flush()
            while self._replies.stalled:  # a peer reading none of its replies
                watch.shut(self._replies.stalled.pop())
            for sock, why in watch.enforce():
                where = ServerSocket.PUBLISH if sock is self._pub else ServerSocket.SIDE_CHANNEL
                self._count(CONNECTION_DROPS[where, why], 0.0)

    def _drain(self, sock: zmq.Socket[bytes], handler: _Handler, watch: SocketMonitors) -> None:
        ends = time.monotonic() + _DRAIN_S
        for _ in range(_DRAIN):
            try:
                frames = watch.receive(sock)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:  # pragma: no cover
                logger.error("handshake server receive failed: %s", exc)
                return
            try:
                if frames is None:  # refused: too many frames
                    self._count("publish_bad" if sock is self._pub else "requests_bad", 0.0)
                else:
                    self._replies.source = watch.source(sock, frames)
                    self._handle(sock, [frame.bytes for frame in frames], handler)
            except Exception:  # the thread must outlive any one message, whatever it held
                logger.exception("handshake server dropped a message it could not answer")
            if time.monotonic() >= ends:
                return

    def _handle(self, sock: zmq.Socket[bytes], parts: list[bytes], handler: _Handler) -> None:
        start = time.perf_counter()
        identity = parts[0]
        peer = f"peer {identity.hex()[:16]} on {self.address}"
        publishing = sock is self._pub
        # DEALER framing: [identity, payload]; REQ framing: [identity, b"", payload]. A REQ
        # peer only sees replies that carry its empty delimiter back, bad frames included.
        envelope = [identity, b""] if len(parts) > 2 and parts[1] == b"" else [identity]
        payload = parts[len(envelope)] if len(parts) == len(envelope) + 1 else None
        if (
            not publishing
            and payload is not None
            and self._answer_vllm_shape(sock, envelope, payload)
        ):
            return
        outcome: str | None
        try:
            if payload is None:
                raise ProtocolViolation(
                    "bad_frame",
                    f"expected 1 payload frame (or an empty delimiter and 1 payload frame), "
                    f"got {len(parts) - 1} frames from {peer}",
                )
            outcome, reply = handler(payload, peer)
            frame = self._codec.encode(reply)
        except ProtocolError as exc:
            code = exc.code if isinstance(exc, ProtocolViolation) else "bad_message"
            outcome = "publish_bad" if publishing else "requests_bad"
            frame = self._codec.encode(ErrorReply(code=code, message=str(exc)))
            logger.debug("bad message from %s: %s", peer, exc)
        except Exception as exc:
            logger.exception("handshake server failed on a message from %s", peer)
            outcome = "publish_bad" if publishing else "requests_internal_error"
            reply = ErrorReply(code="internal", message=f"internal error: {type(exc).__name__}")
            frame = self._codec.encode(reply)
        if outcome is not None:  # counted before sending: a peer that got its reply sees it
            self._count(outcome, time.perf_counter() - start)
        self._replies.send(sock, [*envelope, frame])

    def _answer_vllm_shape(
        self, sock: zmq.Socket[bytes], envelope: list[bytes], payload: bytes
    ) -> bool:
        """Answer a vLLM-shaped request (vLLM's decoder, or a kvrdma client's probe) in vLLM's
        two-frame shape, so vLLM reports a compatibility mismatch instead of choking on a
        kvrdma reply; False when `payload` is not one."""
        tag = parse_request(payload)
        if tag is None:
            return False
        if tag == VLLM_GET_META:
            # A stock vLLM decoder was pointed at this agent: count it and say so.
            self._count("requests_bad", 0.0)
            logger.warning(
                "a vLLM NixlConnector decoder asked %s for its metadata: this is a kvrdma "
                "agent; answered with a compatibility hash vLLM cannot match",
                self.address,
            )
        self._replies.send(sock, envelope + answer_frames())
        return True

    def _serve(self, payload: bytes, peer: str) -> tuple[str | None, msgspec.Struct]:
        req = self._codec.decode(payload, peer)
        return self._answer(req)

    def _answer(self, req: MetadataRequest) -> tuple[str, msgspec.Struct]:
        self._drop_expired()
        with self._lock:
            ranks = self._workers.get((req.engine_id, req.dp_index))
            snapshot = None if ranks is None else dict(ranks)
            engines = sorted({f"{e}/dp{d}" for e, d in self._workers})
        return answer_request(
            req,
            snapshot,
            engines,
            address=self.address,
            max_frame=self._max_frame,
            enforce_compat=self.enforce_compat,
            server_time=self._clock(),
        )

    def _serve_publish(self, payload: bytes, peer: str) -> tuple[str | None, msgspec.Struct]:
        # publish()/unpublish() count their own outcomes, hence the None.
        msg = self._pub_codec.decode(payload, peer)
        if isinstance(msg, PublishRequest):
            w = msg.worker
            try:
                self.publish(w, ttl=msg.ttl)
            except ProtocolViolation as exc:
                return None, ErrorReply(code=exc.code, message=f"{exc} (from {peer})")
            engine_id, tp_rank, dp_index = w.engine_id, w.tp_rank, w.dp_index
        else:
            engine_id, tp_rank, dp_index = msg.engine_id, msg.tp_rank, msg.dp_index
            self.unpublish(engine_id, tp_rank, dp_index)
        return None, PublishAck(
            engine_id=engine_id,
            tp_rank=tp_rank,
            dp_index=dp_index,
            published_ranks=self.published_ranks(engine_id, dp_index),
        )
