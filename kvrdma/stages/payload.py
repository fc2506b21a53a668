"""The unit a stage sends: one request's per-layer KV, its block ids and metadata, packed.

A payload packs into one flat byte buffer — a bytearray to put on a wire, or one uint8
tensor on any device to register with NIXL — laid out as a magic, a msgspec header, then each
tensor's raw bytes at an aligned offset. The header describes the tensors as runs of equal
ones lying back to back (a model's K and V of every layer are one run), so its size and the
work of reading it grow with the kinds of tensors, not with their number. Raw bytes make it
lossless for every dtype (bfloat16, float8, bool, complex...), and each tensor is copied
exactly once each way: packed into aligned host memory by one memcpy per tensor (a large
payload's on two cores, `kvrdma.stages.memcpy`), elsewhere a run moves as one tensor; unpacked
by one copy of all its bytes, a large host payload's into memory that is reused once the caller
drops the tensors (`kvrdma.stages.hostpool`).
"""

from __future__ import annotations

import ctypes
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from kvrdma.errors import MALFORMED, ConfigError, ProtocolError
from kvrdma.stages.hostpool import HostPool
from kvrdma.stages.memcpy import Job, copy_all

MAGIC = b"KVST"
VERSION = 2
_PREFIX = struct.Struct("<4sII")  # magic, version, header length
ALIGN = 64  # every tensor starts on a cache line (and any dtype's alignment)
# unpack copies a payload up to this size with one clone: the allocator recycles memory this
# small, and torch's threads copy it; a larger one goes into memory from a `HostPool`, as a
# fresh allocation of its size is mapped anew and zero-filled by the kernel on every call
_ONE_CLONE_BYTES = 4 << 20
# torch copies a tensor of at most this many elements on the calling thread (its grain size),
# so a run of such tensors is one stack in C++ rather than a memcpy per tensor from Python;
# larger ones would wake torch's threads once per tensor
_SERIAL_NUMEL = 32768
# a payload holds at most this many tensors: a header of a few bytes cannot make a reader
# build millions of (empty) tensors
MAX_TENSORS = 1 << 16

_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
# the dtypes a payload carries: quantized tensors' values are not their bytes alone
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype) and d not in _QUANTIZED
}
_NAMES = {d: name for name, d in _DTYPES.items()}
_MAX_DIM = 1 << 63  # torch sizes are int64
_STRIDED = torch.strided
_POOL = HostPool()  # unpacked copies' memory, shared by the process's receivers


class _RunSpec(msgspec.Struct, array_like=True, frozen=True):
    """`count` tensors of one dtype and shape, back to back from `offset` (after the header)."""

    dtype: str
    shape: list[int]
    offset: int
    count: int


class _Header(msgspec.Struct, frozen=True):
    request_id: str
    block_ids: list[int]
    metadata: dict[str, Any]
    layers: list[int]  # how many tensors each layer has, in order
    runs: list[_RunSpec]  # every tensor, in order
    key: str = ""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Header)


@dataclass
class StagePayload:
    """One request's KV for one receiver: `layers[i]` holds layer i's tensors, e.g. `(K, V)`
    (or one tensor for MLA), each covering the request's blocks in `block_ids` order."""

    request_id: str
    layers: list[tuple[torch.Tensor, ...]]  # a payload being sent may hold `Rows` too
    block_ids: list[int] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    key: str = ""  # the shard key it travels under (set by `StageSender`)


class Rows:
    """Rows `index` of `source` along its first axis, gathered only as they are packed: a
    request's blocks go from a paged cache straight into the packed buffer, copied once. It
    stands in a payload where a tensor would (its `dtype` and `shape` are the gathered ones)."""

    __slots__ = ("index", "source")
    layout = _STRIDED

    def __init__(self, source: torch.Tensor, index: torch.Tensor) -> None:
        self.source, self.index = source, index

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.index.numel(), *self.source.shape[1:]))

    def numel(self) -> int:
        return self.shape.numel()

    def gather(self) -> torch.Tensor:
        """The rows as a new tensor (on the source's device)."""
        return self.source.index_select(0, self.index)

    def gather_into(self, out: torch.Tensor) -> None:
        """Write the rows' values into `out` (of their dtype and shape)."""
        if out.device == self.source.device:
            torch.index_select(self.source, 0, self.index, out=out)
        else:  # index_select writes only on its source's device
            out.copy_(self.gather(), non_blocking=out.is_cuda)


Packable = torch.Tensor | Rows


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Run:
    """Tensors of one dtype and shape lying back to back from `offset`: they move as
    one tensor of one more dimension, so the per-tensor cost is paid once per run."""

    __slots__ = ("count", "dtype", "end", "nbytes", "offset", "shape", "tensors")

    def __init__(self, offset: int, dtype: torch.dtype, shape: Sequence[int], nbytes: int):
        self.offset, self.dtype, self.shape, self.nbytes = offset, dtype, shape, nbytes
        self.tensors: list[Packable] = []
        self.count = 1
        self.end = offset + nbytes if nbytes % ALIGN == 0 else -1  # a gap follows otherwise

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        """The run's bytes in `buf` as a `[count, *shape]` tensor of its dtype."""
        size = self.count * self.nbytes
        return buf[self.offset : self.offset + size].view(self.dtype).view(self.count, *self.shape)


def plan_pack(payload: StagePayload) -> PackPlan:
    """Where each of `payload`'s tensors goes (checked and encoded once: `pack_into` is
    `plan_pack(payload).into(out)`, and a sender sizing its buffer first keeps the plan)."""
    if not isinstance(payload.request_id, str) or not payload.request_id:
        raise ConfigError(f"request_id: expected a non-empty string, got {payload.request_id!r}")
    counts = [len(layer) for layer in payload.layers]
    if sum(counts) > MAX_TENSORS:
        raise ConfigError(f"layers: {sum(counts)} tensors; a payload holds at most {MAX_TENSORS}")
    runs, offset = _plan_runs(payload.layers)
    specs = [_RunSpec(_NAMES[r.dtype], list(r.shape), r.offset, r.count) for r in runs]
    try:
        header = _ENCODER.encode(
            _Header(
                payload.request_id,
                [int(b) for b in payload.block_ids],
                payload.metadata,
                counts,
                specs,
                payload.key,
            )
        )
    except (TypeError, OverflowError, msgspec.EncodeError) as exc:
        raise ConfigError(
            f"request {payload.request_id!r}: block_ids or metadata cannot be packed: {exc}"
        ) from exc
    head = _PREFIX.pack(MAGIC, VERSION, len(header)) + header
    start = _up(len(head))
    for r in runs:
        r.offset += start
    return PackPlan(start + offset, head, runs)


def _plan_runs(layers: Sequence[Sequence[Packable]]) -> tuple[list[_Run], int]:
    """`layers`' tensors as runs (offsets from the end of the header) and their end. The
    loop runs once per tensor, so it reads each tensor's attributes once and keeps the
    current run's in locals."""
    runs: list[_Run] = []
    run: _Run | None = None
    offset = end = 0  # where the next tensor goes; where it goes if it extends `run`
    dtype_: torch.dtype | None = None
    shape_: torch.Size | None = None
    tensor = torch.Tensor
    for layer in layers:
        for t in layer:
            if (not isinstance(t, tensor) and not isinstance(t, Rows)) or t.layout is not _STRIDED:
                raise _not_dense(layers, t)
            dtype, shape = t.dtype, t.shape
            if run is not None and offset == end and dtype is dtype_ and shape == shape_:
                run.count += 1
                run.tensors.append(t)
                offset = end = end + run.nbytes
                continue
            if dtype in _QUANTIZED:
                raise _not_dense(layers, t)
            run = _Run(offset, dtype, shape, t.numel() * dtype.itemsize)
            run.tensors.append(t)
            runs.append(run)
            dtype_, shape_, end = dtype, shape, run.end
            offset = -(-(offset + run.nbytes) // ALIGN) * ALIGN
    return runs, offset


def _not_dense(layers: Sequence[Sequence[Packable]], t: object) -> ConfigError:
    """The error for `t`, found in `layers`, which a payload cannot carry."""
    where = next(
        f"layers[{i}][{j}]" for i, layer in enumerate(layers) for j, u in enumerate(layer) if u is t
    )
    return ConfigError(f"{where}: expected a dense tensor, got {t!r:.60}")


def _raw(t: torch.Tensor) -> bool:
    """`t` is host memory whose bytes are its values in order (no lazy conj/neg bit)."""
    return (
        t.is_cpu
        and t.is_contiguous()
        and not t.is_neg()
        and not (t.dtype.is_complex and t.is_conj())
    )


def _fill(out: torch.Tensor, head: bytes, runs: list[_Run], recheck: bool) -> None:
    if recheck:
        for run in runs:
            for t in run.tensors:
                _check_planned(run, t)
    host = _raw(out)
    if host:
        ctypes.memmove(out.data_ptr(), head, len(head))
    else:
        out[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    overlap = out.is_cuda  # `into` then waits for out's stream; host memory is written now
    if host and not out.storage_offset() % ALIGN:
        copy_all([job for run in runs for job in _memcpys(out, run)])
        return
    if out.storage_offset() % ALIGN:  # typed views of `out` need aligned offsets
        for run in runs:
            for k, t in enumerate(run.tensors):
                lo = run.offset + k * run.nbytes
                # a byte view reads bytes, not values: resolve lazy conj/neg bits and strides
                values = (t.gather() if isinstance(t, Rows) else t).resolve_conj().resolve_neg()
                values = values.contiguous()
                out[lo : lo + run.nbytes].copy_(
                    values.view(-1).view(torch.uint8), non_blocking=overlap
                )
        return
    for run in runs:
        dst = run.view(out)
        if run.count > 1 and all(_on(t, out.device) for t in run.tensors):
            torch.stack(run.tensors, out=dst)  # type: ignore[arg-type]
        else:  # stack wants tensors on one device; copy_ crosses devices
            _copy_each(dst, run.tensors, overlap)


def _on(t: Packable, device: torch.device) -> bool:
    return isinstance(t, torch.Tensor) and t.device == device


def _copy_each(dst: torch.Tensor, tensors: list[Packable], overlap: bool) -> None:
    """Each of `tensors` into its row of `dst` (`Rows` gathered straight into it)."""
    for d, t in zip(dst.unbind(0), tensors, strict=True):
        if isinstance(t, Rows):
            t.gather_into(d)
        else:
            d.copy_(t, non_blocking=overlap)


def _memcpys(out: torch.Tensor, run: _Run) -> list[Job]:
    """Memcpys of `run`'s tensors into host `out`, for those whose bytes are their values
    in order; the rest (on a device, strided, lazily negated or conjugated) are copied by
    torch now, as are `Rows` and a run of small host tensors (one stack)."""
    if any(isinstance(t, Rows) for t in run.tensors):
        _copy_each(run.view(out), run.tensors, False)
        return []
    tensors: list[torch.Tensor] = run.tensors  # type: ignore[assignment]
    if run.count > 1 and math.prod(run.shape) <= _SERIAL_NUMEL and all(t.is_cpu for t in tensors):
        torch.stack(tensors, out=run.view(out))
        return []
    base, jobs = out.data_ptr(), []
    lo, n, conj = run.offset, run.nbytes, run.dtype.is_complex
    for t in tensors:
        if t.is_cpu and t.is_contiguous() and not t.is_neg() and not (conj and t.is_conj()):
            jobs.append((base + lo, t.data_ptr(), n))
        else:
            out[lo : lo + n].view(run.dtype).view(run.shape).copy_(t)
        lo += n
    return jobs


def _check_planned(run: _Run, t: Packable) -> None:
    """`t` still has the dtype and shape its header states (a plan kept across calls)."""
    if t.dtype != run.dtype or t.shape != run.shape:
        raise ConfigError(
            f"a tensor planned as {run.dtype} {tuple(run.shape)} is now {t.dtype} "
            f"{tuple(t.shape)}: plan the payload again"
        )


@dataclass(frozen=True)
class PackPlan:
    """A payload's packed layout: `nbytes` long, written by `into`."""

    nbytes: int
    head: bytes
    runs: list[_Run]

    def into(self, out: torch.Tensor, *, recheck: bool = True) -> int:
        """Pack into the front of `out`, a 1-D uint8 tensor; returns the bytes used.
        `recheck=False` skips checking that every tensor still has its planned dtype and
        shape: only for a plan made just now, from tensors nothing else touches."""
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < self.nbytes:
            raise ConfigError(
                f"out: expected a 1-D uint8 tensor of at least {self.nbytes} bytes, "
                f"got {out.dtype} {tuple(out.shape)}"
            )
        with torch.no_grad():  # a byte copy: `out=` ops refuse inputs that require grad
            _fill(out, self.head, self.runs, recheck)
        if out.device.type == "cuda":
            torch.cuda.current_stream(out.device).synchronize()
        return self.nbytes


def packed_size(payload: StagePayload) -> int:
    """Bytes `pack_into` needs for `payload`."""
    return plan_pack(payload).nbytes


def pack_into(payload: StagePayload, out: torch.Tensor) -> int:
    """Pack into the front of `out`, a 1-D uint8 tensor (e.g. a registered staging buffer,
    so no memory is allocated or first touched per request); returns the bytes used."""
    return plan_pack(payload).into(out, recheck=False)


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


def unpack_tensor(
    buf: torch.Tensor, *, copy: bool = False, pool: HostPool | None = None
) -> StagePayload:
    """Read a payload back from a packed uint8 tensor; tensors view `buf` unless `copy`: then
    they view one copy of its tensor bytes, a clone up to 4 MiB, else (in host memory) a copy
    in memory from `pool` (the process's own by default) reused once they are all gone."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ConfigError(f"buf: expected a 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
    size = buf.numel()
    prefix = bytes(buf[: _PREFIX.size].cpu().numpy())
    hlen, start = _header(prefix, size)
    raw = bytes(buf[_PREFIX.size : _PREFIX.size + hlen].cpu().numpy())
    try:
        header = _DECODER.decode(raw)
    except MALFORMED as exc:
        what = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ProtocolError(f"stage payload: bad header: {what}") from exc
    runs, end = _read_runs(header, size - start)
    data = buf[start : start + end]
    if copy and data.is_cpu and end > _ONE_CLONE_BYTES:  # torch's threads copy it in one call
        data = (pool or _POOL).empty(end).copy_(data)
    elif copy:
        data = data.clone()
    elif data.storage_offset() % ALIGN:  # typed views need aligned offsets
        raise ConfigError(
            f"buf: starts {buf.storage_offset()} bytes into its storage; tensors viewing "
            f"it need a multiple of {ALIGN} (or copy=True)"
        )
    flat: list[torch.Tensor] = []
    for run in runs:
        try:
            flat.extend(run.view(data).unbind(0))
        except RuntimeError as exc:  # a dtype torch cannot view bytes as
            raise ProtocolError(f"stage payload: tensors of {run.dtype}: {exc}") from exc
    layers, i = [], 0
    for n in header.layers:
        layers.append(tuple(flat[i : i + n]))
        i += n
    return StagePayload(
        header.request_id, layers, list(header.block_ids), dict(header.metadata), header.key
    )


def _read_runs(header: _Header, room: int) -> tuple[list[_Run], int]:
    """A header's runs, each checked to fit `room` bytes, and their end; the layers' tensor
    counts checked against the runs'."""
    runs: list[_Run] = []
    end = total = 0
    for spec in header.runs:
        dtype = _DTYPES.get(spec.dtype)
        if dtype is None:
            raise ProtocolError(
                f"stage payload: expected a dtype a payload carries, got {spec.dtype!r}"
            )
        lo, count, n = spec.offset, spec.count, _numel(spec.shape) * dtype.itemsize
        total += count
        if count < 1 or total > MAX_TENSORS or lo < 0 or lo % ALIGN or lo + count * n > room:
            raise ProtocolError(
                f"stage payload: a run of {count} tensors {spec.dtype}{spec.shape} at {lo} "
                f"does not fit the {room} bytes after the header (at most {MAX_TENSORS} tensors)"
            )
        run = _Run(lo, dtype, spec.shape, n)
        run.count = count
        runs.append(run)
        end = max(end, lo + count * n)
    if any(c < 0 for c in header.layers) or sum(header.layers) != total:
        raise ProtocolError(
            f"stage payload: the layers name {sum(header.layers)} tensors, the runs hold {total}"
        )
    return runs, end


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
        if not 0 <= d < _MAX_DIM:
            raise ProtocolError(f"stage payload: expected dimensions in [0, 2**63), got {shape}")
        n *= d
    return n
