"""A middle stage that receives from the stage before it and sends to the one after it over
one endpoint (one NIXL agent and slab): its receiver takes the offers and its sender the
dones that arrive on that agent, neither eating the other's. Real NIXL agents in this
process, the default copy threads."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvrdma.stages import StageEndpoint, StageMapping, StageReceiver, StageSender

pytestmark = pytest.mark.timeout(120)

REQUESTS = 8


def _endpoint(stage: str) -> StageEndpoint:
    return StageEndpoint(pipeline="relay", stage=stage, rank=0, size=1, slot_bytes=1 << 16)


@contextlib.contextmanager
def _stepping(*senders: tuple[StageSender, threading.Lock]) -> Iterator[None]:
    """A thread per sender steps it holding its agent's lock, as a sending stage's loop
    would (an agent is driven from one thread at a time)."""
    stop = threading.Event()

    def pump(sender: StageSender, lock: threading.Lock) -> None:
        while not stop.is_set():
            with lock:
                sender.step()
            time.sleep(0.001)

    threads = [threading.Thread(target=pump, args=pair, daemon=True) for pair in senders]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)


def test_a_stage_that_receives_and_sends_over_one_endpoint_relays_every_request() -> None:
    first, middle, last = _endpoint("thinker"), _endpoint("talker"), _endpoint("coder")
    try:
        tx = StageSender(first, StageMapping(1, 1), stage_index=0)
        rx_mid = StageReceiver(middle, StageMapping(1, 1), from_stage_index=0)
        tx_mid = StageSender(middle, StageMapping(1, 1), stage_index=1)
        rx = StageReceiver(last, StageMapping(1, 1), from_stage_index=1)
        tx.connect("talker", {0: ("127.0.0.1", middle.port)})
        rx_mid.connect("thinker", {0: ("127.0.0.1", first.port)})
        tx_mid.connect("coder", {0: ("127.0.0.1", last.port)})
        rx.connect("talker", {0: ("127.0.0.1", middle.port)})
        first_lock, middle_lock = threading.Lock(), threading.Lock()
        g = torch.Generator().manual_seed(7)
        with _stepping((tx, first_lock), (tx_mid, middle_lock)):
            for i in range(REQUESTS):  # more shards than the middle slab holds at once
                kv = [torch.randn(4, 16, 8, 64, generator=g).to(torch.bfloat16) for _ in range(4)]
                layers = list(zip(kv[::2], kv[1::2], strict=True))
                with first_lock:
                    tx.send(f"r{i}", layers, block_ids=[0, 1, 2, 3])
                with middle_lock:  # its receiver and its sender share the agent
                    got = rx_mid.receive(f"r{i}", timeout=10.0)
                    tx_mid.send(f"r{i}", got.layers, block_ids=got.block_ids)
                out = rx.receive(f"r{i}", timeout=10.0)
                assert all(
                    torch.equal(a, b)
                    for want, have in zip(layers, out.layers, strict=True)
                    for a, b in zip(want, have, strict=True)
                )
            deadline = time.monotonic() + 10.0
            while (tx_mid.held or tx.held) and time.monotonic() < deadline:
                time.sleep(0.01)  # the dones free the senders' slots
            assert not tx_mid.held and not tx.held
    finally:
        for ep in (first, middle, last):
            ep.close()
