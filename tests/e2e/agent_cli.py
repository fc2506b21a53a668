"""Shared by the manifest tests: run the real `kvrdma` CLI the way the agent image does."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI_TIMEOUT_S = 90  # one subprocess: python start-up and imports on a slow 2-core machine


@functools.cache
def cli_problem() -> str | None:
    """Why `kvrdma` cannot run yet (it builds every sub-command's parser), or None."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvrdma", "agent", "--help"],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        cwd=ROOT,
    )
    if proc.returncode == 0:
        return None
    return "`kvrdma agent --help` fails: " + (proc.stderr.strip().splitlines() or ["?"])[-1]


def kvrdma_shim(directory: Path) -> Path:
    """A `kvrdma` command on PATH for the entrypoint: this interpreter's `-m kvrdma`, importing
    this checkout's package (not whichever one the interpreter has installed)."""
    problem = cli_problem()
    if problem:
        pytest.skip(problem)
    shim = directory / "kvrdma"
    shim.write_text(
        f'#!/bin/sh\nexport PYTHONPATH="{ROOT}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
        f'exec "{sys.executable}" -m kvrdma "$@"\n'
    )
    shim.chmod(0o755)
    return directory
