"""What the handshake server learns from its sockets' monitors: the clients CURVE refused, and
the TCP connections its `ConnectionGuard`s watch; and the messages it receives, bounded in
frames."""

from __future__ import annotations

import logging
import resource
import time

import zmq

from kvrdma.handshake.auth import refusal_monitor, refused_clients
from kvrdma.handshake.guard import CONNECTION_EVENTS, ConnectionGuard
from kvrdma.handshake.replies_queue import MAX_AGE_S
from kvrdma.log_limit import RateLimitedLog
from kvrdma.types import ConnectionDrop

logger = logging.getLogger(__name__)

__all__ = ["SocketMonitors", "raise_open_files_limit"]

# Bytes a TCP peer may send without ending a message, in frames of the socket's largest size:
# far above any client's requests in flight, far below what its frames cost libzmq to hold.
_PER_CONNECTION_FRAMES = 4
_TOTAL_FRAMES = 64
_MIN_INTERVAL_S = 0.05
# Share of the process's descriptors one socket's connections may hold: libzmq out of them
# accepts no one, and the process (vLLM's scheduler, say) needs its own.
_DESCRIPTOR_SHARE = 4
_MIN_CONNECTIONS = 16
_UNLIMITED_FILES = 1 << 20  # what an unlimited hard limit is raised to (Linux's default nr_open)
# between checks, per connection: checking is then a small share of the thread's time
_SECONDS_PER_CONNECTION = 20e-6
# A client's message has 2 or 3 frames: the server keeps at most `MAX_FRAMES` of one (and its
# last), enough for a "bad_frame" reply. libzmq holds a small frame at far more than its bytes
# and each costs the server a receive: a message of more than `HOSTILE_FRAMES` is refused
# unanswered and its connection shut down.
MAX_FRAMES = 8
HOSTILE_FRAMES = 1024
_REFUSED_LOG_INTERVAL_S = 10.0
Source = tuple["zmq.Socket[bytes]", int, str]  # (socket, connection descriptor, its peer)


class SocketMonitors:
    """The monitors of ROUTER sockets (`{socket: its largest frame}`), made and read by the
    thread that owns the sockets; `close()` before the sockets."""

    def __init__(self, sockets: dict[zmq.Socket[bytes], int], *, curve: bool) -> None:
        self._guards = {
            sock: ConnectionGuard(
                per_connection=_PER_CONNECTION_FRAMES * max_frame,
                total=_TOTAL_FRAMES * max_frame,
                max_connections=_max_connections(),
            )
            for sock, max_frame in sockets.items()
            if sock.getsockopt_string(zmq.LAST_ENDPOINT).startswith("tcp://")
        }
        self.monitors = {
            refusal_monitor(sock, CONNECTION_EVENTS if sock in self._guards else 0): sock
            for sock in sockets
            if curve or sock in self._guards
        }
        self._checked = 0.0
        self._curve = curve
        self._refused_log = RateLimitedLog(logger, logging.WARNING, _REFUSED_LOG_INTERVAL_S)
        self._clients_log = RateLimitedLog(logger, logging.WARNING, _REFUSED_LOG_INTERVAL_S)
        self._stalled_log = RateLimitedLog(logger, logging.WARNING, _REFUSED_LOG_INTERVAL_S)

    def receive(self, sock: zmq.Socket[bytes]) -> list[zmq.Frame] | None:
        """`sock`'s next message (raises `zmq.Again` when none waits): its first `MAX_FRAMES`
        frames and its last (a message's frames arrive together; the others are received and
        dropped as they come), or None for one of more than `HOSTILE_FRAMES`, whose
        connection is shut down."""
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        frames, count = [frame], 1
        while frame.more:
            frame = sock.recv(zmq.NOBLOCK, copy=False)
            count += 1
            if count <= MAX_FRAMES:
                frames.append(frame)
        if count > MAX_FRAMES:
            frames.append(frame)
        if count <= HOSTILE_FRAMES:
            self.delivered(sock, frames)
            return frames
        guard, fd = self._guards.get(sock), _source(frame)
        peer = guard.drop(fd) if guard is not None and fd is not None else None
        self._refused_log.occurred(
            "handshake server: refused a message of %d frames (at most %d) from %s",
            count,
            HOSTILE_FRAMES,
            f"{peer}: connection shut down" if peer else "a peer",
        )
        return None

    def read(self, monitor: zmq.Socket[bytes]) -> list[str]:
        """Take `monitor`'s events; the endpoints of the clients CURVE refused (without CURVE
        a failed handshake is a port probe or a stranger to ZMTP, refused by no one)."""
        guard = self._guards.get(self.monitors[monitor])
        refused = refused_clients(monitor, None if guard is None else guard.event)
        if not self._curve:
            return []
        for endpoint in refused:  # a client retrying with a wrong key must not flood the log
            self._clients_log.occurred("side channel: refused a client (on %s)", endpoint)
        return refused

    def delivered(self, sock: zmq.Socket[bytes], frames: list[zmq.Frame]) -> None:
        """`sock` delivered one message (`frames`, received without copy)."""
        guard = self._guards.get(sock)
        fd = None if guard is None else _source(frames[-1])
        if guard is not None and fd is not None:
            guard.delivered(fd)

    def source(self, sock: zmq.Socket[bytes], frames: list[zmq.Frame]) -> Source | None:
        """The connection a message `sock` delivered came on, as `shut` takes it (None: not
        one a guard watches)."""
        guard = self._guards.get(sock)
        fd = None if guard is None else _source(frames[-1])
        if guard is None or fd is None:
            return None
        peer = guard.peer(fd)
        return None if peer is None else (sock, fd, peer)

    def shut(self, source: Source) -> None:
        """Shut down the connection of `source` (if it still is that peer's) whose replies its
        peer has not read for `replies_queue.MAX_AGE_S`: that frees what ZMQ holds for it."""
        sock, fd, peer = source
        guard = self._guards.get(sock)
        if guard is not None and guard.peer(fd) == peer and guard.drop(fd):
            self._stalled_log.occurred(
                "handshake server: dropped the connection of %s, which read no reply for %g s",
                peer,
                MAX_AGE_S,
            )

    def enforce(self) -> list[tuple[zmq.Socket[bytes], ConnectionDrop]]:
        """Drop the connections over their guard's bounds, when a check is due; the socket
        each one was on, and why. Many idle connections must not keep the thread from serving,
        so checks come less often the more connections there are."""
        conns = sum(len(g) for g in self._guards.values())
        if time.monotonic() - self._checked < max(_MIN_INTERVAL_S, _SECONDS_PER_CONNECTION * conns):
            return []
        self._checked = time.monotonic()
        return [(sock, why) for sock, guard in self._guards.items() for _, why in guard.check()]

    def close(self) -> None:
        self._refused_log.flush(force=True)
        self._clients_log.flush(force=True)
        self._stalled_log.flush(force=True)
        for monitor in self.monitors:
            monitor.close(linger=0)
        for guard in self._guards.values():
            guard.close()


def _source(frame: zmq.Frame) -> int | None:
    """The descriptor of the connection `frame` came on (ZMTP 1.0 peers' name none)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except zmq.ZMQError:
        return None


def _max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = _UNLIMITED_FILES
    return max(_MIN_CONNECTIONS, soft // _DESCRIPTOR_SHARE)


def raise_open_files_limit() -> int:
    """Raise this process's soft open-files limit to its hard limit, for a process that is
    mostly a server (the agent): the connections a socket keeps are a share of the soft
    limit, and containers often start at 1024. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _UNLIMITED_FILES if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:  # above the kernel's nr_open, say
            logger.warning(
                "open-files limit stays %d (raising it to %d failed: %s)", soft, want, exc
            )
            return soft
        logger.info("open-files limit raised from %d to %d", soft, want)
        return want
    return soft
