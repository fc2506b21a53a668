"""A raw ZMTP 3.0 peer, for exercising the handshake server's connection guard: it sends what
no ZMQ socket does, a message whose last frame never comes (libzmq's pipes pass a message
on only once it is whole)."""

from __future__ import annotations

import socket

__all__ = ["MANY_FRAMES", "UNFINISHED", "send_until_dropped", "zmtp_peer"]

# empty frames, each flagged "more follows": a message that never ends
UNFINISHED = b"\x01\x00" * (1 << 16)
# a whole message of 100,000 empty frames and a last one: 200 KB on the wire
MANY_FRAMES = b"\x01\x00" * 100_000 + b"\x00\x01x"


def zmtp_peer(
    host: str, port: int, *, timeout: float = 5.0, rcvbuf: int | None = None
) -> socket.socket:
    """A DEALER peer (NULL mechanism) connected to `host:port` (with a receive buffer of
    `rcvbuf` bytes: a peer that reads nothing fills it), past its greeting and READY
    command; `ConnectionError` if the server ends the exchange."""
    peer = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if rcvbuf is not None:
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        peer.settimeout(timeout)
        peer.connect((host, port))
        peer.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x01" + b"NULL".ljust(20, b"\0") + bytes(32))
        greeting = b""
        while len(greeting) < 64:
            chunk = peer.recv(64 - len(greeting))
            if not chunk:
                raise ConnectionError("the server closed the connection during the greeting")
            greeting += chunk
        ready = b"\x05READY\x0bSocket-Type" + len(b"DEALER").to_bytes(4, "big") + b"DEALER"
        peer.sendall(b"\x04" + bytes([len(ready)]) + ready)
        flags, size = peer.recv(2, socket.MSG_WAITALL)  # the server's READY, read so that
        if flags != 0x04:  # only the end of the connection is left to read
            raise ConnectionError(f"expected the server's READY command, got flags {flags:#x}")
        peer.recv(size, socket.MSG_WAITALL)
    except BaseException:
        peer.close()
        raise
    return peer


def send_until_dropped(peer: socket.socket, data: bytes, limit: int) -> int:
    """Send `data` again and again until the server drops the connection or `limit` bytes
    went; the bytes sent, or -1 when the connection is still open after that."""
    sent = 0
    try:
        while sent < limit:
            peer.sendall(data)
            sent += len(data)
        peer.settimeout(2.0)
        return -1 if peer.recv(1) else sent
    except (TimeoutError, ConnectionError):
        return -1 if sent >= limit else sent
