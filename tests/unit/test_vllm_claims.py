"""`kvrdma.vllm.claims.LoadClaims`: the producer requests a consumer engine loaded, each
claimed once, in bounded memory."""

from __future__ import annotations

import pytest

from kvrdma.vllm.claims import LoadClaims

pytestmark = pytest.mark.timeout(30)


def test_a_producer_request_is_claimed_once_and_names_its_first_loader() -> None:
    claims = LoadClaims()
    assert claims.claim("P", "r1", "d1") is None
    assert claims.claim("P", "r1", "d2") == "d1"
    assert claims.claim("Q", "r1", "d3") is None  # another engine's request of that id


def test_the_oldest_claims_are_forgotten_past_capacity() -> None:
    claims = LoadClaims(capacity=2)
    for i in range(3):
        assert claims.claim("P", f"r{i}", f"d{i}") is None
    assert claims.claim("P", "r0", "again") is None  # forgotten: the memory stays bounded
    assert claims.claim("P", "r2", "again") == "d2"
