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


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m kvrdma demo ARGS` from the checkout, without the caller's kvrdma/vLLM env."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "KVRDMA_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "kvrdma", "demo", *args],
        capture_output=True, text=True, timeout=280, cwd=REPO, env=env,
    )  # fmt: skip


def test_demo_moves_verified_kv_through_a_three_stage_pipeline() -> None:
    proc = _demo("--stages", "thinker:tp2,talker:tp1,vocoder:tp2", "--requests", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "thinker:tp2 -> talker:tp1" in proc.stdout
    assert "talker:tp1 -> vocoder:tp2" in proc.stdout
    assert "verdict: OK" in proc.stdout


def test_demo_keeps_every_request_when_the_senders_slab_fills_up() -> None:
    """The default 64 requests fill the sender's slab: a send that finds room for only one of
    its receivers' shards offers none, and the demo's retry then sends it whole."""
    proc = _demo("--stages", "thinker:tp1,talker:tp2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "thinker:tp1 -> talker:tp2           64" in proc.stdout, proc.stdout
    assert "verdict: OK" in proc.stdout
