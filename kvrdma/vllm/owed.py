"""Keeping vLLM's engine core stepping while a worker's done notifications are on their way.

The engine core steps (and so calls the workers' connectors) only while its scheduler has
requests or the connector says it has work (`has_pending_push_work`). A decoder's last load
can be reported with a done notification still in flight: an ack READ to a producer rank it
read nothing from, which ends only while the worker progresses its agent, that is while the
engine steps. Each worker tells the scheduler what it still owes in its step's
`KVConnectorWorkerMetadata`, and the scheduler keeps the engine stepping until none is owed;
else that producer rank would hold the request's blocks until its lease ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata


@dataclass
class NotificationsOwed(KVConnectorWorkerMetadata):
    """Done notifications this step's workers still have on their way to producers."""

    count: int

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, NotificationsOwed):
            raise TypeError(f"NotificationsOwed aggregated with {type(other).__name__}")
        return NotificationsOwed(self.count + other.count)


class OwedReport:
    """A worker's report per step: the count while some are owed, then a zero once (an
    engine core stepping no model passes on a connector output only if it says something,
    and the scheduler must hear that none is owed any more)."""

    def __init__(self) -> None:
        self._told = False  # the last count said was not zero

    def meta(self, owed: int) -> NotificationsOwed | None:
        if not owed and not self._told:
            return None
        self._told = owed > 0
        return NotificationsOwed(owed)


def owed_in(meta: KVConnectorWorkerMetadata | None) -> bool:
    """Whether a step's aggregated worker metadata says notifications are still owed; a
    step without any says none (every worker that owes some reports it each step)."""
    return isinstance(meta, NotificationsOwed) and meta.count > 0
