"""`WorkerMetadata` for tests that exercise the handshake, the sidecar and the wire without
registering memory: one consistent default that each test changes only where it matters."""

from __future__ import annotations

from typing import Any

from kvrdma.metadata import RegionMeta, WorkerMetadata, sha256_hex


def worker_metadata(
    engine_id: str = "prefill",
    rank: int = 0,
    tp_size: int = 1,
    *,
    num_blocks: int = 64,
    block_len: int = 4096,
    num_regions: int = 4,
    **fields: Any,
) -> WorkerMetadata:
    """One rank's metadata: split K/V bf16 HND caches (8 KV heads, head dim 128, 16-token
    blocks) in `num_regions` regions at addresses distinct per rank, and an agent blob unique
    to the agent name with its checksum. `fields` replace any field; the blob and checksum
    follow a replaced `agent_name`, the checksum a replaced `agent_metadata`."""
    name = fields.pop("agent_name", f"{engine_id}-agent-{rank}")
    blob = fields.pop("agent_metadata", f"nixl-md:{name}".encode() * 16)
    base = 0x7F00_0000_0000 + rank * 0x1000_0000
    values: dict[str, Any] = {
        "engine_id": engine_id,
        "agent_name": name,
        "agent_metadata": blob,
        "agent_metadata_sha256": sha256_hex(blob),
        "tp_rank": rank,
        "tp_size": tp_size,
        "block_size": 16,
        "num_blocks": num_blocks,
        "cache_layout": "split_kv",
        "kv_layout": "HND",
        "total_num_kv_heads": 8,
        "head_dim": 128,
        "dtype": "bfloat16",
        "element_size": 2,
        "regions": [
            RegionMeta(base + i * 0x10_0000, num_blocks, block_len) for i in range(num_regions)
        ],
    }
    return WorkerMetadata(**(values | fields))
