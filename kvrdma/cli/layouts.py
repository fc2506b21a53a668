"""The `--layout` names `kvrdma demo` and `kvrdma inspect` accept, and the layout each means."""

from __future__ import annotations

from kvrdma.metadata import KV_CACHE_ORDERS

LAYOUT_ALIASES = {
    "split": "split_kv",
    "split_kv": "split_kv",
    "blocks_first": "blocks_first",
    "blocks-first": "blocks_first",
    "mla": "mla",
    "cross_layer": "cross_layer",
    "cross-layer": "cross_layer",
    "mamba": "mamba",
    "unified": "unified",
    **{f"unified:{o}": f"unified:{o}" for o in KV_CACHE_ORDERS},
}
