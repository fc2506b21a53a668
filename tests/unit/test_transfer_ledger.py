"""Producer leases and notification handling (pure logic, injected clock)."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrdma import notify, transfer
from kvrdma.transfer import ProducerLedger


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Metrics:
    def __init__(self) -> None:
        self.expired = 0
        self.freed: dict[str, int] = {}
        self.failed: list[tuple[str, str]] = []

    def expired_leases(self, n: int = 1) -> None:
        self.expired += n

    def freed_blocks(self, n: int, *, reason: str) -> None:
        self.freed[reason] = self.freed.get(reason, 0) + n

    def failed_notification(self, *, remote_engine: str, reason: str) -> None:
        self.failed.append((remote_engine, reason))


def done(rid: str, rank: int, expected: int) -> bytes:
    return notify.encode("done", rid, expected=expected, sender_engine="D", sender_rank=rank)


def test_freed_only_after_every_expected_reader():
    clock, m = Clock(), Metrics()
    led = ProducerLedger(30.0, clock, m)
    led.hold("r1", [1, 2, 3])
    led.on_notif("a", done("r1", 0, 2))
    assert led.take_finished() == set()
    led.on_notif("a", done("r1", 0, 2))  # duplicate from the same rank does not count twice
    assert led.take_finished() == set()
    led.on_notif("b", done("r1", 1, 2))
    assert led.take_finished() == {"r1"}
    assert m.freed == {"notified": 3}
    assert led.num_held == 0


def test_lease_expiry_frees_and_counts():
    clock, m = Clock(), Metrics()
    led = ProducerLedger(30.0, clock, m)
    led.hold("r1", [4, 5])
    clock.t += 29.9
    assert led.take_finished() == set()
    clock.t += 0.2
    assert led.take_finished() == {"r1"}
    assert m.expired == 1 and m.freed == {"lease_expired": 2}
    assert led.counters.expired == 1


def test_heartbeat_renews_lease():
    clock, m = Clock(), Metrics()
    led = ProducerLedger(30.0, clock, m)
    led.hold("r1", [1])
    clock.t += 25
    hb = notify.encode("heartbeat", "r1", expected=1, sender_engine="D", sender_rank=0)
    led.on_notif("a", hb)
    clock.t += 25
    assert led.take_finished() == set()
    clock.t += 6
    assert led.take_finished() == {"r1"}


def test_expiry_is_the_lease_end_renewed_by_heartbeats():
    clock = Clock()
    led = ProducerLedger(30.0, clock)
    led.hold("r1", [1])
    assert led.expiry("r1") == 130.0
    clock.t += 10
    hb = notify.encode("heartbeat", "r1", expected=1, sender_engine="D", sender_rank=0)
    led.on_notif("a", hb)
    assert led.expiry("r1") == 140.0
    assert led.expiry("unknown") is None
    clock.t += 30
    led.take_finished()
    assert led.expiry("r1") is None


def test_notification_before_hold_is_kept():
    led = ProducerLedger(30.0, Clock())
    led.on_notif("a", done("r1", 0, 1))
    assert led.hold("r1", [1]) == 130.0  # every reader was done already: finished at once
    assert led.num_held == 0
    assert led.take_finished() == {"r1"}


def test_malformed_and_late_notifications_are_counted_not_raised():
    clock, m = Clock(), Metrics()
    led = ProducerLedger(30.0, clock, m)
    led.on_notif("a", b"\x00garbage")
    led.on_notif("a", b"")
    led.hold("r1", [1])
    led.on_notif("a", done("r1", 0, 1))
    assert led.take_finished() == {"r1"}
    led.on_notif("a", done("r1", 0, 1))  # late duplicate after release
    assert led.counters.malformed_notifs == 2
    assert led.counters.unknown_notifs == 1
    assert ("D", "expired_request") in m.failed
    # a notification for a request never held ages out as unknown
    led.on_notif("a", done("ghost", 0, 1))
    clock.t += 31
    led.take_finished()
    assert led.counters.unknown_notifs == 2


@pytest.mark.parametrize("freed_by", ["notified", "lease_expired"])
def test_a_heartbeat_after_the_release_fails_only_when_the_lease_ended(freed_by: str) -> None:
    """Once every reader said done, a heartbeat is one sent before (NIXL may hand over a
    retired agent's after its successor's "done"): no failure. After the lease it was too
    late: `expired_request`."""
    clock, m = Clock(), Metrics()
    led = ProducerLedger(30.0, clock, m)
    led.hold("r1", [1])
    if freed_by == "notified":
        led.on_notif("b", done("r1", 0, 1))
    else:
        clock.t += 31
    assert led.take_finished() == {"r1"}
    beat = notify.encode("heartbeat", "r1", expected=1, sender_engine="D", sender_rank=0)
    led.on_notif("a", beat)
    late = freed_by == "lease_expired"
    assert (led.counters.unknown_notifs, m.failed) == (
        (1, [("unknown", "expired_request")]) if late else (0, [])
    )


def _nested(message: bytes, depth: int) -> bytes:
    """`message` (a msgpack fixarray) with one more element: arrays nested `depth` deep."""
    return bytes([message[0] + 1]) + message[1:] + b"\x91" * depth + b"\xc0"


def test_failed_notifications_name_only_engines_that_read_from_this_producer():
    """A sender names its own engine: made-up names must not use up the metrics' bounded
    `remote_engine` values, so only an engine that notified about a held request is named."""
    clock, m = Clock(), Metrics()
    led = ProducerLedger(30.0, clock, m)
    led.hold("r1", [1])
    led.on_notif("a", done("r1", 0, 1))  # from D, a real reader
    led.take_finished()
    led.on_notif("a", done("r1", 0, 1))  # late: D is named
    forged = notify.encode("done", "r1", expected=1, sender_engine="made-up", sender_rank=0)
    led.on_notif("b", forged)
    assert m.failed == [("D", "expired_request"), ("unknown", "expired_request")]


def test_notify_decode_rejects_foreign_bytes():
    assert notify.decode(b"req-1:2") is None
    assert notify.decode(b"\x92\x01") is None
    # a peer's trailing field nested past the decoder's depth limit, in a few bytes
    assert notify.decode(_nested(done("x", 3, 2), 3000)) is None
    assert notify.decode(_nested(done("x", 3, 2), 10)) is not None  # later fields are skipped
    n = notify.decode(done("x", 3, 2))
    assert n is not None and n.sender_rank == 3 and n.expected == 2


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 4000))
def test_any_bytes_after_our_prefix_decode_or_are_none(tail: bytes, depth: int) -> None:
    data = done("x", 0, 1)[:8] + b"\x91" * depth + tail
    assert notify.decode(data) is None or isinstance(notify.decode(data), notify.Notif)


def _step_allocation(past: int, held: int = 0, unknown: int = 0) -> int:
    """Peak bytes one `take_finished` allocates with `past` requests finished (and still
    remembered, inside their lease) before it, `held` requests held and notifications for
    `unknown` request ids never held, none of them due."""
    clock = Clock()
    led = ProducerLedger(30.0, clock)
    for i in range(past):
        led.hold(f"old{i}", [1])
        led.on_notif("a", done(f"old{i}", 0, 1))
    for i in range(held):
        led.hold(f"held{i}", [1])
    for i in range(unknown):
        led.on_notif("a", done(f"ghost{i}", 0, 1))
    assert len(led.take_finished()) == past
    clock.t += 1.0
    led.hold("new", [2])
    led.on_notif("a", done("new", 0, 1))
    tracemalloc.start()
    try:
        assert led.take_finished() == {"new"}
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


def test_step_cost_does_not_grow_with_past_requests():
    """A step touches only what is new or expiring, not every request that finished
    earlier (a copy of that table would allocate tens of bytes per past request)."""
    few, many = _step_allocation(10), _step_allocation(100_000)
    assert many < few + 4096, (few, many)


def test_step_cost_does_not_grow_with_requests_held_or_unknown_ids():
    """Leases and unknown-request entries are checked in the order they fall due: a step
    with many held requests and unknown ids, none due, walks none of them."""
    few, many = _step_allocation(1, 10, 10), _step_allocation(1, 50_000, 50_000)
    assert many < few + 4096, (few, many)


def test_expiry_order_survives_heartbeats_and_a_request_held_again():
    clock = Clock()
    led = ProducerLedger(30.0, clock)
    hb = notify.encode("heartbeat", "r1", expected=1, sender_engine="D", sender_rank=0)
    led.hold("r1", [1])
    led.hold("r2", [2])
    clock.t += 20
    led.on_notif("a", hb)  # r1 now due at 150, r2 still at 130
    clock.t += 11
    assert led.take_finished() == {"r2"}
    led.hold("r2", [2])  # held again: due at 161, the old entry must not free it early
    clock.t += 15
    assert led.take_finished() == set()
    clock.t += 5
    assert led.take_finished() == {"r1"}
    clock.t += 10
    assert led.take_finished() == {"r2"}
    assert led.counters.expired == 3


def test_notifications_for_unknown_requests_are_bounded_and_age_out(monkeypatch):
    """A peer naming ever new request ids cannot grow the producer's memory: past the cap
    they are counted as unknown at once; each remembered one ages out one lease after it
    was last heard of (a heartbeat renews it), and a hold still finds one in time."""
    monkeypatch.setattr(transfer, "MAX_EARLY", 4)
    clock, m = Clock(), Metrics()
    led = ProducerLedger(30.0, clock, m)
    for i in range(6):
        led.on_notif("a", done(f"ghost{i}", 0, 1))
    assert len(led.early) == 4
    assert led.counters.unknown_notifs == 2
    assert m.failed == [("unknown", "unknown_request")] * 2  # D never read a held request
    clock.t += 20
    hb = notify.encode("heartbeat", "ghost0", expected=1, sender_engine="D", sender_rank=0)
    led.on_notif("a", hb)
    clock.t += 11
    led.take_finished()
    assert set(led.early) == {"ghost0"}  # the others were last heard of 31 s ago
    led.hold("ghost0", [7])  # its done notification came before the hold
    assert led.take_finished() == {"ghost0"}
    assert led.counters.unknown_notifs == 5


def test_finished_requests_are_forgotten_after_one_lease():
    clock = Clock()
    led = ProducerLedger(30.0, clock)
    for rid in ("a", "b"):
        led.hold(rid, [1])
        led.on_notif("x", done(rid, 0, 1))
        clock.t += 10
    assert led.take_finished() == {"a", "b"}
    clock.t += 15  # a finished 35 s ago, b 25 s ago
    led.take_finished()
    assert set(led.finished) == {"b"}
    led.hold("b", [1])  # the same id held and finished again: kept for a new lease
    led.on_notif("x", done("b", 0, 1))
    clock.t += 10
    led.take_finished()
    assert set(led.finished) == {"b"}
    clock.t += 25
    led.take_finished()
    assert set(led.finished) == set()


def test_an_unknown_request_falls_due_exactly_once_whatever_the_lease():
    """Leases that are not exact in binary (0.1 s) make `first_seen + lease` and
    `now - first_seen < lease` disagree at the due instant: the step still ends, and the
    entry goes."""
    clock = Clock()
    clock.t = 695173.7745028748
    led = ProducerLedger(0.1, clock)
    led.on_notif("a", done("ghost", 0, 1))
    clock.t += 0.1
    led.take_finished()
    assert led.early == {}
