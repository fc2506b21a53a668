"""Stale blocks with real agents in separate processes: a decoder given the producer's lease
expiry (`Worker.hold`'s return) never reports blocks as read once that lease has ended and the
producer reused them, while a read within the lease still succeeds.

The clock offset comes from the real handshake (`Worker.connect` through a `HandshakeServer`).
"""

from __future__ import annotations

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
