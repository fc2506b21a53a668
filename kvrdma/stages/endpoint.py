"""One rank of one stage on the wire: a NIXL agent, a registered slab of slots, and a
handshake server that tells peers where the slab lives.

A sender packs each shard into a run of its slab's slots and offers it to the receiver with
a NIXL notification; the receiver READs the run into its own slab and says when it is done.
Peers learn each other's agent and slab through kvrdma's handshake (the slab is described
as a one-region `WorkerMetadata`), so stage traffic gets the same validated, bounded and
optionally CURVE-secured metadata exchange as KV-cache reads.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import msgspec
import numpy as np
import torch

from kvrdma.defaults import ucx_num_threads
from kvrdma.errors import MALFORMED, ConfigError, ProtocolError
from kvrdma.handshake import HandshakeClient, HandshakeServer
from kvrdma.handshake.auth import CurveKeys
from kvrdma.lease import ClockOffset
from kvrdma.metadata import RegionMeta, WorkerMetadata, sha256_hex
from kvrdma.nixl.protocol import BackendConfig, DescList, MemType, TransferBackend
from kvrdma.stages.payload import ALIGN

logger = logging.getLogger(__name__)

NOTIF_PREFIX = b"kvst"


# bounds on what a peer's notification may carry: a hostile one costs bounded memory
MAX_KEY_CHARS = 4096
# an offer's lease end, in the sender's clock: finite, and beyond any clock's reading
MAX_EXPIRES_AT = 1e12
# a receiver starts a READ only this long before the sender may reuse its slots (and discards
# one that ends after that), so a shorter lease is never read
READ_ALLOWANCE_SECONDS = 1.0
_MAX_REASON_CHARS = 1024
INCARNATION_CHARS = 64  # a sha256 in hex
# messages of one kind an endpoint keeps for a role that has not taken them yet (a sender
# that is not stepped, or none on this endpoint): a peer cannot fill memory with them
MAX_WAITING = 4096
_Key = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY_CHARS)]
# an offer's name among its sender's offers (0: not said, by a peer that names none)
_OfferId = Annotated[int, msgspec.Meta(ge=0)]


class Offer(msgspec.Struct, tag="offer", frozen=True):
    """Sender -> receiver: the shard `key` waits in slots [slot, slot + slots) until
    `expires_at` in the sender's clock (0: not said), when the sender may reuse them;
    `offer_id` names this offer of `key` (a key may be offered again once freed)."""

    key: _Key
    slot: Annotated[int, msgspec.Meta(ge=0)]
    slots: Annotated[int, msgspec.Meta(ge=1)]
    nbytes: Annotated[int, msgspec.Meta(ge=1)]
    expires_at: Annotated[float, msgspec.Meta(ge=0, le=MAX_EXPIRES_AT)] = 0.0
    # the sender's published agent digest (empty: not said): a new one says it restarted
    incarnation: Annotated[str, msgspec.Meta(max_length=INCARNATION_CHARS)] = ""
    offer_id: _OfferId = 0


class Done(msgspec.Struct, tag="done", frozen=True):
    """Receiver -> sender: the slots of `key` offered as `offer_id` (0: of whichever offer
    of `key` is held) may be reused (read, or given up)."""

    key: _Key
    ok: bool = True
    reason: Annotated[str, msgspec.Meta(max_length=_MAX_REASON_CHARS)] = ""
    offer_id: _OfferId = 0


Message = Offer | Done
_Kind = TypeVar("_Kind", Offer, Done)
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return NOTIF_PREFIX + _ENCODER.encode(msg)


def decode(raw: bytes, peer: str) -> Message:
    if not raw.startswith(NOTIF_PREFIX):
        raise ProtocolError(f"stage notification from {peer!r} lacks the {NOTIF_PREFIX!r} prefix")
    try:
        return _DECODER.decode(raw[len(NOTIF_PREFIX) :])
    except MALFORMED as exc:
        what = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ProtocolError(f"bad stage notification from {peer!r}: {what}") from exc


def take_messages(backend: TransferBackend) -> list[tuple[str, Message]]:
    """The stage notifications that came since the last call, with their senders' agents; a
    malformed one is logged and skipped, so it costs no other message of its batch."""
    messages = []
    for agent, raws in backend.get_notifs().items():
        for raw in raws:
            try:
                messages.append((agent, decode(raw, agent)))
            except ProtocolError as exc:
                logger.warning("%s", exc)
    return messages


class Slots:
    """First-fit allocation of runs of equal slots."""

    def __init__(self, count: int) -> None:
        self.free = np.ones(count, dtype=bool)

    def take(self, n: int) -> int | None:
        """The first slot of a free run of `n`, now taken; None when there is none."""
        if n < 1 or n > len(self.free):
            return None
        window = np.lib.stride_tricks.sliding_window_view(self.free, n).all(axis=1)
        hits = np.flatnonzero(window)
        if len(hits) == 0:
            return None
        first = int(hits[0])
        self.free[first : first + n] = False
        return first

    def give(self, first: int, n: int) -> None:
        self.free[first : first + n] = True


@dataclass
class Peer:
    """A connected rank of another stage: its agent and its slab, prepared for READs."""

    stage: str
    rank: int
    agent: str
    slab: DescList
    slot_bytes: int
    num_slots: int
    offset: ClockOffset | None = None  # its clock - ours, learnt at the handshake
    size: int = 1  # ranks of its stage
    address: tuple[str, int] = ("", 0)  # where its handshake is served
    incarnation: str = ""  # the digest of the agent metadata it published


class StageEndpoint:
    """A NIXL agent with a slab of `num_slots` slots of `slot_bytes`, served on `host:port`
    (0 = a free port) under the engine id `{pipeline}/{stage}`."""

    def __init__(
        self,
        *,
        pipeline: str,
        stage: str,
        rank: int,
        size: int,
        host: str = "127.0.0.1",
        port: int = 0,
        slot_bytes: int = 1 << 20,
        num_slots: int = 64,
        backend: TransferBackend | None = None,
        num_threads: int | None = None,
        handshake_timeout: float = 5.0,
        curve: CurveKeys | None = None,
    ) -> None:
        for name, value in (("slot_bytes", slot_bytes), ("num_slots", num_slots), ("size", size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: expected a positive integer, got {value!r}")
        if slot_bytes % ALIGN:
            raise ConfigError(
                f"slot_bytes: expected a multiple of {ALIGN}, got {slot_bytes} (a landed "
                "shard's tensors are viewed where they lie, aligned from its first slot)"
            )
        if not 0 <= rank < size:
            raise ConfigError(f"rank: expected an integer in [0, {size}), got {rank!r}")
        if not pipeline or not stage or "/" in stage:
            raise ConfigError(f"pipeline {pipeline!r} / stage {stage!r}: expected names")
        self.stage, self.rank, self.size = stage, rank, size
        self.engine_id = f"{pipeline}/{stage}"
        self.pipeline = pipeline
        self.slot_bytes, self.num_slots = slot_bytes, num_slots
        self.slab = torch.zeros(slot_bytes * num_slots, dtype=torch.uint8)
        self.slots = Slots(num_slots)
        self.backend = backend or _nixl(f"{self.engine_id}-{rank}", num_threads)
        # messages by kind, each kept for the role that takes it (`messages`)
        self._inbox: dict[type, deque[tuple[str, Any]]] = {
            kind: deque(maxlen=MAX_WAITING) for kind in (Offer, Done)
        }
        self._regs: list[Any] = []
        self.peers: dict[tuple[str, int], Peer] = {}
        try:
            whole = [[self.slab.data_ptr(), self.slab.numel(), 0]]
            self._regs.append(self.backend.register(np.array(whole, np.uint64), MemType.DRAM))
            self.local = self.backend.prep_local(self._rows(self.slab.data_ptr()), MemType.DRAM)
            self.server = HandshakeServer(host, port, enforce_compat=False, curve=curve)
            published = self.metadata()
            self.server.publish(published)
        except BaseException:
            self.close()
            raise
        self.port = self.server.port
        # told with every offer, so a receiver knows a restarted process by it
        self.incarnation = published.agent_metadata_sha256
        self.handshake_timeout = handshake_timeout
        self._client = HandshakeClient(timeout=handshake_timeout, enforce_compat=False, curve=curve)

    def messages(self, kind: type[_Kind]) -> list[tuple[str, _Kind]]:
        """The stage notifications of `kind` that came since the last call, with their
        senders' agents. One endpoint may serve a receiver (offers) and a sender (dones): a
        message waits for the role that takes its kind, the oldest dropped past `MAX_WAITING`."""
        for agent, msg in take_messages(self.backend):
            self._inbox[type(msg)].append((agent, msg))
        box = self._inbox[kind]
        taken = list(box)
        box.clear()
        return taken

    def _rows(self, base: int) -> np.ndarray:
        addrs = base + self.slot_bytes * np.arange(self.num_slots, dtype=np.uint64)
        rows = np.zeros((self.num_slots, 3), dtype=np.uint64)
        rows[:, 0], rows[:, 1] = addrs, self.slot_bytes
        return rows

    def metadata(self) -> WorkerMetadata:
        """The slab as a one-region `WorkerMetadata` (the handshake's payload)."""
        md = self.backend.metadata()
        return WorkerMetadata(
            engine_id=self.engine_id,
            agent_name=self.backend.agent_name,
            agent_metadata=md,
            tp_rank=self.rank,
            tp_size=self.size,
            block_size=1,
            num_blocks=self.num_slots,
            cache_layout="mla",
            total_num_kv_heads=1,
            head_dim=self.slot_bytes,
            dtype="uint8",
            element_size=1,
            regions=[RegionMeta(self.slab.data_ptr(), self.num_slots, self.slot_bytes, "mla")],
            agent_metadata_sha256=sha256_hex(md),
        )

    def connect(
        self, stage: str, rank: int, host: str, port: int, *, size: int | None = None
    ) -> Peer:
        """Load rank `rank` of `stage` (served at `host:port`) and prepare its slab; `size`:
        the number of ranks this rank's mapping gives that stage, checked against its own."""
        engine, peer = f"{self.pipeline}/{stage}", self.peers.get((stage, rank))
        if peer is None:
            peer = self._connect(engine, stage, rank, host, port)
        if size is not None and peer.size != size:  # its shards would be cut for other ranks
            raise ConfigError(
                f"mapping: {engine} rank {rank} at {host}:{port} is one of {peer.size} "
                f"ranks, this rank's mapping expects {size}: both stages need the same mapping"
            )
        return peer

    def _connect(self, engine: str, stage: str, rank: int, host: str, port: int) -> Peer:
        meta = self._client.fetch(host, port, engine, [rank], use_cache=False)[rank]
        return self._load(engine, stage, rank, (host, port), meta)

    def reconnect(self, peer: Peer, *, timeout: float | None = None) -> Peer:
        """`peer` asked again at its address: itself while it publishes the agent loaded,
        else a new `Peer` for the agent and slab of its new process (a restart: the same
        agent name), the old agent's lists released and its transfers failed. `timeout`
        (seconds) shortens the handshake's, e.g. to what is left of a caller's deadline."""
        (host, port), engine = peer.address, f"{self.pipeline}/{peer.stage}"
        limit = self.handshake_timeout if timeout is None else min(timeout, self.handshake_timeout)
        fetched = self._client.fetch(
            host, port, engine, [peer.rank], use_cache=False, timeout=limit
        )
        meta = fetched[peer.rank]
        if (meta.agent_metadata_sha256 or sha256_hex(meta.agent_metadata)) == peer.incarnation:
            return peer
        if meta.tp_size != peer.size:  # its shards would be cut for other ranks
            raise ConfigError(
                f"mapping: {engine} rank {peer.rank} at {host}:{port} restarted as one of "
                f"{meta.tp_size} ranks, expected {peer.size}: both stages need the same mapping"
            )
        logger.warning(
            "%s rank %d at %s:%d restarted (new NIXL agent): loading it again",
            engine, peer.rank, host, port,
        )  # fmt: skip
        self.peers.pop((peer.stage, peer.rank), None)
        peer.slab.release()
        # NIXL refuses a second entry of a name: add_remote drops the old one (other digest)
        return self._load(engine, peer.stage, peer.rank, (host, port), meta)

    def _load(
        self, engine: str, stage: str, rank: int, address: tuple[str, int], meta: WorkerMetadata
    ) -> Peer:
        """Load the agent `meta` names and prepare its slab for READs."""
        host, port = address
        region = meta.regions[0] if len(meta.regions) == 1 else None
        if region is None or region.block_len < 1 or region.num_blocks < 1:
            raise ProtocolError(f"{engine} rank {rank} at {host}:{port}: not a stage slab")
        if region.block_len != self.slot_bytes:  # a READ pairs slots of equal length
            raise ConfigError(
                f"slot_bytes: {engine} rank {rank} at {host}:{port} has slots of "
                f"{region.block_len} bytes, this rank {self.slot_bytes}: every stage of a "
                "pipeline needs the same"
            )
        agent = self.backend.add_remote(meta.agent_metadata)
        rows = np.zeros((region.num_blocks, 3), dtype=np.uint64)
        rows[:, 0] = region.base_addr + region.block_len * np.arange(
            region.num_blocks, dtype=np.uint64
        )
        rows[:, 1] = region.block_len
        try:
            slab = self.backend.prep_remote(agent, rows, MemType.DRAM)
        except BaseException:
            self.backend.remove_remote(agent)
            raise
        offset = self._client.clock_offsets.get(engine)  # this rank's: just measured
        incarnation = meta.agent_metadata_sha256 or sha256_hex(meta.agent_metadata)
        peer = Peer(
            stage, rank, agent, slab, region.block_len, region.num_blocks, offset,
            meta.tp_size, address, incarnation,
        )  # fmt: skip
        self.peers[(stage, rank)] = peer
        return peer

    def connect_ranks(
        self,
        stage: str,
        ranks: list[int],
        addresses: Mapping[int, tuple[str, int]],
        *,
        size: int | None = None,
    ) -> dict[int, Peer]:
        """`connect` each of `ranks` of `stage` (of `size` ranks); every one needs an address."""
        missing = [r for r in ranks if r not in addresses]
        if missing:
            raise ConfigError(f"no address for rank(s) {missing} of stage {stage!r}")
        return {r: self.connect(stage, r, *addresses[r], size=size) for r in ranks}

    def close(self) -> None:
        for peer in self.peers.values():
            peer.slab.release()
        self.peers.clear()
        for name in ("_client", "server"):
            part = getattr(self, name, None)
            if part is not None:
                part.close()
        local = getattr(self, "local", None)
        if local is not None:
            local.release()
        for reg in self._regs:
            reg.release()
        self._regs.clear()
        self.backend.close()

    def __enter__(self) -> StageEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nixl(name: str, num_threads: int | None) -> TransferBackend:
    from kvrdma.nixl import NixlBackend

    threads = num_threads if num_threads is not None else ucx_num_threads()
    return NixlBackend(BackendConfig(name=name, num_threads=threads))
