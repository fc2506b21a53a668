"""Host buffers for unpacked payloads, used again once every tensor viewing one is gone.

A fresh allocation of a few MiB or more is mapped anew by the allocator and its pages are
zero-filled by the kernel on first touch, which costs about as much as copying into them; a
receiving stage unpacks request after request of similar sizes, so a buffer its caller has
dropped is kept (up to `keep_bytes`) and handed out again with its pages already in place.

A buffer is a NumPy array (weak-referenceable, unlike a torch storage) that the returned
tensor's storage holds: when the storage is freed, with every view of it, the array's
finalizer puts the buffer back.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

__all__ = ["HostPool"]

_ALIGN = 64  # buffers start on a cache line
_MIN_CLASS = 1 << 16  # smaller requests share the smallest size class


class HostPool:
    """Uint8 host tensors whose memory is reused once the caller lets go of it; at most
    `keep_bytes` of free buffers are kept (give or take one buffer let go by two threads at
    once), in power-of-two size classes."""

    def __init__(self, keep_bytes: int = 256 << 20) -> None:
        self.keep_bytes = keep_bytes
        # size class -> buffers free for reuse; list.append/pop are atomic, so finalizers
        # (run by whichever thread drops the last tensor) need no lock
        self._free: dict[int, list[np.ndarray]] = {}

    def empty(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 tensor of `nbytes`, its contents undefined, its start aligned to 64."""
        size = max(_MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())
        try:
            base = self._free[size].pop()
        except (KeyError, IndexError):
            base = np.empty(size + _ALIGN, dtype=np.uint8)
        lo = -base.ctypes.data % _ALIGN
        view = base[lo : lo + nbytes]
        back = weakref.finalize(view, self._put_back, base, size)
        back.atexit = False  # a buffer still in use when the process exits is not put back
        return torch.from_numpy(view)

    def _put_back(self, base: np.ndarray, size: int) -> None:
        if self.free_bytes() + size <= self.keep_bytes:
            self._free.setdefault(size, []).append(base)

    def free_bytes(self) -> int:
        """Bytes of buffers kept for reuse."""
        return sum(size * len(bufs) for size, bufs in list(self._free.items()))
