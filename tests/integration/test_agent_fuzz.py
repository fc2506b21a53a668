"""Fuzz a real `kvrdma agent` process on every port it opens, with real handshakes in between.

Over 20,000 malformed inputs (seeded): ZMQ frames to the handshake port (random bytes,
truncated or oversized msgpack, wrong types, versions and tags, many frames), raw TCP garbage
to that same port, malformed and unservable publishes to the publish socket, and hostile HTTP
to the probe/metrics port. Throughout, valid handshakes must return exactly the published
metadata, no bad publish may be accepted, and the agent's RSS must stay bounded.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable

import msgspec
import pytest
import zmq

from kvrdma.handshake import HandshakeClient, SidecarPublisher
from kvrdma.handshake.wire import (
    ErrorReply,
    MetadataRequest,
    MetadataResponse,
    PublishAck,
    PublishRequest,
    UnpublishRequest,
    client_codec,
    publish_client_codec,
)
from kvrdma.metadata import RegionMeta
from tests.integration.sidecar_helpers import ENGINE, HOST, Agent, http_get, rss_bytes, worker
from tests.integration.test_handshake_fuzz import Mutator

pytestmark = pytest.mark.timeout(180)

SEED = 20261124
HANDSHAKE_FRAMES = 14_000
PUBLISH_FRAMES = 4_000
TCP_GARBAGE = 1_000
HTTP_INPUTS = 2_000
WINDOW = 8  # requests in flight per socket (the agent queues few replies per peer)
RSS_GROWTH_LIMIT = 32 << 20


class PublishMutator:
    """Publish-socket messages that must all be refused (unpublishes of other ranks aside)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.base = msgspec.structs.replace(worker(0), cache_layout="blocks_first")
        # A foreign engine id seven bytes away from ours: no few byte flips make it ours.
        self.foreign_meta = msgspec.structs.replace(self.base, engine_id="xxxxxxx-sidecar")
        self.foreign = msgspec.msgpack.encode(PublishRequest(worker=self.foreign_meta))
        self.kinds: list[Callable[[], tuple[list[bytes], bool]]] = [
            self.random_bytes,
            self.mangled_foreign,
            self.invalid_fields,
            self.wrong_types,
            self.wrong_tag,
            self.harmless_unpublish,
        ]

    def next(self) -> tuple[list[bytes], bool]:
        """(frames, whether an ack is acceptable)."""
        return self.rng.choice(self.kinds)()

    def random_bytes(self) -> tuple[list[bytes], bool]:
        return [self.rng.randbytes(self.rng.randint(1, 3000))], False

    def mangled_foreign(self) -> tuple[list[bytes], bool]:
        data = bytearray(self.foreign)
        if self.rng.random() < 0.5:
            del data[self.rng.randint(1, len(data) - 1) :]
        for _ in range(self.rng.randint(0, 4)):
            data[self.rng.randrange(len(data))] = self.rng.randrange(256)
        return [bytes(data)], False

    def invalid_fields(self) -> tuple[list[bytes], bool]:
        r = self.rng
        changes: dict[str, object] = r.choice(
            [
                {"tp_rank": r.choice([2, 7, 2**40])},
                {"block_size": r.choice([0, -1])},
                {"num_blocks": -r.randint(1, 2**40)},
                {"dp_index": -1},
                {"agent_metadata": r.randbytes(64)},  # no longer matches its sha256
                {"agent_name": ""},
                {"engine_id": "e" * r.randint(257, 2000)},
                {"engine_id": r.choice(["", "prefill", ENGINE + "-2"])},
                {"regions": [RegionMeta(2**64 - r.randint(1, 4096), 2, 4096, "attn", 2)]},
                {"regions": [RegionMeta(2**63, 2**40, 2**40)]},
                {"regions": [RegionMeta(0x1000, 4, 4096, "attn", 3)]},
                {"physical_blocks_per_logical": 0},
            ]
        )
        meta = msgspec.structs.replace(self.base, **changes)
        return [msgspec.msgpack.encode(PublishRequest(worker=meta))], False

    def wrong_types(self) -> tuple[list[bytes], bool]:
        msg = msgspec.to_builtins(PublishRequest(worker=self.foreign_meta), builtin_types=(bytes,))
        target = msg["worker"] if self.rng.random() < 0.8 else msg
        target[self.rng.choice(sorted(target))] = self.rng.choice(
            [None, "x", -(2**63), 2**64 - 1, 1.5, [1, [2, [3]]], {"a": b"b"}, b"\x00" * 9, True]
        )
        return [msgspec.msgpack.encode(msg)], False

    def wrong_tag(self) -> tuple[list[bytes], bool]:
        tag = self.rng.choice(["metadata_request", "publish_ack", "error", "nope", ""])
        frames = [msgspec.msgpack.encode({"type": tag, "version": 1, "engine_id": ENGINE})]
        return frames * self.rng.choice([1, 1, 2, 40]), False

    def harmless_unpublish(self) -> tuple[list[bytes], bool]:
        engine, rank, dp = self.rng.choice(
            [("someone-else", 0, 0), (ENGINE, 5, 0), (ENGINE, 0, 3), ("", 0, 0)]
        )
        msg = UnpublishRequest(engine_id=engine or "x", tp_rank=rank, dp_index=dp)
        return [msgspec.msgpack.encode(msg)], True


def zmtp_garbage(rng: random.Random) -> bytes:
    """Bytes a ZMQ peer might choke on: random, a torn greeting, a greeting then nonsense."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
    greeting += b"\x00" + b"\x00" * 31
    return rng.choice(
        [
            rng.randbytes(rng.randint(1, 4096)),
            greeting[: rng.randint(1, len(greeting))],
            greeting + rng.randbytes(rng.randint(1, 512)),
            greeting + b"\x04\xff" + rng.randbytes(64),  # a command frame claiming 255 bytes
            greeting + b"\x06" + struct.pack(">Q", 2**62) + rng.randbytes(32),  # huge frame
        ]
    )


def http_garbage(rng: random.Random) -> bytes:
    path = "".join(chr(rng.randint(33, 0x2FF)) for _ in range(rng.randint(0, 40)))
    return rng.choice(
        [
            rng.randbytes(rng.randint(1, 2000)),
            f"{rng.choice(['GET', 'POST', 'XYZ', 'G E T'])} /{path} HTTP/1.1\r\n\r\n".encode(
                "utf-8", "replace"
            ),
            b"GET /healthz HTTP/9.9\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n",
            b"GET /readyz HTTP/1.1\r\n" + b"H: v\r\n" * 150 + b"\r\n",
            b"GET /metr",
            b"GET " + b"/" * 70_000 + b" HTTP/1.1\r\n\r\n",
        ]
    )


def send_raw(port: int, data: bytes, rng: random.Random) -> None:
    """Send `data` on a fresh TCP connection, then read a little or hang up (maybe with RST)."""
    with socket.create_connection((HOST, port), timeout=5) as s:
        try:
            s.sendall(data)
            if rng.random() < 0.3:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except OSError:
            pass  # the agent may close a hostile connection first


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def exchange(sock: zmq.Socket[bytes], batch: list[list[bytes]]) -> list[bytes]:
    """Send a window of messages and return the last frame of each reply (one per message)."""
    for frames in batch:
        sock.send_multipart(frames)
    replies = []
    for _ in batch:
        assert sock.poll(10_000), "the agent stopped answering"
        replies.append(sock.recv_multipart()[-1])
    return replies


class RawFuzzer(threading.Thread):
    """Raw TCP garbage to the ZMQ port and hostile HTTP, from a second thread meanwhile."""

    def __init__(self, side_port: int, http_port: int) -> None:
        super().__init__(name="raw-fuzz", daemon=True)
        self.ports = side_port, http_port
        self.rng = random.Random(SEED + 1)
        self.sent = Counter[str]()
        self.errors: list[BaseException] = []

    def run(self) -> None:
        try:
            for i in range(max(TCP_GARBAGE, HTTP_INPUTS)):
                if i < TCP_GARBAGE:
                    send_raw(self.ports[0], zmtp_garbage(self.rng), self.rng)
                    self.sent["tcp"] += 1
                if i < HTTP_INPUTS:
                    send_raw(self.ports[1], http_garbage(self.rng), self.rng)
                    self.sent["http"] += 1
        except BaseException as exc:  # reported by the main thread
            self.errors.append(exc)


class ZmqFuzzer:
    """Windows of hostile frames to the handshake and publish sockets, replies tallied."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], agent: Agent) -> None:
        self.rng = random.Random(SEED)
        self.frames = Mutator(seed=SEED)
        self.frames.valid = msgspec.msgpack.encode(
            MetadataRequest(engine_id=ENGINE, ranks=[0, 1], requester="fuzz", tp_size=2)
        )
        self.publishes = PublishMutator(random.Random(SEED + 2))
        self.codes = Counter[str]()
        self.accepted_bad: list[bytes] = []
        self.sent = Counter[str]()
        self.ctx, self.side = ctx, f"tcp://{HOST}:{agent.side_port}"
        self.hs, self.pub = dealer(ctx, self.side), dealer(ctx, agent.publish)

    def handshake_window(self) -> None:
        batch = [self.frames.next() for _ in range(WINDOW)]
        if self.rng.random() < 0.02:  # many frames in one message
            batch[0] = [self.rng.randbytes(4) for _ in range(self.rng.randint(50, 300))]
        for reply in exchange(self.hs, batch):
            msg = client_codec().decode(reply)
            assert isinstance(msg, ErrorReply | MetadataResponse)
            self.codes["hs:" + (msg.code if isinstance(msg, ErrorReply) else "ok")] += 1
        self.sent["hs"] += len(batch)

    def publish_window(self) -> None:
        batch = [self.publishes.next() for _ in range(WINDOW)]
        replies = exchange(self.pub, [frames for frames, _ in batch])
        for (frames, ack_ok), reply in zip(batch, replies, strict=True):
            msg = publish_client_codec().decode(reply)
            self.codes["pub:" + (msg.code if isinstance(msg, ErrorReply) else "ack")] += 1
            if isinstance(msg, PublishAck) and not ack_ok:
                self.accepted_bad.append(frames[0])
        self.sent["pub"] += len(batch)

    def oversized(self) -> None:
        big = dealer(self.ctx, self.side)
        big.send(b"\x92" + b"\x00" * (128 << 10))
        assert not big.poll(20)  # ZMQ drops the connection unread
        big.close(linger=0)
        self.sent["oversized"] += 1

    def close(self) -> None:
        self.hs.close(linger=0)
        self.pub.close(linger=0)


def test_agent_survives_10k_hostile_inputs_on_every_port(
    agent: Agent, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    expected = {0: worker(0), 1: worker(1)}
    with SidecarPublisher(agent.publish, context=ctx, timeout=5.0) as pub:
        for w in expected.values():
            pub.publish(w)
    peer = HandshakeClient(context=ctx, timeout=10.0, tp_size=2, compat_hash="d" * 64)

    def handshake_ok() -> None:
        assert peer.fetch(HOST, agent.side_port, ENGINE, [0, 1], use_cache=False) == expected

    fuzz = ZmqFuzzer(ctx, agent)
    raw = RawFuzzer(agent.side_port, int(agent.http.rsplit(":", 1)[1]))
    try:
        handshake_ok()
        fuzz.handshake_window()  # warm-up before measuring
        rss_before = rss_bytes(agent.proc.pid)
        t0 = time.monotonic()
        raw.start()
        while fuzz.sent["hs"] < HANDSHAKE_FRAMES or fuzz.sent["pub"] < PUBLISH_FRAMES:
            for _ in range(25):
                if fuzz.sent["hs"] < HANDSHAKE_FRAMES:
                    fuzz.handshake_window()
                if fuzz.sent["pub"] < PUBLISH_FRAMES and fuzz.rng.random() < 0.3:
                    fuzz.publish_window()
            handshake_ok()  # valid handshakes keep their metadata throughout
            if fuzz.sent["hs"] % 1000 < 200:
                fuzz.oversized()
        raw.join(timeout=60)
        assert not raw.is_alive(), "raw TCP/HTTP fuzzing did not finish"
        elapsed = time.monotonic() - t0
        handshake_ok()
        rss_growth = rss_bytes(agent.proc.pid) - rss_before
        status, _ = http_get(agent.http + "/healthz")
        ready_status, ready_body = http_get(agent.http + "/readyz")
    finally:
        fuzz.close()
        peer.close()
    assert not raw.errors, raw.errors
    total = sum(fuzz.sent.values()) + sum(raw.sent.values())
    print(f"agent fuzz: {total} inputs in {elapsed:.1f} s, RSS +{rss_growth / 2**20:.1f} MiB")
    print(dict(fuzz.codes), dict(raw.sent))
    assert total >= 10_000
    bad = fuzz.accepted_bad
    assert not bad, f"{len(bad)} bad publishes accepted, e.g. {bad[0]!r}"
    assert fuzz.codes["hs:internal"] == 0 and fuzz.codes["pub:internal"] == 0, fuzz.codes
    assert (status, ready_status) == (200, 200)
    assert '"published_ranks": [0, 1]' in ready_body
    assert rss_growth < RSS_GROWTH_LIMIT, f"agent RSS grew {rss_growth / 2**20:.1f} MiB"
    err = agent.stop()
    assert "Traceback" not in err, err
