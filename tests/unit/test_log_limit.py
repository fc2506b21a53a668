"""RateLimitedLog: a flood of one event costs a line per interval, and every occurrence is
counted in some line."""

from __future__ import annotations

import logging
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrdma.log_limit import RateLimitedLog

INTERVAL = 10.0


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def setup() -> tuple[RateLimitedLog, _Clock, list[str]]:
    clock, handler = _Clock(), _Lines()
    log = logging.getLogger("tests.log_limit")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.DEBUG)
    return RateLimitedLog(log, logging.WARNING, INTERVAL, clock), clock, handler.lines


def test_the_first_occurrence_is_logged_at_once_and_a_flood_after_it_once_per_interval(
    setup: tuple[RateLimitedLog, _Clock, list[str]],
) -> None:
    limited, clock, lines = setup
    limited.occurred("closed %s", "a")
    assert lines == ["closed a"]
    for i in range(50):
        clock.now += 0.1
        limited.occurred("closed %s", i)
        limited.flush()
    assert lines == ["closed a"]
    clock.now += 6.0  # past the interval since the first line
    limited.flush()
    assert lines == ["closed a", "closed 49 (and 49 more like it in the last 10.9 s)"]


def test_a_forced_flush_logs_what_is_pending_and_nothing_twice(
    setup: tuple[RateLimitedLog, _Clock, list[str]],
) -> None:
    limited, _, lines = setup
    limited.flush(force=True)
    assert lines == []
    limited.occurred("closed %s", 1)
    limited.occurred("closed %s", 2)
    limited.flush(force=True)
    limited.flush(force=True)
    assert lines == ["closed 1", "closed 2"]


def test_after_a_quiet_interval_an_occurrence_is_logged_at_once(
    setup: tuple[RateLimitedLog, _Clock, list[str]],
) -> None:
    limited, clock, lines = setup
    limited.occurred("closed %s", 1)
    clock.now += INTERVAL
    limited.occurred("closed %s", 2)
    assert lines == ["closed 1", "closed 2"]


@given(st.lists(st.floats(min_value=0, max_value=INTERVAL, allow_nan=False), max_size=200))
def test_every_occurrence_is_counted_once_in_at_most_one_line_per_interval(
    gaps: list[float],
) -> None:
    clock, handler = _Clock(), _Lines()
    log = logging.getLogger("tests.log_limit.property")
    log.handlers[:] = [handler]
    log.propagate = False
    limited = RateLimitedLog(log, logging.WARNING, INTERVAL, clock)
    start = clock.now
    for gap in gaps:
        clock.now += gap
        limited.occurred("closed")
        limited.flush()
    limited.flush(force=True)
    counts = [1 + int(m[1]) if (m := re.search(r"and (\d+) more", x)) else 1 for x in handler.lines]
    assert sum(counts) == len(gaps)
    assert len(handler.lines) <= 2 + (clock.now - start) / INTERVAL
