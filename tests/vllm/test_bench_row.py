"""issue 18's benchmark row, `benchmarks/run.py --quick vllm_nixl`, under this (the vLLM)
venv: KvrdmaConnector and vLLM's own NixlConnector both ran it, every loaded block was
checked against P's, and the JSON has what the report reads. Timings are never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _harness import requires_vllm

pytestmark = [pytest.mark.timeout(600), requires_vllm]

ROOT = Path(__file__).resolve().parents[2]
METHODS = {
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "request_finished_all_groups", "update_connector_output", "start_load_kv",
    "get_transfer_results", "all",
}  # fmt: skip


def test_quick_row_runs_both_connectors(tmp_path: Path) -> None:
    env = {**os.environ, "VLLM_VENV": sys.prefix, "NIXL_LOG_LEVEL": "WARN"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--out", str(tmp_path)]
    proc = subprocess.run(
        [*cmd, "vllm_nixl"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=560
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    doc = json.loads((tmp_path / "vllm_nixl.json").read_text())
    assert doc["benchmark"] == "vllm_nixl" and doc["quick"] is True and "skipped" not in doc
    assert doc["parameters"]["vllm"].startswith("0.32.") and doc["parameters"]["requests"] == 4
    rows = {r["connector"]: r for r in doc["results"]}
    assert list(rows) == ["KvrdmaConnector", "NixlConnector"]
    for name, r in rows.items():
        assert r["error"] is None, f"{name}: {r['traceback']}"
        assert r["rounds"] == 1 and r["wrong_blocks"] == 0, name
        assert r["blocks_per_second"]["n"] == 1 and r["blocks_per_second"]["min"] > 0, name
        assert set(r["us_per_step"]) == METHODS, name
        for side in ("d", "p"):  # every hook was timed on both engines
            assert all(r["us_per_step"][m][side]["n"] == 1 for m in METHODS), (name, side)
    assert [len(t["rows"]) for t in doc["tables"]] == [2, len(METHODS)]
    assert doc["summary"] == []
