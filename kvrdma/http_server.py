"""A small HTTP server for probes and `/metrics` that slow or vanishing clients cannot wedge.

One request per connection (HTTP/1.0). One thread does the waiting on sockets, without
blocking: it accepts connections, reads each request head, sends what is left of each reply
and then waits for the client to hang up, each step under one overall deadline, so clients
that trickle their head or never read their reply hold no thread. At most `MAX_PENDING`
connections wait on that thread (a new one closes the oldest, first of those whose complete
head waits for a busy thread). A complete head goes to one of at most `max_threads` handler
threads, kept for later requests, which compute the reply and send what the socket takes at
once; a client that hangs up costs a debug log line, never a traceback. Requests for the
`quick_paths` (probes) have `QUICK_THREADS` threads of their own: slow replies never delay them.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, choose_encoder, generate_latest

from kvrdma import content_coding
from kvrdma.handler_pool import HandlerPool
from kvrdma.log_limit import RateLimitedLog

logger = logging.getLogger(__name__)

READ_TIMEOUT_SECONDS = 2.0  # to receive the whole request head
WRITE_TIMEOUT_SECONDS = 5.0  # to send the whole reply
MAX_THREADS = 64
QUICK_THREADS = 4
# the kernel queues this many connections not yet accepted: past it a SYN is dropped and the
# client retries only after a second, so it holds what the server keeps and more
BACKLOG = 1024
MAX_PENDING = 512  # connections reading a request head, writing a reply or lingering
MAX_HEAD_BYTES = 64 * 1024  # request line and headers
LINGER_SECONDS = 1.0  # after a reply, for the client to read it and hang up
NO_THREAD_LOG_SECONDS = 10.0  # a flood of requests no thread takes: one warning this often
_POLL_SECONDS = 0.05
_HEAD_ENDS = (b"\r\n\r\n", b"\n\n")


@dataclass(frozen=True)
class Response:
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


# Called with the request path (query string removed) and the request headers (names in
# lower case).
Responder = Callable[[str, Mapping[str, str]], Response]


def metrics_responder(registry: CollectorRegistry) -> Responder:
    """Serve `registry` at any path but `/favicon.ico`: OpenMetrics or text, gzip if preferred
    (`kvrdma.content_coding`)."""

    def respond(path: str, headers: Mapping[str, str]) -> Response:
        if path == "/favicon.ico":
            return Response(404, "text/plain; charset=utf-8", b"not found\n")
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        body, coding = content_coding.encode(encoder(registry), headers.get("accept-encoding"))
        return Response(200, content_type, body, coding)

    return respond


class _Handler(BaseHTTPRequestHandler):
    """Parses a request head read by the serving thread and writes the reply into memory, to
    be sent without blocking (`_Server._serve_one`), so no client can hold a handler thread."""

    server: _Server
    server_version = "kvrdma"
    reply = b""

    def setup(self) -> None:
        self.rfile = io.BytesIO(self.request[0])
        self.wfile = self._out = io.BytesIO()

    def finish(self) -> None:
        self.reply = self._out.getvalue()

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            headers = {name.lower(): value for name, value in self.headers.items()}
            response = self.server.respond(path, headers)
        except BaseException:  # SystemExit too: the client is answered, its socket closed
            logger.exception("%s failed to answer GET %s", self.server.name, path)
            response = Response(500, "text/plain; charset=utf-8", b"internal error\n")
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        for name, value in response.headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(response.body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s: " + format, self.server.name, self.address_string(), *args)


class _Phase(Enum):
    """Where a connection held by the serving thread is; the value says why it is closed when
    its deadline passes."""

    HEAD = "request head not received before the read deadline"
    REPLY = "reply not taken before the write deadline"
    # After the reply (FIN sent), what the client sends is read and discarded until it hangs
    # up: closing a socket with unread bytes resets the connection, and the client loses
    # whatever part of the reply it had not read yet.
    LINGER = "did not hang up after its reply"


@dataclass
class _Conn:
    """A connection the serving thread holds: its phase, until when, the request head so far
    and what is left to send of the reply."""

    address: Any
    deadline: float
    phase: _Phase = _Phase.HEAD
    reply: memoryview = field(default_factory=lambda: memoryview(b""))
    head: bytearray = field(default_factory=bytearray)


class _Server(HTTPServer):
    def __init__(
        self,
        address: tuple[str, int],
        respond: Responder,
        *,
        name: str,
        read_timeout: float,
        write_timeout: float,
        max_threads: int,
        backlog: int,
        quick_paths: frozenset[str],
    ) -> None:
        self.respond = respond
        self._quick_paths = quick_paths
        self.name = name
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.request_queue_size = backlog  # read by server_activate() inside __init__
        self._pool = HandlerPool(max_threads, f"kvrdma-{name}-handler")
        self._quick_pool = HandlerPool(QUICK_THREADS, f"kvrdma-{name}-quick")
        self._slot_wait = read_timeout + 1.0  # a complete head's wait for a free thread
        self._conns: dict[socket.socket, _Conn] = {}  # oldest first
        self._ready: deque[tuple[socket.socket, Any, bytes, float]] = deque()
        self._ready_quick: deque[tuple[socket.socket, Any, bytes, float]] = deque()
        # replies handler threads could not send at once, from handler threads
        self._replies: deque[tuple[socket.socket, Any, memoryview]] = deque()
        self._lock = threading.Lock()  # orders queueing a reply with stopping
        self._stopped = False
        self._accept_failing = False  # warned already: accept fails until a descriptor frees
        self._no_thread = RateLimitedLog(logger, logging.WARNING, NO_THREAD_LOG_SECONDS)
        self.closing = threading.Event()
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        # made once bound: a port in use raises from the line above, holding nothing else open
        self._selector = selectors.DefaultSelector()
        try:
            self._wake, self._waker = socket.socketpair()  # a handler thread queued a reply
        except BaseException:
            self._selector.close()
            self.server_close()
            raise
        self._waker.setblocking(False)

    def serve(self) -> None:
        """Serve connections until `closing` is set."""
        self.socket.setblocking(False)
        self._selector.register(self.socket, selectors.EVENT_READ)
        self._selector.register(self._wake, selectors.EVENT_READ)
        try:
            while not self.closing.is_set():
                try:
                    self._step()
                except Exception:  # one connection's surprise must not stop the server
                    logger.exception("%s: serving loop failed; going on", self.name)
        finally:
            with self._lock:
                self._stopped = True
                held = [*self._conns, *(r[0] for r in (*self._ready, *self._ready_quick))]
                for conn in held + [r[0] for r in self._replies]:
                    conn.close()
                self._selector.close()
                self._wake.close()
                self._waker.close()
            self._pool.close()
            self._quick_pool.close()
            self._no_thread.flush(force=True)

    def _step(self) -> None:
        wait = _POLL_SECONDS / 10 if self._ready or self._ready_quick else _POLL_SECONDS
        accept = False
        for key, _ in self._selector.select(wait):
            conn = key.fileobj
            if conn is self.socket:
                accept = True  # after the heads already sent by those accepted before are read
            elif conn is self._wake:
                self._take_replies()
            elif conn in self._conns:  # not dropped earlier in this round
                state = self._conns[conn]
                if state.phase is _Phase.HEAD:
                    self._receive(conn, state)
                elif state.phase is _Phase.REPLY:
                    self._send(conn, state)
                else:
                    self._discard(conn)
        if accept:
            self._accept()
        self._expire(time.monotonic())
        self._dispatch()

    def _accept(self) -> None:
        for _ in range(MAX_PENDING):
            try:
                conn, address = self.socket.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of file descriptors: make room
                level = logging.DEBUG if self._accept_failing else logging.WARNING
                logger.log(level, "%s: cannot accept a connection: %s", self.name, exc)
                self._accept_failing = True
                if not self._make_room():
                    self.closing.wait(_POLL_SECONDS)  # until a handler closes one
                    return
                continue
            if len(self._conns) + len(self._ready) + len(self._ready_quick) >= MAX_PENDING:
                self._make_room()
            self._accept_failing = False
            conn.setblocking(False)
            self._conns[conn] = _Conn(address, time.monotonic() + self.read_timeout)
            self._selector.register(conn, selectors.EVENT_READ)

    def _make_room(self) -> bool:
        """Close the oldest connection held, first one waiting for a busy handler thread (the
        oldest reading its head may be a probe just connected); False if none is held."""
        if self._conns and not self._ready:
            self._drop(next(iter(self._conns)), "oldest connection, closed")
            return True
        if not (ready := self._ready or self._ready_quick):
            return False
        conn, address, _, _ = ready.popleft()
        conn.close()
        logger.debug("%s: connection from %s waited for a thread, closed", self.name, address)
        return True

    def _receive(self, conn: socket.socket, state: _Conn) -> None:
        try:
            chunk = conn.recv(MAX_HEAD_BYTES + 1 - len(state.head))
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop(conn, str(exc))
            return
        start = max(0, len(state.head) - 3)  # an end may begin in the bytes read before
        state.head += chunk
        if not chunk or len(state.head) > MAX_HEAD_BYTES:
            self._drop(conn, "hung up" if chunk == b"" else "request head too long")
        elif any(state.head.find(end, start) >= 0 for end in _HEAD_ENDS):
            self._selector.unregister(conn)
            del self._conns[conn]
            head = bytes(state.head)
            ready = self._ready_quick if _request_path(head) in self._quick_paths else self._ready
            ready.append((conn, state.address, head, time.monotonic() + self._slot_wait))

    def _take_replies(self) -> None:
        with contextlib.suppress(BlockingIOError):
            self._wake.recv(4096)
        now = time.monotonic()
        while self._replies:
            conn, address, rest = self._replies.popleft()
            if rest:  # the whole reply has one deadline, not each send
                state = _Conn(address, now + self.write_timeout, _Phase.REPLY, rest)
                self._selector.register(conn, selectors.EVENT_WRITE)
            else:
                state = _Conn(address, now + LINGER_SECONDS, _Phase.LINGER)
                self._selector.register(conn, selectors.EVENT_READ)
            self._conns[conn] = state

    def _send(self, conn: socket.socket, state: _Conn) -> None:
        try:
            state.reply = _send_some(conn, state.reply)
        except OSError as exc:  # the client hung up
            self._drop(conn, f"reply dropped: {exc}")
            return
        if not state.reply:
            state.phase, state.deadline = _Phase.LINGER, time.monotonic() + LINGER_SECONDS
            self._selector.modify(conn, selectors.EVENT_READ)

    def _discard(self, conn: socket.socket) -> None:
        try:
            if conn.recv(1 << 16):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        self._close(conn)

    def _expire(self, now: float) -> None:
        for conn, state in [(c, s) for c, s in self._conns.items() if s.deadline <= now]:
            if state.phase is _Phase.REPLY:  # reset: the kernel would keep sending it
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self._drop(conn, state.phase.value)
        for ready in (self._ready, self._ready_quick):
            while ready and ready[0][3] <= now:
                conn, address, _, _ = ready.popleft()
                conn.close()
                message = "%s: no free thread, connection from %s closed"
                self._no_thread.occurred(message, self.name, address)
        self._no_thread.flush()

    def _dispatch(self) -> None:
        for ready, pool in ((self._ready_quick, self._quick_pool), (self._ready, self._pool)):
            while ready and pool.try_submit(functools.partial(self._serve_one, *ready[0][:3])):
                ready.popleft()

    def _serve_one(self, conn: socket.socket, address: Any, head: bytes) -> None:
        reply = b""
        try:
            reply = _Handler((head, conn), address, self).reply
        except Exception:
            logger.exception("%s: request from %s failed", self.name, address)
        # what the socket takes now is sent from here (most replies, at once); the serving
        # thread sends the rest and waits for the hang-up, so no client holds this thread
        rest, gone = memoryview(reply), False
        try:
            rest = _send_some(conn, rest)
        except OSError as exc:  # the client hung up
            logger.debug("%s: reply to %s dropped: %s", self.name, address, exc)
            gone = True
        with self._lock:
            if self._stopped or gone:
                conn.close()
                return
            self._replies.append((conn, address, rest))
            with contextlib.suppress(BlockingIOError):
                self._waker.send(b"\0")

    def _close(self, conn: socket.socket) -> None:
        del self._conns[conn]
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()

    def _drop(self, conn: socket.socket, why: str) -> None:
        address = self._conns[conn].address
        self._close(conn)
        logger.debug("%s: connection from %s: %s", self.name, address, why)


def _request_path(head: bytes) -> str:
    """The path of a request head's request line, without its query ("" if it has none)."""
    parts = head.split(b"\n", 1)[0].split()
    return parts[1].split(b"?", 1)[0].decode("latin-1") if len(parts) > 1 else ""


def _send_some(conn: socket.socket, rest: memoryview) -> memoryview:
    """Send what the socket takes of `rest` now, without blocking, and end the reply (FIN)
    once all of it is sent; returns what is left. `OSError`: the client has gone."""
    try:
        rest = rest[conn.send(rest) :]
    except BlockingIOError:
        return rest
    if not rest:
        conn.shutdown(socket.SHUT_WR)
    return rest


class EndpointServer:
    """Serves `respond` on `host:port` (0 picks a free port, see `.port`) from a daemon thread.

    Raises `OSError` when it cannot bind. `close()` stops it and is idempotent. Requests for
    `quick_paths` (cheap probes such as /healthz) get handler threads of their own.
    """

    def __init__(
        self,
        host: str,
        port: int,
        respond: Responder,
        *,
        name: str = "http",
        read_timeout: float = READ_TIMEOUT_SECONDS,
        write_timeout: float = WRITE_TIMEOUT_SECONDS,
        max_threads: int = MAX_THREADS,
        backlog: int = BACKLOG,
        quick_paths: frozenset[str] = frozenset(),
    ) -> None:
        self._httpd = _Server(
            (host, port),
            respond,
            name=name,
            read_timeout=read_timeout,
            write_timeout=write_timeout,
            max_threads=max_threads,
            backlog=backlog,
            quick_paths=quick_paths,
        )
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve, name=f"kvrdma-{name}-{self.port}", daemon=True
        )
        self._thread.start()
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._httpd.closing.set()
        self._thread.join(timeout=5)
        self._httpd.server_close()

    def __enter__(self) -> EndpointServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["EndpointServer", "Responder", "Response", "metrics_responder"]


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in the Prometheus text format, and its Content-Type (for custom servers)."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


class MetricsServer:
    """A running `/metrics` HTTP server on a daemon thread; `shutdown()` is idempotent.

    Any path but `/favicon.ico` serves the registry; see `kvrdma.http_server` for its limits.
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._server = EndpointServer(host, port, metrics_responder(registry), name="metrics")
        self.host = host
        self.port: int = self._server.port

    def shutdown(self) -> None:
        self._server.close()

    close = shutdown

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def start_http_server(
    registry: CollectorRegistry, host: str, port: int
) -> tuple[MetricsServer, int]:
    """Serve `registry` on `http://host:port/metrics` (port 0 picks a free port)."""
    server = MetricsServer(registry, host, port)
    logger.info("serving metrics on http://%s:%d/metrics", host, server.port)
    return server, server.port
