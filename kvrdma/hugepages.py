"""Transparent huge pages for registered host memory.

Why: between processes on one host a NIXL READ is UCX `cma`, i.e. `process_vm_readv`, which
pins every source page before copying it. With 4 KiB pages the pinning, not the copy, bounds
the READ. So kvrdma asks the kernel for huge pages on the DRAM regions it registers:

- ``advise`` (the default): `madvise(MADV_HUGEPAGE)` on the 2 MiB-aligned interior of every
  region (never beyond it: the edges may hold other allocations). Only pages faulted in
  *later* become huge — memory allocated untouched and written after registration, like
  kvrdma's own host-staging mirror. Pages already resident are merged later, slowly, by
  `khugepaged`.
- ``collapse``: ``advise``, then `madvise(MADV_COLLAPSE)` (Linux >= 6.1) on the runs of
  2 MiB chunks that are already resident, which merges them at once. Synchronous and costly
  (seconds per tens of GiB), so opt-in.
- ``off``: nothing.

Device (VRAM) regions are never touched. Huge pages are an optimisation, never a requirement:
a kernel without THP, a non-Linux host, or a refused range is logged and ignored.

NIXL's own allocations are the other half. `make_prepped_xfer` builds per-transfer
descriptor vectors; past glibc's mmap threshold each one is fresh memory, faulted in 4 KiB
at a time unless `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` lets malloc use huge pages. That
tunable must be in the environment when the process starts: the `kvrdma` command (and
`benchmarks/run.py`) re-executes itself once with it (`reexec_with_malloc_hugepages`);
an engine process that uses kvrdma as a library should be started with it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import numpy as np

logger = logging.getLogger(__name__)

Mode = Literal["off", "advise", "collapse"]
MODES: Final = ("off", "advise", "collapse")
HUGE_PAGE: Final = 2 << 20
MADV_HUGEPAGE: Final = 14
MADV_COLLAPSE: Final = 25

# madvise(addr, length, advice) -> 0 or an errno; mincore(addr, length) -> bytes, one per
# 4 KiB-page (bit 0: resident), or None when unknown. Injected in tests.
Madvise = Callable[[int, int, int], int]
Mincore = Callable[[int, int], "bytes | None"]


@dataclass
class Outcome:
    """What `apply` did: bytes advised / collapsed and the failures (errno names)."""

    mode: str
    advised_bytes: int = 0
    collapsed_bytes: int = 0
    collapse_seconds: float = 0.0
    failures: list[str] = field(default_factory=list)


def aligned_interior(addr: int, length: int, page: int = HUGE_PAGE) -> tuple[int, int] | None:
    """The largest `page`-aligned (start, length) inside [addr, addr + length), or None."""
    start = -(-addr // page) * page
    end = (addr + length) // page * page
    return (start, end - start) if end > start else None


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(addr, length) ranges → sorted, disjoint, with overlapping or touching ones merged
    (regions cut from one tensor, e.g. K and V, share their memory)."""
    out: list[list[int]] = []
    for addr, length in sorted((int(a), int(n)) for a, n in ranges if int(n) > 0):
        if out and addr <= out[-1][1]:
            out[-1][1] = max(out[-1][1], addr + length)
        else:
            out.append([addr, addr + length])
    return [(a, e - a) for a, e in out]


def apply(
    ranges: Iterable[tuple[int, int]],
    mode: str,
    *,
    madvise: Madvise | None = None,
    mincore: Mincore | None = None,
) -> Outcome:
    """Ask for huge pages on host memory `ranges` ((addr, length) pairs) per `mode`.

    Never raises for a kernel that refuses (logged once per call at WARNING); raises
    `ValueError` only for an unknown mode (the config validates it first)."""
    if mode not in MODES:
        raise ValueError(f"hugepages: expected one of {', '.join(map(repr, MODES))}, got {mode!r}")
    out = Outcome(mode)
    if mode == "off":
        return out
    if madvise is None:
        madvise = _libc_madvise()
        if madvise is None:
            logger.debug("huge pages: no madvise on this platform (%s)", sys.platform)
            return out
    interiors = [iv for a, n in merge_ranges(ranges) if (iv := aligned_interior(a, n))]
    for start, length in interiors:
        err = madvise(start, length, MADV_HUGEPAGE)
        if err:
            out.failures.append(f"MADV_HUGEPAGE {_errname(err)}")
        else:
            out.advised_bytes += length
    if mode == "collapse":
        t0 = time.perf_counter()
        for start, length in interiors:
            for rs, rn in resident_runs(start, length, mincore or _libc_mincore()):
                err = madvise(rs, rn, MADV_COLLAPSE)
                if err:
                    out.failures.append(f"MADV_COLLAPSE {_errname(err)}")
                else:
                    out.collapsed_bytes += rn
        out.collapse_seconds = time.perf_counter() - t0
    if out.failures:
        logger.warning(
            "huge pages (%s) not available for part of the registered host memory (%s); "
            "READs of it pin 4 KiB pages and run slower. Transparent huge pages off or a "
            "kernel without MADV_COLLAPSE? Set kv_connector_extra_config.hugepages to "
            "'off' to skip this",
            mode,
            ", ".join(sorted(set(out.failures))),
        )
    logger.debug(
        "huge pages (%s): advised %d bytes in %d ranges, collapsed %d bytes in %.3f s",
        mode,
        out.advised_bytes,
        len(interiors),
        out.collapsed_bytes,
        out.collapse_seconds,
    )
    return out


def apply_to_tensors(tensors: Sequence[Any], mode: str, **kw: Any) -> Outcome:
    """`apply` to the memory of contiguous CPU tensors; tensors on any other device (GPU
    memory) are skipped."""
    ranges = [
        (t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.device.type == "cpu"
    ]
    return apply(ranges, mode, **kw)


def resident_runs(
    start: int, length: int, mincore: Mincore | None, page: int = HUGE_PAGE
) -> list[tuple[int, int]]:
    """Runs of `page`-sized chunks in [start, start + length) with at least one resident
    4 KiB page (collapsing a chunk with none would only allocate memory), asked of `mincore`
    in windows of at most `_MINCORE_WINDOW` bytes. Without residency information the whole
    range is one run."""
    hits: list[bool] = []
    for w in range(start, start + length - length % page, _MINCORE_WINDOW):
        n = min(_MINCORE_WINDOW, start + length - w) // page * page
        info = mincore(w, n) if mincore is not None else None
        if info is None:
            return [(start, length)]
        pages = np.frombuffer(info, dtype=np.uint8)[: n // 4096]
        hits += np.bitwise_and(pages, 1).reshape(n // page, -1).max(axis=1).astype(bool).tolist()
    runs: list[tuple[int, int]] = []
    run_start: int | None = None
    for c, hit in enumerate([*hits, False]):
        if hit and run_start is None:
            run_start = c
        elif not hit and run_start is not None:
            runs.append((start + run_start * page, (c - run_start) * page))
            run_start = None
    return runs


_MINCORE_WINDOW = 1 << 30  # 256 KiB of mincore output at a time


def _errname(err: int) -> str:
    return errno.errorcode.get(err, str(err))


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None


def _libc_function(name: str, argtypes: tuple[Any, ...]) -> Any:
    """libc's `name` typed as (argtypes) -> int, or None off Linux or where it is missing."""
    libc = _libc()
    if libc is None or not hasattr(libc, name):
        return None
    fn = getattr(libc, name)
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


def _libc_madvise() -> Madvise | None:
    fn = _libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
    if fn is None:
        return None

    def madvise(addr: int, length: int, advice: int) -> int:
        if fn(addr, length, advice) == 0:
            return 0
        return ctypes.get_errno() or errno.EIO

    return madvise


def _libc_mincore() -> Mincore | None:
    fn = _libc_function("mincore", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p))
    if fn is None:
        return None
    small = os.sysconf("SC_PAGESIZE") if hasattr(os, "sysconf") else 4096

    def mincore(addr: int, length: int) -> bytes | None:
        if small != 4096:
            return None
        vec = ctypes.create_string_buffer(length // 4096)
        return None if fn(addr, length, vec) != 0 else vec.raw

    return mincore


# ---- glibc malloc --------------------------------------------------------------------
MALLOC_TUNABLE: Final = "glibc.malloc.hugetlb=1"
OPT_OUT_ENV: Final = "KVRDMA_MALLOC_HUGEPAGES"  # "0": never re-execute for the tunable
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = _THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or None."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def _hugetlb_tunable(environ: Mapping[str, str]) -> str | None:
    """The value `GLIBC_TUNABLES` gives `glibc.malloc.hugetlb` ("" if named bare), or None."""
    for item in environ.get("GLIBC_TUNABLES", "").split(":"):
        key, _, value = item.partition("=")
        if key == "glibc.malloc.hugetlb":
            return value
    return None


def malloc_hugepages_active(environ: Mapping[str, str] = os.environ) -> bool:
    """This environment asks glibc for huge pages (`glibc.malloc.hugetlb`, any value > 0)."""
    return _hugetlb_tunable(environ) not in (None, "", "0")


def malloc_hugepages_env(
    environ: Mapping[str, str],
    *,
    libc: tuple[str, str] | None = None,
    thp: str | None = "",
) -> dict[str, str] | None:
    """`environ` with `MALLOC_TUNABLE` added to `GLIBC_TUNABLES`, or None where that is
    pointless or unwanted: the tunable (any value) is already set, `KVRDMA_MALLOC_HUGEPAGES`
    is "0", the C library is not glibc >= 2.35, or the kernel's THP mode is "never"."""
    if environ.get(OPT_OUT_ENV, "") == "0" or _hugetlb_tunable(environ) is not None:
        return None
    name, version = libc if libc is not None else platform.libc_ver()
    try:
        if name != "glibc" or tuple(int(x) for x in version.split(".")[:2]) < (2, 35):
            return None
    except ValueError:
        return None
    mode = thp_mode() if thp == "" else thp
    if mode in (None, "never"):
        return None
    old = environ.get("GLIBC_TUNABLES", "")
    return {**environ, "GLIBC_TUNABLES": f"{old}:{MALLOC_TUNABLE}" if old else MALLOC_TUNABLE}


def reexec_with_malloc_hugepages() -> None:
    """Re-execute this program (same interpreter and arguments) with `MALLOC_TUNABLE` when
    `malloc_hugepages_env` says it helps; returns only when it does not (or exec failed).
    For program entry points only: it replaces the running process."""
    env = malloc_hugepages_env(os.environ)
    argv = getattr(sys, "orig_argv", None)
    if env is None or not argv or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    except OSError as exc:
        logger.debug("re-executing with %s failed: %s", MALLOC_TUNABLE, exc)


_hinted = False


def hint_malloc_hugepages() -> None:
    """Log once per process (INFO) how to start it with `MALLOC_TUNABLE` where it would help."""
    global _hinted
    if _hinted:
        return
    _hinted = True  # decided once: the environment does not change under a process
    if malloc_hugepages_env(os.environ) is None:
        return
    logger.info(
        "NIXL's per-transfer descriptor vectors are faulted in 4 KiB at a time in this "
        "process (about half of make_prepped_xfer for 1M descriptors); start it with "
        "GLIBC_TUNABLES=%s to back them with huge pages (kvrdma's own commands do)",
        MALLOC_TUNABLE,
    )
