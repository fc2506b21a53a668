"""`import kvrdma`: a curated, cheap public API."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvrdma


def test_every_public_name_resolves() -> None:
    for name in kvrdma.__all__:
        assert getattr(kvrdma, name) is not None, name
    from kvrdma.config import load_kv_transfer_config
    from kvrdma.progress import ProgressLoop
    from kvrdma.types import FinishedOutput, Outcome
    from kvrdma.worker import Worker

    assert kvrdma.Worker is Worker and kvrdma.ProgressLoop is ProgressLoop
    assert kvrdma.load_kv_transfer_config is load_kv_transfer_config
    assert kvrdma.FinishedOutput is FinishedOutput and kvrdma.Outcome is Outcome
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = kvrdma.Nope  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
def test_import_kvrdma_loads_no_heavy_module() -> None:
    code = (
        "import sys, kvrdma\n"
        "heavy = [m for m in ('torch', 'nixl', 'zmq', 'numpy', 'kvrdma.worker') "
        "if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True
    )
    assert out.stdout.strip() == "", out.stdout


def test_outcome_values_are_the_metric_labels() -> None:
    from kvrdma.telemetry import HANDSHAKE_OUTCOMES, TRANSFER_OUTCOMES
    from kvrdma.types import HandshakeOutcome

    assert TRANSFER_OUTCOMES == (
        "success",
        "failed",
        "timeout",
        "peer_lost",
        "cancelled",
        "expired",
        "corrupt",
    )
    assert tuple(o.value for o in kvrdma.Outcome) == TRANSFER_OUTCOMES
    assert tuple(o.value for o in HandshakeOutcome) == HANDSHAKE_OUTCOMES
    assert str(kvrdma.Outcome.PEER_LOST) == "peer_lost" == kvrdma.Outcome.PEER_LOST
