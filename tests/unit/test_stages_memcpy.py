"""kvrdma.stages.memcpy: every byte copied once, on one core below `PARALLEL_BYTES` and split
with the helper thread from there on (a job spanning the split cut in two)."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvrdma import twocores
from kvrdma.stages import memcpy
from kvrdma.stages.memcpy import _halves, copy_all


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=20), st.data())
def test_halves_cut_the_jobs_at_exactly_the_given_byte(
    sizes: list[int], data: st.DataObject
) -> None:
    jobs, at = [], 0
    for n in sizes:
        jobs.append((10_000 + at, 50_000 + at, n))
        at += n
    first = data.draw(st.integers(1, at))
    head, tail = _halves(jobs, first)
    assert sum(n for *_, n in head) == first
    covered = [(d, s, n) for d, s, n in head + tail]
    # the same bytes in the same order: each piece starts where the previous one ended
    assert covered[0][:2] == (10_000, 50_000) and sum(n for *_, n in covered) == at
    for (d0, s0, n0), (d1, s1, _) in itertools.pairwise(covered):
        assert (d1, s1) == (d0 + n0, s0 + n0)


@pytest.mark.parametrize("parallel_from", [1 << 40, 1])
def test_copy_all_copies_every_byte(monkeypatch: pytest.MonkeyPatch, parallel_from: int) -> None:
    monkeypatch.setattr(memcpy, "PARALLEL_BYTES", parallel_from)
    threads: set[str] = set()
    real = memcpy._copy

    def spy(jobs: list[memcpy.Job]) -> None:
        threads.add(threading.current_thread().name)
        real(jobs)

    monkeypatch.setattr(memcpy, "_copy", spy)
    src = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (4096, 3, 70_000, 1)]
    dst = torch.zeros(sum(t.numel() for t in src), dtype=torch.uint8)
    jobs, at = [], 0
    for t in src:
        jobs.append((dst.data_ptr() + at, t.data_ptr(), t.numel()))
        at += t.numel()
    copy_all(jobs)
    assert torch.equal(dst, torch.cat(src))
    assert len(threads) == (2 if parallel_from == 1 else 1)


def test_at_interpreter_shutdown_the_caller_copies_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class ShutDown:
        def submit(self, *args: object) -> None:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(memcpy, "PARALLEL_BYTES", 1)
    monkeypatch.setattr(twocores, "_helper", ShutDown)
    src = torch.randint(0, 255, (10_000,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    copy_all(
        [
            (dst.data_ptr(), src.data_ptr(), 6000),
            (dst.data_ptr() + 6000, src.data_ptr() + 6000, 4000),
        ]
    )
    assert torch.equal(dst, src)
