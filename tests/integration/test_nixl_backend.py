"""`NixlBackend` against the real NIXL (UCX on loopback: cma for data, tcp for wire-up).

Cheap cases use two agents in this process (the test drives the target's progress by
calling its `get_notifs`); READ/WRITE, notifications and peer failures use a producer agent
in a child process that serves until told to stop.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvrdma.errors import ConfigError, HandshakeError, RegistrationError, TransferError
from kvrdma.nixl import (
    BackendConfig,
    DescList,
    MemType,
    NixlBackend,
    TransferBackend,
    Xfer,
    XferResult,
    XferState,
)
from kvrdma.nixl.checks import MD_MAGIC, unwrap_metadata
from kvrdma.testing import nvidia_gpu_present, stop_process

pytest.importorskip("nixl")

BLOCK = 16 * 1024
MiB = 1 << 20


# ---- helpers ---------------------------------------------------------------------------------
def pattern(nbytes: int, seed: int) -> npt.NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def region(t: torch.Tensor) -> npt.NDArray[np.uint64]:
    dev = max(t.get_device(), 0)
    return np.array([[t.data_ptr(), t.numel() * t.element_size(), dev]], dtype=np.uint64)


def blocks(addr: int, n: int, block: int = BLOCK, dev: int = 0) -> npt.NDArray[np.uint64]:
    """(n, 3) descriptors of n consecutive blocks from addr."""
    out = np.empty((n, 3), dtype=np.uint64)
    out[:, 0] = addr + np.arange(n, dtype=np.uint64) * block
    out[:, 1] = block
    out[:, 2] = dev
    return out


def wait(
    backend: TransferBackend,
    xfer: Xfer,
    timeout: float = 10.0,
    progress: Sequence[TransferBackend] = (),
) -> XferResult:
    """Poll until not PROC (driving the targets' progress), or fail after `timeout`."""
    end = time.monotonic() + timeout
    while (res := backend.poll(xfer)).state is XferState.PROC:
        for p in progress:
            p.get_notifs()
        if time.monotonic() > end:
            xfer.release()
            pytest.fail(f"transfer still PROC after {timeout}s")
    return res


def wait_notifs(
    backend: TransferBackend, timeout: float = 10.0, progress: Sequence[TransferBackend] = ()
) -> dict[str, list[bytes]]:
    """Notifications for `backend`, driving `progress` (e.g. the sender) meanwhile."""
    end = time.monotonic() + timeout
    while not (got := backend.get_notifs()):
        for p in progress:
            p.get_notifs()
        if time.monotonic() > end:
            pytest.fail(f"no notification within {timeout}s")
    return got


def expect_message(child: Any, tag: str, timeout: float = 10.0) -> tuple[Any, ...]:
    """The child's next message with `tag`, skipping others (e.g. notifications)."""
    end = time.monotonic() + timeout
    while True:
        msg = child.recv(max(0.0, end - time.monotonic()))
        if msg[0] == tag:
            return tuple(msg)


# ---- the producer process -------------------------------------------------------------------
def producer(conn: Connection, name: str, nbytes: int, seed: int) -> str:
    """Register a patterned torch tensor, publish metadata, serve until ("stop",).

    Sends ("ready", metadata, addr) then ("notif", sender, message) for every notification;
    answers ("add_remote", md), ("send_notif", agent, msg) and ("blocks", ids) → ("blocks", bytes).
    It calls get_notifs in its loop: without the progress thread, that is what lets readers in.
    """
    logging.getLogger("nixl").setLevel(logging.WARNING)
    buf = torch.from_numpy(pattern(nbytes, seed))
    with NixlBackend(BackendConfig(name=name)) as backend:
        reg = backend.register(region(buf), MemType.DRAM)
        conn.send(("ready", backend.metadata(), buf.data_ptr()))
        while True:
            for sender, msgs in backend.get_notifs().items():
                for m in msgs:
                    conn.send(("notif", sender, m))
            if not conn.poll(0.0005):
                continue
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            if cmd[0] == "add_remote":
                conn.send(("added", backend.add_remote(cmd[1])))
            elif cmd[0] == "send_notif":
                backend.send_notif(cmd[1], cmd[2])
                conn.send(("sent",))
            elif cmd[0] == "blocks":
                view = buf.numpy().reshape(-1, BLOCK)
                conn.send(("blocks", view[np.asarray(cmd[1])].tobytes()))
        reg.release()
    return "stopped"


class Remote:
    """The reader's view of a producer child: lists prepared against its memory."""

    def __init__(self, d: NixlBackend, child: Any, nbytes: int, seed: int) -> None:
        _, md, addr = expect_message(child, "ready", timeout=20)
        self.child, self.seed, self.n = child, seed, nbytes // BLOCK
        self.name = d.add_remote(md)
        self.lists = d.prep_remote(self.name, blocks(addr, self.n), MemType.DRAM)


@pytest.fixture
def reader() -> Iterator[tuple[NixlBackend, torch.Tensor, DescList]]:
    """Agent D with an 8 MiB zeroed buffer, registered and prepared as 16 KiB blocks."""
    d = NixlBackend(BackendConfig(name="D"))
    buf = torch.zeros(8 * MiB, dtype=torch.uint8)
    reg = d.register(region(buf), MemType.DRAM)
    local = d.prep_local(blocks(buf.data_ptr(), buf.numel() // BLOCK), MemType.DRAM)
    try:
        yield d, buf, local
    finally:
        local.release()
        reg.release()
        d.close()


# ---- cross-process ---------------------------------------------------------------------------
def test_read_write_and_notifications_between_processes(
    spawn_child: Callable[..., Any], reader: tuple[NixlBackend, torch.Tensor, DescList]
) -> None:
    d, buf, local = reader
    p = Remote(d, spawn_child(producer, "P", 8 * MiB, 7), 8 * MiB, 7)
    rng = np.random.default_rng(0)
    rids = rng.permutation(p.n)[:300]
    lids = rng.permutation(p.n)[:300]

    x = d.post("READ", local, lids, p.lists, rids, b"req-1")
    res = wait(d, x)
    assert res.state is XferState.DONE, res.error
    x.release()
    got = buf.numpy().reshape(-1, BLOCK)
    np.testing.assert_array_equal(got[lids], pattern(8 * MiB, 7).reshape(-1, BLOCK)[rids])
    assert res.telemetry is not None
    assert res.telemetry.bytes == 300 * BLOCK
    assert 1 <= res.telemetry.descriptors <= 300
    assert res.telemetry.xfer_seconds >= 0 and res.telemetry.post_seconds >= 0
    assert expect_message(p.child, "notif") == ("notif", "D", b"req-1")

    # WRITE our blocks over three of the producer's, then read them back through the pipe.
    got[:3] = 0xAB
    x = d.post("WRITE", local, np.arange(3), p.lists, np.array([5, 0, 9]), b"wrote")
    assert wait(d, x).state is XferState.DONE
    x.release()
    assert expect_message(p.child, "notif") == ("notif", "D", b"wrote")
    p.child.send(("blocks", [5, 0, 9]))
    assert expect_message(p.child, "blocks")[1] == bytes([0xAB]) * (3 * BLOCK)

    # A target that notifies its reader needs the reader's metadata too.
    p.child.send(("add_remote", d.metadata()))
    assert expect_message(p.child, "added") == ("added", "D")
    p.child.send(("send_notif", "D", b"pong"))
    assert wait_notifs(d) == {"P": [b"pong"]}
    p.child.send(("stop",))
    assert p.child.result() == "stopped"


def test_peer_killed_mid_transfer_is_err_not_exception(
    spawn_child: Callable[..., Any], reader: tuple[NixlBackend, torch.Tensor, DescList]
) -> None:
    d, _, local = reader
    p = Remote(d, spawn_child(producer, "P", 8 * MiB, 1), 8 * MiB, 1)
    # Stopped, the peer cannot complete the connection wire-up: the READ stays in flight.
    stop_process(p.child.pid)
    x = d.post("READ", local, np.arange(64), p.lists, np.arange(64), b"never")
    assert d.poll(x).state is XferState.PROC
    p.child.kill()
    t0 = time.monotonic()
    res = wait(d, x, timeout=10)
    assert res.state is XferState.ERR
    assert res.error is not None and "disconnected" in res.error and "'P'" in res.error
    assert res.peer_lost
    assert time.monotonic() - t0 < 5
    x.release()
    x.release()
    assert d.poll(x) == res  # the outcome stays

    # Later posts to the dead peer are ERR outcomes too, and nothing leaks.
    y = d.post("READ", local, np.arange(4), p.lists, np.arange(4), b"")
    assert wait(d, y, timeout=5).state is XferState.ERR
    y.release()


def test_peer_killed_before_post_then_restarted_under_same_name(
    spawn_child: Callable[..., Any], reader: tuple[NixlBackend, torch.Tensor, DescList]
) -> None:
    d, buf, local = reader
    p = Remote(d, spawn_child(producer, "P", 8 * MiB, 1), 8 * MiB, 1)
    x = d.post("READ", local, np.arange(8), p.lists, np.arange(8), b"warm")
    assert wait(d, x).state is XferState.DONE  # connected
    x.release()
    p.child.kill()

    x = d.post("READ", local, np.arange(8), p.lists, np.arange(8), b"lost")
    res = wait(d, x, timeout=5)
    assert res.state is XferState.ERR and res.error is not None and "disconnected" in res.error
    assert res.peer_lost
    x.release()

    # The restarted peer has the same agent name and new metadata: add_remote replaces it.
    q = Remote(d, spawn_child(producer, "P", 8 * MiB, 2), 8 * MiB, 2)
    assert q.name == "P" and d.remotes() == ["P"]
    with pytest.raises(TransferError, match="stale"):
        d.post("READ", local, np.arange(8), p.lists, np.arange(8), b"")
    p.lists.release()
    ids = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    x = d.post("READ", local, np.arange(8), q.lists, ids, b"again")
    assert wait(d, x).state is XferState.DONE
    x.release()
    got = buf.numpy().reshape(-1, BLOCK)[:8]
    np.testing.assert_array_equal(got, pattern(8 * MiB, 2).reshape(-1, BLOCK)[ids])
    assert expect_message(q.child, "notif") == ("notif", "D", b"again")
    q.lists.release()


def _make_backend_under_ucx_tls(conn: Connection) -> list[str]:
    with NixlBackend(BackendConfig(name="cma-only")) as b:
        return [b.agent_name, os.environ.get("UCX_TLS", "")]


def test_ucx_without_tcp_starts_with_error_handling_off(
    spawn_child: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    tls = "cma,sm,self" + (",cuda_copy" if nvidia_gpu_present() else "")  # NIXL's GPU rule
    monkeypatch.setenv("UCX_TLS", tls)
    child = spawn_child(_make_backend_under_ucx_tls)
    assert child.result(timeout=20) == ["cma-only", tls]


def _ucx_pipeline_setting(conn: Connection) -> str | None:
    with NixlBackend(BackendConfig(name="ppln")):
        return os.environ.get("UCX_RMA_PPLN_ENABLE")


@pytest.mark.parametrize(("given", "used"), [(None, "y"), ("n", "n")])
def test_ucx_rma_pipeline_is_on_unless_the_environment_says_otherwise(
    spawn_child: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    given: str | None,
    used: str,
) -> None:
    """Same-GPU VRAM READs need UCX's pipelined RMA (docs/gpus.md); a user's value wins."""
    if given is None:
        monkeypatch.delenv("UCX_RMA_PPLN_ENABLE", raising=False)
    else:
        monkeypatch.setenv("UCX_RMA_PPLN_ENABLE", given)
    assert spawn_child(_ucx_pipeline_setting).result(timeout=20) == used


def _raise_in_child(conn: Connection, text: str) -> None:
    raise RuntimeError(text)


def _outlive_deadline(conn: Connection) -> None:
    conn.send(("started",))
    time.sleep(60)


def test_spawn_child_reports_errors_and_enforces_its_deadline(
    spawn_child: Callable[..., Any],
) -> None:
    with pytest.raises(AssertionError, match="RuntimeError: boom from the child"):
        spawn_child(_raise_in_child, "boom from the child").result(timeout=20)
    slow = spawn_child(_outlive_deadline, deadline=1)
    assert slow.recv(timeout=20) == ("started",)
    with pytest.raises(AssertionError, match=r"exited \(-14\) with nothing more"):  # SIGALRM
        slow.recv(timeout=10)


# ---- in one process -----------------------------------------------------------------------
class Pair:
    def __init__(self) -> None:
        self.p = NixlBackend(BackendConfig(name="P"))
        self.d = NixlBackend(BackendConfig(name="D"))
        self.src = torch.from_numpy(pattern(MiB, 3))
        self.dst = torch.zeros(MiB, dtype=torch.uint8)
        self.n = MiB // BLOCK
        self.regs = [
            self.p.register(region(self.src), MemType.DRAM),
            self.d.register(region(self.dst), MemType.DRAM),
        ]
        self.d.add_remote(self.p.metadata())
        self.local = self.d.prep_local(blocks(self.dst.data_ptr(), self.n), MemType.DRAM)
        self.remote = self.d.prep_remote("P", blocks(self.src.data_ptr(), self.n), MemType.DRAM)

    def read(self, lids: Any, rids: Any, notif: bytes = b"") -> XferResult:
        x = self.d.post("READ", self.local, np.asarray(lids), self.remote, np.asarray(rids), notif)
        res = wait(self.d, x, progress=[self.p])
        x.release()
        return res

    def close(self) -> None:
        self.d.close()
        self.p.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    pr = Pair()
    try:
        yield pr
    finally:
        pr.close()


def test_in_process_scattered_read_and_notification(pair: Pair) -> None:
    lids, rids = np.arange(10), np.array([63, 0, 17, 2, 40, 41, 42, 5, 9, 33])
    res = pair.read(lids, rids, b"hi")
    assert res.state is XferState.DONE and res.telemetry is not None
    assert res.telemetry.bytes == 10 * BLOCK
    src, dst = pair.src.numpy().reshape(-1, BLOCK), pair.dst.numpy().reshape(-1, BLOCK)
    np.testing.assert_array_equal(dst[lids], src[rids])
    assert wait_notifs(pair.p) == {"D": [b"hi"]}


@pytest.mark.parametrize("kind", [list, np.int32, np.int64, np.uint16])
def test_post_takes_lists_and_integer_arrays(pair: Pair, kind: Any) -> None:
    lids, rids = [3, 1, 7], [60, 2, 33]
    ids = (list(lids), list(rids)) if kind is list else (np.array(lids, kind), np.array(rids, kind))
    x = pair.d.post("READ", pair.local, ids[0], pair.remote, ids[1], b"")
    assert wait(pair.d, x, progress=[pair.p]).state is XferState.DONE
    x.release()
    src, dst = pair.src.numpy().reshape(-1, BLOCK), pair.dst.numpy().reshape(-1, BLOCK)
    np.testing.assert_array_equal(dst[lids], src[rids])


def test_strided_descriptor_rows_are_indexed_block_by_block(pair: Pair) -> None:
    row = np.array([[pair.src.data_ptr(), BLOCK, 0, BLOCK, pair.n]], dtype=np.uint64)
    strided = pair.d.prep_remote("P", row, MemType.DRAM)
    assert strided.size == pair.n
    x = pair.d.post("READ", pair.local, np.array([0, 1]), strided, np.array([7, 60]), b"")
    assert wait(pair.d, x, progress=[pair.p]).state is XferState.DONE
    x.release()
    strided.release()
    src, dst = pair.src.numpy().reshape(-1, BLOCK), pair.dst.numpy().reshape(-1, BLOCK)
    np.testing.assert_array_equal(dst[:2], src[[7, 60]])


def test_loopback_read_within_one_agent(pair: Pair) -> None:
    loop = pair.p.prep_remote("P", blocks(pair.src.data_ptr(), pair.n), MemType.DRAM)
    local = pair.p.prep_local(blocks(pair.src.data_ptr(), pair.n), MemType.DRAM)
    x = pair.p.post("READ", local, np.array([0]), loop, np.array([9]), b"self")
    assert wait(pair.p, x).state is XferState.DONE
    src = pair.src.numpy().reshape(-1, BLOCK)
    np.testing.assert_array_equal(src[0], src[9])
    assert wait_notifs(pair.p) == {"P": [b"self"]}


def test_telemetry_off_gives_none() -> None:
    with (
        NixlBackend(BackendConfig(name="P", capture_telemetry=False)) as p,
        NixlBackend(BackendConfig(name="D", capture_telemetry=False)) as d,
    ):
        buf = torch.ones(4 * BLOCK, dtype=torch.uint8)
        out = torch.zeros(4 * BLOCK, dtype=torch.uint8)
        regs = [p.register(region(buf), MemType.DRAM), d.register(region(out), MemType.DRAM)]
        d.add_remote(p.metadata())
        loc = d.prep_local(blocks(out.data_ptr(), 4), MemType.DRAM)
        rem = d.prep_remote("P", blocks(buf.data_ptr(), 4), MemType.DRAM)
        x = d.post("READ", loc, np.arange(4), rem, np.arange(4), b"")
        res = wait(d, x, progress=[p])
        assert len(regs) == 2  # handles kept alive: a dropped one is released
        assert res == XferResult(XferState.DONE)
        assert bool((out == 1).all())


@pytest.mark.parametrize(
    ("lids", "rids", "fragment"),
    [
        (np.array([64]), np.array([0]), "local_ids: id 64 is out of range for the 64"),
        (np.array([0]), np.array([-1]), "remote_ids: id -1 is out of range .* agent 'P'"),
        # NIXL itself would cast these to int32 unchecked (2**32 + 1 -> descriptor 1)
        (np.array([2**32 + 1]), np.array([0]), "local_ids: id 4294967297 is out of range"),
        (np.array([0]), np.array([2**31 + 1], dtype=np.uint32), "remote_ids: id 2147483649"),
        (np.array([0], dtype=np.int32), np.array([64], dtype=np.int32), "remote_ids: id 64 "),
        # lists go to NIXL as they are; its refusals are named the same way
        ([64], [0], "local_ids: id 64 is out of range for the 64"),
        ([0], [2**31], "remote_ids: id 2147483648 is out of range"),
        ([0.5], [0], r"local_ids: expected a flat sequence of integer descriptor ids, got \[0.5\]"),
        ([[1, 2]], [0], r"local_ids: expected a flat sequence of integer descriptor ids"),
        ([1, [2, 3]], [0, 1], r"local_ids: expected a flat sequence of integer descriptor ids"),
        ([], [], "local_ids: expected at least one"),
        (np.array([0, 1]), np.array([0]), "2 local ids but 1 remote ids"),
        (np.zeros((2, 1), dtype=np.int64), np.zeros((2, 1), dtype=np.int64), "1-D integer"),
        (np.array([0.5]), np.array([0]), "1-D integer array, got shape .* dtype float64"),
        (np.array([], dtype=np.int64), np.array([], dtype=np.int64), "at least one"),
    ],
)
def test_post_rejects_bad_ids(pair: Pair, lids: Any, rids: Any, fragment: str) -> None:
    with pytest.raises(TransferError, match=fragment):
        pair.d.post("READ", pair.local, lids, pair.remote, rids, b"")


def test_post_rejects_bad_op_and_swapped_or_foreign_lists(pair: Pair) -> None:
    ids = np.arange(2)
    with pytest.raises(TransferError, match="op must be 'READ' or 'WRITE', got 'read'"):
        pair.d.post("read", pair.local, ids, pair.remote, ids, b"")
    with pytest.raises(TransferError, match="prep_local list then a prep_remote list"):
        pair.d.post("READ", pair.remote, ids, pair.local, ids, b"")
    foreign = pair.p.prep_local(blocks(pair.src.data_ptr(), 2), MemType.DRAM)
    with pytest.raises(TransferError, match="was not prepared by 'D'"):
        pair.d.post("READ", foreign, ids, pair.remote, ids, b"")
    foreign.release()
    pair.local.release()
    with pytest.raises(TransferError, match="was released"):
        pair.d.post("READ", pair.local, ids, pair.remote, ids, b"")


def test_descriptors_outside_registered_memory_fail_at_prep(pair: Pair) -> None:
    beyond = blocks(pair.src.data_ptr() + MiB - BLOCK, 2)  # the second block is past the end
    with pytest.raises(TransferError, match="NIXL refused 2 DRAM descriptors for agent 'P'"):
        pair.d.prep_remote("P", beyond, MemType.DRAM)
    with pytest.raises(TransferError, match="for local memory"):
        pair.d.prep_local(blocks(pair.dst.data_ptr() + MiB, 1), MemType.DRAM)
    with pytest.raises(TransferError, match="unknown agent 'Q'"):
        pair.d.prep_remote("Q", blocks(pair.src.data_ptr(), 1), MemType.DRAM)
    with pytest.raises(TransferError, match=r"shape \(N, 3 or 5\), got shape \(2, 4\)"):
        pair.d.prep_local(np.zeros((2, 4), dtype=np.uint64), MemType.DRAM)
    assert pair.read([0], [0]).state is XferState.DONE  # nothing broke


def test_register_rejects_bad_regions(pair: Pair) -> None:
    with pytest.raises(RegistrationError, match="at least one"):
        pair.d.register(np.zeros((0, 3), dtype=np.uint64), MemType.DRAM)
    with pytest.raises(RegistrationError, match="region 0 has length 0"):
        pair.d.register(np.array([[pair.dst.data_ptr(), 0, 0]], dtype=np.uint64), MemType.DRAM)


def _flip(blob: bytes, i: int) -> bytes:
    b = bytearray(blob)
    b[i] ^= 0xFF
    return bytes(b)


@pytest.mark.parametrize(
    ("mangle", "fragment"),
    [
        (lambda md: b"", "not kvrdma agent metadata"),
        (lambda md: b"garbage", "not kvrdma agent metadata"),
        (lambda md: md[:-7], "corrupted"),
        (lambda md: _flip(md, len(md) - 60), "corrupted"),  # NIXL itself may segfault on this
        (lambda md: _flip(md, len(MD_MAGIC) + 90), "corrupted"),  # NIXL would accept this
        (lambda md: unwrap_metadata(md), "not kvrdma agent metadata"),  # raw NIXL blob
    ],
)
def test_bad_metadata_is_handshake_error_and_leaves_no_entry(
    mangle: Callable[[bytes], bytes], fragment: str
) -> None:
    with NixlBackend(BackendConfig(name="P")) as p, NixlBackend(BackendConfig(name="D")) as d:
        buf = torch.from_numpy(pattern(4 * BLOCK, 5))
        out = torch.zeros(4 * BLOCK, dtype=torch.uint8)
        regs = [p.register(region(buf), MemType.DRAM), d.register(region(out), MemType.DRAM)]
        md = p.metadata()
        with pytest.raises(HandshakeError, match=fragment):
            d.add_remote(mangle(md))
        assert d.remotes() == []
        assert d.add_remote(md) == "P"  # the good blob still loads
        loc = d.prep_local(blocks(out.data_ptr(), 4), MemType.DRAM)
        rem = d.prep_remote("P", blocks(buf.data_ptr(), 4), MemType.DRAM)
        x = d.post("READ", loc, np.arange(4), rem, np.arange(4), b"")
        assert wait(d, x, progress=[p]).state is XferState.DONE
        assert torch.equal(out, buf)
        assert len(regs) == 2


def test_own_metadata_is_rejected(pair: Pair) -> None:
    with pytest.raises(HandshakeError, match="own metadata"):
        pair.d.add_remote(pair.d.metadata())


def test_readd_same_metadata_is_a_noop_and_remove_is_idempotent(pair: Pair) -> None:
    md = pair.p.metadata()
    assert pair.d.add_remote(md) == "P"
    assert pair.read([1], [2]).state is XferState.DONE  # lists still valid
    pair.d.remove_remote("P")
    pair.d.remove_remote("P")
    pair.d.remove_remote("never-added")
    assert pair.d.remotes() == []
    with pytest.raises(TransferError, match="stale: agent 'P' was removed"):
        pair.d.post("READ", pair.local, np.arange(1), pair.remote, np.arange(1), b"")
    with pytest.raises(TransferError, match="unknown agent 'P'"):
        pair.d.send_notif("P", b"x")


def test_remove_remote_fails_in_flight_transfers(pair: Pair) -> None:
    # Nobody progresses P, so the first READ stays in flight (connection wire-up).
    x = pair.d.post("READ", pair.local, np.arange(4), pair.remote, np.arange(4), b"")
    assert pair.d.poll(x).state is XferState.PROC
    pair.d.remove_remote("P")
    res = pair.d.poll(x)
    assert res.state is XferState.ERR and res.error is not None and "removed" in res.error
    x.release()


def test_restarted_peer_in_process(pair: Pair) -> None:
    pair.p.close()
    p2 = NixlBackend(BackendConfig(name="P"))
    try:
        src2 = torch.full((MiB,), 7, dtype=torch.uint8)
        reg = p2.register(region(src2), MemType.DRAM)
        assert pair.d.add_remote(p2.metadata()) == "P"
        with pytest.raises(TransferError, match="stale"):
            pair.d.post("READ", pair.local, np.arange(1), pair.remote, np.arange(1), b"")
        remote2 = pair.d.prep_remote("P", blocks(src2.data_ptr(), pair.n), MemType.DRAM)
        x = pair.d.post("READ", pair.local, np.arange(4), remote2, np.arange(4), b"")
        assert wait(pair.d, x, progress=[p2]).state is XferState.DONE
        assert bool((pair.dst[: 4 * BLOCK] == 7).all())
        x.release()
        remote2.release()
        reg.release()
    finally:
        p2.close()


def test_release_of_in_progress_transfer_cancels_it(pair: Pair) -> None:
    x = pair.d.post("READ", pair.local, np.arange(4), pair.remote, np.arange(4), b"")
    assert pair.d.poll(x).state is XferState.PROC
    x.release()
    res = pair.d.poll(x)
    assert res.state is XferState.ERR and res.error is not None and "cancelled" in res.error
    x.release()
    assert pair.read([0], [0]).state is XferState.DONE  # the agent still works


@pytest.mark.parametrize("ends", ["done", "cancelled", "peer removed"])
def test_close_sweeps_the_copy_threads_only_after_a_transfer_ended_early(
    pair: Pair, ends: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transfer that ends other than DONE may leave pieces queued on UCX copy threads,
    which abort the process when the agent is destroyed: `close()` then sweeps them first
    (loopback rounds until every thread copied); after DONE transfers only, it does not."""
    sweeps: list[list[int]] = []
    sweep = pair.d._warm.sweep

    def counted() -> list[int]:
        sweeps.append(seen := sweep())
        return seen

    monkeypatch.setattr(pair.d._warm, "sweep", counted)
    if ends == "done":
        assert pair.read([0, 1], [5, 6]).state is XferState.DONE
    else:  # nobody progresses P: the first READ stays in flight (connection wire-up)
        x = pair.d.post("READ", pair.local, np.arange(4), pair.remote, np.arange(4), b"")
        assert pair.d.poll(x).state is XferState.PROC
        if ends == "cancelled":
            x.release()
        else:
            pair.d.remove_remote("P")
        assert pair.d.poll(x).state is XferState.ERR
        x.release()
    pair.d.close()
    assert len(sweeps) == (0 if ends == "done" else 1)


def test_releases_and_close_are_idempotent(pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    extra = pair.d.prep_local(blocks(pair.dst.data_ptr(), 2), MemType.DRAM)
    extra.release()
    extra.release()
    x = pair.d.post("READ", pair.local, np.arange(1), pair.remote, np.arange(1), b"")
    pair.regs[0].release()
    pair.regs[0].release()
    with caplog.at_level(logging.WARNING, logger="kvrdma.nixl"):
        pair.d.close()
        pair.d.close()
    assert "never released" not in caplog.text
    assert pair.d.poll(x).state is XferState.ERR  # cancelled by close
    x.release()
    pair.local.release()
    with pytest.raises(TransferError, match="agent 'D' is closed"):
        pair.d.metadata()
    with pytest.raises(TransferError, match="closed"):
        pair.d.get_notifs()


def test_state_checks_follow_the_agent_and_never_keep_a_replaced_one(pair: Pair) -> None:
    """`poll` reads NIXL states through a check made for the current agent: a retirement
    and `close()` replace it with the agent, so a replaced agent is still freed at once."""
    assert pair.read([0], [1]).state is XferState.DONE
    first = weakref.ref(pair.d._agent.agent)
    pair.d.retire("test: replace the agent")
    assert pair.d.parked == [] and first() is None  # nothing was in flight
    assert pair.read([2], [3]).state is XferState.DONE  # polled on the new agent
    second = weakref.ref(pair.d._agent.agent)
    pair.d.close()
    assert second() is None


def test_dropped_handle_is_logged_as_leak(pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvrdma.nixl"):
        pair.d.prep_local(blocks(pair.dst.data_ptr(), 2), MemType.DRAM)  # dropped at once
    assert "<DescList 2 descriptors of local memory> was never released" in caplog.text


def test_send_notif_without_transfer(pair: Pair) -> None:
    # On a fresh connection the *sender* must progress too for the message to go out.
    pair.d.send_notif("P", b"ping")
    assert wait_notifs(pair.p, progress=[pair.d]) == {"D": [b"ping"]}


def test_config_and_plugin_errors() -> None:
    with pytest.raises(TransferError, match="plugin 'NOPE' not found"):
        NixlBackend(BackendConfig(name="x", backends=("NOPE",)))
    with pytest.raises(ConfigError, match="expected a non-empty agent name"):
        NixlBackend(BackendConfig(name=""))


def test_missing_nixl_is_a_transfer_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nixl", None)
    with pytest.raises(TransferError, match="nixl package is not installed"):
        NixlBackend(BackendConfig(name="x"))


def test_kvrdma_imports_without_nixl() -> None:
    code = (
        "import sys; sys.modules['nixl'] = None\n"
        "import kvrdma, kvrdma.nixl, kvrdma.nixl.agent\n"
        "assert 'nixl_cu12' not in sys.modules and 'nixl_cu13' not in sys.modules\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=root)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_read_from_vram() -> None:
    with NixlBackend(BackendConfig(name="P")) as p, NixlBackend(BackendConfig(name="D")) as d:
        src = torch.arange(4 * BLOCK, device="cuda", dtype=torch.int32).to(torch.uint8)
        out = torch.zeros(4 * BLOCK, dtype=torch.uint8)
        regs = [p.register(region(src), MemType.VRAM), d.register(region(out), MemType.DRAM)]
        d.add_remote(p.metadata())
        loc = d.prep_local(blocks(out.data_ptr(), 4), MemType.DRAM)
        rem = d.prep_remote("P", blocks(src.data_ptr(), 4, dev=src.get_device()), MemType.VRAM)
        x = d.post("READ", loc, np.arange(4), rem, np.array([3, 2, 1, 0]), b"")
        assert wait(d, x, progress=[p]).state is XferState.DONE
        want = src.cpu().reshape(4, BLOCK)[[3, 2, 1, 0]].reshape(-1)
        assert torch.equal(out, want)
        assert len(regs) == 2
