"""The handshake wire protocol: msgspec Structs, one tagged union per direction and channel.

Two channels share these messages:

* the **side channel** (peer ⇄ handshake server, ZMQ ROUTER on `host:(base_port + dp_index)`):
  a `MetadataRequest` is answered with a `MetadataResponse` or an `ErrorReply`;
* the **publish channel** (worker ⇄ sidecar, a local ipc:// or loopback socket):
  a `PublishRequest`/`UnpublishRequest` is answered with a `PublishAck` or an `ErrorReply`.

Every message is a msgpack map whose `type` field is the tag and whose first field is the
protocol `version`. Schema evolution follows msgspec's rules: fields are only ever added at
the end, with defaults; a change a peer cannot ignore bumps `PROTOCOL_VERSION` (and is noted
in CHANGELOG.md). Peer bytes are decoded only by the typed `Codec`s below, whose `decode`
raises nothing but `ProtocolError`.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

import msgspec

from kvrdma.defaults import MAX_ENGINE_ID_LENGTH, MAX_TP_SIZE
from kvrdma.errors import MALFORMED, ConfigError, ProtocolError
from kvrdma.metadata import WorkerMetadata, sha256_hex
from kvrdma.nixl.protocol import MemType

PROTOCOL_VERSION = 1
MIN_PROTOCOL_VERSION = 1
# Largest frame either side decodes; larger frames are refused before decoding (ZMQ's
# MAXMSGSIZE drops the connection, and `Codec.decode` checks again).
MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_RANKS_PER_REQUEST = 1024
# Largest metadata_request frame a server accepts: 1024 ranks and three 256-character strings
# fit with room to spare, and anything larger is dropped by ZMQ before it is buffered.
MAX_REQUEST_BYTES = 64 * 1024
# Largest publish frame a server accepts: one rank's metadata, far below what would stall it.
MAX_PUBLISH_BYTES = 16 * 1024 * 1024
# Largest total of published ranks' reply bytes a server holds: publishers cannot grow it
# without bound, and every rank of one engine still fits several times over.
MAX_PUBLISHED_BYTES = 16 * MAX_PUBLISH_BYTES
_ADDRESS_SPACE = 1 << 64

EngineId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ENGINE_ID_LENGTH)]
Identity = Annotated[str, msgspec.Meta(max_length=256)]
HashHex = Annotated[str, msgspec.Meta(max_length=128)]
_MEM_TYPES = frozenset(m.value for m in MemType)
Rank = Annotated[int, msgspec.Meta(ge=0, le=MAX_TP_SIZE)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
MAX_PUBLISH_TTL_S = 86400.0
PublishTtl = Annotated[float, msgspec.Meta(gt=0, le=MAX_PUBLISH_TTL_S)]
Positive = Annotated[int, msgspec.Meta(ge=1)]


def check_publish_ttl(ttl: float | None) -> None:
    """Raise a `ConfigError` unless `ttl` is None or what `PublishTtl` admits."""
    if ttl is not None and not 0 < ttl <= MAX_PUBLISH_TTL_S:
        raise ConfigError(f"ttl: expected seconds in (0, {MAX_PUBLISH_TTL_S:g}], got {ttl!r}")


# Why a request failed; a client retries only the codes in RETRYABLE_CODES.
ErrorCode = Literal[
    "bad_frame",  # wrong number of ZMQ frame parts, empty or oversized payload
    "bad_message",  # not a msgpack message of the expected type
    "bad_version",  # protocol version this agent does not speak
    "unknown_engine",  # no rank of that engine is published here (yet)
    "unknown_rank",  # the engine is here, but not every asked rank (yet)
    "compat_mismatch",  # compatibility hashes differ and the server enforces them
    "invalid_metadata",  # a published WorkerMetadata failed validation
    "internal",  # a bug in the agent; the request was not served
    "bad_request",  # a well-formed request that can never be served (repeated or out-of-TP ranks)
    "wrong_engine",  # a publish for an engine this agent does not serve
    "too_large",  # the reply would exceed the frame limit
]
RETRYABLE_CODES: frozenset[str] = frozenset({"unknown_engine", "unknown_rank"})


# ---------------------------------------------------------------------------- side channel
class MetadataRequest(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="metadata_request"
):
    """A reader asks for the metadata of some TP ranks of one engine (one DP index)."""

    version: int = PROTOCOL_VERSION
    engine_id: EngineId
    ranks: Annotated[list[Rank], msgspec.Meta(min_length=1, max_length=MAX_RANKS_PER_REQUEST)]
    dp_index: NonNegative = 0
    requester: Identity = ""  # who asks: engine id / host / rank, for logs and errors
    compat_hash: HashHex = ""  # the requester's compatibility hash ("" = not given)
    tp_size: Positive = 1  # the requester's TP size
    block_size: NonNegative = 0  # the requester's block size (0 = not given)


class DescriptorSpan(msgspec.Struct, frozen=True, array_like=True):
    """`count` uniform descriptors: descriptor `i` is `(addr + i * stride, length, device_id)`.

    The row order matches NIXL's strided descriptor rows (addr, len, dev, stride, count).
    """

    addr: int
    length: int
    device_id: int
    stride: int
    count: int


class RankDescriptors(msgspec.Struct, frozen=True, kw_only=True):
    """What a reader needs to build its READ descriptor lists against one remote rank.

    `spans` is the remote descriptor table in descriptor-id order (SPEC §2: region-major,
    and for a blocks-first region its K halves then its V halves), so descriptor id
    `r * num_blocks + b` is block `b` of span `r`. Split handles for hetero-TP and Mamba
    reads (SPEC §4) cut these rows by offset/length; `mamba_state_sizes` are the bytes of one
    Mamba state per Mamba region, in region order.
    """

    tp_rank: int
    spans: list[DescriptorSpan] = []
    mamba_state_sizes: list[int] = []


class MetadataResponse(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="metadata_response"
):
    """The metadata of every asked rank, in the order asked."""

    version: int = PROTOCOL_VERSION
    engine_id: str
    workers: list[WorkerMetadata]
    descriptors: list[RankDescriptors] = []
    # the server's clock (the producers' `time.monotonic` on their host) when it built the
    # reply: readers learn its offset to convert lease expiries (None: not told)
    server_time: float | None = None


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="error"):
    """A request that could not be served; `code` says why (see `ErrorCode`)."""

    version: int = PROTOCOL_VERSION
    code: str  # an ErrorCode; plain str so a newer peer's codes still decode
    message: str


# ---------------------------------------------------------------------------- publish channel
class PublishRequest(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="publish"):
    """A worker hands its metadata to the sidecar, which then answers peers for it."""

    version: int = PROTOCOL_VERSION
    worker: WorkerMetadata
    # seconds the sidecar serves the rank unless it is published again (None: until withdrawn),
    # so the ranks of an engine killed without unpublishing stop being served
    ttl: PublishTtl | None = None


class UnpublishRequest(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="unpublish"
):
    """A worker that shuts down withdraws its metadata."""

    version: int = PROTOCOL_VERSION
    engine_id: EngineId
    tp_rank: Rank
    dp_index: NonNegative = 0


class PublishAck(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="publish_ack"):
    """The sidecar stored (or removed) the metadata of `engine_id`/`tp_rank`."""

    version: int = PROTOCOL_VERSION
    engine_id: str
    tp_rank: int
    dp_index: int = 0
    published_ranks: list[int] = []  # ranks of that engine/DP index now held by the sidecar


SideReply = MetadataResponse | ErrorReply
PublishMessage = PublishRequest | UnpublishRequest
PublishReply = PublishAck | ErrorReply


# ---------------------------------------------------------------------------- codecs
class ProtocolViolation(ProtocolError):
    """A `ProtocolError` from `Codec.decode`, with the `ErrorCode` to answer it with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _VersionOnly(msgspec.Struct):
    """Lenient view of any message, used only to explain a failed decode."""

    type: str = ""
    version: int = PROTOCOL_VERSION


T = TypeVar("T")

_PEEK = msgspec.msgpack.Decoder(_VersionOnly)


class Codec(Generic[T]):
    """One socket's encoder and typed decoder, built once.

    `decode` turns a peer's frame into a `T` or raises `ProtocolError` naming what was
    expected, what arrived, and from whom; it never raises anything else.
    """

    def __init__(self, decode_type: Any, expected: str, max_frame_bytes: int = MAX_FRAME_BYTES):
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(decode_type)
        self._encoder = msgspec.msgpack.Encoder()
        self.expected = expected
        self.max_frame_bytes = max_frame_bytes

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, frame: bytes | memoryview, peer: str = "peer") -> T:
        size = len(frame)
        if size == 0:
            raise ProtocolViolation(
                "bad_frame", f"expected {self.expected}, got an empty frame from {peer}"
            )
        if size > self.max_frame_bytes:
            raise ProtocolViolation(
                "bad_frame",
                f"expected {self.expected} of at most {self.max_frame_bytes} bytes, "
                f"got {size} bytes from {peer}",
            )
        try:
            msg = self._decoder.decode(frame)
        except MALFORMED as exc:
            raise self._explain(frame, exc, peer) from None
        version = getattr(msg, "version", None)
        if not isinstance(version, int) or not (
            MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION
        ):
            raise ProtocolViolation("bad_version", _version_message(self.expected, version, peer))
        return msg

    def _explain(
        self, frame: bytes | memoryview, exc: BaseException, peer: str
    ) -> ProtocolViolation:
        # A message from another protocol version may fail for a reason the version explains.
        try:
            peek = _PEEK.decode(frame)
        except Exception:
            peek = None
        if peek is not None and peek.version != PROTOCOL_VERSION:
            return ProtocolViolation(
                "bad_version", _version_message(self.expected, peek.version, peer)
            )
        what = str(exc) or type(exc).__name__
        if isinstance(exc, RecursionError):
            what = "a message nested too deeply"
        return ProtocolViolation(
            "bad_message", f"expected {self.expected}, got invalid data from {peer}: {what}"
        )


def _version_message(expected: str, version: object, peer: str) -> str:
    return (
        f"expected {expected} with protocol version {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}, "
        f"got version {version!r} from {peer}"
    )


def server_codec(max_frame_bytes: int = MAX_FRAME_BYTES) -> Codec[MetadataRequest]:
    """Codec of a handshake server's side-channel socket (decodes requests)."""
    return Codec(MetadataRequest, "a metadata_request message", max_frame_bytes)


def client_codec(max_frame_bytes: int = MAX_FRAME_BYTES) -> Codec[SideReply]:
    """Codec of a handshake client's socket (decodes replies)."""
    return Codec(SideReply, "a metadata_response or error message", max_frame_bytes)


def publish_server_codec(max_frame_bytes: int = MAX_FRAME_BYTES) -> Codec[PublishMessage]:
    """Codec of the sidecar's publish socket (decodes publish/unpublish requests)."""
    return Codec(PublishMessage, "a publish or unpublish message", max_frame_bytes)


def publish_client_codec(max_frame_bytes: int = MAX_FRAME_BYTES) -> Codec[PublishReply]:
    """Codec of a worker's publish socket (decodes acks)."""
    return Codec(PublishReply, "a publish_ack or error message", max_frame_bytes)


# ---------------------------------------------------------------------------- payload rules
def descriptor_spans(meta: WorkerMetadata) -> RankDescriptors:
    """The remote descriptor table of one worker, as strided rows (SPEC §2).

    A blocks-first attention region (two fragments: K half, V half) yields two rows, K then V;
    every other region one row of whole blocks.
    """
    spans: list[DescriptorSpan] = []
    mamba: list[int] = []
    halves = meta.cache_layout in ("blocks_first", "mamba")
    for region in meta.regions:
        if region.kind == "mamba":
            mamba.append(region.block_len)
        if halves and region.kind == "attn" and region.fragments == 2:
            half = region.block_len // 2
            for offset in (0, half):
                spans.append(
                    DescriptorSpan(
                        region.base_addr + offset,
                        half,
                        region.device_id,
                        region.block_len,
                        region.num_blocks,
                    )
                )
        else:
            spans.append(
                DescriptorSpan(
                    region.base_addr,
                    region.block_len,
                    region.device_id,
                    region.block_len,
                    region.num_blocks,
                )
            )
    return RankDescriptors(tp_rank=meta.tp_rank, spans=spans, mamba_state_sizes=mamba)


def worker_problems(meta: WorkerMetadata, digest: str | None = None) -> list[str]:
    """What is wrong with a worker's metadata (empty when it is usable by a reader);
    `digest` is `sha256_hex(meta.agent_metadata)` when the caller has it already."""
    problems: list[str] = []
    if not meta.engine_id:
        problems.append("engine_id is empty")
    elif len(meta.engine_id) > MAX_ENGINE_ID_LENGTH:
        problems.append(
            f"engine_id has {len(meta.engine_id)} characters, at most {MAX_ENGINE_ID_LENGTH} "
            "can be requested"
        )
    if not meta.agent_name:
        problems.append("agent_name is empty")
    if meta.tp_size < 1 or not 0 <= meta.tp_rank < meta.tp_size:
        problems.append(f"tp_rank {meta.tp_rank} is not in [0, tp_size={meta.tp_size})")
    elif meta.tp_size > MAX_TP_SIZE:  # a reader lists the ranks it handshakes with
        problems.append(f"tp_size {meta.tp_size} is over {MAX_TP_SIZE}")
    if meta.mem_type not in _MEM_TYPES:
        problems.append(f"mem_type {meta.mem_type!r} is not one of {sorted(_MEM_TYPES)}")
    if meta.dp_index < 0:
        problems.append(f"dp_index {meta.dp_index} is negative")
    if meta.block_size < 1:
        problems.append(f"block_size {meta.block_size} is not positive")
    if meta.num_blocks < 0:
        problems.append(f"num_blocks {meta.num_blocks} is negative")
    if meta.physical_blocks_per_logical < 1:
        problems.append(
            f"physical_blocks_per_logical {meta.physical_blocks_per_logical} is not positive"
        )
    digest = digest or sha256_hex(meta.agent_metadata)
    if meta.agent_metadata_sha256 != digest:
        problems.append(
            f"agent_metadata_sha256 {meta.agent_metadata_sha256 or '(empty)'!r} does not match "
            f"the {len(meta.agent_metadata)} metadata bytes (sha256 {digest!r})"
        )
    for i, region in enumerate(meta.regions):
        if region.base_addr < 0 or region.block_len < 1 or region.num_blocks < 0:
            problems.append(
                f"region {i} has base_addr={region.base_addr}, block_len={region.block_len}, "
                f"num_blocks={region.num_blocks}"
            )
        elif region.kind != "mamba" and region.num_blocks < meta.num_blocks:
            # block ids are checked against num_blocks: past a region's own they name another's
            problems.append(
                f"region {i} has {region.num_blocks} blocks, fewer than num_blocks "
                f"{meta.num_blocks}"
            )
        elif region.fragments < 1 or region.block_len % region.fragments:
            problems.append(
                f"region {i} block_len {region.block_len} is not a multiple of its "
                f"{region.fragments} fragments"
            )
        elif region.base_addr + region.num_blocks * region.block_len > _ADDRESS_SPACE:
            problems.append(
                f"region {i} (base_addr={region.base_addr:#x}, {region.num_blocks} blocks of "
                f"{region.block_len} bytes) ends past the 64-bit address space"
            )
        elif not 0 <= region.device_id < _ADDRESS_SPACE:
            problems.append(f"region {i} device_id {region.device_id} is not a uint64")
    return problems


def with_checksum(meta: WorkerMetadata) -> WorkerMetadata:
    """`meta` with `agent_metadata_sha256` filled in when it is empty."""
    if meta.agent_metadata_sha256:
        return meta
    return msgspec.structs.replace(meta, agent_metadata_sha256=sha256_hex(meta.agent_metadata))


__all__ = [
    "MAX_ENGINE_ID_LENGTH",
    "MAX_FRAME_BYTES",
    "MAX_PUBLISHED_BYTES",
    "MAX_PUBLISH_BYTES",
    "MAX_PUBLISH_TTL_S",
    "MAX_RANKS_PER_REQUEST",
    "MAX_REQUEST_BYTES",
    "MIN_PROTOCOL_VERSION",
    "PROTOCOL_VERSION",
    "RETRYABLE_CODES",
    "Codec",
    "DescriptorSpan",
    "ErrorCode",
    "ErrorReply",
    "MetadataRequest",
    "MetadataResponse",
    "ProtocolViolation",
    "PublishAck",
    "PublishMessage",
    "PublishReply",
    "PublishRequest",
    "RankDescriptors",
    "SideReply",
    "UnpublishRequest",
    "client_codec",
    "descriptor_spans",
    "publish_client_codec",
    "publish_server_codec",
    "server_codec",
    "with_checksum",
    "worker_problems",
]
