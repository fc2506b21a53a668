"""A small HTTP server for probes and `/metrics` that slow or vanishing clients cannot wedge.

One request per connection (HTTP/1.0). Reading the request line and headers has one overall
deadline (a client trickling bytes cannot hold a thread), writes have their own timeout, at
most `max_threads` requests are served at once (the rest wait in a `backlog`-deep listen
queue), and a client that hangs up costs a debug log line, never a traceback on stderr.
"""

from __future__ import annotations

import gzip
import io
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, choose_encoder, generate_latest

logger = logging.getLogger(__name__)

READ_TIMEOUT_SECONDS = 2.0  # to receive the whole request head
WRITE_TIMEOUT_SECONDS = 5.0  # per send of the reply
MAX_THREADS = 64
BACKLOG = 128
_POLL_SECONDS = 0.05


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
        super().setup()
        raw = DeadlineReader(self.connection, time.monotonic() + self.server.read_timeout)
        self.rfile = io.BufferedReader(raw)

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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

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
        # A connection waits for a thread until a busy one must have hit its read deadline.
        self._slot_wait = read_timeout + 1.0
        self.closing = threading.Event()
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        give_up = time.monotonic() + self._slot_wait
        while not self._slots.acquire(timeout=_POLL_SECONDS):
            if self.closing.is_set() or time.monotonic() > give_up:
                logger.warning("%s: no free thread, connection from %s closed", self.name,
                               client_address)  # fmt: skip
                self.shutdown_request(request)
                return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver prints a traceback to stderr here; a client that vanished is routine.
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            logger.debug("%s: connection from %s failed: %r", self.name, client_address, error)
        else:
            logger.error("%s: request from %s failed: %r", self.name, client_address, error)


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
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": _POLL_SECONDS},
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
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

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
