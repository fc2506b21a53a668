"""What kvrdma's vLLM connector passes around: per-step scheduler→worker metadata, the
handshake payload a worker hands its engine core, and the per-request `kv_transfer_params`
in the exact shape vLLM's pull-mode NixlConnector produces.

Everything here is plain data: it is pickled by vLLM between processes, so it carries no
sockets, agents or tensors.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvrdma.config import KVTransferParams
from kvrdma.defaults import MAX_TP_SIZE
from kvrdma.errors import ConfigError
from kvrdma.metadata import WorkerMetadata, checked_agents
from kvrdma.notify import MAX_REQUEST_ID_BYTES

BlockGroups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class RemoteEngine:
    """Where a producer engine's side channel answers, and its TP size."""

    engine_id: str
    host: str
    port: int
    tp_size: int


@dataclass(frozen=True)
class RecvSpec:
    """A request whose KV this consumer pulls: local blocks per group and P's blocks."""

    local_block_ids: BlockGroups
    remote_block_ids: BlockGroups
    remote_request_id: str
    remote: RemoteEngine
    # when the producer's lease of the blocks ends, in its clock (None: not told)
    remote_expires_at: float | None = None
    push: bool = False  # the producer WRITEs it (`transfer_mode` "push") instead
    # False: only tell the producer to let go (nothing to load: a request aborted before it
    # was scheduled, or one whose prompt is all in the local prefix cache); vLLM does not wait
    # for it, so it must never be reported received
    report: bool = True
    # blocks the request holds per group, null padding included (empty: not told): its
    # blocks up to the last token it loads, which the producer's must span exactly, since
    # they are paired from the end (a local prefix-cache hit covers the first ones)
    span: tuple[int, ...] = ()
    # the producer ranks' agents that hold the blocks, by rank (empty: not told): a producer
    # restarted since holds other requests' KV at those ids
    remote_agents: tuple[str, ...] = ()


@dataclass(frozen=True)
class RefusedLoad:
    """A load that cannot run (its request's `kv_transfer_params` were refused): the worker
    reports its blocks invalid, so vLLM recomputes or fails it per `kv_load_failure_policy`."""

    local_block_ids: BlockGroups
    reason: str
    remote_engine: str = ""
    # a load that only tells the producer to let go of the blocks now (`RecvSpec.report`
    # False); None where nothing may be told (the request's first load told it already)
    release: RecvSpec | None = None


@dataclass(frozen=True)
class KeepAlive:
    """A request waiting for its KV: heartbeat the producer until its read starts."""

    remote_request_id: str
    remote: RemoteEngine


@dataclass
class KvrdmaConnectorMetadata(KVConnectorMetadata):
    """One scheduler step's instructions to every worker of the engine."""

    recv: dict[str, RecvSpec] = field(default_factory=dict)
    send: dict[str, BlockGroups] = field(default_factory=dict)
    keep_alive: dict[str, KeepAlive] = field(default_factory=dict)
    forget: set[str] = field(default_factory=set)
    # push (keyed by the id a push goes by, see `push_rids`; `send` too in push mode):
    # requests whose prefill ends in this step's forward, pushed layer by layer as their
    # layers are saved; pushes begun so that the producer dropped since
    push_layers: dict[str, BlockGroups] = field(default_factory=dict)
    abort_push: set[str] = field(default_factory=set)
    push_rids: dict[str, str] = field(default_factory=dict)  # push id -> vLLM request id
    refused: dict[str, RefusedLoad] = field(default_factory=dict)


@dataclass(frozen=True)
class KvrdmaHandshakeMetadata(KVConnectorHandshakeMetadata):
    """One worker's kvrdma `WorkerMetadata`, msgpack-encoded, for the scheduler to serve."""

    payload: bytes


def remote_engine_of(params: KVTransferParams) -> RemoteEngine:
    """The producer a consumer request reads from (the params were validated)."""
    if params.remote_engine_id is None or params.remote_host is None or not params.remote_port:
        raise ConfigError(
            "kv_transfer_params: remote_engine_id, remote_host and remote_port are required "
            f"to read from a producer, got {params.to_dict()!r}"
        )
    return RemoteEngine(
        params.remote_engine_id, params.remote_host, params.remote_port, params.tp_size
    )


def producer_request_of(params: KVTransferParams) -> str:
    """`remote_request_id`: the producer request a consumer request loads, which every
    notification to the producer names (so one it cannot carry is refused here)."""
    rid = params.remote_request_id
    if not rid or len(rid.encode()) > MAX_REQUEST_ID_BYTES:
        raise ConfigError(
            "kv_transfer_params.remote_request_id: expected the producer's request id (a "
            f"non-empty string of at most {MAX_REQUEST_ID_BYTES} bytes), got {rid!r:.80}"
        )
    return rid


def notifiable_id(rid: str) -> str:
    """`rid`, or a digest of it where notifications could not name it (vLLM takes request
    ids from clients): the id a producer gives its request's decoders."""
    if rid and len(rid.encode()) <= MAX_REQUEST_ID_BYTES:
        return rid
    return f"kvrdma-{hashlib.sha256(rid.encode()).hexdigest()}"


def pushed(params: KVTransferParams) -> bool:
    """Whether the producer WRITEs this request (`transfer_mode` "push") rather than the
    decoder READing it."""
    mode = params.other.get("transfer_mode", "pull")
    if mode not in ("pull", "push"):
        raise ConfigError(
            f"kv_transfer_params.transfer_mode: expected 'pull' or 'push', got {mode!r}"
        )
    return mode == "push"


def expiry_of(params: KVTransferParams) -> float | None:
    """`remote_blocks_expiry_time`: the producer's lease end in its clock, or None."""
    value = params.other.get("remote_blocks_expiry_time")
    if value is None:
        return None
    try:  # an integer past a float's range overflows
        ok = not isinstance(value, bool) and isinstance(value, int | float)
        seconds = float(value) if ok else math.nan
    except OverflowError:
        seconds = math.nan
    if not math.isfinite(seconds):
        raise ConfigError(
            "kv_transfer_params.remote_blocks_expiry_time: expected a finite number of seconds "
            f"(the producer's clock) or null, got {value!r:.80}"
        )
    return seconds


def agents_of(params: KVTransferParams) -> tuple[str, ...]:
    """`remote_agents`: the agent of each producer rank that holds the blocks (`agent_tag`s
    by rank), or () when not told (a stock producer)."""
    value = params.other.get("remote_agents")
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or len(value) > MAX_TP_SIZE:
        raise ConfigError(
            "kv_transfer_params.remote_agents: expected a list of the producer ranks' agent "
            f"checksums or null, got {value!r:.80}"
        )
    checked_agents("kv_transfer_params.remote_agents", value)
    return tuple(value)


def workers_of(metadata: Mapping[tuple[int, int], Any]) -> list[WorkerMetadata]:
    """The workers' kvrdma metadata from their handshake payloads (keyed by (pp, tp) rank),
    by TP rank; `ValueError` for pipeline parallelism or another connector's payload."""
    if any(pp != 0 for pp, _ in metadata):
        raise ValueError(
            "KvrdmaConnector: pipeline-parallel KV transfer (pp_rank > 0 handshake "
            f"metadata, ranks {sorted(metadata)}) is not supported"
        )
    decoder = msgspec.msgpack.Decoder(WorkerMetadata)
    metas = []
    for key, md in sorted(metadata.items()):
        if not isinstance(md, KvrdmaHandshakeMetadata):
            raise ValueError(
                f"KvrdmaConnector: worker {key} sent {type(md).__name__} handshake "
                "metadata, expected KvrdmaHandshakeMetadata"
            )
        metas.append(decoder.decode(md.payload))
    return metas


def computed_tokens_of(params: KVTransferParams) -> int | None:
    """`remote_num_tokens`: how many prompt tokens the producer computed, or None."""
    value = params.other.get("remote_num_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"kv_transfer_params.remote_num_tokens: expected an integer >= 0 or null, got {value!r}"
        )
    return value


def pushed_before_prefill(raw: Mapping[str, Any], params: KVTransferParams) -> bool:
    """A decoder request sent while its prefill runs (a proxy that sends both at once, for
    layer-wise push): P's block ids are not known, P writes its own blocks in order."""
    blocks = raw.get("remote_block_ids")  # null is absent, as for vLLM's proxies
    return params.do_remote_prefill and blocks is None and pushed(params)


def parse_params(raw: Mapping[str, Any] | None) -> KVTransferParams | None:
    """A request's `kv_transfer_params`, every field a worker later reads validated (None
    when absent): a bad value raises `ConfigError` naming the field."""
    if raw is None:
        return None
    params = KVTransferParams.from_dict(raw)
    push = pushed(params)
    expiry_of(params)
    computed_tokens_of(params)
    agents_of(params)
    if params.do_remote_prefill and (params.needs_read or push):
        remote_engine_of(params)
        producer_request_of(params)
    return params


def producer_params(
    *,
    block_ids: Sequence[Sequence[int]],
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    tp_size: int,
    dcp_size: int,
    pp_size: int,
    num_tokens: int,
    expires_at: float | None = None,
    transfer_mode: str = "pull",
    agents: Sequence[str] = (),
) -> dict[str, Any]:
    """What a finished prefill returns for the proxy to hand to the decoder, in the key
    order and value types vLLM's Nixl connectors use (JSON-safe: lists, str, int, float,
    None); `expires_at` is when the blocks' lease ends in the producers' clock; `agents`,
    the producer ranks' agent tags (`remote_agents`, only when known)."""
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[int(b) for b in group] for group in block_ids],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "dcp_size": dcp_size,
        "pp_size": pp_size,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": expires_at,
        "transfer_mode": transfer_mode,
    }
    return params | {"remote_agents": list(agents)} if agents else params


def every_block(groups: Sequence[Sequence[int]]) -> list[int]:
    """Every group's blocks once, in id order (vLLM's groups overlay one buffer); the null
    block 0 left out."""
    return sorted({b for g in groups for b in g if b})


# the id a load that only tells a producer to let go goes by: apart from the request's own,
# whose failure vLLM is told of
RELEASE_PREFIX = "kvrdma-release:"


def release_of(spec: RecvSpec) -> RecvSpec:
    """A load of nothing that only tells `spec`'s producer to free its blocks (a pushing one
    is asked to write none of this engine's blocks, so nothing lands in the refused ones)."""
    return RecvSpec(
        (), spec.remote_block_ids, spec.remote_request_id, spec.remote, push=spec.push,
        report=False, remote_agents=spec.remote_agents,
    )  # fmt: skip


def pair_groups(spec: RecvSpec, ratio: int = 1) -> tuple[list[int], list[int] | None]:
    """Flat (local, remote) block ids over the groups (vLLM's groups overlay one buffer, so a
    block id names the same page in every group), where each local block holds `ratio` of
    the producer's. The producer's blocks start at the prompt's first token; a local
    prefix-cache hit covers a group's first blocks, so only the producer's blocks under the
    local ones are read, and local blocks the producer's do not cover fail the read, as do
    producer blocks spanning other than the request's (`RecvSpec.span`). The null block
    (id 0, padding) is never read into, and a local block facing the producer's fails the
    read (it would keep what it held). A push expected before its prefill names no
    producer blocks (None): the producer writes its own in order, which pairs with one group
    only."""
    if spec.push and not spec.remote_block_ids:
        groups = [g for g in spec.local_block_ids if any(g)]
        if len(groups) > 1:
            raise ConfigError(
                "kv_transfer_params: a push expected before prefill (no remote_block_ids) "
                f"needs a model with one KV-cache group, this one loads {len(groups)}"
            )
        return ([b for b in groups[0] if b] if groups else []), None
    loaded = sum(1 for g in spec.local_block_ids if g)
    if ratio > 1 and loaded > 1:
        raise ConfigError(
            f"a producer whose blocks are 1/{ratio} of this engine's needs a model with one "
            f"KV-cache group, this one loads {loaded}"
        )
    local: list[int] = []
    remote: list[int] = []
    for i, lg in enumerate(spec.local_block_ids):
        rg = spec.remote_block_ids[i] if i < len(spec.remote_block_ids) else ()
        covered = -(-len(rg) // ratio)  # local blocks the producer's blocks fill
        if i < len(spec.span) and covered != spec.span[i]:
            raise ConfigError(
                f"kv_transfer_params.remote_block_ids[{i}]: {len(rg)} producer blocks "
                f"({ratio} per local block) cover {covered} local blocks, this request holds "
                f"{spec.span[i]} up to the last token it loads: they hold another prompt"
            )
        if len(lg) > covered:
            raise ConfigError(
                f"kv_transfer_params.remote_block_ids[{i}]: {len(rg)} producer blocks "
                f"({ratio} per local block) cover {covered} local blocks, the load needs "
                f"{len(lg)}"
            )
        rg = rg[(covered - len(lg)) * ratio :]
        if ratio > 1:
            if 0 in lg or 0 in rg:
                raise ConfigError(
                    f"kv_transfer_params.remote_block_ids[{i}]: null blocks cannot be read "
                    f"at a block size ratio of {ratio}"
                )
            local.extend(lg)
            remote.extend(rg)
            continue
        for lb, rb in zip(lg, rg, strict=True):
            if lb and not rb:  # nothing would land in it, and it holds what it held before
                raise ConfigError(
                    f"kv_transfer_params.remote_block_ids[{i}]: the producer's null block "
                    f"pairs with this engine's block {lb}, which would keep another "
                    "request's KV"
                )
            if lb:
                local.append(lb)
                remote.append(rb)
    return local, remote
