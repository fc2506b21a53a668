"""Byte-exact READ plans for every layout × TP mix × heads × block-size ratio (no NIXL)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from kvrdma.descriptors import kernel_pairs
from kvrdma.errors import ConfigError
from kvrdma.layout import build_regions, worker_metadata
from kvrdma.plan import build_read_plan
from kvrdma.testing.synthetic import CacheSpec, ModelShape, verify
from kvrdma.topology import TransferTopology

from .plan_sim import SimWorker, execute, read_and_permute

LAYOUTS = ["split_kv", "blocks_first", "mla", "cross_layer", "mamba"]
TP_PAIRS = [(1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)]
HEADS = [1, 2, 8]
RATIOS = [1, 2, 4]
D_BLOCK = 16


def _valid(layout: str, heads: int, ratio: int) -> bool:
    return not (layout == "mamba" and ratio != 1)


def _cases():
    for layout, (pt, dt), heads, ratio in itertools.product(LAYOUTS, TP_PAIRS, HEADS, RATIOS):
        if layout == "mla" and heads != 1:
            continue
        if not _valid(layout, heads, ratio):
            continue
        yield pytest.param(
            layout, pt, dt, heads, ratio, id=f"{layout}-p{pt}d{dt}-h{heads}-r{ratio}"
        )


def _spec(layout, rank, tp, heads, block, kvl, n=24):
    shape = ModelShape(
        num_layers=2,
        num_kv_heads=heads,
        head_dim=8,
        latent_dim=12,
        mamba_layers=1,
        mamba_state=64,
        mamba_conv=16,
    )
    return CacheSpec(shape, layout, kvl, rank, tp, block, n)


def _heads(tp: int, k: int) -> int:
    return k // tp if tp <= k else 1


@pytest.mark.parametrize(("layout", "p_tp", "d_tp", "heads", "ratio"), list(_cases()))
@pytest.mark.parametrize(
    ("p_kvl", "d_kvl"), [("HND", "HND"), ("HND", "NHD"), ("NHD", "HND"), ("NHD", "NHD")]
)
def test_plan_moves_exact_bytes(layout, p_tp, d_tp, heads, ratio, p_kvl, d_kvl):
    p_block = D_BLOCK // ratio
    sliced = layout != "mla" and _heads(d_tp, heads) < _heads(p_tp, heads)
    producers = {
        r: SimWorker(_spec(layout, r, p_tp, heads, p_block, p_kvl, n=40), "P", producer=True)
        for r in range(p_tp)
    }
    remote_ids = [3, 17, 5, 6, 7, 30, 0, 39, 11][: max(1, 9 - ratio)]
    n_local = -(-len(remote_ids) // ratio)
    local_ids = [9, 2, 14, 0, 5, 21, 7, 1, 3][:n_local]
    for r in range(d_tp):
        d = SimWorker(_spec(layout, r, d_tp, heads, D_BLOCK, d_kvl), "D", producer=False)
        topo = d.topology()
        metas = {p: w.meta for p, w in producers.items()}
        if sliced and p_kvl == "NHD" and p_block > 1:
            with pytest.raises(ConfigError, match="needs HND on the sender"):
                build_read_plan(topo, d.meta, metas)
            continue
        plan = build_read_plan(topo, d.meta, metas, mamba_states=d.info.mamba_states)
        moved = read_and_permute(d, plan, local_ids, remote_ids)
        assert moved > 0
        bad = verify(d.spec, d.caches, local_ids, remote_ids, p_block)
        assert bad == 0, f"D rank {r}: {bad} wrong elements; {topo.describe()}"
        # untouched blocks stay zero
        untouched = [b for b in range(d.spec.num_blocks) if b not in local_ids]
        for reg in d.info.regions:
            assert int(reg.data[untouched].count_nonzero()) == 0


def test_nhd_sender_cannot_be_head_sliced():
    producers = {0: SimWorker(_spec("split_kv", 0, 1, 8, 16, "NHD"), "P", producer=True)}
    d = SimWorker(_spec("split_kv", 1, 2, 8, 16, "HND"), "D", producer=False)
    with pytest.raises(ConfigError, match="HND on the sender"):
        build_read_plan(d.topology(), d.meta, {0: producers[0].meta})


def test_producer_ranks_with_different_block_counts_are_refused():
    """Block ids are checked against one count: a rank with fewer blocks would take an id
    past its own for a block of its next region."""
    producers = {
        r: SimWorker(_spec("split_kv", r, 2, 8, 16, "HND", n), "P", producer=True)
        for r, n in ((0, 40), (1, 20))
    }
    d = SimWorker(_spec("split_kv", 0, 1, 8, 16, "HND"), "D", producer=False)
    with pytest.raises(ConfigError, match=r"num_blocks differs .*\{0: 40, 1: 20\}"):
        build_read_plan(d.topology(), d.meta, {r: w.meta for r, w in producers.items()})


@pytest.mark.parametrize("remote", [[3, 4, 7], [3, 4, 7, 9]], ids=["partial", "whole"])
def test_kernel_pairs_read_a_last_partial_block_at_a_block_ratio(remote):
    """Two kernel blocks per logical one on both sides, D's kernel blocks twice P's: 3 of
    P's logical blocks fill 1.5 of D's, and D's kernel blocks past them are left out."""
    p = SimWorker(_spec("split_kv", 0, 1, 8, 8, "HND", 40), "P", producer=True)
    d = SimWorker(_spec("split_kv", 0, 1, 8, 16, "HND", 24), "D", producer=False)
    plan = build_read_plan(d.topology(), d.meta, {0: p.meta})
    local, remote_kernel = kernel_pairs([5, 6], remote, 2, plan.block_ratio)
    assert local == [10, 11, 12, 13][: -(-len(remote_kernel) // 2)]
    read_and_permute(d, plan, local, remote_kernel)
    assert verify(d.spec, d.caches, local, remote_kernel, 8) == 0


# ---- vLLM's unified layout: every physical order, alone and as a Mamba hybrid ---------------
ORDERS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]
# P order -> D order pairs with the same regions (the permute converts NHD <-> HND)
MIXED = [("LBHNC", "LBNHC"), ("LBNHC", "LBHNC"), ("BLHNC", "BLNHC"), ("BLNHC", "BLHNC")]


def _unified_spec(order, rank, tp, heads, block, n=24, hybrid=False):
    spec = _spec("unified", rank, tp, heads, block, "HND", n)
    return dataclasses.replace(spec, kv_cache_order=order, hybrid=hybrid)


def _unified_cases():
    pairs = [(o, o) for o in ORDERS] + MIXED
    for (p_order, d_order), (pt, dt), heads, ratio, hybrid in itertools.product(
        pairs, TP_PAIRS, HEADS, RATIOS, (False, True)
    ):
        if hybrid and ratio != 1:
            continue  # hybrids need equal block sizes
        name = p_order if p_order == d_order else f"{p_order}-to-{d_order}"
        yield pytest.param(
            p_order,
            d_order,
            pt,
            dt,
            heads,
            ratio,
            hybrid,
            id=f"{name}-p{pt}d{dt}-h{heads}-r{ratio}{'-hybrid' if hybrid else ''}",
        )


@pytest.mark.parametrize(
    ("p_order", "d_order", "p_tp", "d_tp", "heads", "ratio", "hybrid"), list(_unified_cases())
)
def test_unified_plan_moves_exact_bytes(p_order, d_order, p_tp, d_tp, heads, ratio, hybrid):
    p_block = D_BLOCK // ratio
    sliced = _heads(d_tp, heads) < _heads(p_tp, heads)
    producers = {
        r: SimWorker(
            _unified_spec(p_order, r, p_tp, heads, p_block, 40, hybrid), "P", producer=True
        )
        for r in range(p_tp)
    }
    remote_ids = [3, 17, 5, 6, 7, 30, 0, 39, 11][: max(1, 9 - ratio)]
    n_local = -(-len(remote_ids) // ratio)
    local_ids = [9, 2, 14, 0, 5, 21, 7, 1, 3][:n_local]
    metas = {p: w.meta for p, w in producers.items()}
    for r in range(d_tp):
        d = SimWorker(
            _unified_spec(d_order, r, d_tp, heads, D_BLOCK, hybrid=hybrid), "D", producer=False
        )
        topo = d.topology()
        if sliced and p_order in ("LBNHC", "BLNHC") and p_block > 1:
            msg = f"kv_cache_order {p_order} .*P tp {p_tp} -> D tp {d_tp}"
            with pytest.raises(ConfigError, match=msg):
                build_read_plan(topo, d.meta, metas)
            continue
        plan = build_read_plan(topo, d.meta, metas, mamba_states=d.info.mamba_states)
        assert read_and_permute(d, plan, local_ids, remote_ids) > 0
        bad = verify(d.spec, d.caches, local_ids, remote_ids, p_block)
        assert bad == 0, f"D rank {r}: {bad} wrong elements; {topo.describe()}"
        untouched = [b for b in range(d.spec.num_blocks) if b not in local_ids]
        for reg in d.info.regions:
            assert int(reg.data[untouched].count_nonzero()) == 0


@pytest.mark.parametrize(("p_order", "d_order"), [("LBHNC", "LHBNC"), ("BHLNC", "BLHNC")])
def test_unified_orders_with_different_regions_refused(p_order, d_order):
    p = SimWorker(_unified_spec(p_order, 0, 1, 8, 16), "P", producer=True)
    d = SimWorker(_unified_spec(d_order, 0, 1, 8, 16), "D", producer=False)
    with pytest.raises(ConfigError, match=f"kv_cache_order differs: local '{d_order}'"):
        build_read_plan(d.topology(), d.meta, {0: p.meta})


def _shared_worker(order, rank, tp, block, engine, n=24):
    """A worker whose Mamba layers overlay its attention pages (vLLM's HMA)."""
    w = SimWorker(_unified_spec(order, rank, tp, 8, block, n), engine, producer=False)
    for i in range(2):
        w.caches[f"m{i}"] = w.caches[f"model.layers.{i}.attn"].view(torch.int8).reshape(n, 1, 1, -1)
    w.info = build_regions(w.caches, mamba_layers=["m0", "m1"], **w.spec.layout_args)
    w.meta = worker_metadata(
        w.info, engine_id=engine, agent_name=f"{engine}-{rank}", agent_metadata=b"",
        tp_rank=rank, tp_size=tp, total_num_kv_heads=8,
    )  # fmt: skip
    return w


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("tp", [1, 2])
def test_shared_pages_move_whole_and_exact(order, tp):
    remote_ids, local_ids = [3, 17, 5, 0, 39], [9, 2, 14, 0, 23]
    for r in range(tp):
        p = _shared_worker(order, r, tp, D_BLOCK, "P", n=40)
        for reg in p.info.regions:  # any bytes: attention for some blocks, state for others
            reg.data.copy_(torch.randint(0, 256, reg.data.shape, dtype=torch.uint8))
        d = _shared_worker(order, r, tp, D_BLOCK, "D")
        plan = build_read_plan(d.topology(), d.meta, {r: p.meta})
        assert execute(plan, local_ids, remote_ids) > 0 and not plan.permutes
        for lr, rr in zip(d.info.regions, p.info.regions, strict=True):
            assert torch.equal(lr.data[local_ids], rr.data[remote_ids])


@pytest.mark.parametrize(
    ("p_order", "p_tp", "d_order", "d_tp", "p_block"),
    [("LBHNC", 1, "LBHNC", 2, 16), ("LBHNC", 2, "LBHNC", 1, 16), ("LBHNC", 1, "LBHNC", 1, 8),
     ("LBHNC", 1, "LBNHC", 1, 16)],
)  # fmt: skip
def test_shared_pages_refuse_what_would_split_a_page(p_order, p_tp, d_order, d_tp, p_block):
    metas = {r: _shared_worker(p_order, r, p_tp, p_block, "P", n=40).meta for r in range(p_tp)}
    d = _shared_worker(d_order, 0, d_tp, D_BLOCK, "D")
    with pytest.raises(ConfigError, match=r"Mamba state shares attention pages .*P tp"):
        build_read_plan(d.topology(), d.meta, metas)


# ---- Mamba pages of several states: each state is split over TP on its own -------------------
CONV, SSM = 32, 96  # whole-model state widths (elements)


def _conv_ssm_worker(rank, tp, engine, n=8):
    """A hybrid rank whose Mamba page is [conv part `rank` | ssm part `rank`], each element
    holding its model-wide index (ssm from 1000), as TP shards the two states."""
    attn = torch.zeros(n, 2, 4 // tp, 16, 4).transpose(2, 3).transpose(0, 1)
    c, s = CONV // tp, SSM // tp
    page = torch.zeros(n, c + s)
    conv, ssm = page[:, :c], page[:, c:]
    if engine == "P":
        conv.copy_(torch.arange(rank * c, rank * c + c).float().expand(n, c))
        ssm.copy_(1000 + torch.arange(rank * s, rank * s + s).float().expand(n, s))
    caches = {"attn0": attn, "mamba0": (conv, ssm)}
    info = build_regions(caches, cache_layout="mamba", block_size=16, mamba_layers=["mamba0"])
    meta = worker_metadata(
        info, engine_id=engine, agent_name=f"{engine}{rank}", agent_metadata=b"",
        tp_rank=rank, tp_size=tp, total_num_kv_heads=4,
    )  # fmt: skip
    return meta, info, page


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 4), (4, 2), (1, 1), (2, 2)])
@pytest.mark.parametrize("side", ["local", "remote"])
def test_mamba_page_of_conv_and_ssm_is_split_state_by_state(p_tp, d_tp, side):
    """D rank r's page must be [conv part r | ssm part r] of the model's states, whichever
    side's registration told the planner the state sizes (a decoder reading, or a producer
    pushing)."""
    producers = {r: _conv_ssm_worker(r, p_tp, "P") for r in range(p_tp)}
    metas = {r: m for r, (m, _, _) in producers.items()}
    c, s = CONV // d_tp, SSM // d_tp
    for r in range(d_tp):
        dmeta, dinfo, dpage = _conv_ssm_worker(r, d_tp, "D")
        states = dinfo.mamba_states if side == "local" else producers[0][1].mamba_states
        plan = build_read_plan(
            TransferTopology.for_worker(dmeta), dmeta, metas, mamba_states=states
        )
        execute(plan, [1, 3], [5, 2])
        want = torch.cat((torch.arange(r * c, r * c + c), 1000 + torch.arange(r * s, r * s + s)))
        for b in (1, 3):
            assert torch.equal(dpage[b], want.float()), (r, dpage[b].tolist())
        assert int(dpage[[0, 2, 4, 5, 6, 7]].count_nonzero()) == 0


def test_mamba_states_in_other_proportions_are_refused():
    """The state sizes come from one side; a remote page they cannot cut is another model."""
    pmeta, _, _ = _conv_ssm_worker(0, 1, "P")
    dmeta, _, _ = _conv_ssm_worker(0, 2, "D")
    with pytest.raises(ConfigError, match=r"Mamba region 1: .* proportions .*\[100, 56\]"):
        build_read_plan(
            TransferTopology.for_worker(dmeta), dmeta, {0: pmeta}, mamba_states=[(100, 56)]
        )
