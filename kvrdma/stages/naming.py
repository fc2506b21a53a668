"""Rank-aware transfer keys and collision-free ports for stage-to-stage transfers.

A key names one shard of one chunk of one request on its way from a sending rank to a
receiving rank, so that several ranks of one stage can feed one receiver (or one sender
several receivers) without their shards overwriting each other. Ports keep the layout a
single-replica, single-rank deployment already uses (`base + stage`) and give every other
(replica, rank) its own block above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvrdma.errors import ConfigError

_MAX_PORT = 65535


@dataclass(frozen=True)
class ShardKey:
    """The parts of a transfer key."""

    request_id: str
    from_stage: int
    chunk: int
    from_rank: int
    to_rank: int


class KeyBuilder(Protocol):
    """Turns a `ShardKey` into the string both sides agree on (an injectable hook)."""

    def __call__(self, key: ShardKey) -> str: ...


def default_key(key: ShardKey) -> str:
    """`{request}_{from_stage}_{chunk}_{from_rank}_{to_rank}`."""
    return f"{key.request_id}_{key.from_stage}_{key.chunk}_{key.from_rank}_{key.to_rank}"


def parse_key(text: str) -> ShardKey:
    """Read back a `default_key` string; the request id may itself contain underscores."""
    parts = text.rsplit("_", 4)
    if len(parts) != 5 or not parts[0]:
        raise ConfigError(
            f"transfer key {text!r}: expected '{{request}}_{{stage}}_{{chunk}}_{{from}}_{{to}}'"
        )
    # int() also reads signs, spaces, leading zeros and other scripts' digits, which
    # `default_key` never writes: each key has one spelling
    nums = [int(p) if p.isascii() and p.isdigit() else -1 for p in parts[1:]]
    key = ShardKey(parts[0], *nums)
    if min(nums) < 0 or default_key(key) != text:
        raise ConfigError(
            f"transfer key {text!r}: expected stage, chunk and ranks in ASCII digits 0-9, "
            "without leading zeros"
        )
    return key


def stage_port(
    base: int,
    stage: int,
    *,
    num_stages: int,
    replica: int = 0,
    rank: int = 0,
    ranks_per_replica: int = 1,
) -> int:
    """The port of `stage`'s sender for one (replica, rank): `base + offset + stage`, where
    `offset` is 0 for replica 0 rank 0 (the single-sender port stays `base + stage`) and a
    distinct multiple of `num_stages` for every other (replica, rank), so no two senders of
    any stage on one host share a port."""
    checks = (
        ("num_stages", num_stages, 1),
        ("ranks_per_replica", ranks_per_replica, 1),
        ("base", base, 1),
        ("stage", stage, 0),
        ("replica", replica, 0),
        ("rank", rank, 0),
    )
    for name, value, low in checks:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{name}: expected an integer >= {low}, got {value!r}")
    if stage >= num_stages:
        raise ConfigError(f"stage: expected an integer below num_stages={num_stages}, got {stage}")
    if rank >= ranks_per_replica:
        raise ConfigError(
            f"rank: expected an integer below ranks_per_replica={ranks_per_replica}, got {rank}"
        )
    offset = (replica * ranks_per_replica + rank) * num_stages
    port = base + offset + stage
    if port > _MAX_PORT:
        raise ConfigError(
            f"stage {stage}, replica {replica}, rank {rank}: port {port} is above {_MAX_PORT} "
            f"(base {base}); choose a lower base port"
        )
    return port
