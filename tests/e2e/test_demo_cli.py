"""The README's main job, as a user runs it: `kvrdma demo` variants and `kvrdma inspect`."""

from __future__ import annotations

import json
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
