"""The sending side of a stage rank (`kvrdma.stages.receiver` is the other).

`StageSender.send` cuts each layer's `(K, V)` for every receiver rank the mapping names,
packs every piece into its slab, then offers them, naming how long it keeps them;
`StageSender.step` (call it from the sending stage's loop: it is also what lets receivers'
READs progress) frees what was read and what nobody read before its lease ended. Given
`metrics=`, senders and receivers count what they finish in the `kvrdma_stage_*` series.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from kvrdma.errors import ConfigError, KvrdmaError, TransferError
from kvrdma.lease import EXPIRY_SAFETY_SECONDS
from kvrdma.stages.endpoint import (
    MAX_EXPIRES_AT,
    MAX_KEY_CHARS,
    READ_ALLOWANCE_SECONDS,
    Done,
    Offer,
    Peer,
    StageEndpoint,
    encode,
)
from kvrdma.stages.mapping import StageMapping
from kvrdma.stages.metrics import StageMetrics
from kvrdma.stages.naming import KeyBuilder, ShardKey, default_key
from kvrdma.stages.payload import Rows, StagePayload, plan_pack
from kvrdma.stages.shards import HeadSharder, KVPair, LayerKV, cached_blocks, split_kv

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
# an offer's attempts block `send`, up to 0.2 s apart: more would hold the caller for minutes
MAX_RETRIES = 100
Address = tuple[str, int]


@dataclass
class _Held:
    slot: int
    slots: int
    expires: float
    receiver: str
    offered: float
    nbytes: int
    offer_id: int


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
        if (
            isinstance(retries, bool)
            or not isinstance(retries, int)
            or not 0 <= retries <= MAX_RETRIES
        ):
            raise ConfigError(
                f"retries: expected an integer in [0, {MAX_RETRIES}], got {retries!r}"
            )
        longest = MAX_EXPIRES_AT - clock()  # receivers refuse an offer whose lease ends later
        # receivers start a READ only while the lease leaves its allowance and their margin
        shortest = READ_ALLOWANCE_SECONDS + EXPIRY_SAFETY_SECONDS
        if (
            isinstance(lease, bool)
            or not isinstance(lease, int | float)
            or not shortest < lease <= longest
        ):
            raise ConfigError(
                f"lease: expected a number of seconds in ({shortest:g}, {longest:g}] (a "
                f"receiver starts a READ only {shortest:g} s and the handshake's round trip "
                f"before the lease ends; it must end by {MAX_EXPIRES_AT:g} in the sender's "
                f"clock), got {lease!r}"
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
        self._read: set[str] = set()  # keys read since the last `step`
        # a Done names the offer it answers, so one for a key's earlier offer frees no later
        # one; a random start keeps a restarted process (same agent name) off past offers' ids
        self._offer_ids = itertools.count(secrets.randbelow(1 << 62) + 1)

    def connect(self, stage: str, addresses: Mapping[int, Address]) -> None:
        """Connect to the receiving stage's ranks this rank sends to."""
        ranks = self.mapping.targets(self.endpoint.rank)
        size = self.mapping.receiver_size
        self.receivers.update(self.endpoint.connect_ranks(stage, ranks, addresses, size=size))
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
        """Offer this rank's shard of `request_id` to each of its receivers; returns the keys.
        Every shard is packed into the slab before any is offered: a shard that finds no room
        (or fails to pack) leaves none of them offered, so the same call can be tried again."""
        pairs = [split_kv(layer, kv_axis=kv_axis) for layer in layers]
        return self._send(request_id, pairs, [], chunk, block_ids, metadata)

    def send_blocks(
        self,
        request_id: str,
        kv_caches: Sequence[LayerKV],
        block_ids: Sequence[int],
        *,
        chunk: int = 0,
        metadata: Mapping[str, Any] | None = None,
        kv_axis: int | None = None,
    ) -> list[str]:
        """`send` of the request's blocks `block_ids` out of each layer's paged cache (any of
        the three forms), gathered straight into the slab: one copy where `extract` and then
        `send` make two; the blocks can be reused once this returns. A custom slicer of the
        sharder gets a layer's whole cache, blocks on its first axis."""
        cached = cached_blocks(kv_caches, block_ids, kv_axis=kv_axis)
        pairs, index = [pair for pair, _ in cached], [i for _, i in cached]
        return self._send(request_id, pairs, index, chunk, block_ids, metadata)

    def _send(
        self,
        request_id: str,
        pairs: list[KVPair],
        index: list[torch.Tensor],
        chunk: int,
        block_ids: Sequence[int],
        metadata: Mapping[str, Any] | None,
    ) -> list[str]:
        """`send` of `pairs`, or with `index` (one per layer) of those rows of each."""
        pieces: list[tuple[str, StagePayload, Peer]] = []
        for rank in self.mapping.targets(self.endpoint.rank):
            peer = self.receivers.get(rank)
            if peer is None:
                raise TransferError(f"receiver rank {rank} is not connected: call connect first")
            key = self.key_builder(
                ShardKey(request_id, self.stage_index, chunk, self.endpoint.rank, rank)
            )
            if key in self.held:
                raise TransferError(f"shard {key!r} is already offered and not yet read")
            if any(key == k for k, _, _ in pieces):
                raise ConfigError(f"key_builder: gave {key!r} to two receiver ranks")
            if len(key) > MAX_KEY_CHARS:
                raise ConfigError(f"shard key: at most {MAX_KEY_CHARS} characters, got {len(key)}")
            layers: list[tuple[torch.Tensor, ...]] = [
                self.sharder.for_receiver(p, rank) for p in pairs
            ]
            if index:  # a payload being sent may hold `Rows` where tensors would be
                rows = [(Rows(k, i), Rows(v, i)) for (k, v), i in zip(layers, index, strict=True)]
                layers = cast(list[tuple[torch.Tensor, ...]], rows)
            piece = StagePayload(
                request_id,
                layers,
                list(block_ids),
                dict(metadata or {}),
                key,
            )
            pieces.append((key, piece, peer))
        packed = self._pack_all(pieces)
        for i, (key, _, peer) in enumerate(pieces):
            first, slots, nbytes = packed[i]
            try:
                self._offer(key, first, slots, nbytes, peer)
            except BaseException as exc:
                for later, later_slots, _ in packed[i + 1 :]:
                    self.endpoint.slots.give(later, later_slots)
                if i and isinstance(exc, TransferError):
                    offered = [k for k, _, _ in pieces[:i]]
                    raise TransferError(
                        f"{exc}; shards {offered} were offered before it and stay until read "
                        "or their lease ends"
                    ) from exc
                raise
        return [key for key, _, _ in pieces]

    def _pack_all(
        self, pieces: Sequence[tuple[str, StagePayload, Peer]]
    ) -> list[tuple[int, int, int]]:
        """Each piece packed into slots of its own: `(first slot, slots, bytes)` per piece;
        on any failure every slot taken here is given back."""
        ep = self.endpoint
        packed: list[tuple[int, int, int]] = []
        try:
            for key, piece, peer in pieces:
                plan = plan_pack(piece)
                slots = -(-plan.nbytes // ep.slot_bytes)
                if slots > peer.num_slots:
                    raise TransferError(
                        f"shard {key!r} of {plan.nbytes} bytes needs {slots} slots; receiver "
                        f"rank {peer.rank} lands at most {peer.num_slots} slots of "
                        f"{peer.slot_bytes} bytes"
                    )
                first = ep.slots.take(slots)
                if first is None:
                    self._progress()  # frees what was read meanwhile
                    first = ep.slots.take(slots)
                if first is None:
                    raise TransferError(
                        f"shard {key!r}: no {slots} free slots of {ep.slot_bytes} bytes in this "
                        f"rank's slab ({len(self.held)} shards await their readers)"
                    )
                packed.append((first, slots, plan.nbytes))
                start = first * ep.slot_bytes
                plan.into(ep.slab[start : start + slots * ep.slot_bytes], recheck=False)
        except BaseException as exc:
            for first, slots, _ in packed:
                ep.slots.give(first, slots)
            if not isinstance(exc, ConfigError):  # a payload it cannot pack is the caller's
                self._count("failed")
            raise
        return packed

    def _offer(self, key: str, first: int, slots: int, nbytes: int, peer: Peer) -> None:
        """Tell `peer` of the shard packed at `first`; it is held until read or its lease ends."""
        ep = self.endpoint
        now, offer_id = self.clock(), next(self._offer_ids)
        expires = now + self.lease
        self.held[key] = _Held(first, slots, expires, peer.agent, now, nbytes, offer_id)
        self._count_offered()
        message = encode(Offer(key, first, slots, nbytes, expires, ep.incarnation, offer_id))
        for attempt in range(self.retries + 1):
            try:
                ep.backend.send_notif(peer.agent, message)
                return
            except TransferError as exc:
                if attempt == 0:  # NIXL never talks to a lost agent again: a restart has a new one
                    peer = self._reconnected(peer, key)  # (for the next send, if no retry)
                if attempt == self.retries:
                    self._free(key)
                    self._count("failed")
                    raise TransferError(
                        f"shard {key!r}: offer to receiver rank {peer.rank} failed after "
                        f"{attempt + 1} attempts: {exc}"
                    ) from exc
                time.sleep(min(0.01 * 2**attempt, 0.2))
                self._take_notifs()  # progress the link before trying again

    def _reconnected(self, peer: Peer, key: str) -> Peer:
        """`peer`, or its new process if it restarted: the shards offered to the old one but
        `key` are freed (that process is gone, and with it their offers)."""
        try:
            new = self.endpoint.reconnect(peer)
        except KvrdmaError as exc:  # stopped, not back, or another mapping: retries go on
            logger.warning("receiver rank %d could not be loaded again: %s", peer.rank, exc)
            return peer
        if new is not peer:
            self.receivers[peer.rank] = new
            for old in [k for k, h in self.held.items() if h.receiver == peer.agent and k != key]:
                logger.warning("shard %r was offered to a receiver since restarted: freed", old)
                self._count("failed", self._free(old))
        return new

    def _free(self, key: str) -> _Held | None:
        held = self.held.pop(key, None)
        if held is not None:
            self.endpoint.slots.give(held.slot, held.slots)
            self._count_offered()
        return held

    def _count(self, outcome: str, held: _Held | None = None) -> None:
        if self.metrics is not None:
            nbytes, seconds = (held.nbytes, self.clock() - held.offered) if held else (0, 0.0)
            m, ep = self.metrics, self.endpoint
            m.transfer_of(ep, self.peer_stage, "send", outcome, nbytes, seconds)

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
        self._progress()
        done, self._read = self._read, set()
        return done

    def _progress(self) -> None:
        """Take notifications, then free the shards whose lease ended unread."""
        self._take_notifs()
        now = self.clock()
        for key in [k for k, h in self.held.items() if h.expires <= now]:
            logger.warning("shard %r was not read within its %g s lease: freed", key, self.lease)
            self._free(key)
            self.expired += 1
            self._count("expired")

    def _take_notifs(self) -> None:
        """Free the shards receivers are done with; the read ones go to the next `step`."""
        for agent, msg in self.endpoint.messages(Done):
            if msg.key not in self.held:
                continue
            if self.held[msg.key].receiver != agent:
                logger.warning("%r said done for %r it was not offered", agent, msg.key)
                continue
            if msg.offer_id not in (0, self.held[msg.key].offer_id):  # 0: names no offer
                logger.info("%r said done for an earlier offer of %r: ignored", agent, msg.key)
                continue
            held = self._free(msg.key)
            if msg.ok:
                self._read.add(msg.key)
                self._count("success", held)
            else:
                logger.warning("shard %r given up by its receiver: %s", msg.key, msg.reason)
                self._count("given_up")

    @property
    def pending(self) -> int:
        """Shards offered and not yet read (or expired)."""
        return len(self.held)
