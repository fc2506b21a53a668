"""Why a consumer engine refuses a request's load before reading anything.

Each check returns the reason the load must fail, or None when it may run; the scheduler
hands a refused load to the workers as a `RefusedLoad`, whose blocks vLLM then recomputes
or fails per `kv_load_failure_policy`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvrdma.config import KVTransferParams
from kvrdma.errors import ConfigError
from kvrdma.vllm.claims import LoadClaims
from kvrdma.vllm.params import computed_tokens_of, pushed

logger = logging.getLogger(__name__)


def refused_params(rid: str, raw: object, exc: ConfigError, policy: str) -> str | None:
    """Bad `kv_transfer_params`: a request that asked for a remote prefill has its load
    fail (as for an unreachable producer), so this returns why; any other runs without KV
    transfer (None)."""
    asked = isinstance(raw, Mapping) and bool(raw.get("do_remote_prefill"))
    logger.error(
        "request %r: %s; %s",
        rid,
        exc,
        f"its KV load fails (kv_load_failure_policy {policy!r})"
        if asked
        else "it runs without KV transfer",
    )
    return f"refused kv_transfer_params: {exc}" if asked else None


def shorter_than_producer(params: KVTransferParams, end: int) -> str | None:
    """Why P's blocks cannot fill a prompt that loads `end` tokens, when P computed more:
    they would hold another prompt's KV."""
    computed = computed_tokens_of(params)
    if computed is None or end >= computed:
        return None
    return (
        f"kv_transfer_params.remote_num_tokens: the producer computed {computed} prompt "
        f"tokens, this request loads {end}: its blocks hold a different prompt"
    )


def claimed_before(claims: LoadClaims, rid: str, params: KVTransferParams) -> str | None:
    """Why request `rid`'s read must not run: another request of this engine loaded the
    same producer request, whose blocks the producer may have freed and reused since."""
    if pushed(params):  # the producer writes what it holds, once
        return None
    engine, remote_rid = str(params.remote_engine_id), str(params.remote_request_id)
    earlier = claims.claim(engine, remote_rid, rid)
    if earlier is None:
        return None
    return (
        f"kv_transfer_params.remote_request_id: {remote_rid!r} of engine {engine!r} was "
        f"loaded by request {earlier!r} already; its blocks may hold another prompt's KV now"
    )
