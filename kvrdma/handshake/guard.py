"""A bound on the bytes a TCP peer can make a ROUTER socket buffer before a message of it arrives.

libzmq hands a multipart message to the application only once its last frame arrived, keeps
every frame before that in memory (a small frame costs it far more than its bytes), and limits the
size of a frame (`MAXMSGSIZE`) and the number of whole messages queued (`RCVHWM`) but not the
number of frames in one message: a peer that never ends a message could fill the host. The
guard reads, for each TCP connection, how many bytes the kernel received from it since a
message of it was last delivered, and shuts the connection down once that passes a bound
(or, when all connections together pass theirs, the largest ones). A ZMTP 1.0 peer's messages
do not name their connection: its bytes add up until the bound, as a hostile peer's would.

libzmq also keeps a connection that says nothing after its greeting for as long as the peer
likes, and once out of descriptors accepts no one (its I/O thread spinning on the listening
socket): past `max_connections`, the guard drops the connections idle the longest. A client
reconnects by itself, and a real one is idle for no longer than its request takes.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvrdma.log_limit import RateLimitedLog
from kvrdma.types import ConnectionDrop

__all__ = ["CONNECTION_EVENTS", "ConnectionGuard"]

logger = logging.getLogger(__name__)

CONNECTION_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
# `struct tcp_info`: tcpi_bytes_received (Linux 4.1+) and the size that holds it.
_BYTES_RECEIVED = struct.Struct("<Q")
_BYTES_RECEIVED_OFFSET = 128
_TCP_INFO_SIZE = _BYTES_RECEIVED_OFFSET + _BYTES_RECEIVED.size
_NO_LINGER = struct.pack("ii", 1, 0)
_SHED_LOG_INTERVAL_S = 10.0


@dataclass
class _Connection:
    sock: socket.socket  # over libzmq's descriptor: detached, never closed
    peer: str
    mark: int = 0  # bytes received when a message of this connection was last delivered
    since: float = 0.0  # when it was accepted or last delivered a message

    def received(self) -> int | None:
        """The bytes the connection received so far; None when it is gone."""
        try:
            info = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
        except OSError:
            return None
        if len(info) < _TCP_INFO_SIZE:
            return None
        return int(_BYTES_RECEIVED.unpack_from(info, _BYTES_RECEIVED_OFFSET)[0])


class ConnectionGuard:
    """Shuts down TCP connections whose bytes not yet delivered as a message pass a bound.

    Fed the socket monitor's `CONNECTION_EVENTS` (`event`) and the descriptor of each message
    the socket delivers (`delivered`); `check()` enforces `per_connection` bytes on each
    connection and `total` on all together. Connections it cannot read (not TCP, or already
    closed) are left alone. `close()` (idempotent, also on garbage collection) lets go of
    libzmq's descriptors without closing them.
    """

    def __init__(
        self,
        *,
        per_connection: int,
        total: int,
        max_connections: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_connection, self.total = per_connection, total
        self.max_connections, self._clock = max_connections, clock
        self._conns: dict[int, _Connection] = {}
        # a flood of connections must not flood the log
        self._shed_log = RateLimitedLog(logger, logging.WARNING, _SHED_LOG_INTERVAL_S, clock)

    def __len__(self) -> int:
        return len(self._conns)

    def event(self, event: int, fd: int) -> None:
        """Track a connection accepted on descriptor `fd`, or forget a closed one."""
        self._forget(fd)
        if event != zmq.EVENT_ACCEPTED:
            return
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # closed again before its event was read
            return
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (
                socket.AF_INET,
                socket.AF_INET6,
            ):
                raise OSError(f"descriptor {fd} is not a TCP connection")
            conn = _Connection(sock, _peer_name(sock))
        except OSError:
            sock.detach()
            return
        conn.mark, conn.since = conn.received() or 0, self._clock()
        self._conns[fd] = conn

    def delivered(self, fd: int) -> None:
        """A whole message of connection `fd` was received: what came before it is gone."""
        conn = self._conns.get(fd)
        if conn is not None:
            conn.mark, conn.since = conn.received() or conn.mark, self._clock()

    def peer(self, fd: int) -> str | None:
        """The peer of connection `fd`, None when it is not one watched."""
        conn = self._conns.get(fd)
        return None if conn is None else conn.peer

    def drop(self, fd: int) -> str | None:
        """Shut down connection `fd` now; its peer, or None when it is not one watched."""
        conn = self._conns.get(fd)
        return conn.peer if conn is not None and self._shut_down(fd) else None

    def check(self) -> list[tuple[str, ConnectionDrop]]:
        """Shut down the connections over the byte bounds, then the idlest ones past
        `max_connections`; each peer dropped, with why."""
        backlog: dict[int, int] = {}
        for fd, conn in list(self._conns.items()):
            received = conn.received()
            if received is None:
                self._forget(fd)
            else:
                backlog[fd] = max(0, received - conn.mark)
        over = [fd for fd, n in backlog.items() if n > self.per_connection]
        left = sum(backlog.values()) - sum(backlog[fd] for fd in over)
        if left > self.total:  # the largest go first, until the others fit the total
            for fd in sorted(backlog, key=backlog.__getitem__, reverse=True):
                if left <= self.total:
                    break
                if backlog[fd] <= self.per_connection:
                    over.append(fd)
                    left -= backlog[fd]
        dropped: list[tuple[str, ConnectionDrop]] = []
        for fd in over:
            peer = self._conns[fd].peer
            if self._shut_down(fd):
                logger.warning(
                    "handshake server: dropped the connection of %s, which sent %d bytes "
                    "without ending a message (at most %d per connection, %d for all)",
                    peer,
                    backlog[fd],
                    self.per_connection,
                    self.total,
                )
                dropped.append((peer, ConnectionDrop.UNFINISHED_MESSAGE))
        return dropped + [(peer, ConnectionDrop.IDLE) for peer in self._shed()]

    def _shed(self) -> list[str]:
        """Shut down the connections idle the longest past `max_connections`; their peers."""
        excess = len(self._conns) - self.max_connections
        if excess <= 0:
            return []
        idlest = sorted(self._conns, key=lambda fd: self._conns[fd].since)[:excess]
        shed = []
        for fd in idlest:
            peer = self._conns[fd].peer
            if self._shut_down(fd):
                self._shed_log.occurred(
                    "handshake server: more than %d connections open: dropped that of %s, "
                    "idle the longest",
                    self.max_connections,
                    peer,
                )
                shed.append(peer)
        self._shed_log.flush()
        return shed

    def close(self) -> None:
        self._shed_log.flush(force=True)
        for fd in list(self._conns):
            self._forget(fd)

    def __del__(self) -> None:
        self.close()

    def _forget(self, fd: int) -> None:
        conn = self._conns.pop(fd, None)
        if conn is not None:
            conn.sock.detach()

    def _shut_down(self, fd: int) -> bool:
        conn = self._conns[fd]
        try:
            if _peer_name(conn.sock) != conn.peer:  # the descriptor now serves another peer
                return False
            # shutdown, not close: libzmq owns the descriptor, sees the end and closes it;
            # no linger, so that close resets the connection instead of keeping it open
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _NO_LINGER)
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        finally:
            self._forget(fd)
        return True


def _peer_name(sock: socket.socket) -> str:
    host, port = sock.getpeername()[:2]
    return f"{host}:{port}"
