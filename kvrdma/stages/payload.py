"""The unit a stage sends: one request's per-layer KV, its block ids and metadata, packed.

A payload packs into one flat byte buffer — a bytearray to put on a wire, or one uint8
tensor on any device to register with NIXL — laid out as a magic, a msgspec header that
describes every tensor, then each tensor's raw bytes at an aligned offset. Raw bytes make it
lossless for every dtype (bfloat16, float8, bool, complex...), and each tensor is copied
exactly once each way, so packing runs at copy speed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from kvrdma.errors import ConfigError, ProtocolError

MAGIC = b"KVST"
VERSION = 1
_PREFIX = struct.Struct("<4sII")  # magic, version, header length
_ALIGN = 64  # every tensor starts on a cache line (and any dtype's alignment)

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


class _TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


class _Header(msgspec.Struct, frozen=True):
    request_id: str
    block_ids: list[int]
    metadata: dict[str, Any]
    layers: list[list[_TensorSpec]]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Header)


@dataclass
class StagePayload:
    """One request's KV for one receiver: `layers[i]` holds layer i's tensors, e.g. `(K, V)`
    (or one tensor for MLA), each covering the request's blocks in `block_ids` order."""

    request_id: str
    layers: list[tuple[torch.Tensor, ...]]
    block_ids: list[int] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _plan(payload: StagePayload) -> tuple[bytes, list[tuple[torch.Tensor, int]], int]:
    """The encoded prefix+header, each tensor with its offset, and the total size."""
    if not isinstance(payload.request_id, str) or not payload.request_id:
        raise ConfigError(f"request_id: expected a non-empty string, got {payload.request_id!r}")
    specs: list[list[_TensorSpec]] = []
    placed: list[tuple[torch.Tensor, int]] = []
    offset = 0
    for i, layer in enumerate(payload.layers):
        row = []
        for j, t in enumerate(layer):
            if not isinstance(t, torch.Tensor) or t.is_quantized or t.is_sparse:
                raise ConfigError(f"layers[{i}][{j}]: expected a dense tensor, got {t!r:.60}")
            nbytes = t.numel() * t.element_size()
            row.append(
                _TensorSpec(str(t.dtype).removeprefix("torch."), list(t.shape), offset, nbytes)
            )
            placed.append((t, offset))
            offset = _up(offset + nbytes)
        specs.append(row)
    try:
        header = _ENCODER.encode(
            _Header(
                payload.request_id, [int(b) for b in payload.block_ids], payload.metadata, specs
            )
        )
    except (TypeError, msgspec.EncodeError) as exc:
        raise ConfigError(
            f"request {payload.request_id!r}: metadata cannot be packed: {exc}"
        ) from exc
    head = _PREFIX.pack(MAGIC, VERSION, len(header)) + header
    start = _up(len(head))
    return head, [(t, start + off) for t, off in placed], start + offset


def _fill(out: torch.Tensor, head: bytes, placed: list[tuple[torch.Tensor, int]]) -> None:
    out[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    for t, off in placed:
        flat = t.reshape(-1).view(torch.uint8)
        out[off : off + flat.numel()].copy_(flat, non_blocking=True)


def packed_size(payload: StagePayload) -> int:
    """Bytes `pack_into` needs for `payload`."""
    return _plan(payload)[2]


def pack_into(payload: StagePayload, out: torch.Tensor) -> int:
    """Pack into the front of `out`, a 1-D uint8 tensor (e.g. a registered staging buffer,
    so no memory is allocated or first touched per request); returns the bytes used."""
    head, placed, total = _plan(payload)
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < total:
        raise ConfigError(
            f"out: expected a 1-D uint8 tensor of at least {total} bytes, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    _fill(out, head, placed)
    if out.device.type == "cuda":
        torch.cuda.current_stream(out.device).synchronize()
    return total


def pack_tensor(payload: StagePayload, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """Pack into a new uint8 tensor on `device`."""
    out = torch.empty(packed_size(payload), dtype=torch.uint8, device=device)
    pack_into(payload, out)
    return out


def pack(payload: StagePayload) -> bytearray:
    """Pack into host bytes."""
    buf = bytearray(packed_size(payload))
    if buf:
        pack_into(payload, torch.frombuffer(buf, dtype=torch.uint8))
    return buf


def _header(prefix: bytes, size: int) -> tuple[int, int]:
    if len(prefix) < _PREFIX.size:
        raise ProtocolError(f"stage payload: {size} bytes is too short for its prefix")
    magic, version, hlen = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"stage payload: expected magic {MAGIC!r}, got {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"stage payload: expected version {VERSION}, got {version}")
    if _PREFIX.size + hlen > size:
        raise ProtocolError(f"stage payload: header of {hlen} bytes overruns {size} bytes")
    return hlen, _up(_PREFIX.size + hlen)


def unpack_tensor(buf: torch.Tensor, *, copy: bool = False) -> StagePayload:
    """Read a payload back from a packed uint8 tensor; tensors view `buf` unless `copy`."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ConfigError(f"buf: expected a 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
    size = buf.numel()
    prefix = bytes(buf[: _PREFIX.size].cpu().numpy())
    hlen, start = _header(prefix, size)
    raw = bytes(buf[_PREFIX.size : _PREFIX.size + hlen].cpu().numpy())
    try:
        header = _DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"stage payload: bad header: {exc}") from exc
    layers = []
    for row in header.layers:
        tensors = []
        for spec in row:
            dtype = _DTYPES.get(spec.dtype)
            if dtype is None:
                raise ProtocolError(f"stage payload: unknown dtype {spec.dtype!r}")
            lo = start + spec.offset
            expected = _numel(spec.shape) * torch.empty((), dtype=dtype).element_size()
            if spec.offset % _ALIGN or spec.nbytes != expected or lo + spec.nbytes > size:
                raise ProtocolError(
                    f"stage payload: tensor {spec.dtype}{spec.shape} at {spec.offset} "
                    f"({spec.nbytes} bytes) does not fit the {size}-byte buffer"
                )
            t = buf[lo : lo + spec.nbytes].view(dtype).view(spec.shape)
            tensors.append(t.clone() if copy else t)
        layers.append(tuple(tensors))
    return StagePayload(header.request_id, layers, list(header.block_ids), dict(header.metadata))


def unpack(data: bytes | bytearray | memoryview, *, copy: bool = True) -> StagePayload:
    """Read a payload back from host bytes. Read-only input is copied once; with a bytearray
    and `copy=False` the tensors view it."""
    writable = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
    buf = data if writable else bytearray(data)
    if len(buf) < _PREFIX.size:
        raise ProtocolError(f"stage payload: {len(buf)} bytes is too short for its prefix")
    tensor = torch.frombuffer(buf, dtype=torch.uint8)
    return unpack_tensor(tensor, copy=copy and writable)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        if d < 0:
            raise ProtocolError(f"stage payload: negative dimension in {shape}")
        n *= d
    return n
