"""Replies a ROUTER socket could not hand to its peer's queue yet, sent as room appears.

ZMQ counts a peer's outgoing queue as full until the I/O thread reports that it drained it,
and on a busy machine that report lags: a client with a few requests in flight can find its
queue "full" although it reads every reply. Without `ROUTER_MANDATORY` the socket would drop
such a reply silently, and the client would wait for it until its timeout. The queue keeps
each peer's replies in order and sends them once the socket takes them, within bounds: a
peer that never reads cannot make the server hold more than `PER_PEER` replies, nor all
peers together more than `TOTAL`, nor any reply longer than `MAX_AGE_S`. Replies are sent
without a copy and tracked until ZMQ has written them out (or dropped them with their
connection, once the socket next runs), so the bytes of every reply held, here or in ZMQ's
per-connection queues, stay within `MAX_BYTES` however many peers connect. A connection whose
reply ZMQ has not written out within `MAX_AGE_S` (its peer reads nothing) is reported in
`stalled`, for the server to shut it down: that frees what ZMQ holds for it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import zmq

__all__ = ["MAX_AGE_S", "MAX_BYTES", "PER_PEER", "TOTAL", "ReplyQueue"]

logger = logging.getLogger(__name__)

PER_PEER = 64
TOTAL = 4096
MAX_AGE_S = 10.0  # past any client's timeout: nobody waits for it any more
# Bytes of replies held at once; a reply past it is dropped (its client retries), except
# when nothing is held, so that one reply of any size still goes.
MAX_BYTES = 256 * 1024 * 1024

_Key = tuple["zmq.Socket[bytes]", bytes]  # (socket, peer identity)


class _Tracker(Protocol):
    @property
    def done(self) -> bool: ...


class ReplyQueue:
    """Per-peer ordered replies for ROUTER sockets with `ROUTER_MANDATORY` set."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._queues: dict[_Key, deque[tuple[float, list[bytes], Any]]] = {}
        self._total = 0
        # handed to ZMQ, not yet written out: (tracker, bytes, when, source)
        self._sent: list[tuple[_Tracker, int, float, Any]] = []
        self.held_bytes = 0  # of the replies queued here and those in `_sent`
        self.dropped = 0  # replies given up: bounds, age, or the peer gone
        # where the message being answered came from (set by the server before it answers)
        self.source: Any = None
        self.stalled: list[Any] = []  # sources whose reply ZMQ held past `MAX_AGE_S`

    @property
    def pending(self) -> bool:
        """Replies wait for room: flush soon."""
        return self._total > 0

    def send(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        """Send `frames` ([identity, ...]) now, or after the replies queued before it."""
        self._release_written()
        size = sum(len(f) for f in frames)
        if self.held_bytes and self.held_bytes + size > MAX_BYTES:
            self._drop(frames[0], f"{self.held_bytes} bytes of replies held already")
            return
        key = (sock, frames[0])
        queue = self._queues.get(key)
        if queue is None and self._try(sock, frames, size, self.source):
            return
        if queue is None:
            queue = self._queues[key] = deque()
        if len(queue) >= PER_PEER or self._total >= TOTAL:
            self._drop(frames[0], "too many replies wait for this peer or for all")
            return
        queue.append((self._clock(), frames, self.source))
        self._total += 1
        self.held_bytes += size

    def flush(self) -> None:
        """Send what the sockets take now, oldest first per peer; give up on stale ones."""
        self._release_written()
        if not self._total:
            return
        now = self._clock()
        for key, queue in list(self._queues.items()):
            while queue:
                queued_at, frames, source = queue[0]
                size = sum(len(f) for f in frames)
                if now - queued_at > MAX_AGE_S:
                    self._drop(key[1], f"not taken within {MAX_AGE_S:g} s")
                elif not self._try(key[0], frames, size, source):
                    break
                queue.popleft()
                self._total -= 1
                self.held_bytes -= size
            if not queue:
                del self._queues[key]

    def _try(self, sock: zmq.Socket[bytes], frames: list[bytes], size: int, source: Any) -> bool:
        """True once the reply is handled: sent (and tracked), or its peer is gone."""
        try:
            tracker = sock.send_multipart(frames, zmq.NOBLOCK, copy=False, track=True)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer disconnected meanwhile
            self._drop(frames[0], str(exc))
            return True
        if tracker is not None and not tracker.done:
            self._sent.append((tracker, size, self._clock(), source))
            self.held_bytes += size
        return True

    def _release_written(self) -> None:
        """Forget the replies ZMQ has written out (or dropped with their connection); report
        once the source of each it has held past `MAX_AGE_S` (its peer reads nothing)."""
        if not self._sent:
            return
        oldest, kept = self._clock() - MAX_AGE_S, []
        for tracker, size, at, source in self._sent:
            if tracker.done:
                self.held_bytes -= size
                continue
            if at < oldest and source is not None:
                self.stalled.append(source)
                source = None
            kept.append((tracker, size, at, source))
        self._sent = kept

    def _drop(self, identity: bytes, why: str) -> None:
        self.dropped += 1
        logger.debug("reply to peer %s dropped: %s", identity.hex()[:16], why)
