"""Reads abandoned with READs in flight: retiring the reading agent, or letting them end
before the agent is closed."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import msgspec

from kvrdma.errors import TransferError
from kvrdma.metadata import sha256_hex
from kvrdma.nixl.protocol import Xfer, XferResult, XferState, running_after_grace
from kvrdma.state import WorkerState
from kvrdma.transfer import ReadOp
from kvrdma.types import Outcome

logger = logging.getLogger(__name__)

# a read to report failed: (read, error, outcome, whether every READ it posted has ended)
Failing = tuple[ReadOp, str, Outcome, bool]


def may_land(res: XferResult) -> bool:
    """A READ polled as `res` may still write local memory: handed to NIXL and not ended
    (one still waiting for its peer's connection warm-up was never posted)."""
    return res.state is XferState.PROC and not res.unposted


def _posted_unended(op: ReadOp) -> list[Xfer]:
    """Drop `op`'s parts still parked for their peer's warm-up unposted (polling one could
    complete the warm-up and post it); the parts handed to NIXL not seen ended yet."""
    op.drop_parked(op.polled, len(op.xfers))
    return [x for i, (_, x) in enumerate(op.xfers) if i not in op.done and i not in op.failed]


def settle_parked(op: ReadOp, poll: Callable[[Xfer], XferResult]) -> bool:
    """Drop `op`'s parked parts unposted, then whether nothing it handed to NIXL may still
    land."""
    return not any(may_land(poll(x)) for x in _posted_unended(op))


def settle_reads(ops: Iterable[ReadOp], poll: Callable[[Xfer], XferResult], seconds: float) -> None:
    """Give the READs of `ops` in flight up to `seconds` to end before they are released with
    their agent (parked ones are dropped unposted): one cancelled while UCX's copy threads
    still run it, its peer then removed and its agent destroyed, can abort the process."""
    running_after_grace(poll, [x for op in ops for x in _posted_unended(op)], seconds)


def retire_reader(
    s: WorkerState, ops: list[ReadOp], why: str = "passed its deadline"
) -> tuple[str, list[str]] | None:
    """Reads given up while parts are still in flight: releasing those parts does not
    stop their data (over UCX/TCP it lands whenever a stopped peer resumes, possibly
    over blocks recomputed since), so the reading agent is retired: parked, never
    progressed again, replaced by a fresh one. Reads still in flight on it end as
    cancelled (reported invalid); later reads go through the new agent. Returns the
    reason and the peer agents the new agent dropped (see `TransferBackend.retire`), or
    None if the agent could not be retired."""
    ids = ", ".join(repr(op.request_id) for op in ops[:3]) + (" ..." if len(ops) > 3 else "")
    reason = f"reading agent retired: request {ids} {why} with READs in flight"
    try:
        dropped = s.reader.retire(reason)
    except TransferError as exc:
        logger.error("%s; could not retire it, late writes are possible: %s", reason, exc)
        return None
    s.retirements += 1
    if s.metrics:
        s.metrics.agent_retired()
    if s.reader is s.backend and s.metadata is not None:
        s.former_agents.append(s.metadata.agent_metadata_sha256)  # computed when published
        md = s.backend.metadata()
        s.metadata = msgspec.structs.replace(
            s.metadata,
            agent_name=s.backend.agent_name,
            agent_metadata=md,
            agent_metadata_sha256=sha256_hex(md),
        )
    return reason, dropped


def retire_for(
    s: WorkerState, failing: list[Failing], inflight: Iterable[ReadOp], why: str
) -> list[str]:
    """Where a read of `failing` has READs still running (it `why`, as `retire_reader`
    says): retire the reading agent and add every other read of `inflight` to `failing`
    (cancelled: it ran on that agent). Returns the peer agents the new agent dropped (none
    without a retirement)."""
    if all(settled for *_, settled in failing):
        return []
    retired = retire_reader(s, [op for op, *_, settled in failing if not settled], why)
    if retired is None:
        return []
    reason, dropped = retired
    ending = {op.request_id for op, *_ in failing}
    failing += [
        (op, f"{reason}; this read was in flight on it", Outcome.CANCELLED, False)
        for op in inflight
        if op.request_id not in ending
    ]
    return dropped
