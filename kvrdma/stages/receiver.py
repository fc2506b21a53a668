"""The receiving side of a stage rank: `StageReceiver.receive` waits for the offers of every
sender rank it needs, READs them, and returns one merged payload — or raises a
`TransferError` naming the senders that did not deliver before the deadline. A READ still
in flight at the deadline retires the receiving agent, so its bytes can never land later.
Offers are kept for receives to come, at most `MAX_OFFERS`; one is read only from the
sender a receive expects it from and only while the sender's lease of its slots (converted
with the sender's clock offset from the handshake) leaves `READ_ALLOWANCE_SECONDS`. A READ
that ends after that lease, or whose slots hold another shard, fails the receive.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvrdma.errors import ConfigError, KvrdmaError, TransferError
from kvrdma.lease import read_cutoff
from kvrdma.nixl.protocol import Xfer, XferState
from kvrdma.stages.endpoint import Done, Offer, Peer, StageEndpoint, decode, encode
from kvrdma.stages.manager import Address, Clock
from kvrdma.stages.mapping import StageMapping
from kvrdma.stages.metrics import StageMetrics
from kvrdma.stages.naming import KeyBuilder, ShardKey, default_key
from kvrdma.stages.payload import StagePayload, unpack_tensor
from kvrdma.stages.shards import HeadSharder

logger = logging.getLogger(__name__)

# the pause between polls while waiting for offers (the copy threads need the CPU); a READ in
# flight is polled without a pause: it ends within a copy's time, and each pause delays it
_POLL_SECONDS = 0.0002
_SPIN_SECONDS = 0.001  # nor in a receive's first ms: an offer sent just before arrives in it
_FORGOTTEN = 1024  # keys a receiver remembers giving up, to refuse their late offers
MAX_OFFERS = 4096  # offers a receiver keeps for receives to come (the oldest go first)
# a READ starts only this long before the sender may reuse its slots (and one that ends after
# that is discarded); an offer from a sender whose clock is unknown is kept this long
READ_ALLOWANCE_SECONDS = 1.0
_UNKNOWN_SENDER_SECONDS = 60.0


@dataclass
class _Read:
    sender: int
    offer: Offer
    xfer: Xfer
    slot: int
    agent: str
    cutoff: float  # local time by which it must have ended (the sender may reuse the slots)


@dataclass
class _Wait:
    keys: dict[int, str]  # sender rank -> key
    reads: dict[int, _Read] = field(default_factory=dict)
    got: dict[int, StagePayload] = field(default_factory=dict)
    nbytes: int = 0  # packed bytes READ so far


class StageReceiver:
    """The receiving side of one rank of a stage."""

    def __init__(
        self,
        endpoint: StageEndpoint,
        mapping: StageMapping,
        *,
        from_stage_index: int,
        key_builder: KeyBuilder = default_key,
        sharder: HeadSharder | None = None,
        clock: Clock = time.monotonic,
        metrics: StageMetrics | None = None,
    ) -> None:
        if endpoint.size != mapping.receiver_size:
            raise ConfigError(
                f"endpoint of size {endpoint.size} cannot receive under a mapping to "
                f"{mapping.receiver_size} ranks"
            )
        self.endpoint, self.mapping = endpoint, mapping
        self.from_stage_index = from_stage_index
        self.key_builder = key_builder
        self.sharder = sharder or HeadSharder(mapping)
        self.clock = clock
        self.senders: dict[int, Peer] = {}
        # (key, sender agent) -> (offer, local time by which its READ must have ended), in
        # the order they came
        self.offers: OrderedDict[tuple[str, str], tuple[Offer, float]] = OrderedDict()
        self._given_up: OrderedDict[str, None] = OrderedDict()
        self.metrics = metrics
        self.peer_stage = ""

    def connect(self, stage: str, addresses: Mapping[int, Address]) -> None:
        """Connect to the sending stage's ranks this rank receives from."""
        ranks = self.mapping.sources(self.endpoint.rank)
        self.senders.update(self.endpoint.connect_ranks(stage, ranks, addresses))
        self.peer_stage = stage

    def receive(self, request_id: str, *, chunk: int = 0, timeout: float = 30.0) -> StagePayload:
        """This rank's KV of `request_id`, merged from its senders, within `timeout` s."""
        return self.receive_with_companions(request_id, (), chunk=chunk, timeout=timeout)[0]

    def receive_with_companions(
        self,
        request_id: str,
        companions: Sequence[str],
        *,
        chunk: int = 0,
        timeout: float = 30.0,
    ) -> tuple[StagePayload, dict[str, StagePayload]]:
        """`request_id`'s KV and its companion caches (e.g. the unconditioned branch of
        classifier-free guidance, sent as `companion_id(request_id, name)`), all within one
        `timeout`; a missing companion fails the whole receive."""
        if not timeout > 0 or timeout == float("inf"):
            raise ConfigError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        me = self.endpoint.rank
        ids = [request_id, *(companion_id(request_id, name) for name in companions)]
        waits = [
            _Wait(
                {
                    s: self.key_builder(ShardKey(rid, self.from_stage_index, chunk, s, me))
                    for s in self.mapping.sources(me)
                },
            )
            for rid in ids
        ]
        started = self.clock()
        deadline = started + timeout
        failure = "failed"
        try:
            while True:
                self._pump()
                for wait in waits:
                    self._start_reads(wait)
                    self._finish_reads(wait)
                if all(len(w.got) == len(w.keys) for w in waits):
                    break  # no sleep once everything is in: it would only delay the caller
                if self.clock() >= deadline:
                    failure = "timeout"
                    for wait in waits:
                        if len(wait.got) < len(wait.keys):
                            self._give_up(wait, timeout)
                busy = any(w.reads for w in waits) or self.clock() - started < _SPIN_SECONDS
                time.sleep(0 if busy else _POLL_SECONDS)
        except BaseException:
            for wait in waits:
                self._abandon(wait, "the receive failed")
                self._count(failure)  # none of the requests is delivered
            raise
        merged = [_merged(self.sharder, [w.got[s] for s in sorted(w.got)]) for w in waits]
        for wait in waits:
            self._count("success", wait.nbytes, self.clock() - started)
        return merged[0], dict(zip(companions, merged[1:], strict=True))

    def _count(self, outcome: str, nbytes: int = 0, seconds: float = 0.0) -> None:
        if self.metrics is not None:
            m, ep = self.metrics, self.endpoint
            m.transfer_of(ep, self.peer_stage, "receive", outcome, nbytes, seconds)

    def step(self) -> None:
        """Progress the agent between receives (call it from the stage's loop): offers are
        kept for the next `receive`, late ones for given-up requests are refused at once."""
        self._pump()

    def _pump(self) -> None:
        # offers are kept whoever sent them (a sender may offer before this rank connected
        # to it): `_start_reads` checks the sender, and the cap and leases bound them
        for agent, messages in self.endpoint.backend.get_notifs().items():
            for raw in messages:
                try:
                    msg = decode(raw, agent)
                except KvrdmaError as exc:
                    logger.warning("%s", exc)
                    continue
                if not isinstance(msg, Offer):
                    continue
                if msg.key in self._given_up:
                    self._say_done(agent, msg.key, ok=False, reason="the receiver gave up")
                else:
                    self._keep(agent, msg)
        now, offers = self.clock(), self.offers
        while offers and next(iter(offers.values()))[1] <= now:  # the oldest first
            (key, agent), _ = offers.popitem(last=False)
            logger.warning("offer of %r from %r outlived its lease unread: dropped", key, agent)

    def _keep(self, agent: str, offer: Offer) -> None:
        """Keep `offer` for a receive to come, until the sender may reuse its slots."""
        peer = next((p for p in self.senders.values() if p.agent == agent), None)
        if peer is not None and peer.offset is not None and offer.expires_at > 0:
            cutoff = read_cutoff(offer.expires_at, peer.offset)
        else:  # a sender not connected yet, or of another version: checked when read
            cutoff = self.clock() + _UNKNOWN_SENDER_SECONDS
        self.offers.pop((offer.key, agent), None)  # an offer sent again is as new
        self.offers[(offer.key, agent)] = (offer, cutoff)
        while len(self.offers) > MAX_OFFERS:
            (key, old), _ = self.offers.popitem(last=False)
            self._say_done(old, key, ok=False, reason="too many offers unread")

    def _start_reads(self, wait: _Wait) -> None:
        ep = self.endpoint
        for sender, key in wait.keys.items():
            peer = self.senders.get(sender)
            if sender in wait.reads or sender in wait.got or peer is None:
                continue
            kept = self.offers.get((key, peer.agent))
            if kept is None:
                continue
            offer, cutoff = kept
            if peer.offset is not None and offer.expires_at > 0:  # known now if not then
                cutoff = read_cutoff(offer.expires_at, peer.offset)
            if self.clock() >= cutoff - READ_ALLOWANCE_SECONDS:
                del self.offers[(key, peer.agent)]
                logger.warning("offer of %r too near its lease end to be read: dropped", key)
                continue
            if offer.slots > ep.num_slots or offer.slot + offer.slots > peer.num_slots:
                del self.offers[(key, peer.agent)]
                self._say_done(peer.agent, key, ok=False, reason="does not fit")
                raise TransferError(
                    f"shard {key!r} from sender rank {sender}: {offer.slots} slots at "
                    f"{offer.slot} do not fit (sender slab {peer.num_slots}, landing "
                    f"{ep.num_slots} slots)"
                )
            slot = ep.slots.take(offer.slots)
            if slot is None:
                continue  # landing room frees up as other reads finish
            del self.offers[(key, peer.agent)]
            ids = list(range(slot, slot + offer.slots))
            remote_ids = list(range(offer.slot, offer.slot + offer.slots))
            try:
                xfer = ep.backend.post("READ", ep.local, ids, peer.slab, remote_ids, b"")
            except TransferError:
                ep.slots.give(slot, offer.slots)
                raise
            wait.reads[sender] = _Read(sender, offer, xfer, slot, peer.agent, cutoff)

    def _finish_reads(self, wait: _Wait) -> None:
        ep = self.endpoint
        for sender, read in list(wait.reads.items()):
            result = ep.backend.poll(read.xfer)
            if result.state is XferState.PROC:
                continue
            read.xfer.release()
            del wait.reads[sender]
            start = read.slot * ep.slot_bytes
            key = read.offer.key
            try:
                if result.state is XferState.ERR:
                    raise TransferError(
                        f"shard {key!r}: READ from sender rank {sender} failed: {result.error}"
                    )
                if self.clock() >= read.cutoff:  # the sender may have reused the slots
                    raise TransferError(
                        f"shard {key!r}: READ from sender rank {sender} ended after the "
                        "sender's lease of it: its bytes may be another shard's"
                    )
                view = ep.slab[start : start + read.offer.nbytes]
                got = unpack_tensor(view, copy=True)
                if got.key != key:  # the slots hold another shard
                    raise TransferError(
                        f"shard {key!r} from sender rank {sender}: its slots hold shard {got.key!r}"
                    )
                wait.got[sender] = got
                wait.nbytes += read.offer.nbytes
            finally:
                ep.slots.give(read.slot, read.offer.slots)
            self._say_done(read.agent, key, ok=True)

    def _give_up(self, wait: _Wait, timeout: float) -> None:
        missing = sorted(set(wait.keys) - set(wait.got))
        detail = ", ".join(f"{s} ({'reading' if s in wait.reads else 'no offer'})" for s in missing)
        raise TransferError(
            f"request shards {[wait.keys[s] for s in missing]}: not received from sender "
            f"rank(s) {detail} within {timeout:g} s"
        )

    def _abandon(self, wait: _Wait, reason: str) -> None:
        """Forget a receive that failed; READs still in flight retire the agent so their
        bytes never land in slots handed out again."""
        for sender, key in wait.keys.items():
            self._given_up[key] = None
            while len(self._given_up) > _FORGOTTEN:
                self._given_up.popitem(last=False)
            peer = self.senders.get(sender)
            if peer is not None and self.offers.pop((key, peer.agent), None) is not None:
                self._say_done(peer.agent, key, ok=False, reason=reason)
        if not wait.reads:
            return
        ep = self.endpoint
        try:
            dropped = ep.backend.retire(
                f"stage receive abandoned with {len(wait.reads)} READs in flight"
            )
        except TransferError as exc:
            logger.error("could not retire the receiving agent; late writes possible: %s", exc)
            return  # keep the landing slots taken: something may still write them
        for read in wait.reads.values():
            read.xfer.release()
            ep.slots.give(read.slot, read.offer.slots)
            self._say_done(read.agent, read.offer.key, ok=False, reason=reason)
        wait.reads.clear()
        ep.forget(dropped)

    def _say_done(self, agent: str, key: str, *, ok: bool, reason: str = "") -> None:
        try:
            self.endpoint.backend.send_notif(agent, encode(Done(key, ok, reason)))
        except TransferError as exc:
            logger.warning("could not tell %r that %r is done: %s", agent, key, exc)


def companion_id(request_id: str, name: str) -> str:
    """The request id a companion cache of `request_id` travels under."""
    if not name or "#" in name:
        raise ConfigError(f"companion name: expected a non-empty name without '#', got {name!r}")
    return f"{request_id}#{name}"


def receive_designated(
    receiver: StageReceiver | None,
    request_id: str,
    broadcast: Callable[[StagePayload | None], StagePayload],
    *,
    timeout: float = 30.0,
) -> StagePayload:
    """Where only one rank of a stage may receive: the designated rank (the one given a
    `receiver`, built with a mapping to 1 receiving rank) receives the whole KV and
    `broadcast` hands it to every rank (e.g. `torch.distributed.broadcast_object_list` from
    that rank); the other ranks pass None and get what `broadcast` returns."""
    payload = receiver.receive(request_id, timeout=timeout) if receiver is not None else None
    return broadcast(payload)


def _merged(sharder: HeadSharder, parts: list[StagePayload]) -> StagePayload:
    first = parts[0]
    layers: list[tuple[torch.Tensor, ...]] = []
    for i in range(len(first.layers)):
        pieces = [p.layers[i] for p in parts]
        if all(len(p) == 2 for p in pieces):
            layers.append(sharder.merge([(p[0], p[1]) for p in pieces]))
        else:
            layers.append(pieces[0])
    return StagePayload(first.request_id, layers, first.block_ids, first.metadata)
