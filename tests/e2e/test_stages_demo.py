"""`kvrdma demo --stages`: stage processes move verified KV along a pipeline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrdma.cli.demo.stages import parse_stages
from kvrdma.errors import ConfigError

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]


def test_stage_specs_are_parsed_and_checked() -> None:
    assert parse_stages("thinker:tp2, talker:tp1") == [("thinker", 2), ("talker", 1)]
    for bad in ("thinker:tp2", "a:tp2,a:tp1", "a:2,b:tp1", "a:tp3,b:tp1", "a:tp0,b:tp1"):
        with pytest.raises(ConfigError, match="--stages"):
            parse_stages(bad)


def test_demo_moves_verified_kv_through_a_three_stage_pipeline() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "KVRDMA_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "kvrdma", "demo", "--stages", "thinker:tp2,talker:tp1,vocoder:tp2",
         "--requests", "4"],
        capture_output=True, text=True, timeout=280, cwd=REPO, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "thinker:tp2 -> talker:tp1" in proc.stdout
    assert "talker:tp1 -> vocoder:tp2" in proc.stdout
    assert "verdict: OK" in proc.stdout
