"""A consumer's read that ended: what lands (integrity check, permutes, staging in) and how it
is counted."""

from __future__ import annotations

import logging
from typing import Any

from kvrdma.descriptors import ReadPlan
from kvrdma.integrity import LandedChecksums
from kvrdma.postprocess import apply_permutes
from kvrdma.state import WorkerState
from kvrdma.transfer import ReadOp
from kvrdma.types import Outcome, TransferMode

logger = logging.getLogger(__name__)


def land(s: WorkerState, op: ReadOp, plan: ReadPlan, checks: LandedChecksums | None) -> set[int]:
    """A READ that completed: check its checksums (integrity mode), then permute and stage in
    what landed. Returns the local blocks that failed the check: the read then ends as
    corrupt, with exactly those blocks invalid. A step that raises (a device out of memory,
    say) fails the read with every block invalid, and costs no other read its report."""
    bad = []
    try:
        if checks is not None and op.sub_block_ids is not None:
            bad = checks.bad_blocks(op.sub_block_ids)  # the bytes as landed: before any permute
        if plan.permutes:
            apply_permutes(s.regions, plan.permutes, op.local_block_ids)
        if s.stager is not None:
            s.stager.stage_in(op.local_block_ids)
    except Exception as exc:
        op.outcome = Outcome.FAILED
        op.error = f"landing what was read failed: {type(exc).__name__}: {exc}"
        logger.exception("read of request %r: %s", op.request_id, op.error)
        return {int(b) for b in op.local_block_ids}
    if bad:
        op.outcome = Outcome.CORRUPT
        op.error = (
            f"checksum mismatch: {len(bad)} of {len(op.local_block_ids)} local blocks differ "
            f"from what engine {op.engine_id!r} held: {bad[:8]}"
        )
        logger.warning("read of request %r: %s", op.request_id, op.error)
        if s.metrics:
            s.metrics.corrupt_blocks(remote_engine=op.engine_id, n=len(bad))
    return set(bad)


def count_read(metrics: Any, policy: str, op: ReadOp, elapsed: float, invalid: int) -> None:
    """Count one reported read (pulled or pushed): its transfer, its invalid blocks, its
    request's outcome."""
    mode = TransferMode.PUSH if op.pushed else TransferMode.PULL
    metrics.transfer_finished(remote_engine=op.engine_id, mode=mode)
    if op.release_only:  # it reads nothing: what counts is whether its producer was told
        if op.pushed and op.outcome in (Outcome.PEER_LOST, Outcome.TIMEOUT):  # pull's: `_tell`
            metrics.failed_notification(remote_engine=op.engine_id, reason="send_failed")
        return
    metrics.observe_transfer(
        remote_engine=op.engine_id,
        mode=mode,
        outcome=op.outcome,
        seconds=elapsed,
        post_seconds=op.post_seconds,
        nbytes=op.nbytes if op.error is None else 0,
        descriptors=op.descriptors,
    )
    if invalid:
        metrics.invalid_blocks(remote_engine=op.engine_id, n=invalid)
    failed = "failed" if policy == "fail" else "invalid_blocks"
    metrics.request_finished(outcome="success" if op.error is None else failed)
