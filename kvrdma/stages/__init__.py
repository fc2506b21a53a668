"""Stage-to-stage KV transfer for multi-stage pipelines (a "thinker" stage feeding a "talker").

The rank mapping between two stages, transfer keys and ports, `(K, V)` normalisation with
head slicing and merging, the packed payload, and the sender/receiver that move payloads
between stage processes over NIXL (with `StageMetrics`, their Prometheus series).
"""

from kvrdma.stages.designated import receive_designated
from kvrdma.stages.endpoint import StageEndpoint
from kvrdma.stages.hostpool import HostPool
from kvrdma.stages.manager import StageSender
from kvrdma.stages.mapping import StageMapping
from kvrdma.stages.metrics import StageMetrics
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
from kvrdma.stages.receiver import StageReceiver, companion_id
from kvrdma.stages.shards import HeadSharder, extract, merge_heads, slice_heads, split_kv

__all__ = [
    "HeadSharder",
    "HostPool",
    "KeyBuilder",
    "ShardKey",
    "StageEndpoint",
    "StageMapping",
    "StageMetrics",
    "StagePayload",
    "StageReceiver",
    "StageSender",
    "companion_id",
    "default_key",
    "extract",
    "merge_heads",
    "pack",
    "pack_into",
    "pack_tensor",
    "packed_size",
    "parse_key",
    "receive_designated",
    "slice_heads",
    "split_kv",
    "stage_port",
    "unpack",
    "unpack_tensor",
]
