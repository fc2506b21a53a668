"""Why a consumer engine refuses a request's load before reading anything, and whom it
tells.

Each check returns the reason the load must fail, or None when it may run; the scheduler
hands a refused load to the workers as a `RefusedLoad`, whose blocks vLLM then recomputes
or fails per `kv_load_failure_policy`, and whose release tells the producer to free its
blocks at once rather than hold them until its lease ends.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kvrdma.config import KVTransferParams
from kvrdma.config_checks import MISSING, show
from kvrdma.errors import ConfigError
from kvrdma.vllm.claims import LoadClaims
from kvrdma.vllm.params import (
    RecvSpec,
    computed_tokens_of,
    producer_request_of,
    pushed,
    release_of,
    remote_engine_of,
)

logger = logging.getLogger(__name__)


# what a release needs: the producer engine, where it answers, its request and how it sends
_RELEASE_KEYS = (
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_request_id",
    "tp_size",
    "transfer_mode",
)


@dataclass(frozen=True)
class BadParams:
    """A request that asked for a remote prefill with `kv_transfer_params` it refused."""

    reason: str
    # the load that only tells the producer to let go (`release_of`); None where the params
    # cannot name the producer's request
    release: RecvSpec | None


def refused_params(rid: str, raw: object, exc: ConfigError, policy: str) -> BadParams | None:
    """Bad `kv_transfer_params`: a request that asked for a remote prefill has its load
    fail (as for an unreachable producer), so this returns why and whom to tell; any other
    runs without KV transfer (None)."""
    if not (isinstance(raw, Mapping) and raw.get("do_remote_prefill")):
        logger.error("request %r: %s; it runs without KV transfer", rid, exc)
        return None
    try:
        release: RecvSpec | None = release_named_by(raw)
        told = "its producer is told to free the request's blocks"
    except ConfigError as why:
        release = None
        told = f"its producer is not told ({why}), so it holds the blocks until its lease ends"
    logger.error(
        "request %r: %s; its KV load fails (kv_load_failure_policy %r); %s",
        rid,
        exc,
        policy,
        told,
    )
    return BadParams(f"refused kv_transfer_params: {exc}", release)


def release_named_by(raw: Mapping[Any, Any]) -> RecvSpec:
    """The release of the producer request refused params name, from the fields it needs
    alone, each checked as for a load: it reaches only the producer, and names only the
    request, that valid params would have; a field it cannot trust raises `ConfigError`."""
    named = KVTransferParams.from_dict({k: raw[k] for k in _RELEASE_KEYS if k in raw})
    for key in _RELEASE_KEYS[:4]:
        if getattr(named, key) is None:
            raise ConfigError(
                f"kv_transfer_params.{key}: required to tell the producer, got "
                f"{show(raw.get(key, MISSING))}"
            )
    remote, push = remote_engine_of(named), pushed(named)
    return release_of(RecvSpec((), (), producer_request_of(named), remote, push=push))


def first_release(claims: LoadClaims, rid: str, release: RecvSpec | None) -> RecvSpec | None:
    """`release`, unless another request of this engine loaded (or let go) the producer
    request it names: the producer freed it then, and would count a second word towards
    the request's next hold."""
    if release is None or release.push:  # as `claimed_before`: a push is never claimed
        return release
    earlier = claims.claim(release.remote.engine_id, release.remote_request_id, rid)
    return release if earlier is None else None


def shorter_than_producer(params: KVTransferParams, end: int) -> str | None:
    """Why P's blocks cannot fill a prompt that loads `end` tokens, when P computed more:
    they would hold another prompt's KV."""
    computed = computed_tokens_of(params)
    if computed is None or end >= computed:
        return None
    return (
        f"kv_transfer_params.remote_num_tokens: the producer computed the KV of {computed} "
        f"tokens, this request loads {end}: its blocks hold a longer sequence (another "
        f"prompt, or tokens the producer generated: a prefill is sent max_tokens 1)"
    )


def loaded_by_sibling(
    claims: LoadClaims, rid: str, params: KVTransferParams, live: Collection[str]
) -> bool:
    """Whether another live request of this engine loads the producer request `params`
    name (vLLM gives each sample of a request with n > 1 its params): this one computes its
    prompt itself rather than fail, for a second READ could find the blocks freed."""
    earlier = claims.holder(str(params.remote_engine_id), str(params.remote_request_id))
    if earlier is None or earlier == rid or earlier not in live:
        return False
    logger.info("request %r computes its prompt: request %r loads its KV", rid, earlier)
    return True


def claimed_before(claims: LoadClaims, rid: str, params: KVTransferParams) -> str | None:
    """Why request `rid`'s read must not run: another request of this engine loaded the
    same producer request, whose blocks the producer may have freed and reused since."""
    engine, remote_rid = str(params.remote_engine_id), str(params.remote_request_id)
    if pushed(params):  # the producer writes what it holds, once per expectation
        claims.hold(engine, remote_rid, rid)  # (for `loaded_by_sibling` alone)
        return None
    earlier = claims.claim(engine, remote_rid, rid)
    if earlier is None:
        return None
    return (
        f"kv_transfer_params.remote_request_id: {remote_rid!r} of engine {engine!r} was "
        f"loaded by request {earlier!r} already; its blocks may hold another prompt's KV now"
    )
