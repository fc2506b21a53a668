"""The handshake server refuses what it could not serve and survives what peers send."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from kvrdma.cli.agent import AgentCollector
from kvrdma.errors import ConfigError, HandshakeError, ProtocolError
from kvrdma.handshake import HandshakeClient, HandshakeServer, SidecarPublisher, replies_queue
from kvrdma.handshake.entries import Entry
from kvrdma.handshake.wire import (
    MAX_ENGINE_ID_LENGTH,
    MAX_PUBLISH_BYTES,
    MAX_PUBLISHED_BYTES,
    MAX_REQUEST_BYTES,
    ErrorReply,
    MetadataRequest,
    MetadataResponse,
    ProtocolViolation,
    RankDescriptors,
    client_codec,
)
from kvrdma.metadata import RegionMeta, WorkerMetadata, sha256_hex
from kvrdma.testing import worker_metadata
from kvrdma.testing.zmtp import MANY_FRAMES, UNFINISHED, send_until_dropped, zmtp_peer

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
ENGINE = "prefill"


def worker(
    rank: int = 0, tp: int = 2, *, engine: str = ENGINE, **changes: object
) -> WorkerMetadata:
    fields = {"engine_id": engine, "agent_name": f"agent-{rank}", "cache_layout": "blocks_first"}
    fields |= {"regions": [RegionMeta(0x1000_0000 * (rank + 1), 8, 4096, "attn", 2)], **changes}
    return worker_metadata(rank=rank, tp_size=tp, num_blocks=8, **fields)


@pytest.fixture
def server(ctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[HandshakeServer]:
    srv = HandshakeServer(HOST, 0, context=ctx, publish_address="tcp://127.0.0.1:0")
    yield srv
    srv.close()


def fetch_ok(ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer) -> None:
    with HandshakeClient(context=ctx, timeout=5.0, tp_size=2) as client:
        got = client.fetch(HOST, server.port, ENGINE, [0, 1], use_cache=False)
    assert got == {0: worker(0), 1: worker(1)}


def ask(
    ctx: zmq.Context[zmq.Socket[bytes]],
    port: int,
    frames: list[bytes],
    kind: int = zmq.DEALER,
    wait_ms: int = 5000,
) -> MetadataResponse | ErrorReply | None:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{HOST}:{port}")
        sock.send_multipart(frames)
        if not sock.poll(wait_ms):
            return None
        return client_codec().decode(sock.recv_multipart()[-1])
    finally:
        sock.close(linger=0)


def request(*ranks: int, engine: str = ENGINE) -> bytes:
    return msgspec.msgpack.encode(MetadataRequest(engine_id=engine, ranks=list(ranks)))


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        # A blocks-first region whose V half would start past 2**64 (its reply cannot encode).
        ({"regions": [RegionMeta(2**64 - 4096, 8, 4096, "attn", 2)]}, "64-bit address space"),
        ({"regions": [RegionMeta(0x1000, 8, 4096, "attn", 2, 2**64)]}, "device_id"),
        ({"block_size": 2**65}, "cannot be encoded"),
        ({"engine_id": "p" * (MAX_ENGINE_ID_LENGTH + 1)}, "at most 256"),
    ],
)
def test_unservable_publish_is_refused_with_a_reason(
    ctx: zmq.Context[zmq.Socket[bytes]],
    server: HandshakeServer,
    changes: dict[str, object],
    fragment: str,
) -> None:
    with pytest.raises(ProtocolError, match=fragment):
        server.publish(worker(0, **changes))
    assert server.published() == {}
    assert server.stats["publish_bad"] == 1
    server.publish(worker(0))
    server.publish(worker(1))
    fetch_ok(ctx, server)


def test_publish_over_the_socket_is_refused_before_it_can_break_a_reply(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    assert server.publish_address is not None
    bad = worker(0, regions=[RegionMeta(2**64 - 4096, 8, 4096, "attn", 2)])
    with SidecarPublisher(server.publish_address, context=ctx, timeout=5.0) as pub:
        with pytest.raises(HandshakeError, match=r"invalid_metadata.*64-bit"):
            pub.publish(bad)
        pub.publish(worker(0))
        pub.publish(worker(1))
    fetch_ok(ctx, server)
    assert server.alive


def test_publish_for_another_engine_is_refused(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with HandshakeServer(
        HOST, 0, context=ctx, publish_address="tcp://127.0.0.1:0", engine_id=ENGINE
    ) as server:
        with pytest.raises(ProtocolViolation, match="serves engine 'prefill' only") as info:
            server.publish(worker(0, engine="intruder"))
        assert info.value.code == "wrong_engine"
        assert server.publish_address is not None
        with SidecarPublisher(server.publish_address, context=ctx, timeout=5.0) as pub:
            with pytest.raises(HandshakeError, match="wrong_engine"):
                pub.publish(worker(1, engine="intruder"))
            pub.publish(worker(0))
            pub.publish(worker(1))
        assert server.published() == {(ENGINE, 0): [0, 1]}


@pytest.mark.parametrize(
    ("ranks", "fragment"),
    [((0, 0), r"ranks must be distinct, got \[0\] repeated"), ((1, 2), r"\[2\] outside")],
)
def test_repeated_or_out_of_tp_ranks_are_bad_requests(
    ctx: zmq.Context[zmq.Socket[bytes]],
    server: HandshakeServer,
    ranks: tuple[int, ...],
    fragment: str,
) -> None:
    server.publish(worker(0))
    server.publish(worker(1))
    reply = ask(ctx, server.port, [request(*ranks)])
    assert isinstance(reply, ErrorReply)
    assert reply.code == "bad_request"
    assert re.search(fragment, reply.message), reply.message
    assert server.stats["requests_bad"] == 1
    client = HandshakeClient(context=ctx, timeout=2.0, tp_size=2)
    with client, pytest.raises(HandshakeError, match="bad_request"):
        client.fetch(HOST, server.port, ENGINE, [0, 5])  # not retried: it can never succeed


def test_a_reply_over_the_frame_limit_is_refused(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    blob = b"m" * 3000
    with HandshakeServer(HOST, 0, context=ctx, max_frame_bytes=5000) as server:
        for rank in (0, 1):
            server.publish(
                worker(rank, agent_metadata=blob, agent_metadata_sha256=sha256_hex(blob))
            )
        with pytest.raises(ProtocolViolation, match="over the 5000-byte limit"):
            big = b"m" * 6000
            server.publish(worker(0, agent_metadata=big, agent_metadata_sha256=sha256_hex(big)))
        assert isinstance(ask(ctx, server.port, [request(0)]), MetadataResponse)
        reply = ask(ctx, server.port, [request(0, 1)])
        assert isinstance(reply, ErrorReply) and reply.code == "too_large", reply


def test_published_bytes_are_bounded_and_freed_room_is_used_again(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    blob = b"m" * (MAX_PUBLISH_BYTES - (64 << 10))  # about the largest one publish carries
    digest = sha256_hex(blob)

    def big(rank: int) -> WorkerMetadata:
        return worker(rank, 64, agent_metadata=blob, agent_metadata_sha256=digest)

    held = 0
    with pytest.raises(ProtocolViolation, match=f"{MAX_PUBLISHED_BYTES} bytes") as info:
        for rank in range(64):
            server.publish(big(rank))
            held += 1
    assert info.value.code == "too_large"
    assert 0 < held < 64 and held * len(blob) <= MAX_PUBLISHED_BYTES
    assert server.published() == {(ENGINE, 0): list(range(held))}
    server.publish(big(0))  # a rank published again replaces its own bytes
    assert server.publish_address is not None
    with SidecarPublisher(server.publish_address, context=ctx, timeout=10.0) as pub:
        with pytest.raises(HandshakeError, match="too_large"):
            pub.publish(big(held))
        assert server.unpublish(ENGINE, 0)
        pub.publish(big(held))
    assert server.alive


def test_req_multipart_error_keeps_the_delimiter(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    t0 = time.monotonic()
    reply = ask(ctx, server.port, [request(0), b"extra"], kind=zmq.REQ)
    assert isinstance(reply, ErrorReply) and reply.code == "bad_frame", reply
    assert time.monotonic() - t0 < 2.0


def test_oversized_request_frame_is_dropped_unread(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    server.publish(worker(0))
    server.publish(worker(1))
    # ZMQ drops the connection on the frame header: no reply, nothing buffered or decoded.
    assert ask(ctx, server.port, [b"\x00" * (64 << 20)], wait_ms=300) is None
    fetch_ok(ctx, server)
    assert server.stats["requests_bad"] == 0


def test_a_reply_that_fails_to_encode_is_an_internal_error_not_a_dead_thread(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    server.publish(worker(0))
    server.publish(worker(1))
    # Only a bug could store an entry publish() would refuse; the reply path must survive it.
    broken = worker(0, block_size=2**65)
    server._workers[(ENGINE, 0)][0] = Entry(broken, RankDescriptors(tp_rank=0), 0)
    reply = ask(ctx, server.port, [request(0)])
    assert isinstance(reply, ErrorReply) and reply.code == "internal", reply
    assert server.alive
    server.publish(worker(0))
    fetch_ok(ctx, server)
    assert server.stats["requests_internal_error"] == 1


BAD_TIMEOUTS = [math.inf, 1e9, math.nan, -1.0, 0, True, "5"]


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=repr)
def test_bad_fetch_timeout_is_refused_before_sending(
    ctx: zmq.Context[zmq.Socket[bytes]], timeout: object
) -> None:
    listener = ctx.socket(zmq.ROUTER)
    listener.setsockopt(zmq.LINGER, 0)
    try:
        port = listener.bind_to_random_port(f"tcp://{HOST}")
        with HandshakeClient(context=ctx, timeout=5.0) as client:
            with pytest.raises(ConfigError, match=r"^timeout: expected a number of seconds"):
                client.fetch(HOST, port, ENGINE, [0], timeout=timeout)  # type: ignore[arg-type]
            with pytest.raises(ConfigError, match=r"^timeout: "):
                client.refresh(HOST, port, ENGINE, [0], timeout=timeout)  # type: ignore[arg-type]
        assert not listener.poll(200), "a request was sent despite the bad timeout"
    finally:
        listener.close(linger=0)
    with pytest.raises(ConfigError, match=r"^timeout: "):
        HandshakeClient(context=ctx, timeout=timeout)  # type: ignore[arg-type]
    pub = SidecarPublisher("tcp://127.0.0.1:9", context=ctx)
    with pub, pytest.raises(ConfigError, match=r"^timeout: "):
        pub.publish(worker(0), timeout=timeout)  # type: ignore[arg-type]


def test_engine_id_too_long_to_request_is_refused_before_sending(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    client = HandshakeClient(context=ctx, timeout=5.0)
    with client, pytest.raises(ConfigError, match="engine_id: expected 1 to 256 characters"):
        client.fetch(HOST, 9, "e" * 257, [0])


def test_oversized_publish_is_dropped_unread_and_refused_by_the_publisher(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    assert server.publish_address is not None
    port = int(server.publish_address.rsplit(":", 1)[1])
    server.publish(worker(0))
    server.publish(worker(1))
    assert ask(ctx, port, [b"\x00" * (MAX_PUBLISH_BYTES + 1)], wait_ms=300) is None
    fetch_ok(ctx, server)
    blob = b"b" * MAX_PUBLISH_BYTES
    huge = worker(0, agent_metadata=blob, agent_metadata_sha256=sha256_hex(blob))
    pub = SidecarPublisher(server.publish_address, context=ctx, timeout=5.0)
    with pub, pytest.raises(HandshakeError, match="over the sidecar's 16777216-byte limit"):
        pub.publish(huge)
    assert server.stats["publish_bad"] == 0


# Peers that ask without ever reading (receive queue of 1, kernel buffer of 4 KiB), each under
# its own identity, in their own process so that what they hold is not this one's memory.
NEVER_READ = """
import sys, zmq
port, peers, asks, request = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ctx = zmq.Context()
socks = []
for _ in range(peers):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.connect(f"tcp://127.0.0.1:{port}")
    socks.append(s)
for s in socks:
    for _ in range(asks):
        s.send(bytes.fromhex(request))
print("sent", flush=True)
sys.stdin.read()
"""


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_peers_that_never_read_hold_a_bounded_number_of_reply_bytes(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    """8 ranks of 1 MiB make an 8 MiB reply; 8 peers ask for it 24 times each and never read:
    the server keeps a bounded number of reply bytes (queued, or in ZMQ's queues), not one
    per request, and serves again once they are gone."""
    blob = os.urandom(1 << 20)
    for rank in range(8):
        server.publish(worker(rank, 8, agent_metadata=blob))
    peers, asks = 8, 24
    before = rss_bytes()
    args = [str(server.port), str(peers), str(asks), request(*range(8)).hex()]
    with subprocess.Popen(
        [sys.executable, "-c", NEVER_READ, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as flood:
        try:
            assert flood.stdout is not None and flood.stdout.readline().strip() == "sent"
            end = time.monotonic() + 30
            while server.stats["requests_ok"] < peers * asks:
                assert time.monotonic() < end, server.stats
                time.sleep(0.05)
            time.sleep(0.5)  # what ZMQ still writes out
            grown = rss_bytes() - before
        finally:
            flood.kill()
    # the server's bound (`replies_queue.MAX_BYTES`, 256 MiB) and room for the allocator
    assert grown < 384 << 20, f"{grown >> 20} MiB held for replies"
    with HandshakeClient(context=ctx, timeout=5.0, tp_size=8) as client:
        got = client.fetch(HOST, server.port, ENGINE, list(range(8)), use_cache=False)
    assert sorted(got) == list(range(8))


def test_replies_queued_for_a_peer_that_left_stop_counting_once_the_socket_runs(
    ctx: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer asks for 12 big replies and disconnects before reading: ZMQ drops what it had
    queued for it once the socket next runs (as the server's loop does), so those replies stop
    counting without any connection to shut down, and a big reply goes to the next peer."""
    monkeypatch.setattr(replies_queue, "MAX_BYTES", 16 << 20)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.copy_threshold = 0
    port = router.bind_to_random_port(f"tcp://{HOST}")
    q = replies_queue.ReplyQueue()

    def peer() -> tuple[zmq.Socket[bytes], bytes]:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.RCVBUF, 4096)
        s.connect(f"tcp://{HOST}:{port}")
        s.send(b"ask")
        assert router.poll(5000)
        return s, router.recv_multipart()[0]

    try:
        leaving, identity = peer()
        for _ in range(12):  # more than the kernel's socket buffers take
            q.send(router, [identity, os.urandom(1 << 20)])
        assert q.held_bytes > 0
        leaving.close()
        end = time.monotonic() + 5.0
        while q.held_bytes and time.monotonic() < end:
            router.poll(10)  # the socket runs: it sees the pipe end and drops its messages
            q.flush()
        assert q.held_bytes == 0 and not q.stalled
        reader, identity = peer()
        q.send(router, [identity, bytes(7 << 20)])
        assert reader.poll(5000) and len(reader.recv()) == 7 << 20 and q.dropped == 0
        reader.close()
    finally:
        router.close()


def test_a_peer_that_reads_none_of_its_replies_loses_its_connection(
    ctx: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Peers that keep asking for a big reply and never read (their receive window shut):
    ZMQ holds what it could not write, counted until written, and once a reply waited
    `MAX_AGE_S` the server shuts that connection down, which frees it; the server's memory
    stays bounded and others are served."""
    monkeypatch.setattr(replies_queue, "MAX_AGE_S", 1.0)
    blob = os.urandom(4 << 20)
    with HandshakeServer(HOST, 0, context=ctx) as server:
        server.publish(worker(0, 1, agent_metadata=blob))
        ask_big = request(0)
        before = rss_bytes()
        peers = [zmtp_peer(HOST, server.port, rcvbuf=4096) for _ in range(8)]
        try:
            end, grown = time.monotonic() + 5.0, 0
            while time.monotonic() < end:
                for raw in peers:
                    with contextlib.suppress(OSError):
                        raw.sendall(b"\x00" + bytes([len(ask_big)]) + ask_big)
                grown = max(grown, rss_bytes() - before)
                time.sleep(0.2)
            assert server.alive
            with HandshakeClient(context=ctx, timeout=5.0, tp_size=1) as client:
                assert client.fetch(HOST, server.port, ENGINE, [0], use_cache=False) == {
                    0: worker(0, 1, agent_metadata=blob)
                }
        finally:
            for raw in peers:
                raw.close()
    # the server's bound (`replies_queue.MAX_BYTES`, 256 MiB) and room for the allocator
    assert grown < 320 << 20, f"{grown >> 20} MiB held for peers that read nothing"


def drops(server: HandshakeServer) -> dict[tuple[str, str], float | None]:
    """`kvrdma_handshake_connections_dropped_total` as the agent's /metrics exports it for
    `server`, by (socket, reason); each closed-set pair is exported, at 0 before any drop."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(server, lambda: (True, {})))
    return {
        (sock, why): registry.get_sample_value(
            "kvrdma_handshake_connections_dropped_total", {"socket": sock, "reason": why}
        )
        for sock in ("side_channel", "publish")
        for why in ("unfinished_message", "idle")
    }


@pytest.mark.parametrize("socket_name", ["side_channel", "publish"])
def test_a_message_that_never_ends_is_dropped_before_it_fills_the_server(
    ctx: zmq.Context[zmq.Socket[bytes]], socket_name: str
) -> None:
    """libzmq keeps every frame of a message until its last one, about 64 bytes for each
    2-byte empty frame, with no limit on their number: a peer that never ends its message
    must lose its connection long before the server's memory does, others are served, and
    the drop is counted as one (of that socket, for that reason), not as a bad request.
    Publish frames are bounded as requests are, so that both sockets drop within 8 MiB."""
    with HandshakeServer(
        HOST,
        0,
        context=ctx,
        publish_address="tcp://127.0.0.1:0",
        max_frame_bytes=MAX_REQUEST_BYTES,
    ) as server:
        server.publish(worker(0))
        server.publish(worker(1))
        assert server.publish_address is not None
        publish_port = int(server.publish_address.rsplit(":", 1)[1])
        before = rss_bytes()
        with zmtp_peer(
            HOST, server.port if socket_name == "side_channel" else publish_port
        ) as peer:
            sent = send_until_dropped(peer, UNFINISHED, 8 << 20)
        grown = rss_bytes() - before
        assert sent >= 0, "connection kept open after 8 MiB of one message"
        assert grown < 128 << 20, f"{grown >> 20} MiB held for one unfinished message"
        fetch_ok(ctx, server)
        want = dict.fromkeys(drops(server), 0.0) | {(socket_name, "unfinished_message"): 1.0}
        assert drops(server) == want
        assert server.stats["requests_bad"] == server.stats["publish_bad"] == 0


def test_many_unfinished_messages_are_bounded_together(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    """32 peers each send 192 KiB of one message, less than one connection may, but more than
    all together may: the largest lose their connections, the rest are kept."""
    server.publish(worker(0))
    server.publish(worker(1))
    peers = [zmtp_peer(HOST, server.port) for _ in range(32)]
    try:
        for peer in peers:
            with contextlib.suppress(ConnectionError):
                peer.sendall(b"\x01\x00" * (96 << 10))
        time.sleep(1.0)
        dropped = 0
        for peer in peers:
            peer.settimeout(0.05)
            with contextlib.suppress(TimeoutError):
                try:
                    dropped += peer.recv(1) == b""
                except ConnectionError:
                    dropped += 1
        assert 8 <= dropped < 32, f"{dropped} of 32 connections dropped"
        assert drops(server)[("side_channel", "unfinished_message")] == dropped
        assert server.stats["side_channel_dropped_unfinished_message"] == dropped
        assert server.stats["requests_bad"] == 0  # no request was ever delivered
        fetch_ok(ctx, server)
    finally:
        for peer in peers:
            peer.close()


FEW_DESCRIPTORS = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
from kvrdma.handshake import HandshakeServer
from kvrdma.testing import worker_metadata
with HandshakeServer("127.0.0.1", 0) as server:
    server.publish(worker_metadata(rank=0, tp_size=1, num_blocks=8, engine_id="prefill"))
    print(server.port, flush=True)
    sys.stdin.read()
    print(json.dumps(server.stats), flush=True)
"""


def test_idle_connections_cannot_take_every_descriptor(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A server with 256 descriptors gets 600 connections that greet and then say nothing:
    libzmq would hold them forever and, out of descriptors, accept no one else (spinning on
    the listening socket); the idlest are dropped, and counted as such, so that a real client
    is still served."""
    with subprocess.Popen(
        [sys.executable, "-c", FEW_DESCRIPTORS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        idle: list[socket.socket] = []
        try:
            assert proc.stdout is not None
            port = int(proc.stdout.readline())
            for _ in range(600):  # connecting without waiting: the listen backlog fills up
                peer = socket.socket()
                peer.setblocking(False)
                peer.connect_ex((HOST, port))
                idle.append(peer)
            time.sleep(0.5)
            for peer in idle:
                with contextlib.suppress(OSError):
                    peer.send(b"\xff" + bytes(8) + b"\x7f\x03\x01" + b"NULL".ljust(20, b"\0"))
            with HandshakeClient(context=ctx, timeout=10.0, tp_size=1) as client:
                got = client.fetch(HOST, port, ENGINE, [0], use_cache=False)
            assert list(got) == [0]
            stats = json.loads(proc.communicate("", timeout=10)[0])
            assert stats["side_channel_dropped_idle"] > 0
            assert stats["side_channel_dropped_unfinished_message"] == stats["requests_bad"] == 0
        finally:
            proc.kill()
            for peer in idle:
                peer.close()


def test_a_long_lived_connection_is_bounded_per_message_not_in_all(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    """One connection asks 2,000 times, far more bytes in all than a connection may send
    without ending a message: every request is answered on that same connection."""
    server.publish(worker(0))
    server.publish(worker(1))
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(f"tcp://{HOST}:{server.port}")
        frame = msgspec.msgpack.encode(
            MetadataRequest(engine_id=ENGINE, ranks=[0, 1], requester="r" * 256)
        )
        for _ in range(2000):
            sock.send(frame)
            assert sock.poll(5000), "no reply"
            sock.recv()
        assert 2000 * len(frame) > 256 << 10
        assert not monitor.poll(0), "the server dropped the connection"
        assert server.stats["requests_ok"] == 2000
    finally:
        monitor.close(linger=0)
        sock.close()


def test_a_flood_of_messages_of_many_frames_holds_no_memory_and_others_are_served(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    """Whole messages of many empty frames, each under the byte bound, sent as fast as four
    connections (reconnecting once dropped) take them: each frame costs libzmq far more than
    its bytes and the server a receive, so the server must refuse such a message (a bad
    request), shut its connection down, keep few queued per connection, and keep serving
    others, each fetch within its deadline (slower: the flood costs CPU); its memory must not
    grow with the flood."""
    server.publish(worker(0))
    server.publish(worker(1))
    stop, before = threading.Event(), rss_bytes()

    def flood() -> None:
        while not stop.is_set():
            try:
                with zmtp_peer(HOST, server.port) as peer:
                    while not stop.is_set():
                        peer.sendall(MANY_FRAMES)
            except OSError:
                time.sleep(0.01)

    floods = [threading.Thread(target=flood, daemon=True) for _ in range(4)]
    for t in floods:
        t.start()
    grown, served, took = 0, 0, []
    try:
        end, latest = time.monotonic() + 6.0, time.monotonic() + 30.0
        while (time.monotonic() < end or served < 5) and time.monotonic() < latest:
            t0 = time.monotonic()
            fetch_ok(ctx, server)  # within its 5 s deadline, or it raises
            took.append(time.monotonic() - t0)
            served += 1
            grown = max(grown, rss_bytes() - before)
            if grown >= 1 << 30:
                break
            time.sleep(0.2)
    finally:
        stop.set()
        for t in floods:
            t.join(timeout=10)
    assert grown < 512 << 20, f"{grown >> 20} MiB held during the flood"
    assert served >= 5 and server.stats["requests_bad"] > 0 and server.alive
    assert statistics.median(took) < 3.0, f"fetches took {took} s during the flood"


def test_port_probes_are_not_counted_as_unauthenticated_without_curve(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    """A TCP probe (a Kubernetes `tcpSocket` check), an HTTP request or a torn greeting to the
    side channel fails libzmq's handshake; without CURVE nothing is authenticated, so none is
    a refused client on the dashboard."""
    server.publish(worker(0))
    server.publish(worker(1))
    for data in (b"", b"GET / HTTP/1.0\r\n\r\n", b"\xff" + bytes(8) + b"\x7f\x03"):
        with socket.create_connection((HOST, server.port), timeout=5) as probe:
            probe.sendall(data)
    time.sleep(0.5)  # the monitor's events come in on the server's thread
    fetch_ok(ctx, server)
    assert server.stats["requests_unauthenticated"] == 0, server.stats
