"""Log lines for an event that can come in floods: at most one per interval, each saying how
many occurrences it stands for."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable


class RateLimitedLog:
    """Logs one recurring event at `level` at most once every `interval` seconds.

    An occurrence is logged at once when the interval since the last line has passed; later
    ones are counted and logged by the next `flush` (or occurrence) once it has, as the latest
    one's message with how many more came before it. Called from one thread only.
    """

    def __init__(
        self,
        log: logging.Logger,
        level: int,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._level = level
        self._interval = interval
        self._clock = clock
        self._next_line = -math.inf  # when a line may be logged again
        self._pending = 0  # occurrences not logged yet
        self._first = 0.0  # when the first of them occurred
        self._message = ""
        self._args: tuple[object, ...] = ()

    def occurred(self, message: str, *args: object) -> None:
        """Count one occurrence, described by `message % args`, and log if the interval allows."""
        if self._pending == 0:
            self._first = self._clock()
        self._pending += 1
        self._message, self._args = message, args
        self.flush()

    def flush(self, *, force: bool = False) -> None:
        """Log the occurrences not logged yet, once the interval has passed (at once: `force`)."""
        now = self._clock()
        if self._pending == 0 or (now < self._next_line and not force):
            return
        if self._pending == 1:
            self._log.log(self._level, self._message, *self._args)
        else:
            more = self._pending - 1
            seconds = now - self._first
            suffix = " (and %d more like it in the last %.1f s)"
            self._log.log(self._level, self._message + suffix, *self._args, more, seconds)
        self._pending = 0
        self._next_line = now + self._interval
