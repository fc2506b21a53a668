"""Handshake server and client over real ZMQ sockets on 127.0.0.1."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvrdma.errors import HandshakeError, HandshakeRefused, HandshakeTimeout, ProtocolError
from kvrdma.handshake import HandshakeClient, HandshakeServer, SidecarPublisher, vllm_peer
from kvrdma.handshake.requester import Waiting
from kvrdma.handshake.wire import (
    ErrorReply,
    MetadataRequest,
    MetadataResponse,
    client_codec,
    descriptor_spans,
)
from kvrdma.metadata import WorkerMetadata
from kvrdma.testing import worker_metadata
from kvrdma.types import HandshakeOutcome

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
COMPAT = "a" * 64


def worker(
    engine: str = "prefill",
    rank: int = 0,
    tp: int = 1,
    *,
    agent: str | None = None,
    block_size: int = 16,
    compat: str = COMPAT,
    dp: int = 0,
) -> WorkerMetadata:
    name = agent or f"{engine}-agent-{rank}"
    fields = {"agent_name": name, "block_size": block_size, "compat_hash": compat, "dp_index": dp}
    return worker_metadata(engine, rank, tp, **fields)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@pytest.fixture
def server(ctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[HandshakeServer]:
    srv = HandshakeServer(HOST, 0, context=ctx)
    yield srv
    srv.close()


def client(ctx: zmq.Context[zmq.Socket[bytes]], **kwargs: object) -> HandshakeClient:
    kwargs.setdefault("timeout", 5.0)
    kwargs.setdefault("compat_hash", COMPAT)
    return HandshakeClient(context=ctx, **kwargs)  # type: ignore[arg-type]


class FakePeer:
    """A ROUTER that answers each request with the next scripted frame (None: stay silent)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], replies: list[bytes | None]):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port(f"tcp://{HOST}")
        self.replies = list(replies)
        self.requests: list[bytes] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for reply in self.replies:
            request = self._next_request()
            if request is None:
                break
            identity, payload = request
            self.requests.append(payload)
            if reply is not None:
                self.sock.send_multipart([identity, reply])

    def _next_request(self) -> tuple[bytes, bytes] | None:
        """The next kvrdma request; side-channel probes are answered as a kvrdma server does."""
        while self.sock.poll(10_000):
            identity, *frames = self.sock.recv_multipart()
            if frames[0] != b"":
                return identity, frames[0]
            self.sock.send_multipart([identity, b"", *vllm_peer.answer_frames()])
        return None

    def close(self) -> None:
        self.thread.join(timeout=11)
        self.sock.close(linger=0)


def needed_ranks(d_rank: int, d_tp: int, p_tp: int) -> list[int]:
    if d_tp >= p_tp:
        return [d_rank // (d_tp // p_tp)]
    k = p_tp // d_tp
    return list(range(d_rank * k, d_rank * k + k))


# ---------------------------------------------------------------------------- round trips
TP_MIXES = [(1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)]


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_MIXES)
def test_round_trip_every_tp_mix(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer, p_tp: int, d_tp: int
) -> None:
    published = {r: worker("prefill", r, p_tp) for r in range(p_tp)}
    for meta in published.values():
        server.publish(meta)
    seen: set[int] = set()
    for d_rank in range(d_tp):
        ranks = needed_ranks(d_rank, d_tp, p_tp)
        with client(ctx, tp_size=d_tp, block_size=16, identity=f"decode/{d_rank}") as c:
            got = c.fetch(HOST, server.port, "prefill", ranks)
            assert list(got) == ranks
            for r in ranks:
                assert got[r] == published[r]
                assert c.get_cached("prefill", r) == published[r]
                assert c.get_descriptors("prefill", r) == descriptor_spans(published[r])
        seen.update(ranks)
    assert seen == set(range(p_tp))  # every P rank is read by some D rank
    assert server.stats["requests_ok"] == d_tp
    assert server.stats["requests_bad"] == 0


def test_one_server_serves_several_engines_and_dp_indexes(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    server.publish(worker("a", 0))
    server.publish(worker("b", 0, agent="b0"))
    server.publish(worker("a", 0, agent="a-dp1", dp=1))
    with client(ctx) as c:
        assert c.fetch(HOST, server.port, "a", [0])[0].agent_name == "a-agent-0"
        assert c.fetch(HOST, server.port, "b", [0])[0].agent_name == "b0"
        assert c.fetch(HOST, server.port, "a", [0], dp_index=1)[0].agent_name == "a-dp1"
    assert server.published() == {("a", 0): [0], ("b", 0): [0], ("a", 1): [0]}


def test_concurrent_clients_all_succeed(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    for r in range(4):
        server.publish(worker("prefill", r, 4))
    start = threading.Barrier(32)
    results: dict[int, dict[int, WorkerMetadata]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with client(ctx, tp_size=8) as c:
                start.wait(timeout=10)
                results[i] = c.fetch(HOST, server.port, "prefill", [i % 4])
        except BaseException as exc:  # collected and re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors, errors
    assert len(results) == 32
    assert all(res[i % 4].tp_rank == i % 4 for i, res in results.items())
    assert server.stats["requests_ok"] == 32


def test_req_socket_framing_is_answered(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    server.publish(worker())
    codec = client_codec()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    try:
        req.connect(f"tcp://{HOST}:{server.port}")
        req.send(codec.encode(MetadataRequest(engine_id="prefill", ranks=[0])))
        assert req.poll(5000)
        reply = codec.decode(req.recv())
    finally:
        req.close(linger=0)
    assert isinstance(reply, MetadataResponse)
    assert reply.workers == [worker()]


def test_vllm_decoder_request_gets_vllms_reply_shape_naming_kvrdma(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    """A stock vLLM decoder (REQ, [b"get_meta_msg", pp, tp]) gets two frames it can decode,
    whose compatibility hash names kvrdma; the agent counts it and keeps serving."""
    server.publish(worker())
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    try:
        req.connect(f"tcp://{HOST}:{server.port}")
        req.send(msgspec.msgpack.encode((b"get_meta_msg", 0, 0)))
        assert req.poll(5000)
        payload, stamp = req.recv_multipart()
    finally:
        req.close(linger=0)
    assert msgspec.msgpack.decode(payload)["compatibility_hash"] == vllm_peer.KVRDMA_HASH
    assert isinstance(msgspec.msgpack.decode(stamp), float)
    assert server.stats["requests_bad"] == 1
    with client(ctx) as c:
        assert c.fetch(HOST, server.port, "prefill", [0])[0] == worker()
    assert (server.stats["requests_bad"], server.stats["requests_ok"]) == (1, 1)


# ---------------------------------------------------------------------------- failures
def test_dead_port_fails_within_deadline(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    port = free_port()
    with client(ctx, timeout=0.5, retries=2) as c:
        t0 = time.monotonic()
        with pytest.raises(HandshakeTimeout) as info:
            c.fetch(HOST, port, "prefill", [0, 1])
        elapsed = time.monotonic() - t0
    assert elapsed < 0.5 + 1.0, elapsed  # the deadline, and slack for a loaded host
    text = str(info.value)
    assert f"{HOST}:{port}" in text
    assert "'prefill'" in text and "[0, 1]" in text
    assert "(3 attempt(s), 2 found no connection up)" in text  # the retries sent nothing


def test_unknown_engine_is_named_after_bounded_retries(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    server.publish(worker("other"))
    with client(ctx, timeout=2.0, retries=2) as c:
        t0 = time.monotonic()
        with pytest.raises(HandshakeRefused) as info:
            c.fetch(HOST, server.port, "prefill", [3])
        took = time.monotonic() - t0
    assert took < 1.5, took  # the backoffs (0.3 s) and three answers, not the deadline
    # the peer's last answer says why: counted as refused, with its code, not as an error
    assert info.value.code == "unknown_engine" and info.value.outcome is HandshakeOutcome.REFUSED
    text = str(info.value)
    assert "unknown_engine" in text and "'prefill'" in text and "other/dp0" in text
    assert f"{HOST}:{server.port}" in text and "[3]" in text
    assert server.stats["requests_rejected"] == 3  # one attempt + two retries


def test_rank_published_during_retries_is_fetched(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    server.publish(worker("prefill", 0, 2))

    def publish_once_refused() -> None:  # the first request refused, rank 1 comes up
        end = time.monotonic() + 5.0
        while server.stats["requests_rejected"] < 1 and time.monotonic() < end:
            time.sleep(0.005)
        server.publish(worker("prefill", 1, 2))

    publisher = threading.Thread(target=publish_once_refused)
    publisher.start()
    try:
        with client(ctx, timeout=3.0, retries=6, tp_size=1) as c:
            got = c.fetch(HOST, server.port, "prefill", [0, 1])
    finally:
        publisher.join()
    assert sorted(got) == [0, 1]
    assert server.stats["requests_rejected"] >= 1


def test_compat_mismatch_rejected_by_server_names_both_hashes(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    server.publish(worker(compat="b" * 64))
    with client(ctx) as c, pytest.raises(HandshakeError) as info:
        c.fetch(HOST, server.port, "prefill", [0])
    text = str(info.value)
    assert "compat_mismatch" in text and "a" * 64 in text and "b" * 64 in text


def test_compat_mismatch_rejected_by_client_names_both_hashes(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with HandshakeServer(HOST, 0, context=ctx, enforce_compat=False) as srv:
        srv.publish(worker(compat="b" * 64))
        with client(ctx) as c, pytest.raises(HandshakeError) as info:
            c.fetch(HOST, srv.port, "prefill", [0])
    text = str(info.value)
    assert "compatibility hash mismatch" in text and "a" * 64 in text and "b" * 64 in text


def test_enforce_handshake_compat_false_passes(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with HandshakeServer(HOST, 0, context=ctx, enforce_compat=False) as srv:
        srv.publish(worker(compat="b" * 64))
        with client(ctx, enforce_compat=False) as c:
            assert c.fetch(HOST, srv.port, "prefill", [0])[0].compat_hash == "b" * 64


def test_tp_size_mismatch_names_both_sizes(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    server.publish(worker("prefill", 0, 3))
    with client(ctx, tp_size=2, enforce_compat=False) as c, pytest.raises(HandshakeError) as info:
        c.fetch(HOST, server.port, "prefill", [0])
    assert "local tp_size 2" in str(info.value) and "remote tp_size 3" in str(info.value)


def test_block_size_mismatch_names_both_sizes(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    server.publish(worker(block_size=32))
    server.publish(worker("small", block_size=8))
    with client(ctx, block_size=16) as c:
        with pytest.raises(HandshakeError) as info:
            c.fetch(HOST, server.port, "prefill", [0])
        assert "local block_size 16" in str(info.value)
        assert "remote block_size 32" in str(info.value)
        # a remote block size that divides the local one is supported (SPEC §5)
        assert c.fetch(HOST, server.port, "small", [0])[0].block_size == 8


def test_restarted_peer_is_detected_by_refresh(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    changes: list[tuple[str, str]] = []
    old, new = worker(agent="p-old"), worker(agent="p-new")
    server.publish(old)

    def on_change(stale: WorkerMetadata, fresh: WorkerMetadata) -> None:
        changes.append((stale.agent_name, fresh.agent_name))

    with client(ctx, on_peer_changed=on_change) as c:
        assert c.fetch(HOST, server.port, "prefill", [0])[0] == old
        unchanged = c.refresh(HOST, server.port, "prefill", [0])
        assert not unchanged.changed and changes == []
        server.publish(new)  # P restarted: same engine and rank, new agent
        assert c.fetch(HOST, server.port, "prefill", [0])[0] == old  # served from the cache
        result = c.refresh(HOST, server.port, "prefill", [0])
        assert result.changed and result.changed_ranks == (0,)
        assert result.stale == {0: old}
        assert result.workers == {0: new}
        assert changes == [("p-old", "p-new")]
        assert c.get_cached("prefill", 0) == new
        assert c.fetch(HOST, server.port, "prefill", [0])[0] == new


def test_forgetting_an_engine_drops_its_cached_reply_and_clock_offset(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    """A decoder that drops an engine (idle, or its handshake or add failed) keeps nothing of
    it: a client meeting many short-lived engines does not grow."""
    server.publish(worker(agent="p-0"))
    with client(ctx) as c:
        c.fetch(HOST, server.port, "prefill", [0])
        assert c.get_cached("prefill", 0) is not None and "prefill" in c.clock_offsets
        c.forget("prefill", [0])  # some ranks: the engine's clock offset stays
        assert c.get_cached("prefill", 0) is None and "prefill" in c.clock_offsets
        c.fetch(HOST, server.port, "prefill", [0])
        c.forget("prefill")
        assert c.get_cached("prefill", 0) is None and "prefill" not in c.clock_offsets


def test_new_metadata_blob_under_same_agent_name_counts_as_restart(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    server.publish(worker())
    with client(ctx) as c:
        c.fetch(HOST, server.port, "prefill", [0])
        blob = b"reloaded"
        server.publish(
            msgspec.structs.replace(worker(), agent_metadata=blob, agent_metadata_sha256="")
        )
        assert c.refresh(HOST, server.port, "prefill", [0]).changed


# ---------------------------------------------------------------------------- hostile peers
def encode_response(workers: list[WorkerMetadata], engine: str = "prefill") -> bytes:
    return client_codec().encode(MetadataResponse(engine_id=engine, workers=workers))


@pytest.mark.parametrize(
    ("reply", "fragment"),
    [
        (
            encode_response([msgspec.structs.replace(worker(), agent_metadata=b"corrupt")]),
            "agent_metadata_sha256",
        ),
        (encode_response([worker()], engine="elsewhere"), "answered for 'elsewhere'"),
        (encode_response([worker("prefill", 1, 2)]), "answered with [1]"),
        (b"\x00garbage", "expected a metadata_response or error message"),
        (
            client_codec().encode(ErrorReply(code="bad_message", message="nope")),
            "bad_message: nope",
        ),
    ],
    ids=["corrupt-blob", "wrong-engine", "wrong-rank", "garbage", "error-reply"],
)
def test_bad_replies_raise_handshake_error(
    ctx: zmq.Context[zmq.Socket[bytes]], reply: bytes, fragment: str
) -> None:
    peer = FakePeer(ctx, [reply])
    try:
        with client(ctx, timeout=2.0) as c, pytest.raises(HandshakeError) as info:
            c.fetch(HOST, peer.port, "prefill", [0])
    finally:
        peer.close()
    assert fragment in str(info.value)
    assert f"{HOST}:{peer.port}" in str(info.value)
    assert c.get_cached("prefill", 0) is None


def test_lost_reply_is_retried_on_a_fresh_socket(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    peer = FakePeer(ctx, [None, encode_response([worker()])])
    try:
        with client(ctx, timeout=1.0, retries=1) as c:
            assert c.fetch(HOST, peer.port, "prefill", [0])[0] == worker()
    finally:
        peer.close()
    assert len(peer.requests) == 2


class SlowPeer:
    """A ROUTER that answers every message `delay` seconds after it came (a busy server):
    probes as a kvrdma server does (after `probe_delay`, by default `delay`), the n-th
    request with `replies[n]` (the last one again past the end)."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        replies: list[bytes],
        delay: float,
        probe_delay: float | None = None,
        port: int = 0,
    ):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port:
            self.sock.bind(f"tcp://{HOST}:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{HOST}")
        self.replies, self.delay, self.received, self.requests = replies, delay, 0, 0
        self.probe_delay = delay if probe_delay is None else probe_delay
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        due: list[tuple[float, list[bytes]]] = []
        while not self.stop.is_set():
            if self.sock.poll(5):
                identity, *frames = self.sock.recv_multipart()
                self.received += 1
                if frames[0] == b"":  # a probe
                    at, answer = self.probe_delay, [b"", *vllm_peer.answer_frames()]
                else:
                    at = self.delay
                    answer = [self.replies[min(self.requests, len(self.replies) - 1)]]
                    self.requests += 1
                due.append((time.monotonic() + at, [identity, *answer]))
                due.sort(key=lambda d: d[0])
            while due and due[0][0] <= time.monotonic():
                self.sock.send_multipart(due.pop(0)[1])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close(linger=0)


def timed_fetch(ctx: zmq.Context[zmq.Socket[bytes]], port: int) -> float:
    """Seconds a fetch of rank 0 (3 s deadline, 5 retries: 0.5 s per attempt) took to be
    answered with the right metadata."""
    with client(ctx, timeout=3.0, retries=5) as c:
        t0 = time.monotonic()
        assert c.fetch(HOST, port, "prefill", [0])[0] == worker()
        return time.monotonic() - t0


def test_a_reply_later_than_an_attempts_share_still_answers_the_fetch(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A server that answers every message 0.8 s after it came, asked with a 3 s deadline
    and 5 retries (0.5 s per attempt): the late answers to the first probe and the first
    request are taken, not dropped with their attempt (every attempt would then give up
    before its answer and the fetch would time out though the server answers in time)."""
    peer = SlowPeer(ctx, [encode_response([worker()])], delay=0.8)
    try:
        took = timed_fetch(ctx, peer.port)
    finally:
        peer.close()
    assert 1.5 < took < 3.0
    assert peer.received >= 4  # the probe and the request were each sent again meanwhile


def test_a_late_reply_never_answers_a_later_request(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """The first fetch gives up before its (wrong) answer comes; the second fetch, asking the
    same server, gets its own answer, never the first one's."""
    wrong, right = encode_response([worker()], engine="elsewhere"), encode_response([worker()])
    peer = SlowPeer(ctx, [wrong, right], delay=0.6, probe_delay=0.0)
    try:
        with client(ctx, timeout=0.3, retries=0) as c, pytest.raises(HandshakeTimeout):
            c.fetch(HOST, peer.port, "prefill", [0])
        with client(ctx, timeout=3.0, retries=0) as c:
            assert c.fetch(HOST, peer.port, "prefill", [0])[0] == worker()
    finally:
        peer.close()
    assert peer.requests == 2


def test_a_server_coming_up_gets_no_copy_of_the_retries_made_while_it_was_down(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A fetch (10 s, 3 retries: 2.5 s per attempt) starts while nothing listens; the server
    comes up 6 s later, early in the third attempt, answering probes in 0.3 s. It gets two
    probes (the first attempt's, queued as it was sent, and the third's) and one request:
    the second attempt's probe, made while it was down, was not kept queued as well."""
    port = free_port()
    got: list[WorkerMetadata] = []
    with client(ctx, timeout=10.0, retries=3) as c:
        fetching = threading.Thread(
            target=lambda: got.append(c.fetch(HOST, port, "prefill", [0])[0])
        )
        fetching.start()
        time.sleep(6.0)
        peer = SlowPeer(ctx, [encode_response([worker()])], 0.0, probe_delay=0.3, port=port)
        try:
            fetching.join(timeout=15)
        finally:
            peer.close()
    assert got == [worker()]
    assert (peer.received, peer.requests) == (3, 1)


class FirstConnections:
    """A TCP relay to `port` for its first `n` connections; later ones are accepted and left
    silent, so a ZMQ connection through them never comes up (a server out of descriptors)."""

    def __init__(self, port: int, n: int) -> None:
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self.target, self.n, self.held = port, n, []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            for accepted in itertools.count(1):
                conn, _ = self.listener.accept()
                self.held.append(conn)
                if accepted <= self.n:
                    upstream = socket.create_connection((HOST, self.target))
                    self.held.append(upstream)
                    for a, b in ((conn, upstream), (upstream, conn)):
                        threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)

    def close(self) -> None:
        for s in [self.listener, *self.held]:
            s.close()


def test_a_retry_waiting_for_its_connection_still_takes_an_earlier_reply(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The request's first attempt reaches a server answering in 1.2 s; its retries (0.5 s
    shares of a 3 s fetch) get no connection. The first attempt's reply, coming while a retry
    waits for its connection, answers the fetch."""
    peer = SlowPeer(ctx, [encode_response([worker()])], 1.2, probe_delay=0.0)
    relay = FirstConnections(peer.port, 2)  # the probe's and the request's first attempt
    try:
        took = timed_fetch(ctx, relay.port)
    finally:
        relay.close()
        peer.close()
    assert 1.1 < took < 2.5
    assert peer.requests == 1


def test_waiting_attempts_are_bounded_and_all_closed(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    waiting = Waiting()
    socks = [ctx.socket(zmq.DEALER) for _ in range(10)]
    for sock in socks:
        waiting.add(sock)
    assert [sock.closed for sock in socks] == [True, True] + [False] * 8  # the oldest go
    assert waiting.reply(0.01) is None
    waiting.close()
    assert all(sock.closed for sock in socks)


def test_server_answers_bad_frames_and_counts_them(
    ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer
) -> None:
    codec = client_codec()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"tcp://{HOST}:{server.port}")
        for frames in ([b"\xc1"], [b"a", b"b"], [b""]):
            dealer.send_multipart(frames)
            assert dealer.poll(5000)
            reply = codec.decode(dealer.recv())
            assert isinstance(reply, ErrorReply)
            assert reply.code in ("bad_message", "bad_frame")
    finally:
        dealer.close(linger=0)
    assert server.stats["requests_bad"] == 3


def test_publish_rejects_corrupt_metadata(server: HandshakeServer) -> None:
    with pytest.raises(ProtocolError, match="agent_metadata_sha256"):
        server.publish(msgspec.structs.replace(worker(), agent_metadata=b"x"))
    assert server.stats["publish_bad"] == 1
    assert server.published() == {}


def test_unpublish(ctx: zmq.Context[zmq.Socket[bytes]], server: HandshakeServer) -> None:
    server.publish(worker())
    assert server.unpublish("prefill", 0)
    assert not server.unpublish("prefill", 0)
    with client(ctx, timeout=0.3, retries=0) as c, pytest.raises(HandshakeError):
        c.fetch(HOST, server.port, "prefill", [0])


def test_bind_conflict_is_a_handshake_error(server: HandshakeServer) -> None:
    with pytest.raises(HandshakeError, match=f"{HOST}:{server.port}"):
        HandshakeServer(HOST, server.port)


def test_unusable_publish_address_is_a_handshake_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    address = f"ipc://{tmp_path}/file/publish.sock"
    with pytest.raises(HandshakeError, match=re.escape(address)):
        HandshakeServer(HOST, 0, publish_address=address)


def test_close_is_fast_and_idempotent() -> None:
    srv = HandshakeServer(HOST, 0)
    t0 = time.monotonic()
    srv.close()
    srv.close()
    assert time.monotonic() - t0 < 1.0


def test_publisher_over_loopback(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with HandshakeServer(HOST, 0, context=ctx, publish_address=f"tcp://{HOST}:0") as srv:
        assert srv.publish_address is not None
        with SidecarPublisher(srv.publish_address, context=ctx, timeout=2.0) as pub:
            ack = pub.publish(worker("prefill", 1, 2))
            assert (ack.engine_id, ack.tp_rank, ack.published_ranks) == ("prefill", 1, [1])
            ack = pub.publish(worker("prefill", 0, 2))
            assert ack.published_ranks == [0, 1]
            with pytest.raises(HandshakeError, match="invalid_metadata"):
                pub.publish(msgspec.structs.replace(worker(), tp_rank=5))
            assert pub.unpublish("prefill", 1).published_ranks == [0]
        stats = srv.stats
    assert (stats["publish_ok"], stats["publish_bad"], stats["unpublish_ok"]) == (2, 1, 1)


def test_publisher_to_missing_sidecar_times_out(
    ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path}/nobody.sock"
    with (
        SidecarPublisher(address, context=ctx, timeout=0.3, retries=1) as pub,
        pytest.raises(HandshakeTimeout, match=r"nobody\.sock"),
    ):
        pub.publish(worker())


# ---------------------------------------------------------------------------- restart, real NIXL
PRODUCER = """
import select, sys
import torch
from nixl._api import nixl_agent, nixl_agent_config
from kvrdma.handshake import SidecarPublisher
from kvrdma.metadata import RegionMeta, WorkerMetadata, sha256_hex

address, value = sys.argv[1], int(sys.argv[2])
config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
agent = nixl_agent("prefill-rank0", config)  # a restart keeps the name: worst case for NIXL
kv = torch.full((16, 256), value, dtype=torch.uint8)
agent.register_memory(kv)
blob = agent.get_agent_metadata()
meta = WorkerMetadata(
    engine_id="prefill", agent_name="prefill-rank0", agent_metadata=blob, tp_rank=0,
    tp_size=1, block_size=16, num_blocks=16, cache_layout="mla", total_num_kv_heads=1,
    head_dim=256, dtype="uint8", element_size=1,
    regions=[RegionMeta(kv.data_ptr(), 16, 256, "mla")], agent_metadata_sha256=sha256_hex(blob),
)
with SidecarPublisher(address, timeout=20) as pub:
    pub.publish(meta)
print("published", flush=True)
while not select.select([sys.stdin], [], [], 0.001)[0]:  # progress until stdin closes
    agent.get_new_notifs()
"""


@pytest.mark.timeout(90)
def test_restarted_producer_process_is_rehandshaken_and_read(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    pytest.importorskip("nixl")
    torch = pytest.importorskip("torch")
    from nixl._api import nixl_agent, nixl_agent_config

    def start_producer(address: str, value: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", PRODUCER, address, str(value)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdout is not None
        # raw reads: select() does not see a line that a buffered readline already holds
        fd, seen = proc.stdout.fileno(), b""
        deadline = time.monotonic() + 60
        while b"published" not in seen and (left := deadline - time.monotonic()) > 0:
            if not select.select([fd], [], [], left)[0]:
                break
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            seen += chunk
        if b"published" in seen:
            return proc
        proc.kill()
        proc.communicate()
        pytest.fail("the producer process did not publish its metadata")

    def stop(proc: subprocess.Popen[str]) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)

    reader = nixl_agent("decode-rank0", nixl_agent_config(enable_prog_thread=False))
    dst = torch.zeros((16, 256), dtype=torch.uint8)
    reader.register_memory(dst)
    swaps: list[tuple[str, str]] = []

    def on_peer_changed(stale: WorkerMetadata, fresh: WorkerMetadata) -> None:
        reader.remove_remote_agent(stale.agent_name)  # NIXL refuses a re-add otherwise
        reader.add_remote_agent(fresh.agent_metadata)
        swaps.append((stale.agent_metadata_sha256, fresh.agent_metadata_sha256))

    def read(meta: WorkerMetadata) -> str:
        local = reader.get_xfer_descs(dst)
        remote = reader.get_xfer_descs([(meta.regions[0].base_addr, dst.numel(), 0)], "DRAM")
        handle = reader.initialize_xfer("READ", local, remote, meta.agent_name, b"req:1")
        try:
            state = reader.transfer(handle)
            deadline = time.monotonic() + 10
            while state == "PROC" and time.monotonic() < deadline:
                state = reader.check_xfer_state(handle)
            return str(state)
        finally:
            reader.release_xfer_handle(handle)

    with (
        HandshakeServer(HOST, 0, context=ctx, publish_address=f"tcp://{HOST}:0") as srv,
        client(ctx, compat_hash="", on_peer_changed=on_peer_changed) as c,
    ):
        assert srv.publish_address is not None
        first = start_producer(srv.publish_address, 1)
        try:
            meta = c.fetch(HOST, srv.port, "prefill", [0])[0]
            reader.add_remote_agent(meta.agent_metadata)
            assert read(meta) == "DONE"
            assert int(dst.min()) == int(dst.max()) == 1
        finally:
            stop(first)
        second = start_producer(srv.publish_address, 2)  # new process, same engine id
        try:
            result = c.refresh(HOST, srv.port, "prefill", [0])
            assert result.changed and result.stale == {0: meta}
            assert swaps == [(meta.agent_metadata_sha256, result.workers[0].agent_metadata_sha256)]
            assert read(result.workers[0]) == "DONE"
            assert int(dst.min()) == int(dst.max()) == 2  # read from the new process
        finally:
            stop(second)
