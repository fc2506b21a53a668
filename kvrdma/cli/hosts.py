"""Which addresses a host name stands for, and whether they are this machine's: what the agent's
settings need to tell its own HTTP endpoint from an engine rank's and hosts it can listen on."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import threading

import zmq

from kvrdma.handshake.endpoints import tcp_endpoint

RESOLVE_TIMEOUT_S = 2.0


def resolve(host: str, family: int = socket.AF_UNSPEC) -> list[tuple[int, str]]:
    """(family, address) of each address `host` stands for, in the resolver's order.

    Raises `OSError` when it does not resolve, or when the resolver has not answered within
    `RESOLVE_TIMEOUT_S` seconds.
    """
    found: list[tuple[int, str]] = []
    failed: list[OSError] = []

    def lookup() -> None:
        try:
            for fam, _, _, _, addr in socket.getaddrinfo(host, None, family, socket.SOCK_STREAM):
                if (fam, str(addr[0])) not in found:
                    found.append((fam, str(addr[0])))
        except OSError as exc:
            failed.append(exc)

    # getaddrinfo takes no deadline and waits out an unreachable DNS server: a daemon thread
    # that is given up on cannot hold the process.
    thread = threading.Thread(target=lookup, name="kvrdma-resolve", daemon=True)
    wait = RESOLVE_TIMEOUT_S
    thread.start()
    thread.join(wait)
    if thread.is_alive():
        raise OSError(f"the resolver gave no answer within {wait:g} s")
    if failed:
        raise failed[0]
    return list(found)


def bind_error(family: int, address: str) -> OSError | None:
    """Why a TCP socket cannot bind `address` (any port), None when it can: the kernel binds
    only addresses of this machine."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
    except OSError as exc:
        return exc
    return None


def is_local(family: int, address: str) -> bool:
    """Whether a connection to the IP `address` reaches this machine: a loopback address, the
    unspecified one (Linux connects it to itself), or one of its own."""
    ip = ipaddress.ip_address(address.partition("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified or bind_error(family, address) is None


def listen_problem(host: str) -> str | None:
    """Why an `EndpointServer` could not listen on `host`, None when it could: it binds the first
    address `host` resolves to (IPv6 for a host with a colon, else IPv4), and only this
    machine's bind."""
    if not host:  # every IPv4 address
        return None
    try:
        family, address = resolve(host, socket.AF_INET6 if ":" in host else socket.AF_INET)[0]
    except OSError as exc:
        return f"it does not resolve ({exc})"
    error = bind_error(family, address)
    if error is None:
        return None
    if error.errno == errno.EADDRNOTAVAIL:
        return f"{address} is not an address of this host"
    return f"{address} cannot be bound ({error})"


def side_channel_problem(host: str) -> str | None:
    """Why the handshake server could not bind `host`, None when it could. ZMQ also binds
    interface names (`eth0`), which `resolve` knows nothing of, so a ZMQ socket binds a free
    port of `host` and is closed, in a thread given up on after `RESOLVE_TIMEOUT_S` (a name
    may wait on the resolver)."""
    failed: list[str] = []

    def bind() -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            sock = ctx.socket(zmq.ROUTER)
            try:
                if ":" in host:
                    sock.setsockopt(zmq.IPV6, 1)
                sock.bind(tcp_endpoint(host, "*"))
            finally:
                sock.close(linger=0)
        except zmq.ZMQError as exc:
            failed.append(os.strerror(exc.errno) if exc.errno else str(exc))
        except Exception as exc:  # e.g. a name that cannot be encoded: no host to bind
            failed.append(str(exc))
        finally:
            ctx.term()

    thread = threading.Thread(target=bind, name="kvrdma-bind-probe", daemon=True)
    thread.start()
    thread.join(RESOLVE_TIMEOUT_S)
    if thread.is_alive():
        return f"binding it gave no answer within {RESOLVE_TIMEOUT_S:g} s"
    return failed[0] if failed else None
