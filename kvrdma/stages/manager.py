"""Moving a request's KV from the ranks of one stage to the ranks of the next.

`StageSender.send` cuts each layer's `(K, V)` for every receiver rank the mapping names,
packs each piece into its slab and offers it; `StageSender.step` (call it from the sending
stage's loop: it is also what lets receivers' READs progress) frees what was read and what
nobody read before its lease ended. `StageReceiver.receive` waits for the offers of every
sender rank it needs, READs them, and returns one merged payload — or raises a
`TransferError` naming the senders that did not deliver before the deadline. A READ still
in flight at the deadline retires the receiving agent, so its bytes can never land later.
Given `metrics=`, both count what they finish in the `kvrdma_stage_*` series.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvrdma.errors import ConfigError, KvrdmaError, TransferError
from kvrdma.nixl.protocol import Xfer, XferState
from kvrdma.stages.endpoint import Done, Offer, Peer, StageEndpoint, decode, encode
from kvrdma.stages.mapping import StageMapping
from kvrdma.stages.metrics import StageMetrics
from kvrdma.stages.naming import KeyBuilder, ShardKey, default_key
from kvrdma.stages.payload import StagePayload, plan_pack, unpack_tensor
from kvrdma.stages.shards import HeadSharder, LayerKV, split_kv

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
Address = tuple[str, int]
# the pause between polls while waiting for offers (the copy threads need the CPU); a READ in
# flight is polled without a pause: it ends within a copy's time, and each pause delays it
_POLL_SECONDS = 0.0002
_SPIN_SECONDS = 0.001  # nor in a receive's first ms: an offer sent just before arrives in it
_FORGOTTEN = 1024  # keys a receiver remembers giving up, to refuse their late offers


@dataclass
class _Held:
    slot: int
    slots: int
    expires: float
    receiver: str
    offered: float
    nbytes: int


class StageSender:
    """The sending side of one rank of a stage."""

    def __init__(
        self,
        endpoint: StageEndpoint,
        mapping: StageMapping,
        *,
        stage_index: int,
        key_builder: KeyBuilder = default_key,
        sharder: HeadSharder | None = None,
        lease: float = 60.0,
        retries: int = 3,
        clock: Clock = time.monotonic,
        metrics: StageMetrics | None = None,
    ) -> None:
        if endpoint.size != mapping.sender_size:
            raise ConfigError(
                f"endpoint of size {endpoint.size} cannot send under a mapping from "
                f"{mapping.sender_size} ranks"
            )
        self.endpoint, self.mapping, self.stage_index = endpoint, mapping, stage_index
        self.key_builder = key_builder
        self.sharder = sharder or HeadSharder(mapping)
        self.lease, self.retries, self.clock = lease, retries, clock
        self.receivers: dict[int, Peer] = {}
        self.held: dict[str, _Held] = {}
        self.expired = 0
        self.metrics = metrics
        self.peer_stage = ""

    def connect(self, stage: str, addresses: Mapping[int, Address]) -> None:
        """Connect to the receiving stage's ranks this rank sends to."""
        ranks = self.mapping.targets(self.endpoint.rank)
        self.receivers.update(self.endpoint.connect_ranks(stage, ranks, addresses))
        self.peer_stage = stage

    def send(
        self,
        request_id: str,
        layers: Sequence[LayerKV],
        *,
        chunk: int = 0,
        block_ids: Sequence[int] = (),
        metadata: Mapping[str, Any] | None = None,
        kv_axis: int | None = None,
    ) -> list[str]:
        """Offer this rank's shard of `request_id` to each of its receivers; returns the keys."""
        pairs = [split_kv(layer, kv_axis=kv_axis) for layer in layers]
        keys = []
        for rank in self.mapping.targets(self.endpoint.rank):
            peer = self.receivers.get(rank)
            if peer is None:
                raise TransferError(f"receiver rank {rank} is not connected: call connect first")
            key = self.key_builder(
                ShardKey(request_id, self.stage_index, chunk, self.endpoint.rank, rank)
            )
            piece = StagePayload(
                request_id,
                [self.sharder.for_receiver(p, rank) for p in pairs],
                list(block_ids),
                dict(metadata or {}),
            )
            self._offer(key, piece, peer)
            keys.append(key)
        return keys

    def _offer(self, key: str, piece: StagePayload, peer: Peer) -> None:
        ep = self.endpoint
        if key in self.held:
            raise TransferError(f"shard {key!r} is already offered and not yet read")
        plan = plan_pack(piece)
        nbytes = plan.nbytes
        slots = -(-nbytes // ep.slot_bytes)
        if slots > peer.num_slots:
            self._count("failed")
            raise TransferError(
                f"shard {key!r} of {nbytes} bytes needs {slots} slots; receiver rank "
                f"{peer.rank} lands at most {peer.num_slots} slots of {peer.slot_bytes} bytes"
            )
        first = ep.slots.take(slots)
        if first is None:
            self.step()  # frees what was read meanwhile
            first = ep.slots.take(slots)
        if first is None:
            self._count("failed")
            raise TransferError(
                f"shard {key!r}: no {slots} free slots of {ep.slot_bytes} bytes in this "
                f"rank's slab ({len(self.held)} shards await their readers)"
            )
        start = first * ep.slot_bytes
        plan.into(ep.slab[start : start + slots * ep.slot_bytes])
        now = self.clock()
        self.held[key] = _Held(first, slots, now + self.lease, peer.agent, now, nbytes)
        self._count_offered()
        message = encode(Offer(key, first, slots, nbytes))
        for attempt in range(self.retries + 1):
            try:
                ep.backend.send_notif(peer.agent, message)
                return
            except TransferError as exc:
                if attempt == self.retries:
                    self._free(key)
                    self._count("failed")
                    raise TransferError(
                        f"shard {key!r}: offer to receiver rank {peer.rank} failed after "
                        f"{attempt + 1} attempts: {exc}"
                    ) from exc
                time.sleep(min(0.01 * 2**attempt, 0.2))
                ep.backend.get_notifs()  # progress the link before trying again

    def _free(self, key: str) -> _Held | None:
        held = self.held.pop(key, None)
        if held is not None:
            self.endpoint.slots.give(held.slot, held.slots)
            self._count_offered()
        return held

    def _count(self, outcome: str, held: _Held | None = None) -> None:
        if self.metrics is not None:
            ep = self.endpoint
            self.metrics.transfer(
                pipeline=ep.pipeline,
                stage=ep.stage,
                peer_stage=self.peer_stage,
                tp_rank=ep.rank,
                direction="send",
                outcome=outcome,
                nbytes=held.nbytes if held is not None else 0,
                seconds=self.clock() - held.offered if held is not None else 0.0,
            )

    def _count_offered(self) -> None:
        if self.metrics is not None:
            ep = self.endpoint
            self.metrics.set_offered(
                pipeline=ep.pipeline,
                stage=ep.stage,
                peer_stage=self.peer_stage,
                tp_rank=ep.rank,
                shards=len(self.held),
            )

    def step(self) -> set[str]:
        """Progress the agent; returns the keys read since the last step."""
        done: set[str] = set()
        for agent, messages in self.endpoint.backend.get_notifs().items():
            for raw in messages:
                try:
                    msg = decode(raw, agent)
                except KvrdmaError as exc:
                    logger.warning("%s", exc)
                    continue
                if isinstance(msg, Done) and msg.key in self.held:
                    if self.held[msg.key].receiver != agent:
                        logger.warning("%r said done for %r it was not offered", agent, msg.key)
                        continue
                    held = self._free(msg.key)
                    if msg.ok:
                        done.add(msg.key)
                        self._count("success", held)
                    else:
                        logger.warning("shard %r given up by its receiver: %s", msg.key, msg.reason)
                        self._count("given_up")
        now = self.clock()
        for key in [k for k, h in self.held.items() if h.expires <= now]:
            logger.warning("shard %r was not read within its %g s lease: freed", key, self.lease)
            self._free(key)
            self.expired += 1
            self._count("expired")
        return done

    @property
    def pending(self) -> int:
        """Shards offered and not yet read (or expired)."""
        return len(self.held)


@dataclass
class _Read:
    sender: int
    offer: Offer
    xfer: Xfer
    slot: int
    agent: str


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
        self.offers: dict[str, tuple[str, Offer]] = {}
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
                }
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
            ep = self.endpoint
            self.metrics.transfer(
                pipeline=ep.pipeline,
                stage=ep.stage,
                peer_stage=self.peer_stage,
                tp_rank=ep.rank,
                direction="receive",
                outcome=outcome,
                nbytes=nbytes,
                seconds=seconds,
            )

    def step(self) -> None:
        """Progress the agent between receives (call it from the stage's loop): offers are
        kept for the next `receive`, late ones for given-up requests are refused at once."""
        self._pump()

    def _pump(self) -> None:
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
                    self.offers[msg.key] = (agent, msg)

    def _start_reads(self, wait: _Wait) -> None:
        ep = self.endpoint
        for sender, key in wait.keys.items():
            if sender in wait.reads or sender in wait.got or key not in self.offers:
                continue
            agent, offer = self.offers[key]
            peer = self.senders.get(sender)
            if peer is None or peer.agent != agent:
                raise TransferError(f"shard {key!r} offered by {agent!r}, not by sender {sender}")
            if offer.slots > ep.num_slots or offer.slot + offer.slots > peer.num_slots:
                self.offers.pop(key)
                self._say_done(agent, key, ok=False, reason="does not fit")
                raise TransferError(
                    f"shard {key!r} from sender rank {sender}: {offer.slots} slots at "
                    f"{offer.slot} do not fit (sender slab {peer.num_slots}, landing "
                    f"{ep.num_slots} slots)"
                )
            slot = ep.slots.take(offer.slots)
            if slot is None:
                continue  # landing room frees up as other reads finish
            self.offers.pop(key)
            ids = list(range(slot, slot + offer.slots))
            remote_ids = list(range(offer.slot, offer.slot + offer.slots))
            try:
                xfer = ep.backend.post("READ", ep.local, ids, peer.slab, remote_ids, b"")
            except TransferError:
                ep.slots.give(slot, offer.slots)
                raise
            wait.reads[sender] = _Read(sender, offer, xfer, slot, agent)

    def _finish_reads(self, wait: _Wait) -> None:
        ep = self.endpoint
        for sender, read in list(wait.reads.items()):
            result = ep.backend.poll(read.xfer)
            if result.state is XferState.PROC:
                continue
            read.xfer.release()
            del wait.reads[sender]
            start = read.slot * ep.slot_bytes
            try:
                if result.state is XferState.ERR:
                    raise TransferError(
                        f"shard {read.offer.key!r}: READ from sender rank {sender} failed: "
                        f"{result.error}"
                    )
                view = ep.slab[start : start + read.offer.nbytes]
                wait.got[sender] = unpack_tensor(view, copy=True)
                wait.nbytes += read.offer.nbytes
            finally:
                ep.slots.give(read.slot, read.offer.slots)
            self._say_done(read.agent, read.offer.key, ok=True)

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
        for key in wait.keys.values():
            self._given_up[key] = None
            while len(self._given_up) > _FORGOTTEN:
                self._given_up.popitem(last=False)
            offered = self.offers.pop(key, None)
            if offered is not None:
                self._say_done(offered[0], key, ok=False, reason=reason)
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
