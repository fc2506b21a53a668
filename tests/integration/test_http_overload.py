"""The HTTP endpoints under responders that fail hard and under floods of requests."""

from __future__ import annotations

import socket
from collections.abc import Mapping

import pytest

from kvrdma.http_server import EndpointServer, Response

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"


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
