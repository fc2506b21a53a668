"""A stage sender's offer retries and a stage receiver's deadline, between two real NIXL agents
in this process. A real link loses a notification only by chance, so the sender's backend is
the real one behind a wrapper that fails its first `send_notif` calls on purpose."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from kvrdma.defaults import ucx_num_threads
from kvrdma.errors import ConfigError, TransferError
from kvrdma.lease import EXPIRY_SAFETY_SECONDS
from kvrdma.nixl import BackendConfig, NixlBackend
from kvrdma.stages import (
    StageEndpoint,
    StageMapping,
    StageMetrics,
    StageReceiver,
    StageSender,
    endpoint,
    payload,
    receiver,
)
from kvrdma.stages.endpoint import Done, Offer, encode

pytestmark = pytest.mark.timeout(120)

_names = itertools.count()


class FlakyNotifs:
    """A real backend whose first `failures` notifications fail as a broken link's would."""

    def __init__(self, inner: Any, failures: int) -> None:
        self.inner, self.failures, self.calls = inner, failures, 0

    def send_notif(self, agent_name: str, message: bytes) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise TransferError(f"send_notif to {agent_name!r}: injected failure {self.calls}")
        self.inner.send_notif(agent_name, message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class Pair:
    tx_ep: StageEndpoint
    rx_ep: StageEndpoint
    tx: StageSender
    rx: StageReceiver
    flaky: FlakyNotifs
    registry: CollectorRegistry
    lock: threading.Lock

    def sent(self, outcome: str) -> float | None:
        labels = {"pipeline": "t", "stage": "thinker", "peer_stage": "talker", "tp_rank": "0"}
        return self.registry.get_sample_value(
            "kvrdma_stage_transfers_total", {**labels, "direction": "send", "outcome": outcome}
        )

    def offered(self) -> float | None:
        labels = {"pipeline": "t", "stage": "thinker", "peer_stage": "talker", "tp_rank": "0"}
        return self.registry.get_sample_value("kvrdma_stage_offered_shards", labels)


def _backend(role: str) -> NixlBackend:
    name = f"retries-{role}-{os.getpid()}-{next(_names)}"
    return NixlBackend(BackendConfig(name=name, num_threads=ucx_num_threads()))


@pytest.fixture
def pair() -> Iterator[Pair]:
    """A sending and a receiving stage rank with default settings; a thread steps the sender
    as a sending stage's loop would (its peers' READs and its Done notifications need it)."""
    flaky = FlakyNotifs(_backend("tx"), failures=0)
    registry = CollectorRegistry()
    metrics = StageMetrics(registry=registry)
    tx_ep = StageEndpoint(pipeline="t", stage="thinker", rank=0, size=1, backend=flaky)  # type: ignore[arg-type]
    rx_ep = StageEndpoint(pipeline="t", stage="talker", rank=0, size=1, backend=_backend("rx"))
    tx = StageSender(tx_ep, StageMapping(1, 1), stage_index=0, metrics=metrics)
    rx = StageReceiver(rx_ep, StageMapping(1, 1), from_stage_index=0)
    tx.connect("talker", {0: ("127.0.0.1", rx_ep.port)})
    rx.connect("thinker", {0: ("127.0.0.1", tx_ep.port)})
    p = Pair(tx_ep, rx_ep, tx, rx, flaky, registry, threading.Lock())
    stop = threading.Event()

    def pump() -> None:
        while not stop.is_set():
            with p.lock:
                tx.step()
            time.sleep(0.001)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    yield p
    stop.set()
    thread.join(timeout=10)
    rx_ep.close()
    tx_ep.close()


def _kv(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, 16, 4, 32, generator=g).to(torch.bfloat16) for _ in range(2)]


def _send(p: Pair, request_id: str, layers: list[torch.Tensor]) -> list[str]:
    with p.lock:
        return p.tx.send(request_id, layers, block_ids=[1, 2, 3])


def _same(layers: list[torch.Tensor], got: Any) -> bool:
    return all(
        torch.equal(k, want[0]) and torch.equal(v, want[1])
        for (k, v), want in zip(got.layers, layers, strict=True)
    )


def test_a_transient_offer_failure_is_retried_and_the_shard_arrives(pair: Pair) -> None:
    pair.flaky.failures = 2  # the default 3 retries outlast it
    layers = _kv(1)
    assert _send(pair, "r1", layers) == ["r1_0_0_0_0"]
    assert pair.flaky.calls == 3
    got = pair.rx.receive("r1", timeout=10.0)
    assert _same(layers, got) and got.block_ids == [1, 2, 3]
    deadline = time.monotonic() + 10.0
    while pair.sent("success") != 1.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pair.sent("success") == 1.0 and pair.sent("failed") == 0.0


def test_exhausted_offer_retries_raise_and_free_the_slots(pair: Pair) -> None:
    pair.flaky.failures = 4  # one more than the 3 retries
    with pytest.raises(TransferError) as err:
        _send(pair, "r1", _kv(1))
    assert "'r1_0_0_0_0': offer to receiver rank 0 failed after 4 attempts" in str(err.value)
    assert "injected failure 4" in str(err.value)
    assert pair.flaky.calls == 4
    assert pair.tx.pending == 0 and bool(pair.tx_ep.slots.free.all())
    assert pair.sent("failed") == 1.0 and pair.offered() == 0.0
    # the key is not stuck: once the link heals the same shard is offered and read
    layers = _kv(2)
    _send(pair, "r1", layers)
    assert _same(layers, pair.rx.receive("r1", timeout=10.0))


def test_the_receive_timeout_defaults_to_30_seconds(pair: Pair) -> None:
    """Nobody sends; a clock that runs 1,000 times faster than time shows where the
    receiver gives up without the test waiting half a minute."""
    start = time.monotonic()
    pair.rx.clock = lambda: start + 1000 * (time.monotonic() - start)
    with pytest.raises(TransferError, match=r"sender rank\(s\) 0 \(no offer\) within 30 s"):
        pair.rx.receive("r1")
    assert 0.03 <= time.monotonic() - start < 5.0


def test_a_custom_receive_timeout_is_honoured(pair: Pair) -> None:
    t0 = time.monotonic()
    with pytest.raises(TransferError, match=r"within 0\.5 s"):
        pair.rx.receive("r1", timeout=0.5)
    assert 0.5 <= time.monotonic() - t0 < 3.0
    # a shard offered while the receiver waits arrives within the timeout
    layers = _kv(3)
    later = threading.Timer(0.3, _send, (pair, "r2", layers))
    t0 = time.monotonic()  # before the timer starts: the send comes at least 0.3 s after it
    later.start()
    try:
        assert _same(layers, pair.rx.receive("r2", timeout=10.0))
    finally:
        later.join(timeout=10)
    assert 0.3 <= time.monotonic() - t0 < 10.0


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), float("nan")])
def test_a_receive_timeout_must_be_a_positive_finite_number(pair: Pair, timeout: float) -> None:
    with pytest.raises(ConfigError, match="timeout: expected a positive number of seconds"):
        pair.rx.receive("r1", timeout=timeout)


@pytest.mark.parametrize(
    "settings",
    [
        {"lease": 0},
        {"lease": -1.0},
        {"lease": 0.5},
        {"lease": receiver.READ_ALLOWANCE_SECONDS + EXPIRY_SAFETY_SECONDS},
        {"lease": float("inf")},
        {"lease": float("nan")},
        {"lease": True},
        {"lease": "60"},
        {"lease": 2 * endpoint.MAX_EXPIRES_AT},
        {"lease": 10.0, "clock": lambda: endpoint.MAX_EXPIRES_AT - 5.0},
        {"retries": -1},
        {"retries": 1.5},
        {"retries": True},
        {"retries": 101},
        {"retries": 10**9},
    ],
    ids=lambda s: ",".join(f"{k}={v!r}" if k != "clock" else "late-clock" for k, v in s.items()),
)
def test_a_lease_or_retries_a_sender_cannot_keep_are_refused(pair: Pair, settings: dict) -> None:
    """An offer whose lease ends past what receivers accept would never be read and its
    slots never freed, nor would one too short to leave a receiver its READ allowance;
    negative retries would offer nothing."""
    field = next(iter(settings))
    with pytest.raises(ConfigError, match=f"{field}: expected"):
        StageSender(pair.tx_ep, StageMapping(1, 1), stage_index=0, **settings)
    StageSender(pair.tx_ep, StageMapping(1, 1), stage_index=0, lease=1e6, retries=0)


def test_a_payload_that_cannot_be_packed_is_refused_not_counted_as_failed(pair: Pair) -> None:
    """A block id msgpack cannot hold is the caller's error: no slot is kept, nothing counted."""
    with pytest.raises(ConfigError, match="block_ids or metadata cannot be packed"), pair.lock:
        pair.tx.send("r1", _kv(18), block_ids=[2**70])
    assert pair.tx_ep.slots.free.all() and not pair.sent("failed")


def test_a_notification_nested_too_deeply_costs_no_other_of_its_batch(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each side gets a notification no decoder can read at the head of every batch: it is
    logged and skipped, and the offer and the done that came with it are still taken."""
    junk = msgspec.Raw(b"\x91" * 10_000 + b"\xc0")  # [[[...]]], 10 KB
    nested = endpoint.NOTIF_PREFIX + msgspec.msgpack.encode(
        {"type": "done", "key": "r1", "x": junk}
    )

    def after_nested(get_notifs: Any) -> Any:
        return lambda: {agent: [nested, *raws] for agent, raws in get_notifs().items()}

    monkeypatch.setattr(
        pair.rx_ep.backend, "get_notifs", after_nested(pair.rx_ep.backend.get_notifs)
    )
    monkeypatch.setattr(pair.flaky, "get_notifs", after_nested(pair.flaky.inner.get_notifs))
    layers = _kv(19)
    _send(pair, "r1", layers)
    assert _same(layers, pair.rx.receive("r1", timeout=10.0))
    deadline = time.monotonic() + 10.0
    while pair.sent("success") != 1.0:
        assert time.monotonic() < deadline, "the sender never took the receiver's done"
        time.sleep(0.01)
    refused = " ".join(r.getMessage() for r in caplog.records if "too deeply" in r.getMessage())
    assert pair.rx_ep.backend.agent_name in refused  # by the sender
    assert pair.tx_ep.backend.agent_name in refused  # by the receiver


def _offered(p: Pair, *keys: str) -> None:
    """Step the receiver until it holds the sender's offers of `keys`."""
    deadline = time.monotonic() + 10.0
    while not all((k, p.tx_ep.backend.agent_name) in p.rx.offers for k in keys):
        assert time.monotonic() < deadline, f"offers {keys} never arrived: {list(p.rx.offers)}"
        p.rx.step()


def test_an_offer_too_near_its_lease_end_is_not_read(pair: Pair) -> None:
    """The sender reuses a shard's slots when its lease ends (its clock, converted with the
    offset the handshake measured): a receiver starts a READ only while that leaves the
    READ its allowance, and drops the offer otherwise."""
    _send(pair, "r1", _kv(4))
    _offered(pair, "r1_0_0_0_0")
    start = time.monotonic()
    late = pair.tx.lease - receiver.READ_ALLOWANCE_SECONDS
    pair.rx.clock = lambda: time.monotonic() + late
    # the error says why, not that the sender never offered
    with pytest.raises(TransferError, match=r"0 \(offered too near its lease end to be read\)"):
        pair.rx.receive("r1", timeout=1.0)
    assert not pair.rx.offers
    assert time.monotonic() - start < 5.0


def test_a_read_that_ends_after_the_senders_lease_is_not_delivered(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes READ after the sender may have reused its slots could be another shard's: the
    receive fails instead of handing them over (the receiver's clock jumps past the lease
    right after the READ is posted)."""
    shift = [0.0]
    post = pair.rx_ep.backend.post

    def post_then_jump(*args: Any) -> Any:
        xfer = post(*args)
        shift[0] = pair.tx.lease
        return xfer

    monkeypatch.setattr(pair.rx_ep.backend, "post", post_then_jump)
    pair.rx.clock = lambda: time.monotonic() + shift[0]
    _send(pair, "r1", _kv(4))
    with pytest.raises(TransferError, match="ended after the sender's lease"):
        pair.rx.receive("r1", timeout=10 * pair.tx.lease)
    # the receiver tells the sender at once: its slots come back long before the lease ends
    deadline = time.monotonic() + 10.0
    while pair.tx.pending:
        assert time.monotonic() < deadline, "the sender never heard the READ failed"
        time.sleep(0.01)
    assert pair.sent("given_up") == 1.0 and pair.sent("expired") == 0.0


def test_slots_holding_another_shard_fail_the_receive(pair: Pair) -> None:
    """An offer naming slots that hold another shard (as after the sender reused them): the
    payload says which shard it is, and the receive fails instead of delivering it."""
    _send(pair, "a", _kv(5))
    held = pair.tx.held["a_0_0_0_0"]
    forged = Offer("b_0_0_0_0", held.slot, held.slots, held.nbytes, time.monotonic() + 60.0)
    pair.tx_ep.backend.send_notif(pair.rx_ep.backend.agent_name, encode(forged))
    with pytest.raises(TransferError, match="its slots hold shard 'a_0_0_0_0'"):
        pair.rx.receive("b", timeout=10.0)


def test_slots_holding_no_shard_fail_the_receive_naming_the_shard_and_sender(pair: Pair) -> None:
    """An offer naming slots that hold no payload (never packed, or being packed anew): the
    receive fails with a `TransferError` naming the shard and its sender rank."""
    free = int(np.flatnonzero(pair.tx_ep.slots.free)[0])  # a slab slot nothing was packed in
    forged = Offer("b_0_0_0_0", free, 1, 4096, time.monotonic() + 60.0)
    pair.tx_ep.backend.send_notif(pair.rx_ep.backend.agent_name, encode(forged))
    with pytest.raises(TransferError, match=r"shard 'b_0_0_0_0' from sender rank 0: .*magic"):
        pair.rx.receive("b", timeout=10.0)
    assert bool(pair.rx_ep.slots.free.all())


def test_offers_nobody_receives_are_capped_oldest_first(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offers wait for receives to come, at most `MAX_OFFERS`: the oldest is given back to
    its sender (which frees its slots) and the newest are still received."""
    monkeypatch.setattr(receiver, "MAX_OFFERS", 2)
    for rid in ("r1", "r2", "r3"):
        _send(pair, rid, _kv(6))
    _offered(pair, "r2_0_0_0_0", "r3_0_0_0_0")
    assert [key for key, _ in pair.rx.offers] == ["r2_0_0_0_0", "r3_0_0_0_0"]
    deadline = time.monotonic() + 10.0
    while pair.tx.pending > 2:  # r1's slots are free again
        assert time.monotonic() < deadline, "the sender never heard r1 was given back"
        time.sleep(0.01)
    assert _same(_kv(6), pair.rx.receive("r3", timeout=10.0))


def test_an_offer_from_another_agent_does_not_displace_the_senders(pair: Pair) -> None:
    """Offers are kept per sending agent: one under the same key from an agent this rank
    does not receive from is never read, and the expected sender's is."""
    layers = _kv(7)
    _send(pair, "r1", layers)
    _offered(pair, "r1_0_0_0_0")
    real = pair.rx.offers[("r1_0_0_0_0", pair.tx_ep.backend.agent_name)][0]
    pair.rx._keep("someone-else", real)  # as if another agent had offered the same key
    assert _same(layers, pair.rx.receive("r1", timeout=10.0))
    assert list(pair.rx.offers) == [("r1_0_0_0_0", "someone-else")]


def test_reads_reported_while_an_offer_is_retried_reach_the_next_step(pair: Pair) -> None:
    """A retried offer takes the notifications that came meanwhile: a Done among them still
    frees its shard and is returned by the sender's next `step`."""
    with pair.lock:  # the sender's loop waits
        keys = pair.tx.send("r1", _kv(8), block_ids=[1])
        done = {pair.rx_ep.backend.agent_name: [encode(Done(keys[0]))]}
        pair.flaky.get_notifs = lambda: done.copy()  # type: ignore[attr-defined]
        pair.flaky.failures = pair.flaky.calls + 1  # the next offer's first try fails
        pair.tx.send("r2", _kv(9), block_ids=[1])
        del pair.flaky.get_notifs  # type: ignore[attr-defined]
        assert list(pair.tx.held) == ["r2_0_0_0_0"]
        assert pair.tx.step() == set(keys)
        assert pair.sent("success") == 1.0


def test_a_pack_that_fails_gives_its_slots_back(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Any, out: torch.Tensor, **_: Any) -> int:
        raise RuntimeError("device lost")

    monkeypatch.setattr(payload.PackPlan, "into", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        _send(pair, "r1", _kv(10))
    assert pair.tx_ep.slots.free.all() and not pair.tx.held


def test_a_shard_key_too_long_for_a_notification_is_refused(pair: Pair) -> None:
    with pytest.raises(ConfigError, match="shard key: at most"):
        _send(pair, "r" * endpoint.MAX_KEY_CHARS, _kv(11))
    assert pair.tx_ep.slots.free.all()


def test_companion_names_must_be_distinct(pair: Pair) -> None:
    with pytest.raises(ConfigError, match="companions: expected distinct names"):
        pair.rx.receive_with_companions("r1", ["cfg", "cfg"], timeout=1.0)


def test_a_peer_with_slots_of_another_size_is_refused_at_connect(pair: Pair) -> None:
    """A READ pairs a sender's slots with landing slots of the same length: a mismatch is a
    configuration error named at connect, not a refused READ per request."""
    other = StageEndpoint(
        pipeline="t", stage="talker", rank=0, size=1, slot_bytes=1 << 16, backend=_backend("rx2")
    )
    try:
        with pytest.raises(ConfigError, match=r"slot_bytes: t/thinker rank 0 .* 1048576 bytes"):
            other.connect("thinker", 0, "127.0.0.1", pair.tx_ep.port)
    finally:
        other.close()


def test_a_key_builder_naming_two_receivers_alike_is_refused_before_packing(pair: Pair) -> None:
    ranks = [
        StageEndpoint(pipeline="t", stage="talker2", rank=r, size=2, backend=_backend(f"k{r}"))
        for r in (0, 1)
    ]
    try:
        tx = StageSender(
            pair.tx_ep, StageMapping(1, 2), stage_index=0, key_builder=lambda k: k.request_id
        )
        tx.connect("talker2", {r: ("127.0.0.1", ep.port) for r, ep in enumerate(ranks)})
        free = int(pair.tx_ep.slots.free.sum())
        with pair.lock, pytest.raises(ConfigError, match="key_builder: gave 'r' to two"):
            tx.send("r", _kv(1), block_ids=[1, 2, 3])
        assert not tx.held and int(pair.tx_ep.slots.free.sum()) == free
    finally:
        for ep in ranks:
            ep.close()


def test_stages_whose_mappings_disagree_are_refused_at_connect(pair: Pair) -> None:
    """A receiver mapping 1 -> 1 against a sender of 1 -> 2 would take half of the heads
    as a whole layer: each side checks the other's size against its own mapping."""
    talker = StageEndpoint(pipeline="t", stage="talker", rank=0, size=2, backend=_backend("r2"))
    try:
        tx = StageSender(pair.tx_ep, StageMapping(1, 2), stage_index=0)
        with pytest.raises(ConfigError, match=r"mapping: t/talker rank 0 .* one of 1 ranks, .*2"):
            tx.connect("talker", {0: ("127.0.0.1", pair.rx_ep.port), 1: ("127.0.0.1", 1)})
        rx = StageReceiver(talker, StageMapping(2, 2), from_stage_index=0)
        with pytest.raises(ConfigError, match=r"mapping: t/thinker rank 0 .* one of 1 ranks"):
            rx.connect("thinker", {0: ("127.0.0.1", pair.tx_ep.port)})
        assert not tx.receivers and not rx.senders
    finally:
        talker.close()


def test_a_shard_offered_after_its_receive_gave_up_waits_a_while_for_a_retry(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its receive gave up before the offer came: a retry's receive still gets it, even one
    asking after the grace has passed (nothing stepped the receiver meanwhile); unasked, the
    sender is told to free it once the grace is over."""
    monkeypatch.setattr(receiver, "GIVEN_UP_GRACE_SECONDS", 0.2)
    for rid in ("r1", "r2"):
        with pytest.raises(TransferError, match=r"0 \(no offer\)"):
            pair.rx.receive(rid, timeout=0.3)
    layers = _kv(12)
    _offered(pair, *_send(pair, "r1", layers), *_send(pair, "r2", _kv(13)))
    time.sleep(0.3)
    assert _same(layers, pair.rx.receive("r1", timeout=10.0))
    deadline = time.monotonic() + 10.0
    while pair.tx.pending:  # r1 read, r2 refused
        assert time.monotonic() < deadline, "the sender never heard r2 was given up"
        pair.rx.step()
        time.sleep(0.01)
    assert pair.sent("given_up") == 1.0 and pair.sent("success") == 1.0


def _sender_hears(p: Pair) -> None:
    deadline = time.monotonic() + 10.0
    while p.tx.pending:
        assert time.monotonic() < deadline, "the sender never heard its shard was not taken"
        time.sleep(0.01)


def test_a_read_that_cannot_be_posted_frees_the_senders_shard_at_once(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender is told (it frees the shard before its lease ends), the landing slots are
    given back, and a retry of the request gets the shard offered again."""

    def refused(*args: Any) -> Any:
        raise TransferError("READ refused")

    with monkeypatch.context() as m:
        m.setattr(pair.rx_ep.backend, "post", refused)
        _send(pair, "r1", _kv(14))
        with pytest.raises(TransferError, match="READ refused"):
            pair.rx.receive("r1", timeout=10.0)
    _sender_hears(pair)
    assert pair.sent("given_up") == 1.0 and bool(pair.rx_ep.slots.free.all())
    layers = _kv(15)
    _send(pair, "r1", layers)
    assert _same(layers, pair.rx.receive("r1", timeout=10.0))


def test_a_late_done_for_an_earlier_offer_of_a_key_does_not_free_the_offer_made_since(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receiver's Done for a shard (its READ could not be posted) reaches the sender only
    after that offer's lease ended and the shard was sent again under its key: the sender keeps
    the new offer's slots, so another shard is not packed where the receiver READs it."""

    def refused(*args: Any) -> Any:
        raise TransferError("READ refused")

    late: list[bytes] = []
    with monkeypatch.context() as m:
        m.setattr(pair.rx_ep.backend, "post", refused)
        m.setattr(pair.rx_ep.backend, "send_notif", lambda agent, raw: late.append(raw))
        (key,) = _send(pair, "r1", _kv(20))
        with pytest.raises(TransferError, match="READ refused"):
            pair.rx.receive("r1", timeout=10.0)
    assert len(late) == 1  # the Done, held back
    layers = _kv(21)
    with pair.lock:  # the first offer's lease ends unheard; the request is sent again
        pair.tx.clock = lambda: time.monotonic() + pair.tx.lease + 1.0
        pair.tx.step()
        assert pair.tx.send("r1", layers, block_ids=[1, 2, 3]) == [key]
    _offered(pair, key)
    heard, take = threading.Event(), pair.flaky.get_notifs

    def taking() -> Any:
        got = take()
        if got:
            heard.set()
        return got

    monkeypatch.setattr(pair.flaky, "get_notifs", taking)
    pair.rx_ep.backend.send_notif(pair.tx_ep.backend.agent_name, late[0])
    assert heard.wait(10.0), "the sender never took the late Done"
    with pair.lock:  # the step that took it is over
        pass
    _send(pair, "r2", _kv(22))  # packed where the sender's slab is free
    assert _same(layers, pair.rx.receive("r1", timeout=10.0))
    assert pair.sent("expired") == 1.0 and pair.sent("given_up") == 0.0


def test_an_unpack_that_fails_frees_the_senders_shard_at_once(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any error after the READ (here memory running out while unpacking) tells the sender."""

    def no_memory(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("no memory for the payload")

    monkeypatch.setattr(receiver, "unpack_tensor", no_memory)
    _send(pair, "r1", _kv(16))
    with pytest.raises(MemoryError):
        pair.rx.receive("r1", timeout=10.0)
    _sender_hears(pair)
    assert pair.sent("given_up") == 1.0 and bool(pair.rx_ep.slots.free.all())


def test_an_offer_dropped_at_its_lease_takes_its_given_up_mark_along(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A late offer for a given-up request is dropped at its lease end before the grace is
    over; an offer sent under that key afterwards is a new one, which the grace's end does not
    refuse (its receive, asking after that, gets it)."""
    monkeypatch.setattr(receiver, "GIVEN_UP_GRACE_SECONDS", pair.tx.lease + 10.0)
    with pytest.raises(TransferError, match=r"0 \(no offer\)"):
        pair.rx.receive("r1", timeout=0.2)
    layers = _kv(17)
    (key,) = _send(pair, "r1", layers)
    _offered(pair, key)
    shift = [pair.tx.lease + 1.0]  # past the offer's lease, not the grace
    pair.rx.clock = lambda: time.monotonic() + shift[0]
    pair.rx.step()
    assert not pair.rx.offers and not pair.rx._doubtful
    held = pair.tx.held[key]  # the sender offers the shard again, as new
    lease_end = time.monotonic() + 2 * pair.tx.lease  # past the clock shifts below
    again = Offer(key, held.slot, held.slots, held.nbytes, lease_end)
    pair.tx_ep.backend.send_notif(pair.rx_ep.backend.agent_name, encode(again))
    pair.rx.clock = time.monotonic
    _offered(pair, key)
    shift[0] = pair.tx.lease + 12.0  # past the first offer's grace, not the new one's lease
    pair.rx.clock = lambda: time.monotonic() + shift[0]
    pair.rx.step()
    assert _same(layers, pair.rx.receive("r1", timeout=10.0))


def test_an_offer_that_fails_for_a_later_receiver_names_the_shards_already_offered() -> None:
    """One sender, four receivers: the offer to rank 0 goes out, every attempt to rank 1
    fails; the error names the shard rank 0 still gets, and the slots packed for ranks 1 to 3
    are free again (ranks 2 and 3 are not offered)."""
    flaky = FlakyNotifs(_backend("tx"), failures=0)
    real_send = flaky.send_notif

    def first_only(agent_name: str, message: bytes) -> None:
        if flaky.calls >= 1:
            flaky.calls += 1
            raise TransferError(f"send_notif to {agent_name!r}: injected failure {flaky.calls}")
        real_send(agent_name, message)

    flaky.send_notif = first_only  # type: ignore[method-assign]
    tx_ep = StageEndpoint(pipeline="t", stage="thinker", rank=0, size=1, backend=flaky)  # type: ignore[arg-type]
    rx_eps = [
        StageEndpoint(pipeline="t", stage="talker", rank=r, size=4, backend=_backend(f"rx{r}"))
        for r in range(4)
    ]
    try:
        tx = StageSender(tx_ep, StageMapping(1, 4), stage_index=0)
        rxs = [StageReceiver(ep, StageMapping(1, 4), from_stage_index=0) for ep in rx_eps]
        tx.connect("talker", {r: ("127.0.0.1", ep.port) for r, ep in enumerate(rx_eps)})
        for rx in rxs:
            rx.connect("thinker", {0: ("127.0.0.1", tx_ep.port)})
        with pytest.raises(TransferError) as err:
            tx.send("r1", _kv(1))
        assert "'r1_0_0_0_1': offer to receiver rank 1 failed after 4 attempts" in str(err.value)
        assert "shards ['r1_0_0_0_0'] were offered before it" in str(err.value)
        assert tx.pending == 1  # rank 0's shard, until read
        held = tx.held["r1_0_0_0_0"]
        assert int((~tx_ep.slots.free).sum()) == held.slots  # ranks 1 to 3's given back
        stop = threading.Event()

        def pump() -> None:
            while not stop.is_set():
                tx.step()
                time.sleep(0.001)

        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        try:
            got = rxs[0].receive("r1", timeout=10.0)
        finally:
            stop.set()
            thread.join(timeout=10)
        assert got.request_id == "r1"
    finally:
        for ep in (*rx_eps, tx_ep):
            ep.close()


def test_receive_blocks_refuses_a_shard_that_is_not_all_the_caches_heads(pair: Pair) -> None:
    """A shard of fewer heads than the receiver's cache (or not a layer's KV at all) would
    leave the rest of the blocks holding another request's values: it is refused, naming the
    shard and its sender, and nothing is written."""
    _send(pair, "r1", _kv(1))  # 4 heads
    with pair.lock:
        pair.tx.send("r2", [(torch.ones(8), torch.ones(8))], block_ids=[1])
    caches = [torch.zeros(2, 5, 16, 8, 32, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(TransferError, match=r"shard 'r1_0_0_0_0' of sender 0: layer 0 .* 8 heads"):
        pair.rx.receive_blocks("r1", caches, [0, 1, 2], timeout=10.0)
    with pytest.raises(TransferError, match=r"shard 'r2_0_0_0_0' of sender 0: layer 0 .*\(8,\)"):
        pair.rx.receive_blocks("r2", caches[:1], [0], timeout=10.0)
    assert not any(c.any() for c in caches)


def test_a_sender_restarted_out_of_reach_fails_the_receive_by_its_deadline(pair: Pair) -> None:
    """An offer naming a new process of the sender makes the receiver ask the sender's
    address again; nobody answers there, and the receive still fails by its own deadline,
    not the endpoint's longer handshake timeout."""
    pair.tx_ep.server.close()  # the address serves nothing now
    with pair.lock:
        new = Offer("r1_0_0_0_0", 0, 1, 4096, time.monotonic() + 60.0, "f" * 64, 1)
        pair.tx_ep.backend.send_notif(pair.rx_ep.backend.agent_name, encode(new))
    t0 = time.monotonic()
    with pytest.raises(
        TransferError, match=r"from a new process at .*, which could not be connected"
    ):
        pair.rx.receive("r1", timeout=1.0)
    assert time.monotonic() - t0 < 3.0  # the handshake timeout is 5 s
