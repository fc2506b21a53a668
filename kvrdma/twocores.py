"""Work cut in two: the caller runs one part while a helper thread runs the other.

Only work that lets go of the GIL gains (torch ops on host tensors, `ctypes.memmove`), and
handing a part over costs a thread wake-up, so callers cut only work that takes far longer.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

__all__ = ["both", "by_halves"]

A = TypeVar("A")
B = TypeVar("B")


class _Halvable(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: slice, /) -> Any: ...


S = TypeVar("S", bound=_Halvable)

_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the pid it belongs to, the helper)


def both(mine: Callable[[], A], theirs: Callable[[], B]) -> tuple[A, B]:
    """Run `theirs` on the helper thread and `mine` here; return both results once both are
    done. Either part's error is raised only after the other part ended, so a caller may free
    what the parts use as soon as this returns or raises."""
    try:
        done = _helper().submit(theirs)
    except RuntimeError:  # the interpreter is shutting down: no new threads
        return mine(), theirs()
    try:
        a = mine()
    finally:
        b = _wait(done)
    return a, b


def by_halves(fn: Callable[[S], A], items: S, *, split: bool) -> list[A]:
    """`[fn(items)]`, or with `split` (and two items or more) `fn` of each half of `items`,
    the second half on the helper thread (`both`)."""
    n = len(items)
    if not split or n < 2:
        return [fn(items)]
    head: S = items[: n // 2]
    tail: S = items[n // 2 :]
    return list(both(lambda: fn(head), lambda: fn(tail)))


def _wait(done: Future[B]) -> B:
    """The helper's result, waited for even through an interrupt."""
    interrupted: BaseException | None = None
    while True:
        try:
            result = done.result()
            break
        except BaseException as exc:
            if done.done():
                raise
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted
    return result


def _helper() -> ThreadPoolExecutor:
    """The helper thread of this process (a forked child starts its own)."""
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="kvrdma-helper"))
        return _pool[1]
