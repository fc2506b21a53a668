"""kvrdma.handshake.replies_queue: a reply the socket cannot take yet is sent later, in order
per peer, within bounds; a peer that is gone or never reads costs a bounded amount."""

from __future__ import annotations

import pytest
import zmq

from kvrdma.handshake import replies_queue
from kvrdma.handshake.replies_queue import ReplyQueue


class Tracker:
    def __init__(self) -> None:
        self.done = False


class Sock:
    """A ROUTER with ROUTER_MANDATORY: `room` replies per peer before EAGAIN; each reply sent
    is tracked until `written()` says ZMQ wrote it out."""

    def __init__(self, room: int = 0) -> None:
        self.room = room
        self.sent: list[list[bytes]] = []
        self.gone: set[bytes] = set()
        self.trackers: list[Tracker] = []

    def send_multipart(
        self, frames: list[bytes], flags: int = 0, *, copy: bool = True, track: bool = False
    ) -> Tracker:
        assert (flags, copy, track) == (zmq.NOBLOCK, False, True)
        if frames[0] in self.gone:
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        if self.room <= 0:
            raise zmq.Again()
        self.room -= 1
        self.sent.append(frames)
        self.trackers.append(Tracker())
        return self.trackers[-1]

    def written(self) -> None:
        for t in self.trackers:
            t.done = True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_reply_the_socket_takes_is_sent_at_once() -> None:
    sock, q = Sock(room=1), ReplyQueue()
    q.send(sock, [b"a", b"r1"])
    assert sock.sent == [[b"a", b"r1"]] and not q.pending


def test_replies_wait_for_room_and_go_in_order_per_peer() -> None:
    sock, q = Sock(), ReplyQueue()
    for frames in ([b"a", b"1"], [b"b", b"1"], [b"a", b"2"]):
        q.send(sock, frames)
    assert q.pending and sock.sent == []
    sock.room = 1
    q.flush()
    sock.room = 5
    q.send(sock, [b"a", b"3"])  # behind a's queued ones
    q.flush()
    a = [f[1] for f in sock.sent if f[0] == b"a"]
    assert a == [b"1", b"2", b"3"] and not q.pending and q.dropped == 0


def test_a_peer_that_never_reads_is_bounded() -> None:
    sock, q = Sock(), ReplyQueue()
    for i in range(replies_queue.PER_PEER + 10):
        q.send(sock, [b"x", str(i).encode()])
    assert q.dropped == 10
    q.send(sock, [b"y", b"1"])  # another peer still has room
    assert q.dropped == 10


def test_old_replies_are_given_up() -> None:
    sock, clock = Sock(), Clock()
    q = ReplyQueue(clock)
    q.send(sock, [b"a", b"1"])
    clock.now = replies_queue.MAX_AGE_S + 1
    sock.room = 1
    q.flush()
    assert sock.sent == [] and q.dropped == 1 and not q.pending


def test_a_peer_gone_drops_its_replies_without_blocking_others() -> None:
    sock, q = Sock(), ReplyQueue()
    q.send(sock, [b"a", b"1"])
    q.send(sock, [b"b", b"1"])
    sock.gone.add(b"a")
    sock.room = 1
    q.flush()
    assert sock.sent == [[b"b", b"1"]] and q.dropped == 1 and not q.pending


def test_all_peers_together_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replies_queue, "TOTAL", 3)
    sock, q = Sock(), ReplyQueue()
    for peer in (b"a", b"b", b"c", b"d"):
        q.send(sock, [peer, b"1"])
    assert q.dropped == 1


MiB = 1024 * 1024


def test_replies_held_are_bounded_in_bytes_queued_or_not_yet_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Peers that never read (many identities, big replies): ZMQ takes a few replies and
    never writes them out, the rest would wait here; in bytes, both stay within the bound."""
    reply = bytes(8 * MiB)
    monkeypatch.setattr(replies_queue, "MAX_BYTES", 8 * (len(reply) + 64))
    sock, q = Sock(room=4), ReplyQueue()
    for i in range(64):
        q.send(sock, [f"peer-{i}".encode(), reply])
    assert len(sock.sent) == 4 and q.pending  # 4 in ZMQ's queues, 4 waiting here
    assert q.held_bytes <= replies_queue.MAX_BYTES and q.dropped == 64 - 8
    sock.written()  # the peers read after all: the queued ones go, and room for 4 more
    sock.room = 8
    q.flush()
    for i in range(64):
        q.send(sock, [f"peer-{i}".encode(), reply])
    assert len(sock.sent) == 12 and not q.pending
    assert q.held_bytes <= replies_queue.MAX_BYTES and q.dropped == 2 * (64 - 8) + 4


def test_one_reply_over_the_byte_bound_still_goes_when_nothing_is_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(replies_queue, "MAX_BYTES", 1024)
    sock, q = Sock(room=2), ReplyQueue()
    q.send(sock, [b"a", bytes(4096)])
    q.send(sock, [b"b", b"small"])
    assert [f[0] for f in sock.sent] == [b"a"] and q.dropped == 1
    sock.written()
    q.send(sock, [b"b", b"small"])
    assert [f[0] for f in sock.sent] == [b"a", b"b"] and q.held_bytes == len(b"b" + b"small")
