"""Stage-to-stage KV transfer for multi-stage pipelines (a "thinker" stage feeding a "talker").

Pure building blocks: the rank mapping between two stages, transfer keys and ports, `(K, V)`
normalisation with head slicing and merging, and the packed payload.
"""

from kvrdma.stages.mapping import StageMapping
from kvrdma.stages.naming import KeyBuilder, ShardKey, default_key, parse_key, stage_port
from kvrdma.stages.payload import (
    StagePayload,
    pack,
    pack_into,
    pack_tensor,
    packed_size,
    unpack,
    unpack_tensor,
)
from kvrdma.stages.shards import HeadSharder, merge_heads, slice_heads, split_kv

__all__ = [
    "HeadSharder",
    "KeyBuilder",
    "ShardKey",
    "StageMapping",
    "StagePayload",
    "default_key",
    "merge_heads",
    "pack",
    "pack_into",
    "pack_tensor",
    "packed_size",
    "parse_key",
    "slice_heads",
    "split_kv",
    "stage_port",
    "unpack",
    "unpack_tensor",
]
