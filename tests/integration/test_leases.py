"""Producer leases with real agents in separate processes: P frees a request's blocks only
when every expected D rank notified, or when its lease expires (counted); bad block ids fail
before anything reaches NIXL.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
from rank_host import EnginePair, EngineSpec, HostPool, RankHost

from kvrdma.errors import ConfigError
from kvrdma.testing import stop_process

pytest.importorskip("nixl")

BLOCK = 16
P_BLOCKS = 40
D_BLOCKS = 24
LEASE = {"kv_lease_duration": 1.0, "read_deadline": 0.5}
NOT_YET_S = 0.3  # how long P is watched to show it did *not* finish (notifications take ~ms)


def shape(heads: int = 8) -> dict[str, object]:
    return {"num_layers": 2, "num_kv_heads": heads, "head_dim": 8, "latent_dim": 12}


def pair_p1_d2(pool: HostPool, **extra: object) -> EnginePair:
    """P tp 1, D tp 2, 8 heads: each D rank reads its 4 heads from P rank 0 (expected 2)."""
    p = EngineSpec(1, BLOCK, P_BLOCKS, "split_kv", "HND", shape(), extra=dict(extra))
    d = EngineSpec(2, BLOCK, D_BLOCKS, "split_kv", "HND", shape(), extra=dict(extra))
    return EnginePair(pool, p, d)


def wait_counters(
    pair: EnginePair, done: Callable[[dict[str, Any]], bool], timeout: float = 5.0
) -> dict[str, Any]:
    """P rank 0's counters once `done(counters)` holds (the test fails after `timeout`)."""
    end = time.monotonic() + timeout
    while not done(c := pair.counters()[0]):
        assert time.monotonic() < end, f"P counters still {c} after {timeout}s"
        time.sleep(0.01)
    return c


def read_ok(pair: EnginePair, rank: int, rid: str, local: list[int], remote: list[int]) -> None:
    [[res]] = pair.read([(rid, local, remote)], ranks=[rank])
    assert (res["wrong"], res["invalid"]) == (0, []), f"D rank {rank}: {res}"


def test_blocks_held_until_every_expected_reader_notified(rank_hosts: HostPool) -> None:
    with pair_p1_d2(rank_hosts) as pair:
        plans = pair.connect()
        assert [pl["notify_expected"] for pl in plans] == [2, 2], plans
        pair.hold([("r", [7, 3, 39])])

        read_ok(pair, 0, "r", [5, 0, 23], [7, 3, 39])
        [sent] = pair.wait_sent(["r"], timeout=NOT_YET_S)
        assert sent == {}, "P freed the blocks after 1 of 2 expected notifications"
        [c] = pair.counters()
        assert (c["held"], c["notified"], c["expired"]) == (1, 0, 0), c

        read_ok(pair, 1, "r", [5, 0, 23], [7, 3, 39])
        [sent] = pair.wait_sent(["r"], timeout=10.0)
        assert list(sent) == ["r"]
        [c] = pair.counters()
        assert (c["held"], c["notified"], c["expired"]) == (0, 1, 0), c


@pytest.mark.parametrize("readers", [[], [0]], ids=["nobody-reads", "one-of-two-reads"])
def test_lease_expiry_frees_blocks_of_a_reader_that_never_notifies(
    rank_hosts: HostPool, readers: list[int]
) -> None:
    with pair_p1_d2(rank_hosts, **LEASE) as pair:
        pair.connect()
        pair.hold([("r", [1, 2, 3])])
        for rank in readers:
            read_ok(pair, rank, "r", [4, 5, 6], [1, 2, 3])
        [sent] = pair.wait_sent(["r"], timeout=NOT_YET_S)
        # a slow read may have taken the lease's time: freed, but not before it expired
        assert all(held >= 1.0 for held in sent.values()), "P freed the blocks too early"

        [sent] = pair.wait_sent(["r"], timeout=5.0)
        assert list(sent) == ["r"], "the lease never expired"
        assert 1.0 <= sent["r"] < 2.5, f"freed {sent['r']:.3f}s after hold, lease is 1.0s"
        [c] = pair.counters()
        assert (c["expired"], c["notified"], c["held"]) == (1, 0, 0), c

        # a reader that comes back late is counted, not reported finished a second time
        read_ok(pair, 1, "r", [4, 5, 6], [1, 2, 3])
        c = wait_counters(pair, lambda c: c["unknown_notifs"] > 0)
        assert (c["expired"], c["notified"], c["unknown_notifs"]) == (1, 0, 1), c
        assert c["reports"] == ["r"], c


@pytest.mark.parametrize(
    ("local", "remote", "match"),
    [
        ([0, 1], [3, P_BLOCKS], "remote block ids out of range"),
        ([0, 1], [-1, 3], "remote block ids out of range"),
        ([0, D_BLOCKS], [3, 4], "local block ids out of range"),
        ([0], [3, 4], "need 2 local blocks"),
    ],
    ids=["remote-past-end", "remote-negative", "local-past-end", "too-few-local"],
)
def test_bad_block_ids_fail_before_any_transfer(
    rank_hosts: HostPool, local: list[int], remote: list[int], match: str
) -> None:
    with pair_p1_d2(rank_hosts) as pair:
        pair.connect()
        pair.hold([("r", [3, 4])])
        d0 = pair.d[0]
        with pytest.raises(ConfigError, match=match):
            d0.call("start_read", "r", local, remote)
        assert d0.call("inflight") == [], "a transfer was posted for rejected block ids"
        [sent] = pair.wait_sent(["r"], timeout=NOT_YET_S)
        [c] = pair.counters()
        assert sent == {} and (c["held"], c["notified"], c["unknown_notifs"]) == (1, 0, 0), c
        # the worker is not poisoned: the same request with good ids still reads
        for rank in (0, 1):
            read_ok(pair, rank, "r", [0, 1], [3, 4])
        [sent] = pair.wait_sent(["r"], timeout=10.0)
        assert list(sent) == ["r"]


# ---- notifications to handshake ranks the reader did not READ from ---------------------------
@contextmanager
def stopped(hosts: Sequence[RankHost]) -> Iterator[None]:
    """SIGSTOP `hosts` (a producer busy in a long step), always SIGCONT them again."""
    for h in hosts:
        stop_process(h.process.pid or 0)
    try:
        yield
    finally:
        for h in hosts:
            os.kill(h.process.pid or 0, signal.SIGCONT)


def _mla_p4_d1(pool: HostPool) -> EnginePair:
    """MLA P tp 4 → D tp 1: D reads rank 0 only and notifies ranks 1-3 by `send_notif`."""
    p = EngineSpec(4, BLOCK, P_BLOCKS, "mla", "HND", shape(1))
    d = EngineSpec(1, BLOCK, D_BLOCKS, "mla", "HND", shape(1), idle_progress=False)
    return EnginePair(pool, p, d)


def _read_while_busy(pair: EnginePair) -> None:
    plans = pair.connect()
    assert plans[0]["sources"] == [0] and plans[0]["notify_ranks"] == [0, 1, 2, 3], plans
    pair.hold([("r", [9, 8])])
    with stopped(pair.p[1:]):  # ranks 1-3 busy while D finishes and notifies them
        read_ok(pair, 0, "r", [2, 3], [9, 8])
        time.sleep(0.05)


def _sent_while_reader_steps(pair: EnginePair) -> list[dict[str, float]]:
    """Step the reader as an engine does, step after step, until every P rank reported "r"
    sent (how soon the resumed ranks answer its ack READs depends on the machine's load)."""
    end = time.monotonic() + 10.0
    while True:
        pair.d[0].call("progress", 0.05)  # the reader's next engine step
        sent = pair.wait_sent(["r"], timeout=0.2)
        if [list(s) for s in sent] == [["r"]] * 4 or time.monotonic() >= end:
            return sent


def test_undelivered_notifications_are_counted_until_the_reader_steps_again(
    rank_hosts: HostPool,
) -> None:
    """A done notification to a rank D read nothing from travels on a one-byte ack READ.
    While that rank is busy the notification is pending (the engine must keep stepping:
    `Worker.pending_notifications`), and the data read itself is not held up by it."""
    with _mla_p4_d1(rank_hosts) as pair:
        _read_while_busy(pair)
        assert pair.d[0].call("pending_notifications") > 0
        sent = _sent_while_reader_steps(pair)
        assert [list(s) for s in sent] == [["r"]] * 4, f"finished-sending by P rank: {sent}"
        pair.d[0].call("progress", 0.05)
        assert pair.d[0].call("pending_notifications") == 0
