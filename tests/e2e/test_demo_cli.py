"""The README's main job, as a user runs it: `kvrdma demo` variants and `kvrdma inspect`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("nixl")

ROOT = Path(__file__).resolve().parents[2]


def kvrdma(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvrdma", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _demo_all_verified(tmp_path: Path, requests: int, extra: list[str]) -> dict[str, Any]:
    """Run the demo; every request verified, nothing wrong or invalid; its JSON summary."""
    out = tmp_path / "summary.json"
    run = kvrdma("demo", "--no-progress", "--requests", str(requests), "--json", str(out), *extra)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary: dict[str, Any] = json.loads(out.read_text())
    assert summary["requests"] == summary["verified"] == requests
    assert summary["wrong_elements"] == 0 and summary["invalid_blocks"] == 0
    assert summary["bytes"] > 0
    assert "| wrong elements   | 0" in run.stdout
    return summary


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--p-tp", "4", "--d-tp", "2"],
        ["--layout", "mla"],
        ["--layout", "mamba"],
        ["--p-tp", "1", "--d-tp", "2"],
        ["--host-staging", "--d-tp", "2"],
        ["--layout", "cross_layer", "--p-block-size", "8", "--d-block-size", "32",
         "--d-kv-layout", "NHD"],
        ["--layout", "unified:BHLNC", "--p-tp", "2", "--d-tp", "4", "--p-block-size", "8"],
    ],
    ids=["defaults", "p4-d2", "mla", "mamba", "p1-d2", "host-staging", "cross-layer-ratio4-nhd",
         "unified-bhlnc-p2-d4-ratio2"],
)  # fmt: skip
def test_demo_verifies_every_byte(extra: list[str], tmp_path: Path) -> None:
    _demo_all_verified(tmp_path, 16, extra)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "extra",
    [
        ["--mode", "push"],
        ["--mode", "push", "--layerwise", "--p-tp", "1", "--d-tp", "2", "--p-block-size", "8"],
        ["--mode", "push", "--host-staging", "--layout", "mla", "--p-tp", "2", "--d-tp", "2"],
        ["--mode", "push", "--layerwise", "--layout", "unified:LHBNC", "--p-tp", "2",
         "--d-tp", "4"],
        ["--mode", "push", "--layerwise", "--layout", "mamba", "--p-tp", "2"],
        ["--mode", "push", "--p-tp", "4", "--d-tp", "2"],
        ["--mode", "push", "--layerwise", "--layout", "cross_layer", "--p-block-size", "8",
         "--d-block-size", "32", "--d-kv-layout", "NHD"],
        ["--mode", "push", "--layout", "unified:BHLNC", "--p-tp", "2", "--d-tp", "4",
         "--p-block-size", "8"],
    ],
    ids=["push", "push-layerwise-p1-d2-ratio2", "push-host-staging-mla",
         "push-layerwise-unified-lhbnc-p2-d4", "push-layerwise-mamba", "push-p4-d2",
         "push-layerwise-cross-layer-ratio4-nhd", "push-unified-bhlnc-p2-d4-ratio2"],
)  # fmt: skip
def test_push_demo_verifies_every_byte(extra: list[str], tmp_path: Path) -> None:
    summary = _demo_all_verified(tmp_path, 16, extra)
    assert summary["mode"] == ("push, layer-wise" if "--layerwise" in extra else "push")


def test_demo_rejects_bad_flags_with_a_clear_error() -> None:
    run = kvrdma("demo", "--p-block-size", "16", "--d-block-size", "24")
    assert run.returncode == 2
    assert "--d-block-size 24 must be a multiple of --p-block-size 16" in run.stderr
    run = kvrdma("demo", "--model-shape", "layers=x")
    assert run.returncode == 2 and "--model-shape layers must be an integer" in run.stderr
    run = kvrdma("demo", "--device", "P=cuda,X=cpu")
    assert run.returncode == 2 and "--device item 'X=cpu': expected P=DEVICE" in run.stderr
    run = kvrdma("demo", "--device", "tpu")
    assert run.returncode == 2 and "--device P: 'tpu'" in run.stderr
    run = kvrdma("demo", "--layerwise")
    assert run.returncode == 2 and "--layerwise is for --mode push" in run.stderr


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--read-deadline", "-1", "a finite number in (0, 3600]"),
        ("--read-deadline", "0", "a finite number in (0, 3600]"),
        ("--read-deadline", "nan", "a finite number in (0, 3600]"),
        ("--read-deadline", "inf", "a finite number in (0, 3600]"),
        # finite, but three times it (the ranks' lease) is not
        ("--read-deadline", "1e308", "a finite number in (0, 3600]"),
        ("--timeout", "nan", "a finite number > 0"),
        ("--request-interval", "-0.5", "a finite number >= 0"),
        ("--fault-at", "1.5", "a finite number in 0..1"),
        ("--linger", "inf", "a finite number >= 0"),
        ("--metrics-port", "99999", "an integer in 0..65535"),
        ("--metrics-port", "-1", "an integer in 0..65535"),
    ],
)
def test_demo_rejects_out_of_range_numbers_before_starting(
    flag: str, value: str, expected: str
) -> None:
    """Refused like any bad flag (exit 2, the flag named), before a rank starts: none of them
    may end in a rank's traceback naming an internal key."""
    run = kvrdma("demo", "--no-progress", "--requests", "1", "--p-tp", "1", flag, value)
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"kvrdma demo: error: {flag}: expected {expected}, got" in run.stderr
    assert "Traceback" not in run.stderr and "metrics:" not in run.stderr


def test_demo_metrics_server_reports_a_port_it_cannot_bind_as_a_config_error() -> None:
    """bind() raises OverflowError, not OSError, for a port past 65535."""
    from kvrdma.cli.demo.main import _serve_metrics
    from kvrdma.errors import ConfigError

    with pytest.raises(ConfigError, match="--metrics-port 65536: cannot serve metrics"):
        _serve_metrics(65536, [], None)


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "extra",
    [
        ["--device", "cuda", "--p-tp", "2", "--d-tp", "4"],
        ["--device", "P=cuda,D=cpu", "--layout", "mamba"],
        ["--device", "cuda", "--host-staging", "--layout", "cross_layer"],
    ],
    ids=["vram", "vram-to-dram-mamba", "vram-host-staging-cross-layer"],
)
def test_demo_on_gpu_verifies_every_byte(extra: list[str], tmp_path: Path) -> None:
    summary = _demo_all_verified(tmp_path, 32, extra)
    assert "cuda" in summary["devices"]["P"]


def test_inspect_prints_the_plan() -> None:
    run = kvrdma("inspect", "--local-tp", "1", "--remote-tp", "4", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    (rank,) = report["ranks"]
    assert rank["handshake_ranks"] == [0, 1, 2, 3] and rank["read_ranks"] == [0, 1, 2, 3]
    assert rank["tp_ratio"] == -4
    run = kvrdma("inspect", "--local-tp", "3", "--remote-tp", "2")
    assert run.returncode == 2 and "tp_size" in run.stderr


def test_inspect_unified_layout() -> None:
    base = ["inspect", "--layout", "unified", "--local-tp", "2", "--remote-tp", "1"]
    run = kvrdma(*base, "--order", "BHLNC", "--local-block-size", "32", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["kv_cache_order"] == {"local": "BHLNC", "remote": "BHLNC"}
    assert [r["heads"] for r in report["ranks"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(r["block_size_ratio"] == 2 and r["permutes"] for r in report["ranks"])
    run = kvrdma(*base, "--order", "LBNHC")
    assert run.returncode == 2
    assert "kv_cache_order LBNHC of engine 'prefill' keeps heads apart" in run.stderr
    assert "P tp 1 -> D tp 2" in run.stderr
    run = kvrdma("inspect", "--order", "LHBNC")
    assert run.returncode == 2 and "need --layout unified" in run.stderr


def _documented_faults() -> list[str]:
    """The faults the README's "See it happen" block names."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("kvrdma demo --fault") :].split("```", 1)[0]
    return re.findall(r"[a-z]+-[a-z]+", block.split("--fault", 1)[1])


def test_the_readme_documents_every_fault() -> None:
    from kvrdma.cli.demo.faults import FAULTS

    # partition needs --hosts: README "Across hosts", tests/e2e/test_demo_hosts.py
    assert sorted(_documented_faults()) == sorted(set(FAULTS) - {"partition"})


@pytest.mark.timeout(320)
@pytest.mark.parametrize("fault", _documented_faults())
def test_demo_fault_passes_with_default_arguments(fault: str, tmp_path: Path) -> None:
    """`kvrdma demo --fault X` as the README shows it (no other arguments than the output
    options): the verdict matches the injected fault and the command exits 0."""
    out = tmp_path / "summary.json"
    run = kvrdma("demo", "--fault", fault, "--no-progress", "--json", str(out), timeout=300)
    shown = run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0, shown
    assert "verdict: reports match the injected fault" in run.stdout, shown
    summary = json.loads(out.read_text())
    assert summary["fault_verdict"] is True, summary
    assert summary["requests"] == 64 and summary["wrong_elements"] == 0, summary
    assert not re.search(r"^error: ", run.stderr, re.M), shown  # no rank failed


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("fault", "quarantines_end"),
    [
        ("kill-producer", True),
        ("stall-producer", False),
        ("restart-producer", True),
        ("corrupt-handshake", True),  # fails before any Expect: nothing to quarantine
    ],
)
def test_push_demo_fault_keeps_blocks_quarantined_while_a_producer_could_write(
    fault: str, quarantines_end: bool, tmp_path: Path
) -> None:
    """`kvrdma demo --mode push --fault X`: the verdict matches, failed pushes were
    quarantined, and released during the run unless the producer is stopped (it could
    still write their blocks)."""
    out = tmp_path / "summary.json"
    run = kvrdma(
        "demo", "--mode", "push", "--fault", fault, "--requests", "32", "--read-deadline", "3",
        "--no-progress", "--json", str(out), timeout=180,
    )  # fmt: skip
    shown = run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0 and "verdict: reports match" in run.stdout, shown
    summary = json.loads(out.read_text())
    assert summary["mode"] == "push" and summary["wrong_elements"] == 0, summary
    assert summary["quarantined"] > 0 or fault == "corrupt-handshake", summary
    assert summary["released"] == (summary["quarantined"] if quarantines_end else 0), summary


def test_demo_shows_a_failing_rank_and_exits_non_zero() -> None:
    """A rank that dies at start (here: its KV caches, past the address space, cannot be
    allocated) prints its error, and the run exits 1 even with a fault."""
    run = kvrdma(
        "demo", "--fault", "kill-producer", "--no-progress", "--num-blocks", str(10**12),
        "--requests", "4", "--timeout", "120", timeout=150,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    failed = re.search(r"^error: P rank \d failed to start: RuntimeError", run.stderr, re.M)
    assert failed, run.stderr
