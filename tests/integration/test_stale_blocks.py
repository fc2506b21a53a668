"""Stale blocks with real agents in separate processes: a decoder given the producer's lease
expiry (`Worker.hold`'s return) never reports blocks as read once that lease has ended and the
producer reused them, while a read within the lease still succeeds.

The clock offset comes from the real handshake (`Worker.connect` through a `HandshakeServer`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from rank_host import EnginePair, EngineSpec, HostPool

pytest.importorskip("nixl")

BLOCK = 16
P_BLOCKS = 40
D_BLOCKS = 24
SHORT_LEASE = {"kv_lease_duration": 1.0}


def pair_p1_d1(pool: HostPool, **extra: object) -> EnginePair:
    shape = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 8, "latent_dim": 12}
    p = EngineSpec(1, BLOCK, P_BLOCKS, "split_kv", "HND", shape, extra=dict(extra))
    d = EngineSpec(1, BLOCK, D_BLOCKS, "split_kv", "HND", shape, extra=dict(extra))
    return EnginePair(pool, p, d)


def test_a_read_after_the_lease_ended_and_the_blocks_were_reused_is_invalid(
    rank_hosts: HostPool,
) -> None:
    remote, local = [7, 3, 39], [5, 0, 23]
    with pair_p1_d1(rank_hosts, **SHORT_LEASE) as pair:
        pair.connect()
        [expires] = pair.hold([("r", remote)])
        # nobody reads: P's lease ends, it frees the blocks and reuses them for other KV
        [sent] = pair.wait_sent(["r"], timeout=10.0)
        assert list(sent) == ["r"], "P never let the lease expire"
        pair.p[0].call("reuse", [(b, b - 1) for b in remote])

        [[late]] = pair.read([("r", local, remote)], expires=expires)
        assert late["outcome"] == "expired", late
        assert late["invalid"] == sorted(local), late

        # the same read without the expiry succeeds with the new occupant's bytes: what the
        # expiry protects against really happened
        [[blind]] = pair.read([("r-blind", local, remote)])
        assert blind["outcome"] == "success" and blind["wrong"] > 0, blind


def test_a_read_within_the_lease_succeeds(rank_hosts: HostPool) -> None:
    remote, local = [7, 3, 39], [5, 0, 23]
    with pair_p1_d1(rank_hosts) as pair:  # the default lease
        pair.connect()
        [expires] = pair.hold([("r", remote)])
        [[res]] = pair.read([("r", local, remote)], expires=expires)
        assert (res["outcome"], res["wrong"], res["invalid"]) == ("success", 0, []), res


@pytest.mark.timeout(120)
def test_a_read_still_running_at_the_lease_cutoff_ends_expired_and_never_lands(
    spawn_child: Any, tmp_path: Path
) -> None:
    """P stopped (SIGSTOP, UCX over TCP: its READs cannot finish) while D reads blocks whose
    lease ends before D's read deadline: the read ends expired at the lease cutoff, not at the
    deadline, with every block invalid, and nothing lands in them after P resumes."""
    from soak_harness import Cluster, ClusterSpec, Read

    c = Cluster(
        ClusterSpec(p_tp=1, read_deadline=3.0, lease=6.0, log_dir=str(tmp_path)), spawn_child
    )
    try:
        c.start()
        local, remote = tuple(range(100, 108)), tuple(range(8))
        c.hold([("r", list(remote))])
        # this test's clock is the producer's (one host): the lease is said to end in 1.5 s,
        # well before the 3 s read deadline
        ends = time.monotonic() + 1.5
        c.stall(0)
        try:
            c.read([Read("r", local, remote, expires_at=ends)])
            c.pump_until(lambda: "r" in c.outcomes, 10.0, "the stalled read")
        finally:
            c.resume(0)
        o = c.outcomes["r"]
        assert o.kind == "failed" and o.reason.startswith("expired"), o
        assert list(o.invalid) == sorted(local), o
        assert o.read_seconds < 2.0, o  # ended at the cutoff, not at the 3 s deadline
        end = time.monotonic() + 1.0
        c.pump_until(lambda: time.monotonic() >= end, 2.0, "")
        assert c.audit(list(local)) == 0, "the expired read landed after it was reported"
    finally:
        c.close()
    assert not c.leftovers(), f"rank processes outlived the test: {c.leftovers()}"
