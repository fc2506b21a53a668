"""Byte-for-byte READs through real NIXL agents in separate processes (issue 8's matrix).

Layouts {split K/V, blocks-first, MLA, cross-layer, Mamba hybrid} × (P tp, D tp) × KV heads
{1, 2, 8} × block-size ratio {1, 2, 4} (where valid), P HND, D HND and NHD. Every case sets
up fresh P and D workers on the session's long-lived rank hosts, reads several requests with
scattered block ids (some ending in a partly filled local block), and checks every element on
every D rank, that blocks no request wrote stay zero, and that every P rank reports every
request finished-sending (all expected notifications arrived). Impossible mappings must raise
`ConfigError` at `add_remote`.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import signal
from typing import Any

import pytest
from rank_host import EnginePair, EngineSpec, HostError, HostPool

from kvrdma.errors import ConfigError
from kvrdma.testing import stop_process

pytest.importorskip("nixl")

logger = logging.getLogger(__name__)

LAYOUTS = ["split_kv", "blocks_first", "mla", "cross_layer", "mamba"]
TP_PAIRS = [(1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)]
HEADS = [1, 2, 8]
RATIOS = [1, 2, 4]
D_BLOCK = 16
P_BLOCKS = 40
D_BLOCKS = 24


def shape(heads: int, **over: Any) -> dict[str, Any]:
    """A tiny model: 2 attention layers (+1 Mamba layer for the hybrid), head_dim 8."""
    return {
        "num_layers": 2,
        "num_kv_heads": heads,
        "head_dim": 8,
        "latent_dim": 12,
        "mamba_layers": 1,
        "mamba_state": 64,
        "mamba_conv": 16,
        **over,
    }


def _valid(layout: str, heads: int, ratio: int) -> bool:
    if layout == "mla" and heads != 1:
        return False  # MLA has one latent "head": other head counts are the same case
    return not (layout == "mamba" and ratio != 1)  # hybrids need equal block sizes


def _cases() -> list[Any]:
    out = []
    for layout, (pt, dt), heads, ratio, d_kvl in itertools.product(
        LAYOUTS, TP_PAIRS, HEADS, RATIOS, ("HND", "NHD")
    ):
        if _valid(layout, heads, ratio):
            out.append(
                pytest.param(
                    layout,
                    pt,
                    dt,
                    heads,
                    ratio,
                    d_kvl,
                    id=f"{layout}-p{pt}d{dt}-h{heads}-r{ratio}-{d_kvl}",
                )
            )
    return out


def requests(seed: str, ratio: int) -> list[tuple[str, list[int], list[int]]]:
    """Three requests: scattered remote ids, disjoint local ids (some D blocks left untouched);
    remote counts not a multiple of `ratio` leave the last local block partly filled. The
    first request uses the first and last block on both sides."""
    rng = random.Random(seed)
    counts = [2 * ratio + 1, 3 * ratio, max(1, ratio - 1)]
    local_pool = [0, D_BLOCKS - 1, *rng.sample(range(1, D_BLOCKS - 1), D_BLOCKS - 2)]
    out = []
    for i, n in enumerate(counts):
        remote = rng.sample(range(1, P_BLOCKS - 1), n)
        if i == 0:
            remote[0], remote[-1] = P_BLOCKS - 1, 0
        n_local = -(-n // ratio)
        local, local_pool = local_pool[:n_local], local_pool[n_local:]
        out.append((f"{seed}-req{i}", local, remote))
    return out


def run_case(
    pool: HostPool,
    layout: str,
    p_tp: int,
    d_tp: int,
    heads: int,
    ratio: int,
    d_kvl: str,
    *,
    devices: tuple[str, str] = ("", ""),
    kv_buffer_device: str = "cuda",
) -> None:
    """One case; `devices`: where P's and D's caches live ("": `KVRDMA_TEST_DEVICE`)."""
    common: dict[str, Any] = {"kv_buffer_device": kv_buffer_device}
    p = EngineSpec(
        p_tp, D_BLOCK // ratio, P_BLOCKS, layout, "HND", shape(heads), device=devices[0], **common
    )
    d = EngineSpec(
        d_tp, D_BLOCK, D_BLOCKS, layout, d_kvl, shape(heads), device=devices[1], **common
    )
    check_pair(pool, p, d, ratio)


def check_pair(pool: HostPool, p: EngineSpec, d: EngineSpec, ratio: int, push: str = "") -> None:
    """Read three requests from P into D (or with `push` "whole"/"layerwise", have P push
    them); check every element, the untouched blocks, the unfilled tails and every P rank's
    finished-sending report."""
    d_tp = d.tp
    with EnginePair(pool, p, d) as pair:
        plans = pair.connect()
        reqs = requests(pair.d_engine, ratio)
        rids = [rid for rid, _, _ in reqs]
        if push:
            results = pair.push(reqs, layerwise=push == "layerwise")
        else:
            pair.hold([(rid, remote) for rid, _, remote in reqs])
            results = pair.read(reqs)
        for rank, per_rank in enumerate(results):
            for res in per_rank:
                assert res["invalid"] == [], f"D rank {rank} {res['rid']}: {res}; plan {plans}"
                assert res["wrong"] == 0, (
                    f"D rank {rank} {res['rid']}: {res['wrong']} wrong elements; plan {plans[rank]}"
                )
        used = {b for _, local, _ in reqs for b in local}
        untouched = [b for b in range(D_BLOCKS) if b not in used]
        nonzero = pool.gather([(h, "untouched_nonzero", (untouched,)) for h in pair.d])
        assert nonzero == [0] * d_tp, f"D ranks wrote outside the requested blocks: {nonzero}"
        tails = pool.gather([(h, "tail_nonzero", (reqs, D_BLOCK // ratio)) for h in pair.d])
        assert tails == [0] * d_tp, f"D ranks wrote past the tokens read: {tails}"
        sent = pair.wait_sent(rids, timeout=10.0)
        for rank, got in enumerate(sent):
            assert sorted(got) == sorted(rids), (
                f"P rank {rank} finished-sending {sorted(got)}, expected {rids}; plans {plans}"
            )
        for rank, c in enumerate(pair.counters()):
            notified = 0 if push else len(rids)  # pushed blocks are freed by the WRITEs' end
            assert (c["notified"], c["expired"], c["held"]) == (notified, 0, 0), (
                f"P rank {rank}: {c}"
            )
            assert c["unknown_notifs"] == c["malformed_notifs"] == 0, f"P rank {rank}: {c}"


@pytest.mark.parametrize(("layout", "p_tp", "d_tp", "heads", "ratio", "d_kvl"), _cases())
def test_read_matrix_byte_exact(
    rank_hosts: HostPool, layout: str, p_tp: int, d_tp: int, heads: int, ratio: int, d_kvl: str
) -> None:
    run_case(rank_hosts, layout, p_tp, d_tp, heads, ratio, d_kvl)


# ---- vLLM's unified layout: each physical order, with hetero TP both ways --------------------
def _unified_cases() -> list[Any]:
    rows = [
        # (P order, D order, P tp, D tp, KV heads, block ratio, Mamba hybrid)
        ("LBHNC", "LBHNC", 1, 2, 8, 2, False),
        ("LBHNC", "LBHNC", 4, 2, 8, 1, False),
        ("LBHNC", "LBNHC", 2, 1, 8, 2, False),
        ("LHBNC", "LHBNC", 2, 4, 8, 2, False),
        ("LHBNC", "LHBNC", 4, 1, 2, 1, False),
        ("LHBNC", "LHBNC", 1, 2, 2, 1, True),
        ("BLHNC", "BLHNC", 1, 4, 8, 4, False),
        ("BLHNC", "BLNHC", 4, 2, 8, 1, False),
        ("BLHNC", "BLHNC", 4, 2, 8, 1, True),
        ("BHLNC", "BHLNC", 2, 4, 8, 2, False),
        ("BHLNC", "BHLNC", 4, 1, 2, 4, False),
        ("BHLNC", "BHLNC", 2, 1, 8, 1, True),
        ("LBNHC", "LBNHC", 2, 2, 8, 2, False),
        ("LBNHC", "LBNHC", 4, 2, 8, 1, False),  # whole P blocks, permuted on receive
        ("BLNHC", "BLNHC", 4, 1, 2, 2, False),
        ("LBHNC", "LBHNC", 1, 4, 1, 2, False),  # MLA: one latent head on every rank
        ("BHLNC", "BHLNC", 4, 2, 1, 1, False),  # MLA
    ]
    return [
        pytest.param(*row, id=f"{row[0]}-{row[1]}-p{row[2]}d{row[3]}-h{row[4]}-r{row[5]}"
                     + ("-hybrid" if row[6] else ""))
        for row in rows
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("p_order", "d_order", "p_tp", "d_tp", "heads", "ratio", "hybrid"), _unified_cases()
)
def test_unified_layout_byte_exact(
    rank_hosts: HostPool,
    p_order: str,
    d_order: str,
    p_tp: int,
    d_tp: int,
    heads: int,
    ratio: int,
    hybrid: bool,
) -> None:
    def spec(tp: int, block: int, blocks: int, order: str) -> EngineSpec:
        return EngineSpec(
            tp, block, blocks, "unified", "HND", shape(heads), kv_cache_order=order, hybrid=hybrid
        )

    p = spec(p_tp, D_BLOCK // ratio, P_BLOCKS, p_order)
    check_pair(rank_hosts, p, spec(d_tp, D_BLOCK, D_BLOCKS, d_order), ratio)


# ---- senders in NHD: fine unless the reader slices heads out of a block ----------------------
@pytest.mark.parametrize(
    ("layout", "p_tp", "d_tp", "heads", "ratio"),
    [
        ("split_kv", 1, 1, 8, 2),
        ("split_kv", 2, 1, 8, 4),
        ("blocks_first", 4, 2, 8, 1),
        ("cross_layer", 4, 1, 2, 2),
        ("split_kv", 1, 4, 1, 2),  # one replicated head: nothing to slice
        ("mla", 1, 4, 1, 4),
        ("mamba", 4, 2, 2, 1),
    ],
)
def test_nhd_sender_without_head_slicing(
    rank_hosts: HostPool, layout: str, p_tp: int, d_tp: int, heads: int, ratio: int
) -> None:
    p = EngineSpec(p_tp, D_BLOCK // ratio, P_BLOCKS, layout, "NHD", shape(heads))
    d = EngineSpec(d_tp, D_BLOCK, D_BLOCKS, layout, "HND", shape(heads))
    with EnginePair(rank_hosts, p, d) as pair:
        pair.connect()
        reqs = requests(pair.d_engine, ratio)
        pair.hold([(rid, remote) for rid, _, remote in reqs])
        for rank, per_rank in enumerate(pair.read(reqs)):
            for res in per_rank:
                assert (res["wrong"], res["invalid"]) == (0, []), f"D rank {rank}: {res}"
        sent = pair.wait_sent([rid for rid, _, _ in reqs])
        assert all(len(s) == len(reqs) for s in sent), sent


# ---- impossible mappings: ConfigError at add_remote, nothing loaded ------------------------
def _invalid() -> list[Any]:
    h8, h6, h2 = shape(8), shape(6), shape(2)
    cases = [
        # (P spec, D spec, message fragment)
        ("nhd-sender-sliced-p1d2", EngineSpec(1, 16, 8, "split_kv", "NHD", h8),
         EngineSpec(2, 16, 8, "split_kv", "HND", h8), "HND on the sender"),
        ("nhd-sender-sliced-p2d4", EngineSpec(2, 8, 8, "blocks_first", "NHD", h8),
         EngineSpec(4, 16, 8, "blocks_first", "HND", h8), "HND on the sender"),
        ("nhd-sender-sliced-p1d4-h2", EngineSpec(1, 16, 8, "mamba", "NHD", h2),
         EngineSpec(4, 16, 8, "mamba", "HND", h2), "HND on the sender"),
        ("nhd-sender-sliced-cross-layer", EngineSpec(1, 4, 8, "cross_layer", "NHD", h8),
         EngineSpec(4, 16, 8, "cross_layer", "NHD", h8), "HND on the sender"),
        ("tp-not-dividing-p2d3", EngineSpec(2, 16, 8, "split_kv", "HND", h6),
         EngineSpec(3, 16, 8, "split_kv", "HND", h6), "TP sizes must divide"),
        ("tp-not-dividing-p3d2", EngineSpec(3, 16, 8, "split_kv", "HND", h6),
         EngineSpec(2, 16, 8, "split_kv", "HND", h6), "TP sizes must divide"),
        ("mamba-block-ratio-2", EngineSpec(1, 8, 8, "mamba", "HND", h8),
         EngineSpec(1, 16, 8, "mamba", "HND", h8), "equal block sizes"),
        ("remote-block-larger", EngineSpec(1, 32, 8, "split_kv", "HND", h8),
         EngineSpec(1, 16, 8, "split_kv", "HND", h8), "must divide local block_size"),
        ("remote-block-not-dividing", EngineSpec(1, 6, 8, "split_kv", "HND", h8),
         EngineSpec(1, 16, 8, "split_kv", "HND", h8), "must divide local block_size"),
        ("head-dim-differs", EngineSpec(1, 16, 8, "split_kv", "HND", shape(8, head_dim=16)),
         EngineSpec(1, 16, 8, "split_kv", "HND", h8), "head_dim differs"),
        ("heads-differ", EngineSpec(2, 16, 8, "split_kv", "HND", shape(4)),
         EngineSpec(2, 16, 8, "split_kv", "HND", h8), "total_num_kv_heads"),
        ("cache-layout-differs", EngineSpec(1, 16, 8, "blocks_first", "HND", h8),
         EngineSpec(1, 16, 8, "split_kv", "HND", h8), "cache_layout differs"),
        ("dtype-differs", EngineSpec(1, 16, 8, "split_kv", "HND", shape(8, dtype="bfloat16")),
         EngineSpec(1, 16, 8, "split_kv", "HND", h8), "dtype differs"),
        ("layers-differ", EngineSpec(1, 16, 8, "split_kv", "HND", shape(8, num_layers=3)),
         EngineSpec(1, 16, 8, "split_kv", "HND", h8), "regions"),
        ("unified-nhd-order-sliced-p1d2",
         EngineSpec(1, 16, 8, "unified", "HND", h8, kv_cache_order="LBNHC"),
         EngineSpec(2, 16, 8, "unified", "HND", h8, kv_cache_order="LBNHC"),
         "kv_cache_order LBNHC of engine"),
        ("unified-nhd-order-sliced-p2d4",
         EngineSpec(2, 8, 8, "unified", "HND", h8, kv_cache_order="BLNHC"),
         EngineSpec(4, 16, 8, "unified", "HND", h8, kv_cache_order="BLNHC"),
         "P tp 2 -> D tp 4"),
        ("unified-orders-differ",
         EngineSpec(1, 16, 8, "unified", "HND", h8, kv_cache_order="LHBNC"),
         EngineSpec(1, 16, 8, "unified", "HND", h8, kv_cache_order="LBHNC"),
         "kv_cache_order differs"),
    ]  # fmt: skip
    return [pytest.param(p, d, m, id=name) for name, p, d, m in cases]


@pytest.mark.parametrize(("p", "d", "match"), _invalid())
def test_impossible_mapping_raises_config_error_at_add_remote(
    rank_hosts: HostPool, p: EngineSpec, d: EngineSpec, match: str
) -> None:
    with EnginePair(rank_hosts, p, d) as pair:
        # every P rank offered (not only the handshake targets), so `Worker.add_remote` —
        # not the target-rank helper — is what must refuse
        results = pair.connect(only_targets=False, errors=False)
        for rank, res in enumerate(results):
            assert isinstance(res, ConfigError), f"D rank {rank}: add_remote returned {res!r}"
            assert match in str(res), f"D rank {rank}: {res}"
        remotes = rank_hosts.gather([(h, "remotes", ()) for h in pair.d])
        assert remotes == [{"engines": [], "agents": []}] * d.tp, remotes


# ---- the harness itself: a silent or dead host fails the case, and is replaced --------------
@pytest.mark.timeout(240)  # may start the pool, then restarts one host (imports, agent)
def test_silent_or_dead_host_fails_the_case_then_is_replaced(rank_hosts: HostPool) -> None:
    spec = EngineSpec(4, D_BLOCK, D_BLOCKS, "split_kv", "HND", shape(8))
    with EnginePair(rank_hosts, spec, spec) as pair:
        victim = pair.d[3]  # the host the fewest cases use
        pid = victim.process.pid or 0
        stop_process(pid)
        try:
            with pytest.raises(HostError, match="no reply to 'ping' within"):
                victim.call("ping", timeout=0.5)
        finally:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(HostError, match=r"died \(exit code -9\)"):
            victim.call("ping", timeout=10.0)
    assert victim.broken
    replaced = rank_hosts.replaced
    run_case(rank_hosts, "split_kv", 2, 4, 8, 2, "NHD")
    assert rank_hosts.replaced == replaced + 1 and rank_hosts.d[3] is not victim


# ---- last: hundreds of cases later, the hosts hold no agents and have not grown -------------
WARM_CASES = 20  # allocator arenas, torch and UCX caches settle over the first cases
MIN_CASES = 100
MAX_RSS_GROWTH_MB = 32.0


def test_hosts_release_agents_and_stay_bounded(rank_hosts: HostPool) -> None:
    """Runs after the matrix (file order): teardown released every agent and worker, and
    RSS, file descriptors and threads did not grow with the number of cases."""
    stats = rank_hosts.stats()
    for name, st in stats.items():
        alive = {k: st[k] for k in ("nixl_agent", "NixlBackend", "Worker")}
        assert alive == dict.fromkeys(alive, 0), f"host {name} after teardown: {alive} alive"
    if stats["P0"]["cases"] < MIN_CASES:
        pytest.skip(f"only {stats['P0']['cases']} cases ran; need {MIN_CASES} to judge growth")
    summary = []
    for name, st in stats.items():
        after = st["after"]
        if len(after) <= WARM_CASES:
            continue  # a host that was replaced, or that few cases use (P3, D3)
        base, last = after[WARM_CASES - 1], after[-1]
        peak = max(a["rss_mb"] for a in after[WARM_CASES:])
        summary.append(
            f"{name}: {len(after)} cases, RSS {after[0]['rss_mb']:.0f} → {base['rss_mb']:.0f} "
            f"(case {WARM_CASES}) → {last['rss_mb']:.0f} MiB (peak {peak:.0f}), "
            f"fds {base['fds']:.0f} → {last['fds']:.0f}, "
            f"threads {base['threads']:.0f} → {last['threads']:.0f}"
        )
        assert peak - base["rss_mb"] < MAX_RSS_GROWTH_MB, "\n".join(summary)
        assert last["fds"] <= base["fds"] + 2, "\n".join(summary)
        assert last["threads"] <= base["threads"] + 1, "\n".join(summary)
    logger.info("rank hosts:\n%s", "\n".join(summary))
