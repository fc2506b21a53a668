"""`kvrdma demo --hosts N` as a user runs it (root): the engines on network-namespace hosts,
a partition mid-run, random loss, and `--netem` refused clearly where the kernel has no
sch_netem."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvrdma.testing.netns import netem_missing, unavailable_reason

pytest.importorskip("nixl")

_REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(bool(_REASON), reason=f"no network namespaces: {_REASON}")

ROOT = Path(__file__).resolve().parents[2]
# UCX aborts a producer whose endpoint to a retired reading agent fails once a partition heals
# (docs/cluster.md, "A producer can die after a partition heals"): a known bug, not fixed.
KNOWN_ABORT = "Fatal: unexpected error: Endpoint timeout"


def _demo(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run the demo in a session of its own; on timeout the whole session is killed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvrdma", "demo", "--no-progress", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"demo ran past {timeout:g} s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return {line.split(" ", 1)[0] for line in out.stdout.splitlines() if line}


@pytest.mark.timeout(200)
def test_demo_across_three_hosts(tmp_path: Path) -> None:
    """P and its sidecar on one host, a D rank on each of two more, a bridge between them:
    every request verifies, and no namespace is left afterwards."""
    before = _namespaces()
    summary = tmp_path / "summary.json"
    run = _demo(
        "--hosts", "3", "--d-tp", "2", "--requests", "12", "--max-tokens", "256",
        "--json", str(summary),
        timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "(P + sidecar on 10.233.0.1; UCX over TCP)" in run.stderr
    result = json.loads(summary.read_text())
    assert result["verified"] == result["requests"] == 12 and result["wrong_elements"] == 0
    assert _namespaces() <= before, "the demo left network namespaces behind"


@pytest.mark.timeout(200)
def test_demo_partition(tmp_path: Path) -> None:
    """The P host's link goes down mid-run and comes back after 1.5x the deadline: cut
    reads are reported within 2x the deadline, later ones verify, no rank dies."""
    summary = tmp_path / "summary.json"
    run = _demo(
        "--hosts", "2", "--fault", "partition", "--read-deadline", "1",
        "--requests", "40", "--concurrency", "4", "--max-tokens", "256",
        "--request-interval", "0.05", "--json", str(summary),
        timeout=180,
    )  # fmt: skip
    text = run.stdout[-4000:] + run.stderr[-4000:]
    if run.returncode != 0 and KNOWN_ABORT in run.stderr:
        pytest.xfail(f"known UCX abort of a producer after the partition: {KNOWN_ABORT!r}")
    assert run.returncode == 0, text
    assert "reports match the injected fault" in run.stdout, text
    result = json.loads(summary.read_text())
    assert result["wrong_elements"] == 0 and result["failed"] > 0 and result["verified"] > 0
    assert 0 < result["fault_detected_seconds"] <= 2.0, result


@pytest.mark.timeout(200)
def test_demo_with_random_loss_verifies_every_request(tmp_path: Path) -> None:
    """--loss 1: 1 % of the packets reaching each host lost (nftables, no netem needed):
    TCP recovers them, every request verifies."""
    if shutil.which("nft") is None:
        pytest.skip("--loss needs the nftables tool `nft` (.ci/sysdeps installs it)")
    summary = tmp_path / "summary.json"
    run = _demo(
        "--hosts", "2", "--loss", "1", "--requests", "12", "--max-tokens", "256",
        "--json", str(summary),
        timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads(summary.read_text())
    assert result["verified"] == result["requests"] == 12 and result["wrong_elements"] == 0
    assert _demo("--loss", "1", timeout=30).returncode == 2  # it needs --hosts


@pytest.mark.timeout(200)
def test_push_demo_partition_quarantines_until_the_link_heals(tmp_path: Path) -> None:
    """Push across hosts, the P host cut off mid-run: pushes cut off are reported at their
    deadline, their blocks stay quarantined while the cut-off producer could still write, and
    are released once it has heard the abort after the link came back."""
    summary = tmp_path / "summary.json"
    run = _demo(
        "--hosts", "2", "--mode", "push", "--fault", "partition", "--read-deadline", "1",
        "--requests", "40", "--concurrency", "4", "--max-tokens", "256",
        "--request-interval", "0.05", "--json", str(summary),
        timeout=180,
    )  # fmt: skip
    text = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0 and "reports match the injected fault" in run.stdout, text
    result = json.loads(summary.read_text())
    assert result["wrong_elements"] == 0 and result["failed"] > 0 and result["verified"] > 0
    assert result["quarantined"] == result["released"] > 0, result


@pytest.mark.timeout(60)
def test_demo_netem_and_partition_flags() -> None:
    """--netem and --fault partition need --hosts; --netem without sch_netem is refused
    before any rank starts, naming the missing scheduler."""
    run = _demo("--netem", "delay 5ms", timeout=30)
    assert run.returncode == 2 and "--netem shapes the links between hosts" in run.stderr
    run = _demo("--fault", "partition", timeout=30)
    assert run.returncode == 2 and "--fault partition cuts a link between hosts" in run.stderr
    run = _demo("--hosts", "3", timeout=30)
    assert run.returncode == 2 and "--hosts: expected 2..2" in run.stderr
    if not netem_missing():
        pytest.skip("this kernel has sch_netem: the refusal cannot be shown here")
    run = _demo("--hosts", "2", "--netem", "delay 5ms loss 1%", timeout=30)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "--netem 'delay 5ms loss 1%'" in run.stderr and "sch_netem" in run.stderr


@pytest.mark.timeout(200)
def test_demo_under_netem(tmp_path: Path) -> None:
    """5 ms +- 1 ms of latency and 1 % loss on every link: every request still verifies."""
    missing = netem_missing()
    if missing:
        pytest.skip(f"needs sch_netem: {missing}")
    summary = tmp_path / "summary.json"
    run = _demo(
        "--hosts", "2", "--netem", "delay 5ms 1ms loss 1%", "--requests", "16",
        "--max-tokens", "256", "--json", str(summary),
        timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads(summary.read_text())
    assert result["verified"] == result["requests"] == 16 and result["wrong_elements"] == 0
