"""Metrics of several real worker processes read as one.

`aggregated_registry` (the sidecar pulls the workers' /metrics) and `multiprocess_registry`
(a parent reads its children's prometheus-client multiprocess files), each with two workers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import mark_process_dead
from prometheus_client.parser import text_string_to_metric_families

from kvrdma import __version__
from kvrdma.scrape import aggregated_registry, multiprocess_registry
from kvrdma.telemetry import start_http_server

ROOT = Path(__file__).resolve().parents[2]

# One worker rank: records scripted events; with "serve", serves /metrics on a free port,
# prints the port, then waits for stdin to close; with "write", just exits.
WORKER = textwrap.dedent(
    """
    import json, sys
    from prometheus_client import CollectorRegistry
    from kvrdma.telemetry import KvrdmaMetrics, build_info, start_http_server
    rank = int(sys.argv[1])
    reg = CollectorRegistry()
    build_info(reg)
    m = KvrdmaMetrics(registry=reg, engine_id="decode-0", role="consumer", tp_rank=rank)
    m.set_registered(nbytes=(rank + 1) * 2**30, regions=32)
    m.set_connected_peers(rank)
    for _ in range(rank + 2):
        m.observe_transfer(remote_engine="prefill-0", mode="pull", outcome="success",
                           seconds=0.003, post_seconds=5e-5, nbytes=1 << 20, descriptors=64)
    m.observe_transfer(remote_engine="prefill-0", mode="pull", outcome="timeout", seconds=10,
                       post_seconds=5e-5, nbytes=1 << 20, descriptors=64)
    m.invalid_blocks(remote_engine="prefill-0", n=10 * (rank + 1))
    if sys.argv[2] == "serve":
        server, port = start_http_server(reg, "127.0.0.1", 0)
        print(json.dumps({"port": port}), flush=True)
        sys.stdin.read()
        server.shutdown()
    """
)


def _start_worker(rank: int) -> tuple[subprocess.Popen[str], int]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(rank), "serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded by the test timeout
    if not line:
        _stop(proc)
        pytest.fail(f"worker {rank} exited with {proc.returncode} before serving metrics")
    return proc, int(json.loads(line)["port"])


def _stop(proc: subprocess.Popen[str]) -> None:
    """Close stdin (the worker's signal to exit), wait, kill if it hangs, close the pipes."""
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None and not pipe.closed:
            pipe.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def workers() -> Iterator[list[tuple[subprocess.Popen[str], int]]]:
    started: list[tuple[subprocess.Popen[str], int]] = []
    try:
        for rank in (0, 1):
            started.append(_start_worker(rank))
        yield started
    finally:
        for proc, _ in started:
            _stop(proc)


def _scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


@pytest.mark.timeout(60)
def test_sidecar_serves_both_ranks_and_notices_one_going_away(
    workers: list[tuple[subprocess.Popen[str], int]],
) -> None:
    endpoints = [f"127.0.0.1:{port}" for _, port in workers]
    agg = aggregated_registry(endpoints, local=CollectorRegistry(), timeout=5.0)
    server, port = start_http_server(agg, "127.0.0.1", 0)
    try:
        samples = _scrape(port)

        def get(name: str, **labels: str) -> float | None:
            return samples.get((name, frozenset(labels.items())))

        for rank in (0, 1):
            w = {"engine_id": "decode-0", "role": "consumer", "tp_rank": str(rank)}
            peer = {**w, "remote_engine": "prefill-0"}
            assert get("kvrdma_registered_bytes", **w) == (rank + 1) * 2**30
            assert get("kvrdma_connected_remote_engines", **w) == rank
            pull = {**peer, "mode": "pull"}
            assert get("kvrdma_transfers_total", **pull, outcome="success") == rank + 2
            assert get("kvrdma_transfers_total", **pull, outcome="timeout") == 1
            assert get("kvrdma_transfer_bytes_sum", **pull) == (rank + 2) * (1 << 20)
            assert get("kvrdma_transfer_duration_seconds_bucket", **pull, le="0.005") == rank + 2
            assert get("kvrdma_invalid_blocks_total", **peer) == 10 * (rank + 1)
        for e in endpoints:
            assert get("kvrdma_worker_endpoint_up", endpoint=e) == 1

        # rank 1 exits: its series leave the aggregate and its endpoint reads 0
        _stop(workers[1][0])
        samples = _scrape(port)
        ranks = {
            dict(labels).get("tp_rank")
            for name, labels in samples
            if name.startswith("kvrdma_transfers")
        }
        assert ranks == {"0"}
        assert get("kvrdma_worker_endpoint_up", endpoint=endpoints[0]) == 1
        assert get("kvrdma_worker_endpoint_up", endpoint=endpoints[1]) == 0
    finally:
        server.shutdown()


@pytest.mark.timeout(60)
def test_parent_reads_two_children_through_multiprocess_files(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    pids: list[int] = []
    for rank in (0, 1):
        done = subprocess.run(
            [sys.executable, "-c", WORKER, str(rank), "write"], env=env, cwd=ROOT, timeout=30
        )
        assert done.returncode == 0
        pids.append(_pid_of(tmp_path, exclude=pids))
    registry = multiprocess_registry(str(tmp_path))

    def get(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    for rank in (0, 1):
        w = {"engine_id": "decode-0", "role": "consumer", "tp_rank": str(rank)}
        peer = {**w, "remote_engine": "prefill-0"}
        assert get("kvrdma_registered_bytes", **w) == (rank + 1) * 2**30
        pull = {**peer, "mode": "pull"}
        assert get("kvrdma_transfers_total", **pull, outcome="success") == rank + 2
        assert get("kvrdma_transfers_total", **pull, outcome="failed") == 0
        assert get("kvrdma_transfer_duration_seconds_bucket", **pull, le="0.005") == rank + 2
        assert get("kvrdma_invalid_blocks_total", **peer) == 10 * (rank + 1)
    assert get("kvrdma_build_info", version=__version__, protocol_version="1") == 1

    # a child that exited is marked dead: its gauges go, its counters stay (they only grow)
    mark_process_dead(pids[1], str(tmp_path))
    w1 = {"engine_id": "decode-0", "role": "consumer", "tp_rank": "1"}
    assert get("kvrdma_registered_bytes", **w1) is None
    assert get("kvrdma_invalid_blocks_total", **w1, remote_engine="prefill-0") == 20


def _pid_of(directory: Path, exclude: list[int]) -> int:
    """The pid of the one process (not in `exclude`) that left gauge files in `directory`."""
    pids = {int(p.stem.rsplit("_", 1)[1]) for p in directory.glob("gauge_live*_*.db")}
    (pid,) = pids - set(exclude)
    return pid
