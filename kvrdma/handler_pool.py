"""A bounded pool of handler threads that are kept between jobs.

Handing a job to a waiting thread is a queue put; starting a thread instead blocks the caller
until the new thread runs, which, while many threads compete for the GIL, takes milliseconds,
and the HTTP server's single serving thread would hold every other connection up meanwhile.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

Job = Callable[[], None]


class HandlerPool:
    """Runs at most `size` jobs at once, each on a thread kept for the next job; threads are
    started only while every one of them is busy, so the pool grows to the peak load.
    `try_submit` and `close` are called from one thread."""

    def __init__(self, size: int, name: str) -> None:
        self._slots = threading.BoundedSemaphore(size)
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads not committed to a job
        self._threads = 0
        self._start_failing = False  # warned already, until a thread starts again
        self._name = name

    def try_submit(self, job: Job) -> bool:
        """Queue `job` for a thread of the pool; False (and nothing queued) when `size` jobs
        are running or queued already, or when no thread can be started for it."""
        if not self._slots.acquire(blocking=False):
            return False
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        if start:
            thread = threading.Thread(
                target=self._work, name=f"{self._name}-{self._threads}", daemon=True
            )
            try:
                thread.start()
            except RuntimeError as exc:  # out of threads: as busy as a full pool, not an error
                self._slots.release()
                level = logging.DEBUG if self._start_failing else logging.WARNING
                logger.log(level, "%s: cannot start a thread: %s", self._name, exc)
                self._start_failing = True
                return False
            except BaseException:
                self._slots.release()
                raise
            self._start_failing = False
            self._threads += 1
        self._jobs.put(job)
        return True

    def close(self) -> None:
        """Let every thread end once the jobs queued before this call are done."""
        for _ in range(self._threads):
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except BaseException:  # a thread that ended here would still be counted idle
                logger.exception("%s: a job failed", self._name)
            finally:
                # idle before the slot frees: a job that takes the slot finds this thread
                with self._lock:
                    self._idle += 1
                self._slots.release()
