"""What the handshake server learns from its sockets' monitors: the clients CURVE refused, and
the TCP connections its `ConnectionGuard`s watch."""

from __future__ import annotations

import logging
import resource
import time

import zmq

from kvrdma.handshake.auth import refusal_monitor, refused_clients
from kvrdma.handshake.guard import CONNECTION_EVENTS, ConnectionGuard
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

    def read(self, monitor: zmq.Socket[bytes]) -> list[str]:
        """Take `monitor`'s events; the endpoints of the clients CURVE refused."""
        guard = self._guards.get(self.monitors[monitor])
        return refused_clients(monitor, None if guard is None else guard.event)

    def delivered(self, sock: zmq.Socket[bytes], frames: list[zmq.Frame]) -> None:
        """`sock` delivered one message (`frames`, received without copy)."""
        guard = self._guards.get(sock)
        if guard is None:
            return
        try:
            fd = frames[-1].get(zmq.SRCFD)
        except zmq.ZMQError:  # ZMTP 1.0 peers' messages carry no descriptor
            return
        guard.delivered(fd)

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
        for monitor in self.monitors:
            monitor.close(linger=0)
        for guard in self._guards.values():
            guard.close()


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
