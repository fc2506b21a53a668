"""The HTTP endpoints under responders that fail hard and under floods of requests."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

import pytest

from kvrdma.http_server import EndpointServer, Response

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
QUICK = frozenset({"/healthz"})


def get(port: int, path: str, timeout: float = 5.0) -> bytes:
    """The whole reply to one GET on a fresh connection (b"" when closed unanswered)."""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def test_a_responder_raising_systemexit_gets_a_500_and_costs_no_thread() -> None:
    def respond(path: str, headers: Mapping[str, str]) -> Response:
        if path == "/exit":
            raise SystemExit(1)
        return Response(200, "text/plain", b"ok\n")

    with EndpointServer(HOST, 0, respond, max_threads=1) as server:
        for _ in range(3):
            assert get(server.port, "/exit").startswith(b"HTTP/1.0 500")
        assert get(server.port, "/ok").startswith(b"HTTP/1.0 200")


# Complete requests for a slow path, as fast as one process can open connections: each waits
# for a handler thread, and there are soon more of them than `MAX_PENDING`.
FLOOD = """
import socket, sys
port = int(sys.argv[1])
print("started", flush=True)
while True:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /slow HTTP/1.0\\r\\n\\r\\n")
"""


def test_probes_are_answered_while_more_requests_wait_for_a_thread_than_are_kept() -> None:
    """Past `MAX_PENDING` the oldest connection is closed: under a flood of requests waiting
    for a busy handler thread that must be one of them, not a probe that has just connected."""
    release = threading.Event()

    def respond(path: str, headers: Mapping[str, str]) -> Response:
        if path == "/slow":
            release.wait(30)
        return Response(200, "text/plain", b"ok\n")

    with EndpointServer(HOST, 0, respond, max_threads=2, quick_paths=QUICK) as server:
        flood = subprocess.Popen(
            [sys.executable, "-c", FLOOD, str(server.port)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert flood.stdout is not None and flood.stdout.readline().strip() == "started"
            time.sleep(1.0)  # more requests are waiting for a thread than the server keeps
            replies = []
            for _ in range(20):
                try:
                    replies.append(get(server.port, "/healthz")[:12])
                except OSError as exc:  # closed to make room
                    replies.append(repr(exc).encode())
                time.sleep(0.05)
        finally:
            flood.kill()
            flood.communicate(timeout=10)
            release.set()
    assert replies == [b"HTTP/1.0 200"] * 20, [r for r in replies if r != b"HTTP/1.0 200"]
