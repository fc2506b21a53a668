"""`kvrdma inspect`: print the transfer plan for a config, a TP mix and a model shape.

For each local (decode) rank: the remote ranks it handshakes with and reads from, the byte
offsets inside local and remote blocks, descriptors per block and bytes per block — what a
user checks before deploying a P/D pair.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvrdma.cli.layouts import LAYOUT_ALIASES
from kvrdma.metadata import KV_CACHE_ORDERS

_ORDERS = [*KV_CACHE_ORDERS, "HND", "NHD"]


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="", help="kv_transfer_config JSON or file (the reader's)")
    p.add_argument("--local-tp", type=int, default=1, help="this (reading) engine's TP size")
    p.add_argument("--remote-tp", type=int, default=2, help="the producer engine's TP size")
    p.add_argument("--local-block-size", type=int, default=16)
    p.add_argument("--remote-block-size", type=int, default=16)
    p.add_argument("--layout", default="split_kv", choices=sorted(LAYOUT_ALIASES))
    p.add_argument("--local-kv-layout", choices=["HND", "NHD"], default="HND")
    p.add_argument("--remote-kv-layout", choices=["HND", "NHD"], default="HND")
    p.add_argument(
        "--order",
        choices=_ORDERS,
        default=None,
        help="--layout unified: the physical order of [L, B, H, N, C] (default LBHNC)",
    )
    p.add_argument("--remote-order", choices=_ORDERS, default=None, help="default: --order")
    p.add_argument(
        "--hybrid", action="store_true", help="--layout unified: Mamba layers follow (a hybrid)"
    )
    p.add_argument(
        "--model-shape",
        default="layers=8,heads=8,head_dim=128,dtype=float16",
        help="comma list: layers, heads, head_dim, dtype, latent, mamba_layers, mamba_state",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _layout_and_orders(args: argparse.Namespace) -> tuple[str, str, str]:
    """(layout, local kv_cache_order, remote kv_cache_order) the flags ask for."""
    from kvrdma.errors import ConfigError
    from kvrdma.testing.synthetic import split_layout
    from kvrdma.unified import normalize_order

    layout, order = split_layout(LAYOUT_ALIASES[args.layout])
    if args.order is not None or args.remote_order is not None or args.hybrid:
        if layout != "unified":
            raise ConfigError("--order, --remote-order and --hybrid need --layout unified")
        order = normalize_order(args.order or order)
    return layout, order, normalize_order(args.remote_order or order)


def _synthetic_worker(
    args: argparse.Namespace, layout: str, engine: str, rank: int, side: str, order: str
) -> tuple[Any, Any]:
    """(metadata, layout) of rank `rank` of the `side` ("local"/"remote") engine; the caller
    keeps the layout (whose regions view the caches) alive while their addresses are used."""
    from kvrdma.layout import build_regions, worker_metadata
    from kvrdma.testing.synthetic import CacheSpec, ModelShape, make_caches

    shape = ModelShape.parse(args.model_shape)
    tp, bs = getattr(args, f"{side}_tp"), getattr(args, f"{side}_block_size")
    kv_layout = getattr(args, f"{side}_kv_layout")
    spec = CacheSpec(shape, layout, kv_layout, rank, tp, bs, 2, "cpu", order, args.hybrid)  # type: ignore[arg-type]
    caches, mamba = make_caches(spec)
    info = build_regions(caches, mamba_layers=mamba, **spec.layout_args)  # type: ignore[arg-type]
    meta = worker_metadata(
        info,
        engine_id=engine,
        agent_name=f"{engine}-{rank}",
        agent_metadata=b"",
        tp_rank=rank,
        tp_size=tp,
        total_num_kv_heads=shape.num_kv_heads,
    )
    return meta, info


def _source_report(src: Any, block_ratio: int, local: Any, rmeta: Any) -> dict[str, Any]:
    """One source rank's descriptors and bytes per block, and its first entries' offsets."""
    entries = []
    for k in range(src.num_entries):
        la, ln, _, _, _ = (int(x) for x in src.local_rows[k])
        ra, _, _, _, _ = (int(x) for x in src.remote_rows[k])
        lbase = max(r.base_addr for r in local.regions if r.base_addr <= la)
        rbase = max(r.base_addr for r in rmeta.regions if r.base_addr <= ra)
        entries.append({"local_offset": la - lbase, "remote_offset": ra - rbase, "bytes": ln})
    return {
        "remote_rank": src.remote_rank,
        "descriptors_per_block": src.num_entries * block_ratio,
        "bytes_per_local_block": src.bytes_per_block,
        "first_entries": entries[:4],
    }


def _rank_report(
    local: Any, remotes: dict[int, Any], layout: str, mamba_states: Any
) -> dict[str, Any]:
    """The plan of one local rank reading the remote engine whose metadata is `remotes`."""
    from kvrdma.plan import build_read_plan, transfer_info
    from kvrdma.topology import TransferTopology

    topo = TransferTopology.for_worker(local)
    plan = build_read_plan(topo, local, remotes, mamba_states=mamba_states)
    info = transfer_info(topo, local, next(iter(remotes.values())))
    return {
        "local_rank": local.tp_rank,
        "heads": None if layout == "mla" else list(range(*topo.local_heads())),
        "tp_ratio": info.tp_ratio,
        "block_size_ratio": info.block_size_ratio,
        "handshake_ranks": list(info.handshake_ranks),
        "read_ranks": [s.remote_rank for s in plan.sources],
        "notify_expected_per_remote_rank": plan.notify_expected,
        "bytes_per_local_block": plan.bytes_per_local_block,
        "permutes": [
            f"region {p.region}: {p.remote_layout}->{p.local_layout} R={p.ratio} C={p.chunks}"
            for p in plan.permutes
        ],
        "sources": [
            _source_report(s, plan.block_ratio, local, remotes[s.remote_rank]) for s in plan.sources
        ],
    }


def plan_report(args: argparse.Namespace) -> dict[str, Any]:
    from kvrdma.config import load_kv_transfer_config

    cfg_src: Any = args.config or {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "engine_id": "decode",
    }
    config = load_kv_transfer_config(cfg_src)
    layout, order, remote_order = _layout_and_orders(args)
    remotes = {
        r: _synthetic_worker(args, layout, "prefill", r, "remote", remote_order)
        for r in range(args.remote_tp)
    }
    report: dict[str, Any] = {
        "config": config.to_dict(),
        "layout": layout,
        "kv_cache_order": {"local": order, "remote": remote_order} if layout == "unified" else None,
        "model_shape": args.model_shape,
        "local_tp": args.local_tp,
        "remote_tp": args.remote_tp,
        "ranks": [],
    }
    remote_metas = {r: m for r, (m, _) in remotes.items()}
    for rank in range(args.local_tp):
        local, info = _synthetic_worker(args, layout, config.engine_id, rank, "local", order)
        report["ranks"].append(_rank_report(local, remote_metas, layout, info.mamba_states))
    return report


def run(args: argparse.Namespace) -> int:
    report = plan_report(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    orders = report["kv_cache_order"]
    if orders:
        report["layout"] += f" (P order {orders['remote']}, D order {orders['local']})"
    print(
        f"layout {report['layout']}, model {report['model_shape']}: "
        f"remote (P) tp {report['remote_tp']} -> local (D) tp {report['local_tp']}"
    )
    for r in report["ranks"]:
        heads = "all (latent)" if r["heads"] is None else r["heads"]
        print(
            f"local rank {r['local_rank']}: heads {heads}, tp_ratio {r['tp_ratio']}, "
            f"block_size_ratio {r['block_size_ratio']}, handshake {r['handshake_ranks']}, "
            f"reads {r['read_ranks']}, {r['bytes_per_local_block']} bytes per local block"
        )
        for s in r["sources"]:
            print(
                f"  <- remote rank {s['remote_rank']}: {s['descriptors_per_block']} descriptors "
                f"and {s['bytes_per_local_block']} bytes per local block"
            )
            for e in s["first_entries"]:
                print(
                    f"       local +{e['local_offset']:<8} <- remote +{e['remote_offset']:<8} "
                    f"{e['bytes']} bytes"
                )
        for p in r["permutes"]:
            print(f"  on receive: permute {p}")
    return 0
