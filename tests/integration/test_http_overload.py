"""The HTTP endpoints under responders that fail hard and under floods of requests."""

from __future__ import annotations

import logging
import re
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

import pytest

from kvrdma.http_server import READ_TIMEOUT_SECONDS, EndpointServer, Response

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


WAITING = 100  # complete requests that find the only handler thread busy


def test_connections_closed_for_want_of_a_thread_cost_a_bounded_number_of_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each connection that waited too long for a handler thread is closed; a flood of them
    must not log a warning each, yet the warnings still say how many were closed."""
    caplog.set_level("DEBUG", logger="kvrdma")
    release = threading.Event()

    def respond(path: str, headers: Mapping[str, str]) -> Response:
        release.wait(30)
        return Response(200, "text/plain", b"ok\n")

    with EndpointServer(HOST, 0, respond, max_threads=1) as server:
        socks = [socket.create_connection((HOST, server.port), timeout=5) for _ in range(WAITING)]
        try:
            for s in socks:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert _closed_unanswered(socks, seconds=READ_TIMEOUT_SECONDS + 5) == WAITING - 1
        finally:
            release.set()
            for s in socks:
                s.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(warnings) <= 2, warnings
    more = [re.search(r"and (\d+) more", w) for w in warnings]
    assert sum(1 + int(m[1]) if m else 1 for m in more) == WAITING - 1, warnings


def _closed_unanswered(socks: list[socket.socket], seconds: float) -> int:
    """How many of `socks` the server closes without a reply within `seconds`, once all but
    one of them are closed (the one a handler thread holds)."""
    closed = 0
    deadline = time.monotonic() + seconds
    with selectors.DefaultSelector() as sel:
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        while closed < len(socks) - 1 and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                sel.unregister(key.fileobj)
                try:
                    reply = key.fileobj.recv(1)  # type: ignore[union-attr]
                except ConnectionResetError:
                    reply = b""
                assert reply == b"", "a connection waiting for a thread got a reply"
                closed += 1
    return closed


# Connections that send most of a request head at once, never its end, then one more byte at
# a time: each byte makes the server look for the head's end again.
LONG_HEADS = """
import selectors, socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
sel = selectors.DefaultSelector()
head = b"GET / HTTP/1.1\\r\\nX: a" + b"\\r\\n\\ra" * 15_000  # no blank line in it
def open_one():
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(head)
    s.setblocking(False)
    sel.register(s, selectors.EVENT_READ)
for _ in range(n):
    open_one()
print("started", flush=True)
while True:
    for key, _ in sel.select(0.01):  # readable: the server closed it
        sel.unregister(key.fileobj)
        key.fileobj.close()
        open_one()
    for key in list(sel.get_map().values()):
        try:
            key.fileobj.send(b"a")
        except OSError:
            pass
"""
LONG_HEAD_CLIENTS = 450
PROBE_BUDGET_S = 0.1


def test_probes_answer_at_once_while_hundreds_of_long_heads_trickle_in() -> None:
    def respond(path: str, headers: Mapping[str, str]) -> Response:
        return Response(200, "text/plain", b"ok\n")

    with EndpointServer(HOST, 0, respond, quick_paths=QUICK) as server:
        args = [sys.executable, "-c", LONG_HEADS, str(server.port), str(LONG_HEAD_CLIENTS)]
        with subprocess.Popen(args, stdout=subprocess.PIPE, text=True) as slow:
            try:
                assert slow.stdout is not None and slow.stdout.readline().strip() == "started"
                timings = []
                for _ in range(12):  # over two read deadlines: cut clients are back meanwhile
                    t0 = time.perf_counter()
                    assert get(server.port, "/healthz").startswith(b"HTTP/1.0 200")
                    timings.append(time.perf_counter() - t0)
                    time.sleep(4 * READ_TIMEOUT_SECONDS / 12)
            finally:
                slow.kill()
    # The half of the probes within budget: a rescan of every head per byte made each one
    # slow, while a probe meeting the wave of cut clients reconnecting may be slow anyway.
    assert statistics.median(timings) < PROBE_BUDGET_S, [round(t, 3) for t in sorted(timings)]


@pytest.mark.parametrize(
    ("end", "cut"), [(b"\r\n\r\n", 1), (b"\r\n\r\n", 2), (b"\r\n\r\n", 3), (b"\n\n", 1)]
)
def test_a_head_whose_end_arrives_in_two_reads_is_answered(end: bytes, cut: int) -> None:
    def respond(path: str, headers: Mapping[str, str]) -> Response:
        return Response(200, "text/plain", b"ok\n")

    with (
        EndpointServer(HOST, 0, respond) as server,
        socket.create_connection((HOST, server.port), timeout=5) as s,
    ):
        s.sendall(b"GET / HTTP/1.0" + end[:cut])
        time.sleep(0.1)  # the server has read the first part
        s.sendall(end[cut:])
        assert s.recv(12) == b"HTTP/1.0 200"
