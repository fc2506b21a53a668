"""Receiving on one designated rank of a stage and handing the KV to every rank."""

from __future__ import annotations

from collections.abc import Callable

from kvrdma.errors import TransferError
from kvrdma.stages.payload import StagePayload
from kvrdma.stages.receiver import StageReceiver


def receive_designated(
    receiver: StageReceiver | None,
    request_id: str,
    broadcast: Callable[[StagePayload | None], StagePayload | None],
    *,
    timeout: float = 30.0,
) -> StagePayload:
    """Where only one rank of a stage may receive: the designated rank (the one given a
    `receiver`, built with a mapping to 1 receiving rank) receives the whole KV and
    `broadcast` hands it to every rank (e.g. `torch.distributed.broadcast_object_list` from
    that rank); the other ranks pass None and get what `broadcast` returns. A designated
    receive that fails still broadcasts (None) before raising its error, and every other
    rank then raises a `TransferError`: none waits in `broadcast` for a payload never sent."""
    payload = None
    if receiver is not None:
        try:
            payload = receiver.receive(request_id, timeout=timeout)
        except Exception:
            broadcast(None)  # the other ranks wait in it
            raise
    got = broadcast(payload)
    if got is None:
        raise TransferError(f"request {request_id!r}: the designated rank did not receive it")
    return got
