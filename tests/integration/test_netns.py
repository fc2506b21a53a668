"""P and D on different "hosts": network namespaces joined by veth links (`kvrdma.testing.netns`).

Each test builds its own testbed: the P rank and its sidecar (`kvrdma agent`, publish socket on
the host's loopback, side channel on the host's address) on one host, the D rank on another,
UCX over TCP only on the testbed interface. Reads must be byte-exact across hosts, and under
network faults the invariants hold: every request ends exactly once, a read that cannot
complete is reported invalid within 2x its deadline, nothing lands after it was given up, the
side channel recovers once a partition heals, no rank dies and nothing hangs.

Detection times (seconds from posting a read to its failure being reported) and throughput
are attached to each test as `record_property` entries and, where `KVRDMA_NETNS_RESULTS`
names a file, appended to it as JSON lines (the benchmarks' report reads them).
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from kvrdma.testing.netns import (
    NetemUnavailable,
    NetnsBed,
    enter,
    netem_missing,
    run_in,
    unavailable_reason,
)

pytest.importorskip("nixl")

_REASON = unavailable_reason()
pytestmark = [
    pytest.mark.skipif(bool(_REASON), reason=f"no network namespaces: {_REASON}"),
    pytest.mark.timeout(120),
]

DEADLINE = 2.0  # read_deadline of the D rank: short, so partitions outlast it quickly
LEASE = 12.0  # P holds blocks long enough for reads that wait out a partition
BLOCKS = 24  # per request: a fraction of a second under the bandwidth cap, so a cut lands mid-read
_BLOCK_BYTES = 2 * 2 * 4 * 32 * 16 * 2  # soak_harness defaults: K and V, 2 layers, 4x32x16 fp16


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return {line.split(" ", 1)[0] for line in out.stdout.splitlines() if line}


def _record(record_property: Callable[[str, Any], None], name: str, value: Any) -> None:
    record_property(name, value)
    path = os.environ.get("KVRDMA_NETNS_RESULTS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"name": name, "value": value}) + "\n")


@dataclass
class Bed:
    """A testbed with a P engine (one rank + sidecar) on host 0 and a D rank on host 1."""

    testbed: NetnsBed
    cluster: Any  # soak_harness.Cluster
    seen: dict[str, list[Any]] = field(default_factory=dict)  # rid -> every outcome reported
    next_local: int = 0
    count: int = 0

    @property
    def p(self) -> Any:
        return self.testbed.hosts[0]

    def post(self, tag: str, n: int = 4) -> list[Any]:
        """Hold and post `n` requests of `BLOCKS` blocks each (fresh D blocks every time)."""
        from soak_harness import Read

        reads = []
        for i in range(n):
            local = self.next_local % (512 - BLOCKS)
            self.next_local += BLOCKS
            self.count += 1
            remote = (i * BLOCKS) % (256 - BLOCKS)
            reads.append(
                Read(
                    f"{tag}{self.count}",
                    tuple(range(local, local + BLOCKS)),
                    tuple(range(remote, remote + BLOCKS)),
                )
            )
        self.cluster.hold([(r.rid, list(r.remote_ids)) for r in reads])
        self.cluster.read(reads)
        return reads

    def wait(self, reads: list[Any], timeout: float) -> list[Any]:
        """Every read's first outcome, within `timeout` seconds."""
        done = self.cluster.outcomes
        self.cluster.pump_until(lambda: all(r.rid in done for r in reads), timeout, "outcomes")
        return [done[r.rid] for r in reads]

    def settle(self, seconds: float) -> None:
        """Keep handling reports for `seconds` (late duplicates would show up here)."""
        end = time.monotonic() + seconds
        self.cluster.pump_until(lambda: time.monotonic() >= end, seconds + 2.0, "")

    def ok(self, tag: str, timeout: float = 30.0) -> list[Any]:
        """A batch that must verify byte-exact; returns its outcomes."""
        outs = self.wait(self.post(tag), timeout)
        assert all(o.kind == "ok" and o.wrong == 0 for o in outs), outs
        return outs

    def duplicates(self) -> dict[str, int]:
        return {rid: len(v) for rid, v in self.seen.items() if len(v) != 1}


@pytest.fixture
def bed(spawn_child: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Bed]:
    """Two hosts, the P engine on host 0 and D on host 1; up, one batch verified. Everything
    is torn down afterwards, even when the test fails: no process, no namespace left.
    Parametrised with "eth1", the hosts get a second link and UCX is told to use it."""
    from soak_harness import Cluster, ClusterSpec, consumer_main

    from kvrdma.testing.sidecar import SidecarProcess

    device = getattr(request, "param", "")
    testbed = NetnsBed(2)
    p_host, d_host = testbed.hosts
    cluster = None
    try:
        if device:
            testbed.add_interface(p_host, d_host, device, "10.234.0.1")
        spec = ClusterSpec(
            p_tp=1,
            read_deadline=DEADLINE,
            lease=LEASE,
            handshake_host=p_host.address,
            log_dir=str(tmp_path),
        )
        sidecar = SidecarProcess(p_host, spec.p_engine, ranks=1, log=str(tmp_path / "sidecar.log"))

        def spawn(target: Any, *args: Any, **kw: Any) -> Any:
            host = d_host if target is consumer_main else p_host
            return spawn_child(run_in, host, testbed.env(host, device), target, *args, **kw)

        cluster = Cluster(spec, spawn, server=sidecar)
        b = Bed(testbed, cluster)
        keep = cluster.on_outcome
        cluster.on_outcome = lambda o, at: (b.seen.setdefault(o.rid, []).append(o), keep(o, at))
        cluster.start()
        b.ok("warm")
        yield b
        assert not b.duplicates(), f"requests reported more than once: {b.duplicates()}"
    finally:
        if cluster is not None:
            cluster.close()
            assert not cluster.leftovers(), (
                f"rank processes outlived the test: {cluster.leftovers()}"
            )
        testbed.close()
    assert not {h.netns for h in testbed.hosts} & _namespaces(), "a namespace was left behind"


def _in_netns(host: Any, fn: Callable[[], Any]) -> Any:
    """`fn()` on a thread of its own inside `host`'s namespace (the sockets it makes live
    there); its result or its exception."""
    box: list[Any] = []

    def body() -> None:
        try:
            enter(host, sysfs=False)  # a thread of this process: sockets only
            box.append((True, fn()))
        except Exception as exc:
            box.append((False, exc))

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(10)
    assert box, f"no result from {host.netns} within 10 s"
    ok, value = box[0]
    if not ok:
        raise value
    return value


def test_testbed_links_every_host_and_leaves_nothing() -> None:
    """Three hosts on a bridge: each reaches every other by TCP on its testbed address, no
    host reaches the caller's loopback, the caller's namespace gains no interface, and
    closing removes every namespace."""
    before = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    with NetnsBed(3) as tb:
        names = {h.netns for h in tb.hosts} | {tb.switch}
        assert names <= _namespaces()
        listeners = {}
        for h in tb.hosts:
            listeners[h.index] = _in_netns(h, lambda h=h: socket.create_server((h.address, 0)))
        try:
            for a in tb.hosts:
                for b in tb.hosts:
                    if a is not b:
                        port = listeners[b.index].getsockname()[1]
                        conn = _in_netns(a, partial(socket.create_connection, (b.address, port), 5))
                        conn.close()
            with socket.create_server(("127.0.0.1", 0)) as own, pytest.raises(OSError):
                target = ("127.0.0.1", own.getsockname()[1])
                _in_netns(tb.hosts[0], partial(socket.create_connection, target, 1))
        finally:
            for s in listeners.values():
                s.close()
    after = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert before.count("\n") == after.count("\n")
    assert not names & _namespaces()


def test_stale_namespaces_of_dead_runs_are_swept() -> None:
    """A namespace left by a killed run (its pid gone) is removed by the next testbed; one of
    a live process is not."""
    dead = subprocess.Popen(["true"])
    dead.wait(10)
    stale, live = f"kvrdma-{dead.pid}-0-h0", f"kvrdma-{os.getpid()}-999-h0"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        with NetnsBed(2):
            assert stale not in _namespaces()
            assert live in _namespaces()
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=10)


# UCX aborts (or crashes) a producer whose endpoint to a retired reading agent fails once a
# partition heals (docs/cluster.md, "A producer can die after a partition heals"): a known
# bug, not fixed.
KNOWN_ABORT = "Fatal: unexpected error: Endpoint timeout"
KNOWN_CRASH = re.compile(r"child 'p\d+' exited \(-(6|11)\)")  # SIGABRT, SIGSEGV


def _xfail_if_known_abort(log_dir: Path, error: Exception) -> None:
    for log in log_dir.glob("p*.log"):
        if KNOWN_ABORT in log.read_text(errors="replace"):
            pytest.xfail(f"known UCX abort of a producer ({log.name}: {KNOWN_ABORT!r})")
    if KNOWN_CRASH.search(str(error)):
        pytest.xfail(f"known death of a producer after the partition healed: {error}")


def _alive(bed: Bed) -> None:
    c = bed.cluster
    for p in [*c.p.values(), c.d]:
        assert p.child.process.is_alive(), f"rank {p.name} died ({p.child.process.exitcode})"


def _recover(bed: Bed, tag: str, timeout: float) -> float:
    """Post batches until one verifies; seconds that took (the side channel and the data
    path are back)."""
    t0 = time.monotonic()
    while True:
        outs = bed.wait(bed.post(tag, n=2), timeout)
        if all(o.kind == "ok" for o in outs):
            assert all(o.wrong == 0 for o in outs), outs
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, f"no read verified {timeout:g} s after healing"


@pytest.mark.timeout(150)
def test_partition_mid_read(bed: Bed, record_property: Any, tmp_path: Path) -> None:
    """P's link goes down while D reads (a bandwidth cap keeps the reads on the wire) and
    comes back after the deadline, then after twice the deadline. Each read verifies or is
    reported invalid with exactly its blocks within 2x the deadline; nothing writes a given-up
    block after the link heals; later reads verify again; both ranks live through it."""
    try:
        _partitions(bed, record_property)
    except Exception as exc:  # an assertion, or a rank that died (conftest.ChildError)
        _xfail_if_known_abort(tmp_path, exc)
        raise


def _partitions(bed: Bed, record_property: Any) -> None:
    tb = bed.testbed
    for heal_factor in (1.25, 2.25):
        tb.rate_limit(bed.p, "20mbit")
        reads = bed.post(f"cut{heal_factor}-")
        bed.settle(0.1)
        tb.partition(bed.p, cut=True)
        cut_at = time.monotonic()
        try:
            outs = bed.wait(reads, 2 * DEADLINE + 5.0)
            left = cut_at + heal_factor * DEADLINE - time.monotonic()
            if left > 0:
                bed.settle(left)
        finally:
            tb.partition(bed.p, cut=False)
            tb.clear_qdisc(bed.p)
        failed = [(r, o) for r, o in zip(reads, outs, strict=True) if o.kind != "ok"]
        assert failed, f"no read was cut by the partition: {outs}"
        for r, o in zip(reads, outs, strict=True):
            if o.kind == "ok":
                assert o.wrong == 0, o
                continue
            assert list(o.invalid) == sorted(r.local_ids), o
            assert max(o.read_seconds, o.waited) <= 2 * DEADLINE, f"reported too late: {o}"
        detection = [round(max(o.read_seconds, o.waited), 3) for _, o in failed]
        _record(record_property, f"partition_{heal_factor}x_detection_s", detection)
        _record(record_property, f"partition_{heal_factor}x_reasons", [o.reason for _, o in failed])
        bed.settle(1.0)
        assert bed.cluster.audit([i for r, _ in failed for i in r.local_ids]) == 0
        recovery = _recover(bed, f"healed{heal_factor}-", 30.0)
        _record(record_property, f"partition_{heal_factor}x_recovery_s", round(recovery, 3))
        _alive(bed)


def test_reads_across_hosts_byte_exact_and_under_a_bandwidth_cap(
    bed: Bed, record_property: Any
) -> None:
    """D on host 1 reads from P on host 0 over TCP: every element checks. Under a 20 Mbit/s
    token bucket on P's link reads still verify, and take at least as long as the cap
    allows (the data really crosses the testbed link)."""
    t0 = time.monotonic()
    outs = bed.ok("exact")
    size = len(outs) * BLOCKS * _BLOCK_BYTES
    _record(
        record_property, "netns_read_mbit_s", round(size * 8 / (time.monotonic() - t0) / 1e6, 2)
    )
    bed.testbed.rate_limit(bed.p, "20mbit")
    t0 = time.monotonic()
    outs = bed.ok("capped")
    mbit = len(outs) * BLOCKS * _BLOCK_BYTES * 8 / (time.monotonic() - t0) / 1e6
    _record(record_property, "tbf_20mbit_read_mbit_s", round(mbit, 2))
    assert mbit <= 20 * 1.1, f"{mbit:.1f} Mbit/s through a 20 Mbit/s cap"
    _alive(bed)


_netem_missing = functools.cache(netem_missing)


@pytest.fixture
def netem() -> None:
    """Skips the test (before its testbed starts) where the kernel has no sch_netem."""
    if _netem_missing():
        pytest.skip(f"needs sch_netem: {_netem_missing()}")


@pytest.mark.parametrize(
    "shape", ["delay 5ms 1ms", "loss 1%", "delay 5ms reorder 25% 50%"], ids=str.split
)
def test_netem(netem: None, bed: Bed, shape: str, record_property: Any) -> None:
    """Latency, loss and reordering on both ends of the link: each read verifies or is
    reported invalid with exactly its blocks within 2x the deadline; nothing lands late."""
    for h in bed.testbed.hosts:
        bed.testbed.netem(h, shape)
    _shaped_reads(bed, f"netem_{shape.replace(' ', '_')}", record_property)


def test_random_loss_without_netem(bed: Bed, record_property: Any) -> None:
    """1 % of the packets reaching either end lost at random (nftables, which works where
    the kernel has no sch_netem): the same guarantees as under netem."""
    try:
        for h in bed.testbed.hosts:
            bed.testbed.drop(h, 1)
    except NetemUnavailable as exc:
        pytest.skip(str(exc))
    _shaped_reads(bed, "nft_loss_1%", record_property)


def _shaped_reads(bed: Bed, label: str, record_property: Any) -> None:
    t0 = time.monotonic()
    reads = bed.post(label.split("_")[0])
    outs = bed.wait(reads, 2 * DEADLINE + 5.0)
    seconds = time.monotonic() - t0
    for r, o in zip(reads, outs, strict=True):
        if o.kind == "ok":
            assert o.wrong == 0, o
        else:
            assert list(o.invalid) == sorted(r.local_ids), o
            assert max(o.read_seconds, o.waited) <= 2 * DEADLINE, o
    good = sum(o.kind == "ok" for o in outs)
    mib_s = good * BLOCKS * _BLOCK_BYTES / seconds / 2**20
    _record(record_property, f"{label}_mib_s", round(mib_s, 2))
    bed.settle(1.0)
    failed = [i for r, o in zip(reads, outs, strict=True) if o.kind != "ok" for i in r.local_ids]
    assert bed.cluster.audit(failed) == 0
    _alive(bed)


@pytest.mark.parametrize("bed", ["eth1"], indirect=True)
def test_two_interfaces_use_the_configured_one(bed: Bed) -> None:
    """Each host has eth0 (the side channel's) and eth1; with UCX_NET_DEVICES=eth1 reads keep
    verifying after eth0 goes down: the data path is on the configured interface."""
    bed.testbed.set_link(bed.p, up=False)
    try:
        bed.ok("eth1-")
    finally:
        bed.testbed.set_link(bed.p, up=True)
    _alive(bed)


def probe_agent(conn: Any) -> str:
    """Child: build a NIXL agent under this process's UCX settings; "" or why it failed."""
    from kvrdma.errors import TransferError
    from kvrdma.nixl import BackendConfig, NixlBackend

    try:
        NixlBackend(BackendConfig(name=f"probe-{os.getpid()}")).close()
    except TransferError as exc:
        return str(exc)
    return ""


@pytest.mark.timeout(90)
def test_a_wrong_or_down_device_is_reported_clearly(spawn_child: Any) -> None:
    """UCX_NET_DEVICES naming no interface of the host, or one that is down: creating the
    agent fails at once, naming the device and what the host has (no hang)."""
    with NetnsBed(2) as tb:
        host = tb.hosts[0]
        t0 = time.monotonic()
        right = spawn_child(run_in, host, tb.env(host), probe_agent, deadline=60)
        assert right.result(timeout=60) == ""
        wrong = spawn_child(run_in, host, tb.env(host, "eth9"), probe_agent, deadline=60)
        msg = wrong.result(timeout=60)
        assert "UCX_NET_DEVICES: 'eth9' is not a network device here (have: ['eth0', 'lo'])" in msg
        tb.set_link(host, up=False)
        down = spawn_child(run_in, host, tb.env(host), probe_agent, deadline=60)
        msg = down.result(timeout=60)
        assert "UCX_NET_DEVICES: 'eth0' is down" in msg, msg
        assert time.monotonic() - t0 < 60


def reader_across_a_partition(conn: Any) -> None:
    """Child on host 1: reads from the producer child (host 0), then retires its agent twice
    while the test holds host 0 cut off, timing each `retire` and the peers it dropped; once
    host 0 is back, loads the producer again and reads."""
    import numpy as np
    import torch
    from test_nixl_backend import BLOCK, MiB, blocks, region, wait

    from kvrdma.nixl import BackendConfig, MemType, NixlBackend, XferState

    md, addr = conn.recv()
    buf = torch.zeros(MiB, dtype=torch.uint8)
    with NixlBackend(BackendConfig(name="D")) as d:
        reg = d.register(region(buf), MemType.DRAM)  # noqa: F841 - kept registered
        local = d.prep_local(blocks(buf.data_ptr(), MiB // BLOCK), MemType.DRAM)

        def read() -> bytes:
            peer = d.add_remote(md)
            remote = d.prep_remote(peer, blocks(addr, 4), MemType.DRAM)
            x = d.post("READ", local, np.arange(4), remote, np.arange(4), b"")
            assert wait(d, x, timeout=20).state is XferState.DONE
            return bytes(buf[: 4 * BLOCK].numpy())

        first = read()
        d.wait_standby(10)  # the standby has loaded the producer
        conn.send(("read", first))
        assert conn.recv() == "cut"
        for i in range(2):  # the first retirement starts a standby that cannot reach P
            t0 = time.monotonic()
            dropped = d.retire(f"round {i}")
            conn.send(("retired", time.monotonic() - t0, dropped))
        assert conn.recv() == "healed"
        buf.zero_()
        conn.send(("read", read()))


@pytest.mark.timeout(90)
def test_a_retirement_never_waits_for_an_unreachable_peer(spawn_child: Any) -> None:
    """Loading a peer the network cannot reach blocks until TCP gives up. A retirement that
    finds its standby still stuck loading such a peer takes a fresh agent within about a
    second, drops the peer (it is returned), and the peer loads and reads again once
    reachable."""
    from test_nixl_backend import BLOCK, MiB, pattern, producer

    with NetnsBed(2) as tb:
        p_host, d_host = tb.hosts
        p = spawn_child(run_in, p_host, tb.env(p_host), producer, "P", MiB, 7, deadline=80)
        d = spawn_child(run_in, d_host, tb.env(d_host), reader_across_a_partition, deadline=80)
        _, md, addr = p.recv(timeout=30)
        d.send((md, addr))
        want = pattern(MiB, 7)[: 4 * BLOCK].tobytes()
        assert d.recv(timeout=30) == ("read", want)
        tb.partition(p_host, cut=True)
        try:
            d.send("cut")
            *_, kept = d.recv(timeout=30)
            assert not kept, "the standby loaded P before the cut: nothing to drop"
            _, dropped_s, dropped = d.recv(timeout=30)
        finally:
            tb.partition(p_host, cut=False)
        assert dropped_s < 3.0, f"retire took {dropped_s:.1f} s with an unreachable peer"
        assert dropped == ["P"]
        d.send("healed")
        assert d.recv(timeout=30) == ("read", want)
        p.send(("stop",))
