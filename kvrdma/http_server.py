"""A small HTTP server for probes and `/metrics` that slow or vanishing clients cannot wedge.

One request per connection (HTTP/1.0). One thread accepts connections and reads every request
head at once, without blocking, each under one overall deadline: clients trickling bytes hold
no thread, and at most `MAX_PENDING` connections wait for their head (a new one closes the
oldest). A complete head goes to one of at most `max_threads` handler threads; writes have
their own timeout, and a client that hangs up costs a debug log line, never a traceback.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import selectors
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import TracebackType
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, choose_encoder, generate_latest

logger = logging.getLogger(__name__)

READ_TIMEOUT_SECONDS = 2.0  # to receive the whole request head
WRITE_TIMEOUT_SECONDS = 5.0  # per send of the reply
MAX_THREADS = 64
BACKLOG = 128
MAX_PENDING = 512  # connections whose request head is still arriving
MAX_HEAD_BYTES = 64 * 1024  # request line and headers
LINGER_SECONDS = 1.0  # after a reply, for the client to read it and hang up
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
    """Serve `registry` at any path but `/favicon.ico`: OpenMetrics or text, gzip if accepted."""

    def respond(path: str, headers: Mapping[str, str]) -> Response:
        if path == "/favicon.ico":
            return Response(404, "text/plain; charset=utf-8", b"not found\n")
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        body = encoder(registry)
        if "gzip" in headers.get("accept-encoding", ""):
            return Response(200, content_type, gzip.compress(body), (("Content-Encoding", "gzip"),))
        return Response(200, content_type, body)

    return respond


class DeadlineReader(io.RawIOBase):
    """A socket's bytes, readable only until `deadline` (one budget for the whole read, where
    a socket timeout restarts with every byte). `makefile` is all `http.client.HTTPResponse`
    asks of a socket, so a response's headers and body can be read under it too."""

    def __init__(self, sock: socket.socket, deadline: float, what: str = "request") -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline
        self._what = what

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{self._what} not received before the read deadline")
        self._sock.settimeout(remaining)
        return self._sock.recv_into(buffer)

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(self)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "kvrdma"

    def setup(self) -> None:
        self.request, head = self.request  # the socket and the head read by the server thread
        super().setup()
        self.connection.settimeout(self.server.write_timeout)  # all that is left is writing
        self.rfile.close()
        self.rfile = io.BytesIO(head)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            headers = {name.lower(): value for name, value in self.headers.items()}
            response = self.server.respond(path, headers)
        except Exception:
            logger.exception("%s failed to answer GET %s", self.server.name, path)
            response = Response(500, "text/plain; charset=utf-8", b"internal error\n")
        self.connection.settimeout(self.server.write_timeout)
        try:
            self.send_response(response.status)
            self.send_header("Content-Type", response.content_type)
            self.send_header("Content-Length", str(len(response.body)))
            for name, value in response.headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(response.body)
        except OSError as exc:  # the client hung up or stopped reading
            self.close_connection = True
            logger.debug("%s: reply to %s dropped: %s", self.server.name, self.client_address, exc)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s: " + format, self.server.name, self.address_string(), *args)


@dataclass
class _Head:
    """A connection whose request head is arriving: its bytes so far, and until when."""

    address: Any
    deadline: float
    data: bytearray = field(default_factory=bytearray)


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
    ) -> None:
        self.respond = respond
        self.name = name
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.request_queue_size = backlog  # read by server_activate() inside __init__
        self._slots = threading.BoundedSemaphore(max_threads)
        # how long a complete head waits for a free thread before its connection is closed
        self._slot_wait = read_timeout + 1.0
        self._pending: dict[socket.socket, _Head] = {}  # oldest first
        self._ready: deque[tuple[socket.socket, Any, bytes, float]] = deque()
        self._selector = selectors.DefaultSelector()
        self._accept_failing = False  # warned already: accept fails until a descriptor frees
        self.closing = threading.Event()
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def serve(self) -> None:
        """Accept connections and read their heads until `closing` is set."""
        self.socket.setblocking(False)
        self._selector.register(self.socket, selectors.EVENT_READ)
        try:
            while not self.closing.is_set():
                try:
                    self._step()
                except Exception:  # one connection's surprise must not stop the server
                    logger.exception("%s: serving loop failed; going on", self.name)
        finally:
            for conn in [*self._pending, *(r[0] for r in self._ready)]:
                conn.close()
            self._selector.close()

    def _step(self) -> None:
        wait = _POLL_SECONDS / 10 if self._ready else _POLL_SECONDS
        for key, _ in self._selector.select(wait):
            if key.fileobj is self.socket:
                self._accept()
            elif key.fileobj in self._pending:  # not dropped earlier in this round
                self._receive(key.fileobj)
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
                if not self._pending:
                    self.closing.wait(_POLL_SECONDS)  # until a handler closes one
                    return
                self._drop(next(iter(self._pending)), "closed to accept others")
                continue
            if len(self._pending) + len(self._ready) >= MAX_PENDING and self._pending:
                self._drop(next(iter(self._pending)), "oldest unfinished head, closed")
            self._accept_failing = False
            conn.setblocking(False)
            self._pending[conn] = _Head(address, time.monotonic() + self.read_timeout)
            self._selector.register(conn, selectors.EVENT_READ)

    def _receive(self, conn: socket.socket) -> None:
        head = self._pending[conn]
        try:
            chunk = conn.recv(MAX_HEAD_BYTES + 1 - len(head.data))
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop(conn, str(exc))
            return
        head.data += chunk
        if not chunk or len(head.data) > MAX_HEAD_BYTES:
            self._drop(conn, "hung up" if chunk == b"" else "request head too long")
        elif any(end in head.data for end in _HEAD_ENDS):
            self._selector.unregister(conn)
            del self._pending[conn]
            conn.setblocking(True)
            give_up = time.monotonic() + self._slot_wait
            self._ready.append((conn, head.address, bytes(head.data), give_up))

    def _expire(self, now: float) -> None:
        while self._pending:
            conn, head = next(iter(self._pending.items()))
            if head.deadline > now:
                break
            self._drop(conn, "request head not received before the read deadline")
        while self._ready and self._ready[0][3] <= now:
            conn, address, _, _ = self._ready.popleft()
            logger.warning("%s: no free thread, connection from %s closed", self.name, address)
            conn.close()

    def _dispatch(self) -> None:
        while self._ready and self._slots.acquire(blocking=False):
            conn, address, head, _ = self._ready.popleft()
            thread = threading.Thread(
                target=self._serve_one, args=(conn, address, head), daemon=True
            )
            try:
                thread.start()
            except BaseException:
                self._slots.release()
                conn.close()
                raise

    def _serve_one(self, conn: socket.socket, address: Any, head: bytes) -> None:
        try:
            self.finish_request((conn, head), address)  # type: ignore[arg-type]
            _linger(conn, time.monotonic() + LINGER_SECONDS)
        except Exception:
            self.handle_error(conn, address)
        finally:
            self.shutdown_request(conn)
            self._slots.release()

    def _drop(self, conn: socket.socket, why: str) -> None:
        head = self._pending.pop(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()
        logger.debug("%s: connection from %s: %s", self.name, head.address, why)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver prints a traceback to stderr here; a client that vanished is routine.
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            logger.debug("%s: connection from %s failed: %r", self.name, client_address, error)
        else:
            logger.error("%s: request from %s failed: %r", self.name, client_address, error)


def _linger(conn: socket.socket, deadline: float) -> None:
    """End the reply (FIN), then discard what the client sent past its request head until it
    hangs up or `deadline`: closing a socket with unread bytes resets the connection, and the
    client loses whatever part of the reply it had not read yet."""
    conn.shutdown(socket.SHUT_WR)
    reader, scrap = DeadlineReader(conn, deadline, "the client's hang-up"), bytearray(4096)
    while reader.readinto(scrap):
        pass


class EndpointServer:
    """Serves `respond` on `host:port` (0 picks a free port, see `.port`) from a daemon thread.

    Raises `OSError` when it cannot bind. `close()` stops it and is idempotent.
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
    ) -> None:
        self._httpd = _Server(
            (host, port),
            respond,
            name=name,
            read_timeout=read_timeout,
            write_timeout=write_timeout,
            max_threads=max_threads,
            backlog=backlog,
        )
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve,
            name=f"kvrdma-{name}-{self.port}",
            daemon=True,
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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
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
