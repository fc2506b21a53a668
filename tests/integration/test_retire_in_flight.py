"""A reading agent retired while a large READ over cma (UCX's shared-memory copy) runs.

UCX cannot cancel the copies of such a READ it has queued, only run them; a READ cancelled
with copies queued keeps them on the parked agent, and destroying that agent aborted the
whole process (`arbiter.c` assertion). Each cycle runs in a fresh Python process (the
first cycle in a process aborted most often), so an abort fails the test instead of
killing pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl")

CHILDREN = 5
BLOCKS = 2048  # 128 MiB of 8 KiB descriptors: a READ that runs long enough to be caught
TRIES = 3  # cycles a child runs while its READ ends before the cut


def retire_cycle(how: str) -> None:
    """A fresh D/P pair: a large READ is cut off (`how`: its engine removed, or its
    deadline passed) while it may still land, then both workers close; again with a new
    pair while the READ ended before the cut (a preempted test), a few times at most."""
    for _ in range(TRIES):
        if _cut_off(how):
            return
    raise AssertionError(f"the READ ended before the retirement in each of {TRIES} cycles")


def _cut_off(how: str) -> bool:
    """One cycle; whether the cut retired the reading agent (False: the READ ended first)."""
    from worker_pair import reader_pair

    from kvrdma.testing.synthetic import CacheSpec, ModelShape

    spec = CacheSpec(ModelShape(num_layers=4, head_dim=64), "split_kv", "HND", 0, 1, 16, BLOCKS)
    rng = np.random.default_rng()
    now = [1000.0]  # the deadline case's clock, moved past the deadline at once
    clock = time.monotonic if how == "removed" else lambda: now[0]
    with reader_pair(spec, clock) as (d, p, _):
        _read(d, p, "warm", np.array([1, 2]), np.array([1, 2]))
        for _ in range(20):  # both sides idle a while
            p.get_finished()
            d.get_finished()
        remote = rng.permutation(BLOCKS)
        p.hold("big", remote.tolist())
        d.start_read("big", rng.permutation(BLOCKS), remote, "P")
        assert d.consumer is not None
        op = d.consumer.inflight["big"]
        end = time.monotonic() + 10
        while not _running(d, op):
            p.get_finished()
            time.sleep(0.0005)
            assert time.monotonic() < end, "the READ never started"
        if how == "removed":
            d.remove_remote("P")
        else:
            now[0] += 100.0
            out = d.get_finished()
        retired = d.backend.agent_name.endswith(".r1")
        if retired and how == "deadline":
            assert "big" in out.invalid_block_ids, out
        return retired


def _running(d: Any, op: Any) -> bool:
    """Whether a READ of `op` may still land (checked under the worker's lock, as the
    backlog thread posts under it)."""
    from kvrdma.retirement import may_land

    with d._s.lock:
        return any(may_land(d.backend.poll(x)) for _, x in op.xfers)


def _read(d: Any, p: Any, rid: str, local: Any, remote: Any) -> None:
    p.hold(rid, remote.tolist())
    d.start_read(rid, local, remote, "P")
    end = time.monotonic() + 10
    while rid not in d.get_finished().finished_recving:
        p.get_finished()
        assert time.monotonic() < end, f"read {rid!r} not reported"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["removed", "deadline"])
def test_a_retirement_with_a_read_in_flight_never_aborts_the_process(how: str) -> None:
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), *sys.path])}
    code = f"import test_retire_in_flight as t; t.retire_cycle({how!r})"
    for i in range(CHILDREN):
        r = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=25
        )
        assert r.returncode == 0 and "arbiter.c" not in r.stderr, (
            f"cycle {i}: exit {r.returncode}\n{r.stderr[-3000:]}"
        )
