"""ZMQ address helpers shared by the handshake client, publisher and server."""

from __future__ import annotations

import ipaddress
import os

__all__ = ["ensure_ipc_dir", "ipc_file_id", "loopback_tcp", "tcp_endpoint", "tcp_port"]


def tcp_endpoint(host: str, port: int | str) -> str:
    """`tcp://host:port`, with IPv6 literals bracketed."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def ensure_ipc_dir(address: str) -> None:
    """Create the directory of an `ipc://` address (a shared volume may start empty)."""
    if address.startswith("ipc://"):
        directory = os.path.dirname(address[len("ipc://") :])
        if directory:
            os.makedirs(directory, exist_ok=True)


def ipc_file_id(address: str) -> tuple[str, int] | None:
    """(path, inode) of the file behind an `ipc://` address, None for other transports."""
    if not address.startswith("ipc://"):
        return None
    path = address[len("ipc://") :]
    try:
        return path, os.stat(path).st_ino
    except OSError:
        return None


def tcp_port(address: str) -> int | None:
    """The PORT of `tcp://HOST:PORT` when it is an integer in 0..65535, else None (libzmq
    would bind another port for 99999, or fail naming no flag for `abc`)."""
    port = address.rpartition(":")[2]
    if not address.startswith("tcp://") or not (port.isascii() and port.isdigit()):
        return None
    return int(port) if len(port) <= 5 and int(port) <= 65535 else None


def loopback_tcp(address: str) -> bool:
    """True for `tcp://HOST:PORT` whose HOST is a loopback IP address and PORT a port number."""
    host = address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if not address.startswith("tcp://") or not host or tcp_port(address) is None:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name or an interface: it may resolve off this host
        return False
