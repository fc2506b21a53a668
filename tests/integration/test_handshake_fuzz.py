"""Fuzz the handshake server with ≥ 10,000 hostile frames while real handshakes keep working."""

from __future__ import annotations

import os
import random
import struct
import time
from collections import Counter
from collections.abc import Callable

import msgspec
import pytest
import zmq

from kvrdma.handshake import HandshakeClient, HandshakeServer
from kvrdma.handshake.wire import (
    ErrorReply,
    MetadataRequest,
    MetadataResponse,
    client_codec,
)
from kvrdma.metadata import RegionMeta, WorkerMetadata
from kvrdma.testing import worker_metadata

HOST = "127.0.0.1"
FRAMES = 20_000
BATCH = 200
WINDOW = 8
MAX_FRAME = 1 << 20
RSS_SLACK_BYTES = 24 << 20

pytestmark = pytest.mark.timeout(120)


def worker(rank: int) -> WorkerMetadata:
    # 32 blocks-first regions: a large reply, so a leak per frame shows in the RSS
    regions = [RegionMeta(0x10_0000 * (i + 1), 128, 8192, "attn", 2) for i in range(32)]
    fields = {"cache_layout": "blocks_first", "regions": regions, "compat_hash": "c" * 64}
    return worker_metadata("prefill", rank, 2, num_blocks=128, **fields)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Mutator:
    """Deterministic generator of hostile frame lists (each list = one multipart message)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.valid = msgspec.msgpack.encode(
            MetadataRequest(engine_id="prefill", ranks=[0, 1], requester="fuzz", tp_size=2)
        )
        self.kinds: list[Callable[[], list[bytes]]] = [
            self.random_bytes,
            self.truncated,
            self.bit_flips,
            self.wrong_types,
            self.huge_lengths,
            self.wrong_version,
            self.frame_parts,
            self.deep_nesting,
            self.wrong_message,
        ]

    def next(self) -> list[bytes]:
        return self.rng.choice(self.kinds)()

    def random_bytes(self) -> list[bytes]:
        return [self.rng.randbytes(self.rng.randint(1, 600))]

    def truncated(self) -> list[bytes]:
        return [self.valid[: self.rng.randint(1, len(self.valid) - 1)]]

    def bit_flips(self) -> list[bytes]:
        data = bytearray(self.valid)
        for _ in range(self.rng.randint(1, 6)):
            data[self.rng.randrange(len(data))] = self.rng.randrange(256)
        return [bytes(data)]

    def random_value(self, depth: int = 0) -> object:
        choice = self.rng.randrange(8 if depth < 3 else 5)
        if choice == 0:
            return self.rng.randint(-(2**63), 2**64 - 1)
        if choice == 1:
            return self.rng.random() * 1e300
        if choice == 2:
            return "".join(chr(self.rng.randint(0, 0x2FFF)) for _ in range(self.rng.randint(0, 8)))
        if choice == 3:
            return self.rng.randbytes(self.rng.randint(0, 16))
        if choice == 4:
            return self.rng.choice([None, True, False])
        if choice == 5:
            return [self.random_value(depth + 1) for _ in range(self.rng.randint(0, 4))]
        if choice == 6:
            return {str(i): self.random_value(depth + 1) for i in range(self.rng.randint(0, 4))}
        return {"type": "metadata_request", "version": 1}

    def wrong_types(self) -> list[bytes]:
        msg: dict[str, object] = {
            "type": "metadata_request",
            "version": 1,
            "engine_id": "prefill",
            "ranks": [0],
        }
        field = self.rng.choice(
            ["type", "version", "engine_id", "ranks", "dp_index", "tp_size", "block_size"]
        )
        msg[field] = self.random_value()
        return [msgspec.msgpack.encode(msg)]

    def huge_lengths(self) -> list[bytes]:
        header = self.rng.choice([b"\xc6", b"\xdb", b"\xdd", b"\xdf"])  # bin32 str32 arr32 map32
        size = struct.pack(">I", self.rng.choice([0xFFFFFFFF, 0x7FFFFFFF, 0x10000000]))
        prefix = self.rng.choice([b"", b"\x84\xa4type\xb0metadata_request\xa5ranks"])
        return [prefix + header + size + self.rng.randbytes(self.rng.randint(0, 32))]

    def wrong_version(self) -> list[bytes]:
        version = self.rng.choice([0, 2, 3, 255, -1, 2**40])
        msg = msgspec.msgpack.decode(self.valid)
        msg["version"] = version
        return [msgspec.msgpack.encode(msg)]

    def frame_parts(self) -> list[bytes]:
        n = self.rng.choice([2, 3, 4, 7])
        parts = [self.rng.choice([b"", self.valid, self.rng.randbytes(8)]) for _ in range(n)]
        if parts[:2] == [b"", self.valid] and n == 2:  # that one is a valid REQ envelope
            parts.append(b"extra")
        return parts if self.rng.random() < 0.8 else [b""]

    def deep_nesting(self) -> list[bytes]:
        depth = self.rng.choice([100, 10_000, 60_000])  # under MAX_REQUEST_BYTES
        return [b"\x82\xa4type\xb0metadata_request\xa1z" + b"\x91" * depth + b"\x01"]

    def wrong_message(self) -> list[bytes]:
        tag = self.rng.choice(["publish", "error", "metadata_response", "unpublish", "nope"])
        return [msgspec.msgpack.encode({"type": tag, "version": 1})]


def test_server_survives_fuzz_and_keeps_serving(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    server = HandshakeServer(HOST, 0, context=ctx, max_frame_bytes=MAX_FRAME)
    client = HandshakeClient(context=ctx, timeout=5.0, tp_size=2, compat_hash="c" * 64)
    fuzz = ctx.socket(zmq.DEALER)
    fuzz.setsockopt(zmq.LINGER, 0)
    codec = client_codec()
    mutator = Mutator(seed=20240601)
    codes: Counter[str] = Counter()
    try:
        for rank in (0, 1):
            server.publish(worker(rank))
        fuzz.connect(f"tcp://{HOST}:{server.port}")
        expected = {0: worker(0), 1: worker(1)}

        def handshake_ok() -> None:
            got = client.fetch(HOST, server.port, "prefill", [0, 1], use_cache=False)
            assert got == expected

        def send_batch(n: int) -> int:
            errors = 0
            # The server keeps few replies queued per peer, so at most WINDOW are in flight.
            for start in range(0, n, WINDOW):
                window = min(WINDOW, n - start)
                for _ in range(window):
                    fuzz.send_multipart(mutator.next())
                for _ in range(window):  # exactly one reply per message, whatever it held
                    assert fuzz.poll(5000), "the server stopped answering"
                    reply = codec.decode(fuzz.recv_multipart()[-1])  # [b"", reply] for REQ
                    assert isinstance(reply, ErrorReply | MetadataResponse)
                    if isinstance(reply, ErrorReply):
                        errors += 1
                        codes[reply.code] += 1
            return errors

        handshake_ok()
        errors = send_batch(1000)  # warm up allocator pools before measuring memory
        handshake_ok()
        rss_before = rss_bytes()
        sent, t0 = 1000, time.monotonic()
        while sent < FRAMES:
            errors += send_batch(BATCH)
            sent += BATCH
            handshake_ok()  # valid requests keep succeeding throughout
            if sent % 2000 == 0:
                oversized = ctx.socket(zmq.DEALER)  # the server drops this connection
                oversized.setsockopt(zmq.LINGER, 0)
                oversized.connect(f"tcp://{HOST}:{server.port}")
                oversized.send(b"\x00" * (MAX_FRAME + 1))
                assert not oversized.poll(50)
                oversized.close(linger=0)
        elapsed = time.monotonic() - t0
        handshake_ok()
        rss_growth = rss_bytes() - rss_before
        stats = server.stats
    finally:
        fuzz.close(linger=0)
        client.close()
        server.close()
    assert sent >= FRAMES
    assert errors > 0.95 * sent
    assert stats["requests_bad"] >= errors - stats["requests_rejected"]
    assert stats["requests_internal_error"] == 0
    assert {"bad_frame", "bad_message", "bad_version"} <= set(codes), codes
    assert rss_growth < RSS_SLACK_BYTES, f"RSS grew {rss_growth / 2**20:.1f} MiB"
    print(f"fuzz: {sent} frames in {elapsed:.1f} s, RSS +{rss_growth / 2**20:.2f} MiB, {codes}")
