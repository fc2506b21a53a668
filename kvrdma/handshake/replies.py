"""The handshake server's answer to one `MetadataRequest`, built from the ranks it publishes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import msgspec

from kvrdma.handshake.entries import Entry
from kvrdma.handshake.wire import ErrorReply, MetadataRequest, MetadataResponse, ProtocolViolation

__all__ = ["answer_request"]

_LIST_LIMIT = 16  # how many engines/ranks an error message lists


def answer_request(
    req: MetadataRequest,
    ranks: Mapping[int, Entry] | None,
    engines: list[str],
    *,
    address: str,
    max_frame: int,
    enforce_compat: bool,
    server_time: float | None = None,
) -> tuple[str, msgspec.Struct]:
    """The outcome to count and the reply to send; a `ProtocolViolation` for a bad request.

    `ranks` are the ranks published for the requested engine and DP index (None: none are),
    `engines` every engine served as "engine/dpN"; `address` is the server's, named in error
    replies, `max_frame` its largest reply in bytes, and `enforce_compat` refuses a requester
    whose compatibility hash differs; `server_time` is the server's clock, sent with the reply.
    """
    where = f"engine {req.engine_id!r} dp_index {req.dp_index}"
    if len(set(req.ranks)) != len(req.ranks):
        repeated = sorted(r for r, n in Counter(req.ranks).items() if n > 1)
        raise ProtocolViolation(
            "bad_request", f"{where}: ranks must be distinct, got {_short(repeated)} repeated"
        )
    if ranks is None:
        return "requests_rejected", ErrorReply(
            code="unknown_engine",
            message=f"{where} has no published ranks on {address}; serving: {_short(engines)}",
        )
    tp_size = max((e.meta.tp_size for e in ranks.values()), default=0)
    outside = [r for r in req.ranks if r >= tp_size]
    if outside:
        raise ProtocolViolation(
            "bad_request",
            f"{where}: rank(s) {_short(outside)} outside its tp_size {tp_size}",
        )
    entries = [ranks.get(r) for r in req.ranks]
    missing = [r for r, e in zip(req.ranks, entries, strict=True) if e is None]
    if missing:
        return "requests_rejected", ErrorReply(
            code="unknown_rank",
            message=f"{where}: rank(s) {_short(missing)} not published on {address}; "
            f"published: {_short(sorted(ranks))}",
        )
    found = [e for e in entries if e is not None]
    size = sum(e.size for e in found)
    if size > max_frame:
        return "requests_rejected", ErrorReply(
            code="too_large",
            message=f"{where}: {len(found)} ranks make a {size}-byte reply, over the "
            f"{max_frame}-byte limit; ask for fewer ranks at a time",
        )
    if enforce_compat and req.compat_hash:
        for e in found:
            if e.meta.compat_hash and e.meta.compat_hash != req.compat_hash:
                return "requests_rejected", ErrorReply(
                    code="compat_mismatch",
                    message=f"compatibility hash mismatch: requester {req.requester!r} has "
                    f"{req.compat_hash}, {where} rank {e.meta.tp_rank} has "
                    f"{e.meta.compat_hash} (set enforce_handshake_compat=false to skip)",
                )
    return "requests_ok", MetadataResponse(
        engine_id=req.engine_id,
        workers=[e.meta for e in found],
        descriptors=[e.descriptors for e in found],
        server_time=server_time,
    )


def _short(items: list[int] | list[str]) -> str:
    shown = ", ".join(str(i) for i in items[:_LIST_LIMIT])
    more = f", … ({len(items)} in all)" if len(items) > _LIST_LIMIT else ""
    return f"[{shown}{more}]"
