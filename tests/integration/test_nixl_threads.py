"""READs through UCX worker threads: `num_threads`, `split_batch_size` and descriptor merging
turned off where it would idle copy threads (`skip_desc_merge`, `kvrdma.nixl.merging`) move
exactly the right bytes, between processes, for short and long descriptors, contiguous runs
and scattered ids; and the settings fall back instead of failing where a NIXL does not know
them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
import torch
from test_nixl_backend import MiB, blocks, expect_message, pattern, region, wait

from kvrdma.defaults import ucx_num_threads
from kvrdma.errors import ConfigError
from kvrdma.nixl import BackendConfig, MemType, NixlBackend, XferState
from kvrdma.nixl.merging import (
    RUNS_PER_THREAD,
    SKIP_MERGE_MIN_BYTES,
    SPREAD_MIN_BYTES,
    contiguous_runs,
)

pytest.importorskip("nixl")

SIZE = 8 * MiB
SMALL, MID, LARGE = 16 * 1024, 32 * 1024, 128 * 1024
assert SMALL < MID < SKIP_MERGE_MIN_BYTES <= LARGE
assert SIZE >= SPREAD_MIN_BYTES  # a read of the whole buffer is cut into a share per thread


def threaded_producer(conn: Connection, name: str, seed: int, threads: int) -> str:
    """A patterned buffer behind an agent with UCX threads; serves until ("stop",)."""
    logging.getLogger("nixl").setLevel(logging.WARNING)
    buf = torch.from_numpy(pattern(SIZE, seed))
    with NixlBackend(BackendConfig(name=name, num_threads=threads)) as backend:
        reg = backend.register(region(buf), MemType.DRAM)
        conn.send(("ready", backend.metadata(), buf.data_ptr()))
        while not conn.poll(0.0005) or conn.recv()[0] != "stop":
            backend.get_notifs()
        reg.release()
    return "stopped"


class Recording:
    """Forwards to a NIXL agent, recording the keywords of `make_prepped_xfer` and the runs
    of the ids it was given, for transfers with a notification (the backend's own warm-up
    READs, `kvrdma.nixl.warm`, have none)."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.kwargs: list[dict[str, Any]] = []
        self.runs: list[int] = []

    def make_prepped_xfer(self, *a: Any, **kw: Any) -> Any:
        if a[5]:
            self.kwargs.append(kw)
            self.runs.append(contiguous_runs(a[2], a[4]))
        return self._agent.make_prepped_xfer(*a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


@pytest.fixture(params=[(2, 1), (2, None), (4, 1), (0, 1)], ids=lambda p: f"nt{p[0]}-split{p[1]}")
def threaded_reader(request: pytest.FixtureRequest) -> Iterator[tuple[NixlBackend, Any]]:
    threads, split = request.param
    d = NixlBackend(BackendConfig(name="D", num_threads=threads, split_batch_size=split))
    buf = torch.zeros(SIZE, dtype=torch.uint8)
    reg = d.register(region(buf), MemType.DRAM)
    rec = Recording(d._agent)
    d._agent = rec
    try:
        yield d, (buf, rec, threads)
    finally:
        reg.release()
        d.close()


@pytest.mark.parametrize("peer_threads", [0, 2])
def test_threaded_reads_are_byte_exact(
    spawn_child: Callable[..., Any], threaded_reader: tuple[NixlBackend, Any], peer_threads: int
) -> None:
    d, (buf, rec, threads) = threaded_reader
    child = spawn_child(threaded_producer, "P", 11, peer_threads)
    _, md, addr = expect_message(child, "ready", timeout=20)
    d.add_remote(md)
    src = pattern(SIZE, 11)
    rng = np.random.default_rng(5)
    for size in (SMALL, MID, LARGE):
        n = SIZE // size
        local = d.prep_local(blocks(buf.data_ptr(), n, size), MemType.DRAM)
        remote = d.prep_remote("P", blocks(addr, n, size), MemType.DRAM)
        runs = (np.arange(8)[:, None] * 8 + np.arange(4)[None, :]).reshape(-1)  # 8 runs of 4
        cases = {
            "contiguous": (np.arange(n // 2), np.arange(n // 2) + n // 4),
            "everything": (np.arange(n), np.arange(n)),
            "scattered": (rng.permutation(n)[: n // 2 + 3], rng.permutation(n)[: n // 2 + 3]),
            "one": (np.array([n - 1]), np.array([0])),
            "eight runs": (runs, runs[::-1].reshape(8, 4)[:, ::-1].reshape(-1) + 2),
        }
        for what, (lids, rids) in cases.items():
            buf.zero_()
            rec.kwargs.clear()
            rec.runs.clear()
            x = d.post("READ", local, lids, remote, rids, f"{size}-{what}".encode())
            res = wait(d, x, timeout=20)
            assert res.state is XferState.DONE, (size, what, res.error)
            x.release()
            got = buf.numpy().reshape(-1, size)
            want = src.reshape(-1, size)
            np.testing.assert_array_equal(got[lids], want[rids], err_msg=f"{size} {what}")
            untouched = np.setdiff1d(np.arange(n), lids)
            assert not got[untouched].any(), f"{size} {what}: bytes outside the read"
            # merged, fewer than RUNS_PER_THREAD runs per copy thread would idle threads:
            # long descriptors go unmerged, a whole buffer of shorter ones is cut in shares
            single = what in ("contiguous", "one", "everything")
            few = single or (what == "eight runs" and RUNS_PER_THREAD * threads > 8)
            skip = threads > 1 and size >= SKIP_MERGE_MIN_BYTES and few
            assert rec.kwargs == [{"skip_desc_merge": True} if skip else {}], (size, what)
            cut = threads > 1 and what == "everything" and not skip
            if cut:
                assert rec.runs == [RUNS_PER_THREAD * threads], (size, what)
            else:
                assert rec.runs == [contiguous_runs(lids, rids)], (size, what)
        local.release()
        remote.release()
    child.send(("stop",))
    assert child.result(timeout=20) == "stopped"


def churning_reader(conn: Connection, md_p: bytes, addr: int, md_q: bytes, seconds: float) -> int:
    """Scattered READs from P on the default copy threads; while each runs, peer Q is removed
    and loaded again (endpoints closed and created on every UCX worker). Returns the READs."""
    logging.getLogger("nixl").setLevel(logging.WARNING)
    d = NixlBackend(BackendConfig(name="D", num_threads=ucx_num_threads()))
    page = 4096  # thousands of short descriptors: the copy threads are busy for milliseconds
    n = SIZE // page
    buf = torch.zeros(4 * SIZE, dtype=torch.uint8)
    reg = d.register(region(buf), MemType.DRAM)
    d.add_remote(md_p)
    d.add_remote(md_q)
    local = d.prep_local(blocks(buf.data_ptr(), 4 * n, page), MemType.DRAM)
    remote = d.prep_remote("P", blocks(addr, n, page), MemType.DRAM)
    lids = np.arange(0, 4 * n, 2)  # every other page: nothing to merge, shares on every thread
    rids = np.tile(np.arange(n), 2)
    want = pattern(SIZE, 11).reshape(-1, page)[rids]
    reads, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        buf.zero_()
        x = d.post("READ", local, lids, remote, rids, b"r")
        while (res := d.poll(x)).state is XferState.PROC:
            d.get_notifs()
            d.remove_remote("Q")
            d.add_remote(md_q)
        assert res.state is XferState.DONE, res.error
        x.release()
        np.testing.assert_array_equal(buf.numpy().reshape(-1, page)[lids], want)
        reads += 1
    reg.release()
    d.close()
    return reads


def test_peers_come_and_go_while_copy_threads_read(spawn_child: Callable[..., Any]) -> None:
    """The caller's thread opens and closes endpoints on the workers the copy threads are
    progressing: NIXL must be told to make those workers thread-safe, or UCX crashes."""
    p = spawn_child(threaded_producer, "P", 11, 0)
    q = spawn_child(threaded_producer, "Q", 12, 0)
    _, md_p, addr = expect_message(p, "ready", timeout=20)
    _, md_q, _ = expect_message(q, "ready", timeout=20)
    d = spawn_child(churning_reader, md_p, addr, md_q, 8.0, deadline=60.0)
    assert d.result(timeout=60) > 0
    for child in (p, q):
        child.send(("stop",))
        assert child.result(timeout=20) == "stopped"


# ---- fallbacks -------------------------------------------------------------------------------
class NoSkipKeyword(Recording):
    """A NIXL agent from before `skip_desc_merge` existed."""

    def make_prepped_xfer(self, *a: Any, **kw: Any) -> Any:
        if a[5]:
            self.kwargs.append(kw)
        if kw:
            raise TypeError("make_prepped_xfer() got an unexpected keyword 'skip_desc_merge'")
        return self._agent.make_prepped_xfer(*a)


def test_without_skip_desc_merge_reads_merge_as_before() -> None:
    with (
        NixlBackend(BackendConfig(name="P")) as p,
        NixlBackend(BackendConfig(name="D", num_threads=2)) as d,
    ):
        src = torch.from_numpy(pattern(2 * MiB, 3))
        dst = torch.zeros(2 * MiB, dtype=torch.uint8)
        regs = [p.register(region(src), MemType.DRAM), d.register(region(dst), MemType.DRAM)]
        d.add_remote(p.metadata())
        n = 2 * MiB // LARGE
        loc = d.prep_local(blocks(dst.data_ptr(), n, LARGE), MemType.DRAM)
        rem = d.prep_remote("P", blocks(src.data_ptr(), n, LARGE), MemType.DRAM)
        old = NoSkipKeyword(d._agent)
        d._agent = old
        for _ in range(2):
            x = d.post("READ", loc, np.arange(n), rem, np.arange(n), b"n")  # one run: unmerged
            assert wait(d, x, progress=[p]).state is XferState.DONE
            x.release()
        # the keyword was tried once, then never again
        assert old.kwargs == [{"skip_desc_merge": True}, {}, {}]
        np.testing.assert_array_equal(dst.numpy(), src.numpy())
        assert len(regs) == 2


def _record_create_backend(
    monkeypatch: pytest.MonkeyPatch, refuse: str | None = None
) -> list[dict[str, str]]:
    """Every `create_backend` init dict NIXL agents get from now on; one holding the key
    `refuse` is turned down as an older plugin would."""
    import nixl

    real = nixl.nixl_agent
    tried: list[dict[str, str]] = []

    class Recorded:
        def __init__(self, *a: Any, **kw: Any) -> None:
            self._agent = real(*a, **kw)

        def create_backend(self, backend: str, params: dict[str, str]) -> Any:
            tried.append(dict(params))
            if refuse is not None and refuse in params:
                raise RuntimeError(f"unknown init param {refuse}")
            return self._agent.create_backend(backend, params)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._agent, name)

    monkeypatch.setattr(nixl, "nixl_agent", Recorded)
    return tried


def test_ucx_refusing_split_batch_size_starts_without_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tried = _record_create_backend(monkeypatch, refuse="split_batch_size")
    with caplog.at_level(logging.WARNING, logger="kvrdma.nixl"):
        b = NixlBackend(BackendConfig(name="picky", num_threads=2, split_batch_size=1))
    b.close()
    assert tried == [{"num_threads": "2", "split_batch_size": "1"}, {"num_threads": "2"}]
    assert "without split_batch_size" in caplog.text and "unknown init param" in caplog.text


def test_split_batch_size_is_only_passed_to_ucx_with_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tried = _record_create_backend(monkeypatch)
    for threads, split in ((0, 1), (2, None), (3, 8)):
        NixlBackend(BackendConfig(name="s", num_threads=threads, split_batch_size=split)).close()
    assert tried == [{}, {"num_threads": "2"}, {"num_threads": "3", "split_batch_size": "8"}]


def test_bad_split_batch_size_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="split_batch_size None or >= 1"):
        NixlBackend(BackendConfig(name="x", num_threads=2, split_batch_size=0))
