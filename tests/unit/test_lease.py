"""The consumer's view of a producer lease: the clock offset learnt at the handshake and the
cutoff rule that decides whether a read may still be posted."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrdma.errors import ConfigError
from kvrdma.lease import (
    EXPIRY_SAFETY_SECONDS,
    ClockOffset,
    Renewals,
    heartbeat_period,
    lease_cutoff,
    read_cutoff,
)

finite = st.floats(-1e6, 1e6, allow_nan=False)


@given(local=finite, true_offset=finite, out=st.floats(0, 5), back=st.floats(0, 5))
def test_offset_estimate_brackets_the_true_offset(
    local: float, true_offset: float, out: float, back: float
) -> None:
    """Whenever the remote read its clock during the round trip, the true offset is within
    the estimate's uncertainty."""
    sent, received = local, local + out + back
    remote_time = (local + out) + true_offset  # read when the request arrived
    est = ClockOffset.estimate(sent, received, remote_time)
    # received - sent rounds at the magnitude of `local` (float spacing below 1e-9 there)
    assert est.uncertainty == pytest.approx(out + back, abs=1e-9)
    assert abs(est.offset - true_offset) <= est.uncertainty + 1e-6


def test_offset_estimate_is_the_round_trip_midpoint() -> None:
    est = ClockOffset.estimate(10.0, 10.2, 1000.0)
    assert est.offset == pytest.approx(1000.0 - 10.1)
    assert est.uncertainty == pytest.approx(0.2)
    assert est.to_local(1005.0) == pytest.approx(15.1)


@pytest.mark.parametrize(
    ("sent", "received", "remote", "word"),
    [(2.0, 1.0, 0.0, "before sent"), (0.0, 1.0, math.nan, "remote_time"), (math.inf, 1, 0, "sent")],
)
def test_offset_estimate_rejects_impossible_readings(
    sent: float, received: float, remote: float, word: str
) -> None:
    with pytest.raises(ValueError, match=word):
        ClockOffset.estimate(sent, received, remote)


def test_cutoff_subtracts_uncertainty_and_safety() -> None:
    off = ClockOffset(offset=100.0, uncertainty=0.1)
    # the lease ends at remote 130 = local 30
    assert read_cutoff(130.0, off) == pytest.approx(30.0 - 0.1 - EXPIRY_SAFETY_SECONDS)
    assert read_cutoff(130.0, off, safety=0.0) == pytest.approx(29.9)


def test_a_later_renewal_moves_the_cutoff_an_earlier_one_does_not() -> None:
    off = ClockOffset(offset=0.0, uncertainty=0.0)
    assert read_cutoff(10.0, off, renewed_until=25.0, safety=0.0) == 25.0
    assert read_cutoff(10.0, off, renewed_until=5.0, safety=0.0) == 10.0


def test_lease_cutoff_without_expiry_or_offset_keeps_todays_behaviour() -> None:
    off = ClockOffset(0.0, 0.0)
    assert lease_cutoff(None, off, renewals=None, lease=5.0) is None
    assert lease_cutoff(10.0, None, renewals=None, lease=5.0) is None
    # renewed by heartbeats for a lease length the producer never told: cannot tell the end
    assert lease_cutoff(10.0, off, renewals=Renewals(8.0), lease=0.0) is None


def test_lease_cutoff_counts_heartbeats_for_the_producers_lease() -> None:
    off = ClockOffset(0.0, 0.0)
    got = lease_cutoff(10.0, off, renewals=Renewals(8.0), lease=5.0)
    assert got == pytest.approx(13.0 - EXPIRY_SAFETY_SECONDS)
    assert lease_cutoff(10.0, off, renewals=None, lease=5.0) == pytest.approx(
        10.0 - EXPIRY_SAFETY_SECONDS
    )


def renewals(*sent: float) -> Renewals:
    r = Renewals(sent[0])
    for t in sent[1:]:
        r.sent(t)
    return r


@pytest.mark.parametrize(
    ("sent", "cutoff"),
    [
        # each heartbeat left before the lease it renews ended (less the margin)
        ((9.0, 13.0, 17.0), 22.0),
        # the first left after the cutoff: the producer may have freed the blocks already
        ((9.9, 13.0), 10.0),
        ((11.0, 14.0, 17.0), 10.0),
        # a gap longer than the lease less the margin: the lease may have ended within it
        ((9.0, 13.9, 17.0), 10.0),
    ],
)
def test_heartbeats_count_only_while_each_left_within_the_lease_it_renews(
    sent: tuple[float, ...], cutoff: float
) -> None:
    off = ClockOffset(0.0, 0.5)  # margin: 0.5 + EXPIRY_SAFETY_SECONDS
    got = lease_cutoff(10.0, off, renewals=renewals(*sent), lease=5.0)
    assert got == pytest.approx(cutoff - 0.5 - EXPIRY_SAFETY_SECONDS)


@pytest.mark.parametrize("bad", ["10", True, math.nan, math.inf, [1.0]])
def test_lease_cutoff_names_a_bad_expiry(bad: object) -> None:
    with pytest.raises(ConfigError, match="remote_expires_at"):
        lease_cutoff(bad, ClockOffset(0.0, 0.0), renewals=None, lease=1.0)


@pytest.mark.parametrize(
    ("own", "told", "period"),
    [
        (30.0, [], 5.0),  # no producer told its lease
        (30.0, [0.0, 60.0], 5.0),  # 0: not told; a longer one does not stretch it
        (30.0, [3.0, 12.0], 0.5),  # a producer's shorter lease sets the pace
        (30.0, [1e-6], EXPIRY_SAFETY_SECONDS / 6),  # a peer's value counts no shorter than that
    ],
)
def test_heartbeats_keep_to_the_shortest_lease_told_but_not_below_a_reads_margin(
    own: float, told: list[float], period: float
) -> None:
    assert heartbeat_period(own, told) == pytest.approx(period)
