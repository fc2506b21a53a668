"""A failed handshake's `kvrdma_handshakes_total` outcome comes from its error's type, never
from words in its message (a peer's message may say anything)."""

from __future__ import annotations

from typing import get_args

import pytest

from kvrdma.connect import outcome_of
from kvrdma.errors import (
    ConfigError,
    HandshakeError,
    HandshakeIncompatible,
    HandshakeRefused,
    HandshakeTimeout,
    PeerUnreachable,
    TransferError,
)
from kvrdma.handshake.client import refusal
from kvrdma.handshake.wire import RETRYABLE_CODES, ErrorCode, ErrorReply
from kvrdma.nixl.checks import load_error
from kvrdma.types import HandshakeOutcome

pytestmark = pytest.mark.timeout(30)

# words the outcome was once guessed from, in a message that must not sway it
MISLEADING = "rejected: incompatible compat hash, TP sizes not divisible"

ERRORS = {
    HandshakeOutcome.TIMEOUT: HandshakeTimeout(f"no reply within 5 s ({MISLEADING})"),
    HandshakeOutcome.UNREACHABLE: PeerUnreachable(f"cannot connect ({MISLEADING})", "P-0"),
    HandshakeOutcome.REFUSED: HandshakeRefused("peer answered too_large: ask for fewer", "x"),
    HandshakeOutcome.INCOMPATIBLE: HandshakeIncompatible("a vLLM NixlConnector side channel"),
    HandshakeOutcome.ERROR: HandshakeError(f"rank 0 sent invalid metadata ({MISLEADING})"),
}


@pytest.mark.parametrize("outcome", list(ERRORS), ids=str)
def test_each_failed_outcome_comes_from_the_errors_type(outcome: HandshakeOutcome) -> None:
    assert outcome_of(ERRORS[outcome]) is outcome


def test_every_failed_outcome_has_an_error() -> None:
    assert set(ERRORS) == set(HandshakeOutcome) - {HandshakeOutcome.SUCCESS}


@pytest.mark.parametrize(
    ("exc", "outcome"),
    [
        (ConfigError("remote tp_size 3 does not divide local tp_size 4"), "incompatible"),
        (TransferError(f"posting failed ({MISLEADING})"), "error"),
        (RuntimeError(MISLEADING), "error"),
    ],
    ids=["config", "transfer", "bug"],
)
def test_an_error_outside_the_handshake_tree(exc: Exception, outcome: str) -> None:
    """An impossible mapping can never work; anything else is an error, whatever it says."""
    assert outcome_of(exc) == outcome


FINAL_CODES = [c for c in get_args(ErrorCode) if c not in RETRYABLE_CODES]


@pytest.mark.parametrize("code", FINAL_CODES)
def test_a_peers_final_error_reply_is_refused_or_incompatible(code: str) -> None:
    """Hashes and protocol versions that differ never match: incompatible; any other error
    reply is the peer refusing this request, and the error keeps its code."""
    exc = refusal(ErrorReply(code=code, message="rejected, incompatible"), "handshake with P")
    never = code in ("compat_mismatch", "bad_version")
    assert outcome_of(exc) == ("incompatible" if never else "refused")
    assert f"peer answered {code}" in str(exc)
    assert never or (isinstance(exc, HandshakeRefused) and exc.code == code)


def test_nixl_refusing_a_peers_metadata_is_an_error_not_the_peers_refusal() -> None:
    exc = load_error(RuntimeError("bad blob"), "P-agent", 64)
    assert "NIXL rejected" in str(exc)
    assert outcome_of(exc) == "error"
