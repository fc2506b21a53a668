"""Combine per-worker KV transfer outputs into the scheduler's view (SPEC §6).

Each of `world_size` workers reports, per step, the requests it finished sending or
receiving, as a `FinishedOutput` (what `Worker.get_finished()` returns). A request is
reported finished only once every worker has reported it, even when workers report in
different steps. A failed receive is reported by a worker as the request id in
`finished_recving` plus its invalid block ids and its `FailureReason`, in the same output; the
aggregator reports the union of the blocks and one merged reason (`FailureReason.merge`, with
the failing ranks) when the request finishes. Stats are merged per step: numbers are summed,
lists concatenated.

Bad input policy: a report from a rank outside ``0..world_size-1``, or an output whose fields
do not fit together, is a wiring bug and raises `ValueError` (the output is not recorded). A
duplicate report (a worker reporting a request it already reported, before or shortly after
the request finished) is ignored, logged and counted in `duplicate_reports`.
Entries are removed once reported; completed ids are remembered in a bounded window only, to
recognise late duplicates. Not thread-safe: one owner calls `add`/`take`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal

from kvrdma.types import FailureReason, FinishedOutput, StatValue

__all__ = ["AggregatedOutput", "KVOutputAggregator", "StatValue", "WorkerOutput"]

logger = logging.getLogger(__name__)

# the per-worker report is the worker's own step output (one shape on both sides)
WorkerOutput = FinishedOutput
_EMPTY: Mapping[str, frozenset[int]] = MappingProxyType({})
_NO_STATS: Mapping[str, StatValue] = MappingProxyType({})
_NO_REASONS: Mapping[str, FailureReason] = MappingProxyType({})


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _stat_value(key: str, value: object) -> StatValue:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and all(_is_number(v) for v in value):
        return tuple(value)
    raise ValueError(f"stats[{key!r}]: expected a number or a list of numbers, got {value!r}")


@dataclass(frozen=True)
class _Report:
    """One worker's output, checked and copied (the worker may reuse its sets)."""

    sending: frozenset[str]
    recving: frozenset[str]
    invalid: Mapping[str, frozenset[int]]
    failures: Mapping[str, FailureReason]
    stats: Mapping[str, StatValue]


def _checked(output: FinishedOutput) -> _Report:
    recving = frozenset(output.finished_recving)
    invalid = {req: frozenset(ids) for req, ids in output.invalid_block_ids.items()}
    for what, reqs in (("invalid_block_ids", invalid), ("failures", output.failures)):
        stray = sorted(set(reqs) - recving)
        if stray:
            raise ValueError(
                f"{what}: requests {stray} are not in finished_recving of the same output; a "
                "failed receive is reported as finished with its invalid blocks and reason"
            )
    for req, ids in invalid.items():
        bad = [b for b in ids if isinstance(b, bool) or not isinstance(b, int) or b < 0]
        if bad:
            raise ValueError(
                f"invalid_block_ids[{req!r}]: expected block ids (integers >= 0), got {bad!r}"
            )
    for req, reason in output.failures.items():
        if not isinstance(reason, FailureReason):
            raise ValueError(
                f"failures[{req!r}]: expected a FailureReason, got {type(reason).__name__}"
            )
    return _Report(
        sending=frozenset(output.finished_sending),
        recving=recving,
        invalid=invalid,
        failures=dict(output.failures),
        stats={key: _stat_value(key, value) for key, value in output.stats.items()},
    )


@dataclass(frozen=True)
class AggregatedOutput:
    """The scheduler's view of one step: requests finished on every worker since last `take`.

    `invalid_block_ids` has an entry for each request in `finished_recving` whose receive
    failed on at least one worker (the union over workers), `failures` its reason (merged
    over the failing ranks). `failed` is the subset the scheduler must fail (policy "fail");
    under "recompute" it is empty and the scheduler recomputes from the first invalid block.
    """

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    invalid_block_ids: Mapping[str, frozenset[int]] = field(default_factory=lambda: _EMPTY)
    failed: frozenset[str] = frozenset()
    stats: Mapping[str, StatValue] = field(default_factory=lambda: _NO_STATS)
    failures: Mapping[str, FailureReason] = field(default_factory=lambda: _NO_REASONS)

    @property
    def all_invalid_block_ids(self) -> frozenset[int]:
        """The union of invalid block ids over all requests (vLLM's `invalid_block_ids`)."""
        return frozenset().union(*self.invalid_block_ids.values())

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.stats)


class _Recent:
    """Insertion-ordered set of recently completed ids, holding at most `capacity`."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, req_id: str) -> None:
        self._ids[req_id] = None
        self._ids.move_to_end(req_id)
        while len(self._ids) > self._capacity:
            self._ids.popitem(last=False)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


class _Tracker:
    """Per-direction bookkeeping: which ranks reported each request, and what they found."""

    def __init__(self, world_size: int, direction: str, recent_capacity: int) -> None:
        self._world_size = world_size
        self._direction = direction
        self._ranks: dict[str, set[int]] = {}
        self._invalid: dict[str, set[int]] = {}
        self._reasons: dict[str, FailureReason] = {}
        self._recent = _Recent(recent_capacity)
        self.ready: dict[str, frozenset[int]] = {}
        self.reasons: dict[str, FailureReason] = {}
        self.duplicates = 0

    def __len__(self) -> int:
        return len(self._ranks)

    def report(
        self,
        rank: int,
        req_ids: Iterable[str],
        invalid: Mapping[str, AbstractSet[int]],
        reasons: Mapping[str, FailureReason] = _NO_REASONS,
    ) -> None:
        for req_id in req_ids:
            bad = invalid.get(req_id, frozenset())
            if req_id in self.ready or req_id in self._recent:
                self.duplicates += 1
                logger.warning(
                    "worker %d reported request %r finished %s after it completed on all "
                    "workers; ignored (invalid blocks dropped: %s)",
                    rank,
                    req_id,
                    self._direction,
                    sorted(bad),
                )
                continue
            ranks = self._ranks.setdefault(req_id, set())
            if bad:
                self._invalid.setdefault(req_id, set()).update(bad)
            if rank in ranks:
                self.duplicates += 1
                logger.warning(
                    "worker %d reported request %r finished %s twice; duplicate ignored",
                    rank,
                    req_id,
                    self._direction,
                )
                continue
            ranks.add(rank)
            reason = reasons.get(req_id)
            if reason is not None:
                reason = replace(reason, ranks=(rank,))
                old = self._reasons.get(req_id)
                self._reasons[req_id] = reason if old is None else old.merge(reason)
            if len(ranks) == self._world_size:
                del self._ranks[req_id]
                self.ready[req_id] = frozenset(self._invalid.pop(req_id, ()))
                if req_id in self._reasons:
                    self.reasons[req_id] = self._reasons.pop(req_id)

    def take(self) -> tuple[dict[str, frozenset[int]], dict[str, FailureReason]]:
        ready, self.ready = self.ready, {}
        reasons, self.reasons = self.reasons, {}
        for req_id in ready:
            self._recent.add(req_id)
        return ready, reasons

    def waiting_on(self, req_id: str) -> frozenset[int]:
        reported = self._ranks.get(req_id)
        if reported is None:
            return frozenset()
        return frozenset(range(self._world_size)) - reported


def _merge_stats(into: dict[str, StatValue], new: Mapping[str, StatValue]) -> dict[str, StatValue]:
    merged = dict(into)
    for key, value in new.items():
        old = merged.get(key)
        if old is None:
            merged[key] = value
        elif isinstance(old, tuple) and isinstance(value, tuple):
            merged[key] = old + value
        elif isinstance(old, tuple) or isinstance(value, tuple):
            raise ValueError(
                f"stats[{key!r}]: a counter on one worker and a list on another "
                f"({old!r} vs {value!r})"
            )
        else:
            merged[key] = old + value
    return merged


class KVOutputAggregator:
    """Turns per-worker `FinishedOutput`s into `AggregatedOutput`s for the scheduler.

    Use `add(rank, output)` as each worker's output arrives and `take()` once per step, or
    `aggregate(outputs)` with one output (or None) per rank.
    """

    def __init__(
        self,
        world_size: int,
        *,
        failure_policy: Literal["recompute", "fail"] = "fail",
        recent_capacity: int = 65536,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size: expected an integer >= 1, got {world_size!r}")
        if failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"failure_policy: expected 'recompute' or 'fail', got {failure_policy!r}"
            )
        if isinstance(recent_capacity, bool) or not isinstance(recent_capacity, int):
            raise ValueError(f"recent_capacity: expected an integer >= 0, got {recent_capacity!r}")
        if recent_capacity < 0:
            raise ValueError(f"recent_capacity: expected an integer >= 0, got {recent_capacity!r}")
        self._world_size = world_size
        self._failure_policy = failure_policy
        self._sending = _Tracker(world_size, "sending", recent_capacity)
        self._recving = _Tracker(world_size, "receiving", recent_capacity)
        self._stats: dict[str, StatValue] = {}

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def failure_policy(self) -> str:
        return self._failure_policy

    @property
    def duplicate_reports(self) -> int:
        """How many duplicate or late reports were ignored since construction."""
        return self._sending.duplicates + self._recving.duplicates

    @property
    def num_pending(self) -> tuple[int, int]:
        """(sending, receiving) requests reported by some but not yet all workers."""
        return len(self._sending), len(self._recving)

    def waiting_on(self, request_id: str) -> tuple[frozenset[int], frozenset[int]]:
        """Ranks that have not yet reported `request_id` as (sending, receiving)."""
        return self._sending.waiting_on(request_id), self._recving.waiting_on(request_id)

    def add(self, worker_rank: int, output: FinishedOutput | None) -> None:
        """Record one worker's output for the current step (None: nothing to report)."""
        if (
            isinstance(worker_rank, bool)
            or not isinstance(worker_rank, int)
            or not 0 <= worker_rank < self._world_size
        ):
            raise ValueError(
                f"worker_rank: expected an integer in 0..{self._world_size - 1} "
                f"(world_size={self._world_size}), got {worker_rank!r}"
            )
        if output is None:
            return
        if not isinstance(output, FinishedOutput):
            raise TypeError(
                f"output: expected a FinishedOutput or None, got {type(output).__name__}"
            )
        # Check and merge first: the only steps that can fail, so a bad output changes nothing.
        report = _checked(output)
        stats = _merge_stats(self._stats, report.stats)
        self._sending.report(worker_rank, report.sending, _EMPTY)
        self._recving.report(worker_rank, report.recving, report.invalid, report.failures)
        self._stats = stats

    def take(self) -> AggregatedOutput:
        """Everything that completed since the last `take`, and the merged stats; then reset."""
        sent, _ = self._sending.take()
        received, reasons = self._recving.take()
        invalid = {req: ids for req, ids in received.items() if ids}
        failed = frozenset(invalid) if self._failure_policy == "fail" else frozenset()
        stats, self._stats = self._stats, {}
        return AggregatedOutput(
            finished_sending=frozenset(sent),
            finished_recving=frozenset(received),
            invalid_block_ids=MappingProxyType(invalid),
            failed=failed,
            stats=MappingProxyType(stats),
            failures=MappingProxyType(reasons),
        )

    def aggregate(self, outputs: Sequence[FinishedOutput | None]) -> AggregatedOutput:
        """One step: `outputs[rank]` for every rank (None where a worker had nothing)."""
        if len(outputs) != self._world_size:
            raise ValueError(
                f"outputs: expected one entry per worker ({self._world_size}), got {len(outputs)}"
            )
        for rank, output in enumerate(outputs):
            self.add(rank, output)
        return self.take()
