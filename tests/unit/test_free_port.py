"""kvrdma.testing.free_port hands out bindable ports below the ephemeral range, never twice."""

from __future__ import annotations

import socket

import pytest

from kvrdma.testing import free_port


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(20000 <= p <= 32000 for p in ports)
    for port in ports[:5]:
        with socket.create_server(("127.0.0.1", port)):
            pass


def test_a_port_handed_out_once_is_not_handed_out_again() -> None:
    port = free_port()
    with pytest.raises(RuntimeError, match="no free port"):
        free_port(port, port)


def test_a_port_in_use_is_never_handed_out() -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"no free port in {port}..{port}"):
            free_port(port, port)
