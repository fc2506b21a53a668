"""Combine per-worker KV transfer outputs into the scheduler's view (SPEC §6).

Each of `world_size` workers reports, per step, the requests it finished sending or
receiving. A request is reported finished only once every worker has reported it, even when
workers report in different steps. A failed receive is reported by a worker as the request id
in `finished_recving` plus its invalid block ids, in the same `WorkerOutput`; the aggregator
reports the union over workers when the request finishes. Stats are merged per step: numbers
are summed, lists concatenated.

Bad input policy: a report from a rank outside ``0..world_size-1`` is a wiring bug and raises
`ValueError`. A duplicate report (a worker reporting a request it already reported, before or
shortly after the request finished) is ignored, logged and counted in `duplicate_reports`.
Entries are removed once reported; completed ids are remembered in a bounded window only, to
recognise late duplicates. Not thread-safe: one owner calls `add`/`take`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, TypeAlias, cast

__all__ = ["AggregatedOutput", "KVOutputAggregator", "StatValue", "WorkerOutput"]

logger = logging.getLogger(__name__)

Number: TypeAlias = int | float
StatValue: TypeAlias = int | float | tuple[Number, ...]
_EMPTY: Mapping[str, frozenset[int]] = MappingProxyType({})
_NO_STATS: Mapping[str, StatValue] = MappingProxyType({})


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _stat_value(key: str, value: object) -> StatValue:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and all(_is_number(v) for v in value):
        return tuple(value)
    raise ValueError(f"stats[{key!r}]: expected a number or a list of numbers, got {value!r}")


@dataclass(frozen=True)
class WorkerOutput:
    """What one worker reports in one step; sets, mappings and lists are copied and frozen."""

    finished_sending: AbstractSet[str] = frozenset()
    finished_recving: AbstractSet[str] = frozenset()
    invalid_block_ids: Mapping[str, AbstractSet[int]] = field(default_factory=lambda: _EMPTY)
    stats: Mapping[str, StatValue | Sequence[Number]] = field(default_factory=lambda: _NO_STATS)

    def __post_init__(self) -> None:
        sending = frozenset(self.finished_sending)
        recving = frozenset(self.finished_recving)
        invalid = {req: frozenset(ids) for req, ids in self.invalid_block_ids.items()}
        stray = sorted(set(invalid) - recving)
        if stray:
            raise ValueError(
                f"invalid_block_ids: requests {stray} are not in finished_recving of the same "
                "output; a failed receive is reported as finished with its invalid blocks"
            )
        for req, ids in invalid.items():
            bad = [b for b in ids if isinstance(b, bool) or not isinstance(b, int) or b < 0]
            if bad:
                raise ValueError(
                    f"invalid_block_ids[{req!r}]: expected block ids (integers >= 0), got {bad!r}"
                )
        stats = {key: _stat_value(key, value) for key, value in self.stats.items()}
        object.__setattr__(self, "finished_sending", sending)
        object.__setattr__(self, "finished_recving", recving)
        object.__setattr__(self, "invalid_block_ids", MappingProxyType(invalid))
        object.__setattr__(self, "stats", MappingProxyType(stats))


@dataclass(frozen=True)
class AggregatedOutput:
    """The scheduler's view of one step: requests finished on every worker since last `take`.

    `invalid_block_ids` has an entry for each request in `finished_recving` whose receive
    failed on at least one worker (the union over workers). `failed` is the subset the
    scheduler must fail (policy "fail"); under "recompute" it is empty and the scheduler
    recomputes from the first invalid block.
    """

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    invalid_block_ids: Mapping[str, frozenset[int]] = field(default_factory=lambda: _EMPTY)
    failed: frozenset[str] = frozenset()
    stats: Mapping[str, StatValue] = field(default_factory=lambda: _NO_STATS)

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
        self._recent = _Recent(recent_capacity)
        self.ready: dict[str, frozenset[int]] = {}
        self.duplicates = 0

    def __len__(self) -> int:
        return len(self._ranks)

    def report(
        self, rank: int, req_ids: Iterable[str], invalid: Mapping[str, AbstractSet[int]]
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
            if len(ranks) == self._world_size:
                del self._ranks[req_id]
                self.ready[req_id] = frozenset(self._invalid.pop(req_id, ()))

    def take(self) -> dict[str, frozenset[int]]:
        ready, self.ready = self.ready, {}
        for req_id in ready:
            self._recent.add(req_id)
        return ready

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
    """Turns per-worker `WorkerOutput`s into `AggregatedOutput`s for the scheduler.

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

    def add(self, worker_rank: int, output: WorkerOutput | None) -> None:
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
        if not isinstance(output, WorkerOutput):
            raise TypeError(f"output: expected a WorkerOutput or None, got {type(output).__name__}")
        # Merge first: it is the only step that can fail, so a bad output changes nothing.
        # (__post_init__ froze every stats value to a number or a tuple.)
        stats = _merge_stats(self._stats, cast(Mapping[str, StatValue], output.stats))
        self._sending.report(worker_rank, output.finished_sending, _EMPTY)
        self._recving.report(worker_rank, output.finished_recving, output.invalid_block_ids)
        self._stats = stats

    def take(self) -> AggregatedOutput:
        """Everything that completed since the last `take`, and the merged stats; then reset."""
        sent = self._sending.take()
        received = self._recving.take()
        invalid = {req: ids for req, ids in received.items() if ids}
        failed = frozenset(invalid) if self._failure_policy == "fail" else frozenset()
        stats, self._stats = self._stats, {}
        return AggregatedOutput(
            finished_sending=frozenset(sent),
            finished_recving=frozenset(received),
            invalid_block_ids=MappingProxyType(invalid),
            failed=failed,
            stats=MappingProxyType(stats),
        )

    def aggregate(self, outputs: Sequence[WorkerOutput | None]) -> AggregatedOutput:
        """One step: `outputs[rank]` for every rank (None where a worker had nothing)."""
        if len(outputs) != self._world_size:
            raise ValueError(
                f"outputs: expected one entry per worker ({self._world_size}), got {len(outputs)}"
            )
        for rank, output in enumerate(outputs):
            self.add(rank, output)
        return self.take()
