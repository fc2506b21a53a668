"""The receiving side of a stage rank: `StageReceiver.receive` waits for the offers of every
sender rank it needs, READs them, and returns one merged payload — or raises a `TransferError`
naming the senders that did not deliver before the deadline. A READ still in flight when its
receive fails keeps its landing slots until NIXL says it ended (a stopped sender's bytes may
land whenever it resumes), so no other shard is handed memory it can still write.
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

from kvrdma.config_checks import check_number
from kvrdma.errors import ConfigError, KvrdmaError, ProtocolError, TransferError
from kvrdma.lease import read_cutoff
from kvrdma.nixl.protocol import Xfer, XferState
from kvrdma.stages.endpoint import (
    READ_ALLOWANCE_SECONDS,
    Done,
    Offer,
    Peer,
    StageEndpoint,
    encode,
)
from kvrdma.stages.manager import Address, Clock
from kvrdma.stages.mapping import StageMapping
from kvrdma.stages.metrics import StageMetrics
from kvrdma.stages.naming import KeyBuilder, ShardKey, default_key
from kvrdma.stages.payload import StagePayload, unpack_tensor
from kvrdma.stages.shards import HeadSharder, LayerKV, cached_blocks, write_blocks
from kvrdma.transfer import parked

logger = logging.getLogger(__name__)

# the pause between polls while waiting for offers (the copy threads need the CPU); a READ in
# flight is polled without a pause: it ends within a copy's time, and each pause delays it
_POLL_SECONDS = 0.0002
_SPIN_SECONDS = 0.001  # nor in a receive's first ms: an offer sent just before arrives in it
_FORGOTTEN = 1024  # keys given up before their offer came (see GIVEN_UP_GRACE_SECONDS)
# how long an offer for a given-up key waits for a receive asking for it again (a retry's)
# before its sender is told to free it
GIVEN_UP_GRACE_SECONDS = 5.0
MAX_OFFERS = 4096  # offers a receiver keeps for receives to come (the oldest go first)
_UNKNOWN_SENDER_SECONDS = 60.0  # an offer from a sender whose clock is unknown is kept this long
_REASON_CHARS = 200  # of an error told to a sender


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
    offered: set[int] = field(default_factory=set)  # senders whose offer came
    late: set[int] = field(default_factory=set)  # ... too near its lease end to be read
    nbytes: int = 0  # packed bytes READ so far
    # takes each sender's shard as views of the landing slots, before they are given back
    # (its tensors are not kept); None: a copy of each shard is kept
    sink: Callable[[int, StagePayload], None] | None = None


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
        # offers for given-up keys: kept until then (local clock) for a retry's receive
        self._doubtful: dict[tuple[str, str], float] = {}
        self.metrics = metrics
        self.peer_stage = ""
        self.abandoned: list[_Read] = []  # READs of failed receives, not yet ended

    def connect(self, stage: str, addresses: Mapping[int, Address]) -> None:
        """Connect to the sending stage's ranks this rank receives from."""
        ranks = self.mapping.sources(self.endpoint.rank)
        size = self.mapping.sender_size
        self.senders.update(self.endpoint.connect_ranks(stage, ranks, addresses, size=size))
        self.peer_stage = stage

    def receive(self, request_id: str, *, chunk: int = 0, timeout: float = 30.0) -> StagePayload:
        """This rank's KV of `request_id`, merged from its senders, within `timeout` s."""
        return self.receive_with_companions(request_id, (), chunk=chunk, timeout=timeout)[0]

    def receive_blocks(
        self,
        request_id: str,
        kv_caches: Sequence[LayerKV],
        block_ids: Sequence[int],
        *,
        chunk: int = 0,
        timeout: float = 30.0,
        kv_axis: int | None = None,
    ) -> StagePayload:
        """`receive`, written into the blocks `block_ids` of each layer's paged cache (any of
        the three forms): each sender's shard goes from the landing slots into its heads of
        those blocks, not copied first. Returns the request id, the sender's block ids and
        metadata (no layers). A receive that fails may have written some senders' heads. With
        a custom merger, the merged payload is written."""
        cached = cached_blocks(kv_caches, block_ids, kv_axis=kv_axis, distinct=True)
        axis, what = self.sharder.axis, f"request {request_id!r}"
        if self.sharder.merger is not None:
            got = self.receive(request_id, chunk=chunk, timeout=timeout)
            write_blocks(cached, got.layers, piece=(0, 1), head_axis=axis, what=what)
            return StagePayload(got.request_id, [], got.block_ids, got.metadata, got.key)
        order = self.mapping.sources(self.endpoint.rank)

        def sink(sender: int, shard: StagePayload) -> None:
            piece = (order.index(sender), len(order))  # its equal share of the cache's heads
            what = f"shard {shard.key!r} of sender {sender}"
            write_blocks(cached, shard.layers, piece=piece, head_axis=axis, what=what)

        return self._receive([request_id], chunk, timeout, sink)[0]

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
        if len(set(companions)) != len(companions):
            raise ConfigError(f"companions: expected distinct names, got {list(companions)!r}")
        ids = [request_id, *(companion_id(request_id, name) for name in companions)]
        merged = self._receive(ids, chunk, timeout, None)
        return merged[0], dict(zip(companions, merged[1:], strict=True))

    def _receive(
        self,
        ids: list[str],
        chunk: int,
        timeout: float,
        sink: Callable[[int, StagePayload], None] | None,
    ) -> list[StagePayload]:
        """The requests `ids`, each merged from its senders, within one finite `timeout`."""
        timeout = check_number("timeout", timeout, "a positive number of seconds", positive=True)
        me = self.endpoint.rank
        waits = [
            _Wait(
                {
                    s: self.key_builder(ShardKey(rid, self.from_stage_index, chunk, s, me))
                    for s in self.mapping.sources(me)
                },
                sink=sink,
            )
            for rid in ids
        ]
        for wait in waits:  # asked for again (a retry): its shards are welcome again
            for sender, key in wait.keys.items():
                self._given_up.pop(key, None)
                if (peer := self.senders.get(sender)) is not None:
                    self._doubtful.pop((key, peer.agent), None)
        started = self.clock()
        deadline = started + timeout
        failure = "failed"
        try:
            while True:
                self._pump()
                for wait in waits:
                    self._start_reads(wait, deadline)
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
            merged = [_merged(self.sharder, [w.got[s] for s in sorted(w.got)]) for w in waits]
        except BaseException:
            for wait in waits:
                self._abandon(wait, "the receive failed")
                self._count(failure)  # none of the requests is delivered
            raise
        for wait in waits:
            self._count("success", wait.nbytes, self.clock() - started)
        return merged

    def _count(self, outcome: str, nbytes: int = 0, seconds: float = 0.0) -> None:
        if self.metrics is not None:
            m, ep = self.metrics, self.endpoint
            m.transfer_of(ep, self.peer_stage, "receive", outcome, nbytes, seconds)

    def step(self) -> None:
        """Progress the agent between receives (call it from the stage's loop): offers are
        kept for the next `receive`; one that comes after its receive gave up is refused
        unless a receive asks for it again within `GIVEN_UP_GRACE_SECONDS`."""
        self._pump()

    def _pump(self) -> None:
        if self.abandoned:
            self._reap()
        # offers are kept whoever sent them (a sender may offer before this rank connected
        # to it): `_start_reads` checks the sender, and the cap and leases bound them
        for agent, msg in self.endpoint.messages(Offer):
            if msg.key in self._given_up:  # late, or a retry's: kept for a while
                del self._given_up[msg.key]
                self._doubtful[(msg.key, agent)] = self.clock() + GIVEN_UP_GRACE_SECONDS
            self._keep(agent, msg)
        now, offers = self.clock(), self.offers
        for pair, until in list(self._doubtful.items()) if self._doubtful else ():
            if now >= until:
                del self._doubtful[pair]
                if (kept := offers.pop(pair, None)) is not None:  # no receive asked again
                    self._say_done(pair[1], kept[0], ok=False, reason="the receiver gave up")
        while offers and next(iter(offers.values()))[1] <= now:  # the oldest first
            key, agent = next(iter(offers))
            self._drop_offer(key, agent)
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
            (key, old), (oldest, _) = next(iter(self.offers.items()))
            self._drop_offer(key, old)
            self._say_done(old, oldest, ok=False, reason="too many offers unread")

    def _drop_offer(self, key: str, agent: str) -> tuple[Offer, float] | None:
        """Forget an offer, and whether it came for a given-up key: an offer sent later
        under that key is a new one."""
        self._doubtful.pop((key, agent), None)
        return self.offers.pop((key, agent), None)

    def _start_reads(self, wait: _Wait, deadline: float) -> None:
        ep = self.endpoint
        for sender, key in wait.keys.items():
            peer = self.senders.get(sender)
            if sender in wait.reads or sender in wait.got or peer is None:
                continue
            kept = self.offers.get((key, peer.agent))
            if kept is None:
                continue
            offer, cutoff = kept
            if offer.incarnation not in ("", peer.incarnation):  # from a restarted sender
                if (left := deadline - self.clock()) <= 0:  # a retry's receive asks again
                    continue
                peer = self._restarted(sender, peer, offer, left)
                if peer is None:
                    continue
            wait.offered.add(sender)
            if peer.offset is not None and offer.expires_at > 0:  # known now if not then
                cutoff = read_cutoff(offer.expires_at, peer.offset)
            if self.clock() >= cutoff - READ_ALLOWANCE_SECONDS:
                self._drop_offer(key, peer.agent)
                wait.late.add(sender)
                logger.warning("offer of %r too near its lease end to be read: dropped", key)
                continue
            if (
                offer.slots > ep.num_slots
                or offer.slot + offer.slots > peer.num_slots
                or offer.nbytes > offer.slots * peer.slot_bytes
            ):
                self._drop_offer(key, peer.agent)
                self._say_done(peer.agent, offer, ok=False, reason="does not fit")
                raise TransferError(
                    f"shard {key!r} from sender rank {sender}: {offer.nbytes} bytes in "
                    f"{offer.slots} slots at {offer.slot} do not fit (sender slab "
                    f"{peer.num_slots} slots of {peer.slot_bytes} bytes, landing "
                    f"{ep.num_slots} slots)"
                )
            slot = ep.slots.take(offer.slots)
            if slot is None:
                continue  # landing room frees up as other reads finish
            self._drop_offer(key, peer.agent)
            ids = list(range(slot, slot + offer.slots))
            remote_ids = list(range(offer.slot, offer.slot + offer.slots))
            try:
                xfer = ep.backend.post("READ", ep.local, ids, peer.slab, remote_ids, b"")
            except TransferError as exc:  # the sender frees the shard now, not at its lease end
                ep.slots.give(slot, offer.slots)
                self._say_done(peer.agent, offer, ok=False, reason=str(exc)[:_REASON_CHARS])
                raise
            wait.reads[sender] = _Read(sender, offer, xfer, slot, peer.agent, cutoff)

    def _restarted(self, sender: int, peer: Peer, offer: Offer, left: float) -> Peer | None:
        """The new process of `sender`, asked for within `left` s and loaded in place of the
        old one (whose READs fail); None for an offer from a process that is gone (dropped)."""
        try:
            peer = self.senders[sender] = self.endpoint.reconnect(peer, timeout=left)
        except KvrdmaError as exc:  # the offer stays: a retry's receive asks again
            raise TransferError(
                f"shard {offer.key!r}: sender rank {sender} offered it from a new process at "
                f"{peer.address[0]}:{peer.address[1]}, which could not be connected: {exc}"
            ) from exc
        if offer.incarnation == peer.incarnation:
            return peer
        self._drop_offer(offer.key, peer.agent)
        logger.warning("offer of %r from a past process of sender %d: dropped", offer.key, sender)
        return None

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
                try:
                    got = unpack_tensor(view, copy=wait.sink is None)
                except ProtocolError as exc:  # nothing, or a shard half packed anew
                    raise TransferError(
                        f"shard {key!r} from sender rank {sender}: its slots hold no readable "
                        f"payload: {exc}"
                    ) from exc
                if got.key != key:  # the slots hold another shard
                    raise TransferError(
                        f"shard {key!r} from sender rank {sender}: its slots hold shard {got.key!r}"
                    )
                if wait.sink is not None:  # the views die with the slots, given back below
                    wait.sink(sender, got)
                    got.layers = []
                wait.got[sender] = got
                wait.nbytes += read.offer.nbytes
            except BaseException as exc:  # the sender frees the shard now, not at its lease end
                self._say_done(read.agent, read.offer, ok=False, reason=str(exc)[:_REASON_CHARS])
                raise
            finally:
                ep.slots.give(read.slot, read.offer.slots)
            self._say_done(read.agent, read.offer, ok=True)

    def _give_up(self, wait: _Wait, timeout: float) -> None:
        missing = sorted(set(wait.keys) - set(wait.got))
        detail = ", ".join(f"{s} ({self._why(wait, s)})" for s in missing)
        raise TransferError(
            f"request shards {[wait.keys[s] for s in missing]}: not received from sender "
            f"rank(s) {detail} within {timeout:g} s"
        )

    def _why(self, wait: _Wait, sender: int) -> str:
        """Why `sender`'s shard of `wait` has not arrived."""
        peer = self.senders.get(sender)
        if sender in wait.reads:
            return "reading"
        if peer is None:
            return "not connected: call connect first"
        kept = self.offers.get((wait.keys[sender], peer.agent))
        if kept is None:
            return (
                "offered too near its lease end to be read" if sender in wait.late else "no offer"
            )
        held = f", {self.held_slots} held by READs given up earlier" if self.abandoned else ""
        return f"offered; no {kept[0].slots} free landing slots{held}"

    def _abandon(self, wait: _Wait, reason: str) -> None:
        """Forget a receive that failed: its READs waiting for their sender's warm-up are
        dropped unposted, those in flight keep their landing slots until they end (`_reap`)."""
        for sender, key in wait.keys.items():
            peer = self.senders.get(sender)
            if peer is not None and (kept := self._drop_offer(key, peer.agent)) is not None:
                self._say_done(peer.agent, kept[0], ok=False, reason=reason)
            elif sender not in wait.offered:
                self._given_up[key] = None  # its offer may still come
                while len(self._given_up) > _FORGOTTEN:
                    self._given_up.popitem(last=False)
        for read in wait.reads.values():  # the sender may reuse its slots: we discard these
            self._say_done(read.agent, read.offer, ok=False, reason=reason)
            if parked(read.xfer):  # never handed to NIXL: nothing of it can land
                read.xfer.release()
                self.endpoint.slots.give(read.slot, read.offer.slots)
            else:
                self.abandoned.append(read)
        if wait.reads:
            wait.reads.clear()
            self._count_held()

    def _reap(self) -> None:
        """Give back the landing slots of abandoned READs that have ended."""
        ep, left = self.endpoint, []
        for read in self.abandoned:
            if ep.backend.poll(read.xfer).state is XferState.PROC:
                left.append(read)
                continue
            read.xfer.release()
            ep.slots.give(read.slot, read.offer.slots)
        if len(left) < len(self.abandoned):
            self.abandoned = left
            self._count_held()

    def _count_held(self) -> None:
        if self.metrics is not None:
            self.metrics.held_slots_of(self.endpoint, self.peer_stage, self.held_slots)

    @property
    def held_slots(self) -> int:
        """Landing slots held by abandoned READs that have not ended yet."""
        return sum(read.offer.slots for read in self.abandoned)

    def _say_done(self, agent: str, offer: Offer, *, ok: bool, reason: str = "") -> None:
        done = Done(offer.key, ok, reason, offer.offer_id)
        try:
            self.endpoint.backend.send_notif(agent, encode(done))
        except TransferError as exc:
            logger.warning("could not tell %r that %r is done: %s", agent, offer.key, exc)


def companion_id(request_id: str, name: str) -> str:
    """The request id a companion cache of `request_id` travels under."""
    if not name or "#" in name:
        raise ConfigError(f"companion name: expected a non-empty name without '#', got {name!r}")
    return f"{request_id}#{name}"


def _merged(sharder: HeadSharder, parts: list[StagePayload]) -> StagePayload:
    """One payload of the senders' shards (in sender rank order), merged along the heads."""
    first = parts[0]
    shapes = [[tuple(len(layer) for layer in p.layers), p.request_id] for p in parts]
    if any(s != shapes[0] for s in shapes):
        raise TransferError(
            f"shards of {first.key!r} and its siblings do not match (tensors per layer, request "
            f"id, by sender): {shapes}"
        )
    layers: list[tuple[torch.Tensor, ...]] = []
    for i in range(len(first.layers)):
        pieces = [p.layers[i] for p in parts]
        dtypes = [tuple(str(t.dtype).removeprefix("torch.") for t in p) for p in pieces]
        if any(d != dtypes[0] for d in dtypes):  # torch would promote them silently
            raise TransferError(
                f"shards of {first.key!r}: layer {i} has other dtypes by sender: {dtypes}"
            )
        if len(pieces[0]) != 2:
            layers.append(pieces[0])
            continue
        try:
            layers.append(sharder.merge([(p[0], p[1]) for p in pieces]))
        except (RuntimeError, ConfigError) as exc:  # shapes that cannot be joined
            why = f"shards of {first.key!r}: layer {i} does not merge: {exc}"
            raise TransferError(why) from exc
    return StagePayload(first.request_id, layers, first.block_ids, first.metadata)
