"""kvrdma.hugepages and where the worker applies it: only 2 MiB-aligned interiors of host
memory are advised, GPU memory never, collapse only where pages are resident, and a kernel
that refuses is logged, not raised."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrdma import hugepages
from kvrdma.config import load_kv_transfer_config
from kvrdma.hugepages import HUGE_PAGE, MADV_COLLAPSE, MADV_HUGEPAGE, aligned_interior
from kvrdma.nixl import MemType
from kvrdma.worker import Worker

MiB = 1 << 20


class Recorder:
    """A fake madvise: records (addr, length, advice), answers `answer(advice)`."""

    def __init__(self, fail: dict[int, int] | None = None) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.fail = fail or {}

    def __call__(self, addr: int, length: int, advice: int) -> int:
        self.calls.append((addr, length, advice))
        return self.fail.get(advice, 0)

    def advised(self, advice: int) -> list[tuple[int, int]]:
        return [(a, n) for a, n, adv in self.calls if adv == advice]


@pytest.mark.parametrize(
    ("addr", "length", "want"),
    [
        (0, 4 * MiB, (0, 4 * MiB)),
        (4096, 4 * MiB, (2 * MiB, 2 * MiB)),  # both edges cut
        (2 * MiB, 4 * MiB + 4096, (2 * MiB, 4 * MiB)),
        (4096, 2 * MiB, None),  # no whole huge page inside
        (2 * MiB - 1, 2 * MiB + 2, (2 * MiB, 2 * MiB)),
        (0, 0, None),
    ],
)
def test_aligned_interior(addr: int, length: int, want: tuple[int, int] | None) -> None:
    assert aligned_interior(addr, length) == want


@given(st.integers(0, 1 << 40), st.integers(0, 64 * MiB))
def test_aligned_interior_stays_inside_and_is_aligned(addr: int, length: int) -> None:
    got = aligned_interior(addr, length)
    if got is None:
        assert length < 2 * HUGE_PAGE or (addr + length) // HUGE_PAGE * HUGE_PAGE <= addr
        return
    start, n = got
    assert start % HUGE_PAGE == 0 and n % HUGE_PAGE == 0 and n > 0
    assert addr <= start and start + n <= addr + length
    assert start - addr < HUGE_PAGE and (addr + length) - (start + n) < HUGE_PAGE


def test_overlapping_and_touching_ranges_are_merged() -> None:
    got = hugepages.merge_ranges([(10, 5), (0, 10), (100, 10), (105, 20), (50, 0)])
    assert got == [(0, 15), (100, 25)]


def test_advise_covers_only_the_aligned_interior_of_each_range() -> None:
    rec = Recorder()
    base = 64 * MiB
    ranges = [
        (base + 4096, 5 * MiB),  # → [base + 2 MiB, base + 4 MiB)
        (base + 32 * MiB, 1 * MiB),  # too small: nothing
        (base + 40 * MiB, 4 * MiB),  # aligned already
    ]
    out = hugepages.apply(ranges, "advise", madvise=rec)
    assert rec.calls == [
        (base + 2 * MiB, 2 * MiB, MADV_HUGEPAGE),
        (base + 40 * MiB, 4 * MiB, MADV_HUGEPAGE),
    ]
    assert out.advised_bytes == 6 * MiB and out.collapsed_bytes == 0 and not out.failures


def test_regions_sharing_memory_are_advised_once() -> None:
    rec = Recorder()
    k, v = (0, 8 * MiB), (8 * MiB, 8 * MiB)  # K and V halves of one tensor
    hugepages.apply([k, v, k], "advise", madvise=rec)
    assert rec.calls == [(0, 16 * MiB, MADV_HUGEPAGE)]


def test_off_does_nothing() -> None:
    rec = Recorder()
    assert hugepages.apply([(0, 64 * MiB)], "off", madvise=rec).advised_bytes == 0
    assert rec.calls == []


def test_unknown_mode_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="expected one of 'off', 'advise', 'collapse', got 'on'"):
        hugepages.apply([(0, 4 * MiB)], "on", madvise=Recorder())


def test_collapse_only_runs_of_resident_chunks() -> None:
    rec = Recorder()
    per = HUGE_PAGE // 4096
    # 5 huge-page chunks: resident, resident (one page), empty, resident, empty
    info = np.zeros(5 * per, dtype=np.uint8)
    info[0:per] = 1
    info[per + 7] = 1
    info[3 * per + per - 1] = 1
    seen: list[tuple[int, int]] = []

    def mincore(addr: int, length: int) -> bytes:
        seen.append((addr, length))
        return info.tobytes()

    out = hugepages.apply([(0, 5 * HUGE_PAGE)], "collapse", madvise=rec, mincore=mincore)
    assert seen == [(0, 5 * HUGE_PAGE)]
    assert rec.advised(MADV_HUGEPAGE) == [(0, 5 * HUGE_PAGE)]
    assert rec.advised(MADV_COLLAPSE) == [(0, 2 * HUGE_PAGE), (3 * HUGE_PAGE, HUGE_PAGE)]
    assert out.collapsed_bytes == 3 * HUGE_PAGE


def test_residency_is_asked_in_bounded_windows() -> None:
    gib = 1 << 30
    seen: list[tuple[int, int]] = []

    def mincore(addr: int, length: int) -> bytes:
        seen.append((addr, length))
        return bytes([1]) * (length // 4096)  # all resident

    runs = hugepages.resident_runs(0, 2 * gib + 3 * HUGE_PAGE + 4096, mincore)
    assert seen == [(0, gib), (gib, gib), (2 * gib, 3 * HUGE_PAGE)]
    assert runs == [(0, 2 * gib + 3 * HUGE_PAGE)]


def test_collapse_without_residency_information_collapses_the_whole_interior() -> None:
    rec = Recorder()
    hugepages.apply([(0, 4 * MiB)], "collapse", madvise=rec, mincore=lambda a, n: None)
    assert rec.advised(MADV_COLLAPSE) == [(0, 4 * MiB)]


@pytest.mark.parametrize("mode", ["advise", "collapse"])
def test_a_refusing_kernel_is_logged_not_raised(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    rec = Recorder(fail={MADV_HUGEPAGE: errno.EINVAL, MADV_COLLAPSE: errno.EINVAL})
    with caplog.at_level(logging.WARNING, logger="kvrdma.hugepages"):
        out = hugepages.apply(
            [(0, 4 * MiB), (64 * MiB, 4 * MiB)], mode, madvise=rec, mincore=lambda a, n: None
        )
    assert out.advised_bytes == 0 and out.collapsed_bytes == 0
    assert "MADV_HUGEPAGE EINVAL" in out.failures
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # one line per call, not per range
    assert "huge pages" in warnings[0].getMessage() and "hugepages" in warnings[0].getMessage()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_real_madvise_on_a_tensor_never_raises() -> None:
    t = torch.empty(8 * MiB, dtype=torch.uint8)
    for mode in ("advise", "collapse"):
        out = hugepages.apply_to_tensors([t], mode)  # THP may be off here: then logged
        assert out.advised_bytes + len(out.failures) > 0
    t.zero_()
    assert int(t.sum()) == 0


class _OnDevice:
    """Stands in for a tensor in GPU memory (nothing here may touch its address)."""

    device = torch.device("cuda", 0)

    def data_ptr(self) -> int:
        raise AssertionError("a GPU tensor's memory must not be advised")


def test_tensors_not_on_the_cpu_are_skipped() -> None:
    rec = Recorder()
    cpu = torch.empty(6 * MiB, dtype=torch.uint8)
    meta = torch.empty(6 * MiB, dtype=torch.uint8, device="meta")
    hugepages.apply_to_tensors([_OnDevice(), meta, cpu], "advise", madvise=rec)
    assert len(rec.calls) == 1
    start, n, _ = rec.calls[0]
    assert cpu.data_ptr() <= start and start + n <= cpu.data_ptr() + cpu.numel()


# ---- where the worker applies it -----------------------------------------------------------
class FakeBackend:
    """Just enough of `TransferBackend` for `Worker.register_kv_caches`."""

    agent_name = "fake"

    def __init__(self) -> None:
        self.registered: list[tuple[Any, MemType]] = []

    def register(self, regions: Any, mem_type: MemType) -> Any:
        self.registered.append((np.array(regions), mem_type))
        return self

    def prep_local(self, descs: Any, mem_type: MemType, scratch: bool = False) -> Any:
        return self

    def metadata(self) -> bytes:
        return b"fake-agent-metadata"

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


def _worker(mode: str, **top: Any) -> tuple[Worker, FakeBackend]:
    cfg = load_kv_transfer_config(
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer",
            "engine_id": "P",
            "kv_connector_extra_config": {"hugepages": mode},
            **top,
        },
        environ={},
    )
    b = FakeBackend()
    return Worker(cfg, b, tp_rank=0, tp_size=1, total_num_kv_heads=2), b  # type: ignore[arg-type]


def _caches(blocks: int = 64) -> dict[str, torch.Tensor]:
    # split K/V: [2, blocks, 16 tokens, 2 heads, 64] fp16 = 4 KiB per block half
    return {f"l{i}": torch.zeros(2, blocks, 16, 2, 64, dtype=torch.float16) for i in range(2)}


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[tuple[int, int]], str]]:
    calls: list[tuple[list[tuple[int, int]], str]] = []
    real = hugepages.apply

    def spy(ranges: Any, mode: str, **kw: Any) -> Any:
        ranges = [(int(a), int(n)) for a, n in ranges]
        calls.append((ranges, mode))
        return real(ranges, mode, madvise=Recorder(), **kw)

    monkeypatch.setattr(hugepages, "apply", spy)
    return calls


@pytest.mark.parametrize("mode", ["off", "advise", "collapse"])
def test_worker_advises_its_registered_host_regions(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    calls = _spy(monkeypatch)
    w, b = _worker(mode)
    caches = _caches()
    w.register_kv_caches(caches, cache_layout="split_kv", block_size=16)
    table, mem = b.registered[0]
    assert mem is MemType.DRAM
    assert calls == [([(int(a), int(n)) for a, n, _ in table], mode)]
    spans = {(t.data_ptr(), t.numel() * t.element_size()) for t in caches.values()}
    for a, n in calls[0][0]:  # every advised range lies inside one cache tensor
        assert any(s <= a and a + n <= s + sn for s, sn in spans)


def test_worker_never_advises_gpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvrdma.registration as registration_mod

    calls = _spy(monkeypatch)
    real = registration_mod.build_regions

    def on_gpu(*a: Any, **kw: Any) -> Any:  # the CPU layout, as if it lived on a GPU
        return dataclasses.replace(real(*a, **kw), device=torch.device("cuda", 0))

    monkeypatch.setattr(registration_mod, "build_regions", on_gpu)
    w, b = _worker("collapse")
    w.register_kv_caches(_caches(), cache_layout="split_kv", block_size=16)
    assert b.registered[0][1] is MemType.VRAM
    assert calls == []


def test_host_staging_mirror_is_advised_before_it_is_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvrdma.registration as registration_mod

    seen: list[tuple[str, int]] = []  # (mode, bytes not yet written when advised)

    def spy(tensors: Any, mode: str, **kw: Any) -> Any:
        for t in tensors:
            seen.append((mode, t.numel()))
            t.fill_(0xFF)  # stands for whatever an untouched buffer holds
        return hugepages.Outcome(mode)

    monkeypatch.setattr(hugepages, "apply_to_tensors", spy)
    calls = _spy(monkeypatch)
    real = registration_mod.build_regions
    monkeypatch.setattr(
        registration_mod,
        "build_regions",
        lambda *a, **kw: dataclasses.replace(real(*a, **kw), device=torch.device("cuda", 0)),
    )
    w, b = _worker("advise", kv_buffer_device="cpu")
    # the stager copies between the "device" regions and the mirror: plain CPU tensors here
    w.register_kv_caches(_caches(), cache_layout="split_kv", block_size=16)
    assert b.registered[0][1] is MemType.DRAM
    assert [m for m, _ in seen] == ["advise"] * len(w._s.layout.regions)  # type: ignore[union-attr]
    assert calls == []  # the mirror is not advised a second time
    for r in w._s.layout.regions:  # type: ignore[union-attr]
        assert int(r.data.count_nonzero()) == 0  # zeroed after advising


# ---- glibc malloc tunable -----------------------------------------------------------------
GLIBC = ("glibc", "2.36")


@pytest.mark.parametrize(
    ("environ", "want"),
    [
        ({}, hugepages.MALLOC_TUNABLE),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
         "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, None),  # the user said no
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=2"}, None),  # already asked for
        ({hugepages.OPT_OUT_ENV: "0"}, None),
    ],
)  # fmt: skip
def test_malloc_tunable_is_added_once_and_respects_the_user(
    environ: dict[str, str], want: str | None
) -> None:
    env = hugepages.malloc_hugepages_env({"PATH": "/bin", **environ}, libc=GLIBC, thp="madvise")
    if want is None:
        assert env is None
    else:
        assert env is not None and env["GLIBC_TUNABLES"] == want and env["PATH"] == "/bin"
        assert hugepages.malloc_hugepages_active(env)
        assert hugepages.malloc_hugepages_env(env, libc=GLIBC, thp="madvise") is None  # no loop


@pytest.mark.parametrize(
    ("libc", "thp"),
    [(("glibc", "2.34"), "madvise"), (("", ""), "always"), (("musl", "1.2"), "always"),
     (GLIBC, "never"), (GLIBC, None)],
)  # fmt: skip
def test_malloc_tunable_only_where_it_can_work(libc: tuple[str, str], thp: str | None) -> None:
    assert hugepages.malloc_hugepages_env({}, libc=libc, thp=thp) is None


def test_thp_mode_reads_the_bracketed_word(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(str(f)) == "madvise"
    assert hugepages.thp_mode(str(tmp_path / "missing")) is None


def test_the_kvrdma_command_runs_with_the_malloc_tunable() -> None:
    """The program re-executes itself once with the tunable where it helps (glibc >= 2.35,
    THP not 'never'); `kvrdma inspect` prints nothing of its environment, so ask Python."""
    code = (
        "import os, sys; from kvrdma.hugepages import reexec_with_malloc_hugepages as r; "
        "r(); print(os.environ.get('GLIBC_TUNABLES', ''))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES",)}
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    expected = hugepages.malloc_hugepages_env(env)
    assert run.stdout.strip() == (expected["GLIBC_TUNABLES"] if expected else "")
