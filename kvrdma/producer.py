"""The producer side of a worker: holds a finished request's blocks until every reader is done
(pull), and writes requests into the decoders that expect them (push, `kvrdma.push`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from kvrdma import notify
from kvrdma.push import wire
from kvrdma.push.sender import Pusher
from kvrdma.state import WorkerState
from kvrdma.transfer import ProducerLedger


class ProducerSide:
    """Holds a finished request's blocks until every reader notified, or the lease ends, and
    pushes requests to decoders."""

    def __init__(self, shared: WorkerState) -> None:
        self.s = shared
        self.ledger = ProducerLedger(
            shared.config.extra.kv_lease_duration, shared.clock, shared.metrics
        )
        self.pusher = Pusher(shared)

    def hold(self, request_id: str, block_ids: Collection[int]) -> float:
        """The request's prefill is done: keep its blocks for readers (stage to host first);
        returns when the lease ends (see `Worker.hold`).

        With host staging, call this before telling any reader about the request: the host
        copy is what they read."""
        ids = [int(b) for b in block_ids]
        self.stage(ids)
        if self.s.checksums is not None:  # integrity mode: of the bytes readers will read
            self.s.checksums.update(ids)
        return self.ledger.hold(request_id, ids)

    def stage(self, block_ids: Collection[int]) -> None:
        """Host staging: copy these device blocks to the registered host blocks now."""
        if self.s.stager is not None:
            self.s.stager.stage_out([int(b) for b in block_ids])

    def on_notifs(self, notifs: Mapping[str, list[bytes]]) -> None:
        for agent, msgs in notifs.items():
            for m in msgs:
                n = notify.decode(m)
                if n is None:
                    self.ledger.malformed(agent, len(m))
                elif n.kind != "heartbeat" or not self.pusher.renew(n.request_id):
                    self.ledger.on_message(n)  # a heartbeat for a push renews that instead

    def on_push(self, message: wire.Expect | wire.Abort) -> None:
        self.pusher.on_message(message)

    def push(self, request_id: str, block_ids: Collection[int], *, layerwise: bool) -> None:
        """Write the request into the decoders that expect it (see `Worker.push`)."""
        ids = [int(b) for b in block_ids]
        if not layerwise:
            self.stage(ids)
        self.pusher.begin(request_id, ids, layerwise=layerwise)

    def take_finished(self) -> set[str]:
        done = self.ledger.take_finished()
        if not self.pusher.idle:
            done |= self.pusher.take_finished()
        return done

    @property
    def idle(self) -> bool:
        """Nothing held, no notification waiting for its hold, nothing to report."""
        led = self.ledger
        return not (led.held or led.early or led.has_unreported) and self.pusher.idle
