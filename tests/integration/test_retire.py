"""`NixlBackend.retire`: an abandoned READ must never land, and the backend carries on.

Over UCX/TCP a READ from a stopped peer stays in flight; releasing it does not stop its data,
which lands whenever the peer resumes (measured: all of it). `retire` parks the agent (never
called again) and carries on with a fresh one; with `num_threads` UCX copy threads it also
cancels the transfers (the threads drop them) and waits until those threads are idle. These
tests run both sides over `UCX_TLS=tcp` with the producer child of `test_nixl_backend`, the
reader with 0, 1 and the default number of copy threads, and check the bytes, the handles,
the parked agent's lifetime and that the stopped peer survives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from test_nixl_backend import (
    BLOCK,
    MiB,
    Remote,
    blocks,
    expect_message,
    pattern,
    producer,
    region,
    wait,
)

from kvrdma.defaults import ucx_num_threads
from kvrdma.errors import TransferError
from kvrdma.nixl import BackendConfig, MemType, NixlBackend, XferState
from kvrdma.nixl.retire import MAX_PARKED
from kvrdma.testing import stop_process, tcp_only

pytest.importorskip("nixl")

NBYTES = 4 * MiB


@pytest.fixture
def tcp(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Both sides over TCP (children inherit the environment): a stopped peer stalls READs.
    Parametrised "default": UCX's own choice (cma for data on one host, TCP for wire-up)."""
    if getattr(request, "param", "tcp") == "tcp":
        monkeypatch.setenv("UCX_TLS", tcp_only())
    else:
        monkeypatch.delenv("UCX_TLS", raising=False)


THREADS = [0, 1, ucx_num_threads()]  # num_threads: none, one, the configuration's default


@pytest.fixture(params=THREADS, ids=lambda n: f"threads{n}")
def d(tcp: None, request: pytest.FixtureRequest) -> Iterator[tuple[NixlBackend, Any, Any]]:
    """Reader agent "D" (8 MiB zeroed, 16 KiB blocks) over TCP, with `num_threads` UCX copy
    threads (which keep progressing a transfer NIXL still holds)."""
    with reader(request.param) as r:
        yield r


@contextlib.contextmanager
def reader(num_threads: int) -> Iterator[tuple[NixlBackend, Any, Any]]:
    """Reader agent "D": 8 MiB zeroed, registered and prepared as 16 KiB blocks."""
    backend = NixlBackend(BackendConfig(name="D", num_threads=num_threads))
    buf = torch.zeros(8 * MiB, dtype=torch.uint8)
    reg = backend.register(region(buf), MemType.DRAM)
    local = backend.prep_local(blocks(buf.data_ptr(), buf.numel() // BLOCK), MemType.DRAM)
    try:
        yield backend, buf, local
    finally:
        local.release()
        reg.release()
        backend.close()


def _connected(spawn_child: Callable[..., Any], backend: NixlBackend, local: Any, name: str,
               seed: int) -> Remote:  # fmt: skip
    """A producer child, its lists prepared, and one READ done (the connection is up)."""
    p = Remote(backend, spawn_child(producer, name, NBYTES, seed), NBYTES, seed)
    x = backend.post("READ", local, np.arange(2), p.lists, np.arange(2), b"warm")
    assert wait(backend, x).state is XferState.DONE
    x.release()
    assert expect_message(p.child, "notif") == ("notif", backend.agent_name, b"warm")
    return p


def _stalled_read(d: NixlBackend, local: Any, p: Remote, n: int = 64) -> Any:
    """SIGSTOP the producer and post a READ of its first `n` blocks: it stays in flight."""
    stop_process(p.child.pid)
    x = d.post("READ", local, np.arange(n), p.lists, np.arange(n), b"stalled")
    end = time.monotonic() + 0.2
    while time.monotonic() < end:
        assert d.poll(x).state is XferState.PROC
    return x


def _progress(d: NixlBackend, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        d.get_notifs()
        time.sleep(0.001)


def test_retired_read_never_lands_and_handles_keep_working(
    spawn_child: Callable[..., Any], d: Any
) -> None:
    backend, buf, local = d
    p = _connected(spawn_child, backend, local, "P", 5)
    buf.zero_()

    x = _stalled_read(backend, local, p)
    old_md = backend.metadata()
    backend.retire("test: deadline passed")
    assert backend.agent_name == "D.r1" and backend.parked == ["D"]
    assert backend.metadata() != old_md
    res = backend.poll(x)
    assert res.state is XferState.ERR and res.error is not None
    assert "abandoned: test: deadline passed" in res.error and "'P'" in res.error
    x.release()

    os.kill(p.child.pid, signal.SIGCONT)
    _progress(backend, 1.0)  # the old agent is never progressed: nothing may land
    assert int(buf.count_nonzero()) == 0

    # The same handles work on the new agent; the parked one goes once P answered it.
    ids = np.array([7, 3, 11, 2])
    y = backend.post("READ", local, np.arange(4), p.lists, ids, b"after")
    assert wait(backend, y, timeout=10).state is XferState.DONE
    y.release()
    want = pattern(NBYTES, 5).reshape(-1, BLOCK)[ids]
    np.testing.assert_array_equal(buf.numpy().reshape(-1, BLOCK)[:4], want)
    assert expect_message(p.child, "notif") == ("notif", "D.r1", b"after")
    assert backend.parked == []
    assert int(buf.numpy().reshape(-1, BLOCK)[4:64].astype(bool).sum()) == 0
    p.child.send(("stop",))
    assert p.child.result() == "stopped"  # the stopped peer survived all of it


@pytest.mark.parametrize("tcp", ["default"], indirect=True)
def test_retired_read_to_a_peer_stopped_before_wire_up_never_lands(
    spawn_child: Callable[..., Any], d: Any
) -> None:
    """Default transports: over cma a READ needs nothing from the peer once connected, but
    the connection's wire-up does; a first READ to a stopped peer stays in flight."""
    backend, buf, local = d
    p = Remote(backend, spawn_child(producer, "P", NBYTES, 4), NBYTES, 4)
    x = _stalled_read(backend, local, p)
    backend.retire("test: deadline passed")
    assert backend.poll(x).state is XferState.ERR
    x.release()
    os.kill(p.child.pid, signal.SIGCONT)
    _progress(backend, 1.0)
    assert int(buf.count_nonzero()) == 0
    y = backend.post("READ", local, np.arange(4), p.lists, np.arange(4), b"after")
    assert wait(backend, y, timeout=10).state is XferState.DONE
    y.release()
    np.testing.assert_array_equal(buf.numpy()[: 4 * BLOCK], pattern(NBYTES, 4)[: 4 * BLOCK])
    assert int(buf.numpy()[4 * BLOCK : 64 * BLOCK].astype(bool).sum()) == 0
    p.child.send(("stop",))
    assert p.child.result() == "stopped"


def test_retire_with_nothing_in_flight_destroys_the_old_agent_at_once(
    spawn_child: Callable[..., Any], d: Any
) -> None:
    backend, buf, local = d
    p = _connected(spawn_child, backend, local, "P", 6)
    buf.zero_()
    backend.retire("first")
    backend.retire("second")
    assert backend.agent_name == "D.r2" and backend.parked == []
    assert backend.remotes() == ["P"]
    x = backend.post("READ", local, np.arange(8), p.lists, np.arange(8), b"")
    assert wait(backend, x).state is XferState.DONE
    x.release()
    np.testing.assert_array_equal(buf.numpy()[: 8 * BLOCK], pattern(NBYTES, 6)[: 8 * BLOCK])


def test_retire_drops_a_dead_peer_and_keeps_the_live_one(
    spawn_child: Callable[..., Any], d: Any
) -> None:
    backend, buf, local = d
    live = _connected(spawn_child, backend, local, "P1", 2)
    dead = Remote(backend, spawn_child(producer, "P0", NBYTES, 1), NBYTES, 1)
    assert backend.wait_standby(10.0)  # the standby has loaded P0, alive
    buf.zero_()
    dead.child.kill()
    backend.retire("first")  # P0 was loaded into the standby while alive: kept
    assert backend.remotes() == ["P0", "P1"]
    assert backend.wait_standby(10.0)  # the next standby could not load P0 (dead)
    assert backend.retire("peer gone") == ["P0"]
    assert backend.remotes() == ["P1"]
    with pytest.raises(TransferError, match="stale"):
        backend.post("READ", local, np.arange(2), dead.lists, np.arange(2), b"")
    x = backend.post("READ", local, np.arange(2), live.lists, np.arange(2), b"")
    assert wait(backend, x).state is XferState.DONE
    x.release()
    np.testing.assert_array_equal(buf.numpy()[: 2 * BLOCK], pattern(NBYTES, 2)[: 2 * BLOCK])


def test_a_peer_added_after_the_standby_started_survives_a_retirement(
    spawn_child: Callable[..., Any], d: Any
) -> None:
    """The standby loads the peers added after it started too: a retirement keeps them (and
    their lists), so reads and heartbeats to them go on without a new handshake."""
    backend, buf, local = d
    first = _connected(spawn_child, backend, local, "P1", 4)
    assert backend.wait_standby(10.0)  # built with P1 only
    later = _connected(spawn_child, backend, local, "P2", 5)
    assert backend.retire("a read passed its deadline") == []
    assert backend.remotes() == ["P1", "P2"]
    for p, seed in ((later, 5), (first, 4)):
        buf.zero_()
        x = backend.post("READ", local, np.arange(4), p.lists, np.arange(4), b"after")
        assert wait(backend, x).state is XferState.DONE
        x.release()
        np.testing.assert_array_equal(buf.numpy()[: 4 * BLOCK], pattern(NBYTES, seed)[: 4 * BLOCK])


def test_a_peer_restarted_after_the_standby_loaded_it_survives_a_retirement() -> None:
    """A restarted peer (same name, new metadata) replaces its entry in the standby too, so
    the agent a retirement brings in has it, as the live agent did."""
    with NixlBackend(BackendConfig(name="D")) as d:
        dst = torch.zeros(MiB, dtype=torch.uint8)
        reg = d.register(region(dst), MemType.DRAM)
        first = NixlBackend(BackendConfig(name="P"))
        src = torch.ones(MiB, dtype=torch.uint8)
        first_reg = first.register(region(src), MemType.DRAM)
        d.add_remote(first.metadata())
        d.prep_remote("P", blocks(src.data_ptr(), 4), MemType.DRAM).release()  # starts it
        assert d.wait_standby(10.0)
        first_reg.release()
        first.close()
        with NixlBackend(BackendConfig(name="P")) as again:
            src = torch.full((MiB,), 2, dtype=torch.uint8)
            again_reg = again.register(region(src), MemType.DRAM)
            d.add_remote(again.metadata())
            assert d.retire("a read passed its deadline") == []
            lists = d.prep_remote("P", blocks(src.data_ptr(), 4), MemType.DRAM)
            local = d.prep_local(blocks(dst.data_ptr(), 4), MemType.DRAM)
            x = d.post("READ", local, np.arange(4), lists, np.arange(4), b"after")
            assert wait(d, x, progress=[again]).state is XferState.DONE
            x.release()
            assert int(dst[: 4 * BLOCK].min()) == 2
            for h in (lists, local, again_reg):
                h.release()
        reg.release()


def test_parked_agents_are_bounded(spawn_child: Callable[..., Any], d: Any) -> None:
    backend, _, local = d
    p = _connected(spawn_child, backend, local, "P", 3)
    stop_process(p.child.pid)
    for i in range(MAX_PARKED + 2):
        y = backend.post("READ", local, np.arange(4), p.lists, np.arange(4), b"")
        assert backend.poll(y).state is XferState.PROC
        backend.retire(f"round {i}")
        assert backend.poll(y).state is XferState.ERR
        y.release()
        assert len(backend.parked) == min(i + 1, MAX_PARKED)
    assert backend.parked == [f"D.r{g}" for g in range(2, 2 + MAX_PARKED)]  # oldest went
    p.child.kill()  # resumed, it would abort: the oldest parked agent it owed data is gone
    backend.close()  # destroys the parked agents too
    assert backend.parked == []


@pytest.mark.parametrize("tcp", ["default"], indirect=True)
def test_after_one_read_every_copy_thread_reads_a_stopped_peer(
    spawn_child: Callable[..., Any], d: Any
) -> None:
    """Default transports: once one READ to a peer is done, every UCX worker a later READ
    may run on is wired up to it, so a READ spread over all copy threads completes while the
    peer is stopped (cma copies on the reader's side alone). Repeated on fresh agents."""
    backend, buf, local = d
    p = Remote(backend, spawn_child(producer, "P", NBYTES, 8), NBYTES, 8)
    want = pattern(NBYTES, 8)[: 64 * BLOCK]
    for i in range(5):
        buf.zero_()
        x = backend.post("READ", local, np.arange(1), p.lists, np.arange(1), b"")
        assert wait(backend, x, timeout=10).state is XferState.DONE
        x.release()
        stop_process(p.child.pid)
        try:
            y = backend.post("READ", local, np.arange(64), p.lists, np.arange(64), b"")
            assert wait(backend, y, timeout=5).state is XferState.DONE, f"round {i}"
            y.release()
        finally:
            os.kill(p.child.pid, signal.SIGCONT)
        np.testing.assert_array_equal(buf.numpy()[: 64 * BLOCK], want)
        backend.retire(f"round {i}")  # nothing in flight: a fresh agent, cold connections
    p.child.send(("stop",))
    assert p.child.result() == "stopped"
