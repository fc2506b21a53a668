"""Pure checks at the NIXL boundary (no nixl import): the checksummed envelope around NIXL
agent metadata, descriptor and id arrays validated before NIXL sees them, and error texts.
`kvrdma.nixl.agent` uses these; they are here to keep that module small.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import numpy.typing as npt

from kvrdma.errors import HandshakeError, PeerUnreachable, TransferError
from kvrdma.nixl.protocol import DescIds, out_of_range_ids

_I32, _I64 = np.dtype(np.int32), np.dtype(np.int64)
MD_MAGIC = b"KVRDMD\x01"  # envelope: magic+version, blake2b-16 digest of the payload, payload
DIGEST = 16
_NIXL_MD_HEAD = b"nixlSerDes|Agent"  # NIXL's blob starts with the agent name: u64 LE len + bytes


def wrap_metadata(payload: bytes) -> bytes:
    """NIXL agent metadata → the checksummed envelope `add_remote` accepts."""
    return MD_MAGIC + hashlib.blake2b(payload, digest_size=DIGEST).digest() + payload


def unwrap_metadata(blob: bytes) -> bytes:
    """The NIXL payload of an envelope; `HandshakeError` if it is not one or is corrupted."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise HandshakeError(f"agent metadata: expected bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    head = len(MD_MAGIC) + DIGEST
    if not blob.startswith(MD_MAGIC) or len(blob) <= head:
        raise HandshakeError(
            f"not kvrdma agent metadata: expected {len(MD_MAGIC) + DIGEST}+ bytes starting "
            f"{MD_MAGIC!r}, got {len(blob)} bytes starting {blob[: len(MD_MAGIC)]!r}"
        )
    payload = blob[head:]
    want = blob[len(MD_MAGIC) : head]
    got = hashlib.blake2b(payload, digest_size=DIGEST).digest()
    if got != want:
        raise HandshakeError(
            f"agent metadata is corrupted: checksum {got.hex()} of the {len(payload)} payload "
            f"bytes does not match {want.hex()} (expected the blob unchanged since metadata())"
        )
    return payload


def peek_agent_name(payload: bytes) -> str | None:
    """The agent name at the head of a NIXL blob, or None if the layout is not recognised."""
    start = len(_NIXL_MD_HEAD) + 8
    if not payload.startswith(_NIXL_MD_HEAD) or len(payload) < start:
        return None
    n = int.from_bytes(payload[len(_NIXL_MD_HEAD) : start], "little")
    if n == 0 or len(payload) < start + n:
        return None
    try:
        return payload[start : start + n].decode()
    except UnicodeDecodeError:
        return None


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def is_peer_lost(exc: BaseException) -> bool:
    """NIXL says the remote agent disconnected."""
    return type(exc).__name__ == "nixlRemoteDisconnectError"


def failure_reason(exc: BaseException, op: str, peer: str) -> str:
    name = type(exc).__name__
    if is_peer_lost(exc):
        return f"{op} with agent {peer!r} failed: remote agent disconnected ({name})"
    if name == "nixlNotFoundError":
        return f"{op} with agent {peer!r} failed: agent was removed or re-registered ({name})"
    return f"{op} with agent {peer!r} failed: {describe(exc)}"


def as_desc_array(descs: Any, what: str, widths: tuple[int, ...]) -> npt.NDArray[np.uint64]:
    arr = np.asarray(descs)
    if arr.ndim != 2 or arr.shape[1] not in widths or arr.dtype.kind not in "iu":
        raise TransferError(
            f"{what}: expected an integer array of shape (N, {' or '.join(map(str, widths))}), "
            f"got shape {arr.shape} dtype {arr.dtype}"
        )
    if arr.shape[0] == 0:
        raise TransferError(f"{what}: expected at least one descriptor, got none")
    if arr.dtype.kind == "i" and arr.min() < 0:
        raise TransferError(f"{what}: negative value in row {int(np.argmin(arr.min(axis=1)))}")
    return np.ascontiguousarray(arr, dtype=np.uint64)


def as_ids(ids: Any, what: str, size: int, whose: str) -> DescIds | list[int]:
    """`ids` as NIXL takes indices into a list of `size` descriptors prepared for `whose`:
    a list of ints as it is (NIXL's binding refuses a non-int or a value past int32), an
    array as a contiguous int32 array, or `TransferError`. NIXL casts wider integer arrays
    to int32 without a check (2**32 + 1 selects descriptor 1), so those are range-checked
    here before the cast; int32 arrays and lists go as they are (NIXL refuses an index
    outside its list, and `NixlBackend.post` names it)."""
    if type(ids) is list:
        if not ids:
            raise TransferError(f"{what}: expected at least one descriptor id, got none")
        return ids
    arr = np.asarray(ids)
    dt = arr.dtype
    if arr.ndim != 1 or dt.kind not in "iu":
        raise TransferError(
            f"{what}: expected a 1-D integer array, got shape {arr.shape} dtype {dt}"
        )
    if arr.size == 0:
        raise TransferError(f"{what}: expected at least one descriptor id, got none")
    if dt != _I32:
        wide = arr if dt == _I64 else arr.astype(np.int64)  # uint64 past 2**63 turns negative
        bad = out_of_range_ids(wide, size)
        if bad.size:
            raise TransferError(id_out_of_range(what, int(bad[0]), size, whose))
        arr = wide.astype(np.int32)
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def refused_ids(ids: DescIds | list[int], what: str, size: int, whose: str) -> str | None:
    """After NIXL refused a request: what is wrong with these `ids`, if anything."""
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError, OverflowError):  # ragged, or ints past int64
        arr = None
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iu":
        return f"{what}: expected a flat sequence of integer descriptor ids, got {ids[:4]!r}"
    bad = out_of_range_ids(arr.astype(np.int64), size)
    return id_out_of_range(what, int(bad[0]), size, whose) if bad.size else None


def id_out_of_range(what: str, bad: int, size: int, whose: str) -> str:
    return f"{what}: id {bad} is out of range for the {size} descriptors prepared for {whose}"


def load_error(exc: BaseException, name: str | None, size: int) -> HandshakeError:
    """The error for NIXL refusing a peer's metadata: `PeerUnreachable` where the metadata
    was understood but the peer's address could not be connected to (UCX reports that as
    a backend error), `HandshakeError` for metadata NIXL would not take."""
    who = f"agent {name or '(unknown name)'!r}"
    if type(exc).__name__ == "nixlBackendError":
        return PeerUnreachable(
            f"cannot connect to {who} ({describe(exc)}): its process has exited, or its "
            "address cannot be reached from here",
            agent=name,
        )
    return HandshakeError(f"NIXL rejected the metadata of {who} ({size} bytes): {describe(exc)}")
