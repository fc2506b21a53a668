"""Replies a ROUTER socket could not hand to its peer's queue yet, sent as room appears.

ZMQ counts a peer's outgoing queue as full until the I/O thread reports that it drained it,
and on a busy machine that report lags: a client with a few requests in flight can find its
queue "full" although it reads every reply. Without `ROUTER_MANDATORY` the socket would drop
such a reply silently, and the client would wait for it until its timeout. The queue keeps
each peer's replies in order and sends them once the socket takes them, within bounds: a
peer that never reads cannot make the server hold more than `PER_PEER` replies, nor all
peers together more than `TOTAL`, nor any reply longer than `MAX_AGE_S`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import zmq

__all__ = ["MAX_AGE_S", "PER_PEER", "TOTAL", "ReplyQueue"]

logger = logging.getLogger(__name__)

PER_PEER = 64
TOTAL = 4096
MAX_AGE_S = 10.0  # past any client's timeout: nobody waits for it any more

_Key = tuple["zmq.Socket[bytes]", bytes]  # (socket, peer identity)


class ReplyQueue:
    """Per-peer ordered replies for ROUTER sockets with `ROUTER_MANDATORY` set."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._queues: dict[_Key, deque[tuple[float, list[bytes]]]] = {}
        self._total = 0
        self.dropped = 0  # replies given up: bounds, age, or the peer gone

    @property
    def pending(self) -> bool:
        """Replies wait for room: flush soon."""
        return self._total > 0

    def send(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        """Send `frames` ([identity, ...]) now, or after the replies queued before it."""
        key = (sock, frames[0])
        queue = self._queues.get(key)
        if queue is None and self._try(sock, frames):
            return
        if queue is None:
            queue = self._queues[key] = deque()
        if len(queue) >= PER_PEER or self._total >= TOTAL:
            self._drop(frames[0], "too many replies wait for this peer or for all")
            return
        queue.append((self._clock(), frames))
        self._total += 1

    def flush(self) -> None:
        """Send what the sockets take now, oldest first per peer; give up on stale ones."""
        if not self._total:
            return
        now = self._clock()
        for key, queue in list(self._queues.items()):
            while queue:
                queued_at, frames = queue[0]
                if now - queued_at > MAX_AGE_S:
                    self._drop(key[1], f"not taken within {MAX_AGE_S:g} s")
                elif not self._try(key[0], frames):
                    break
                queue.popleft()
                self._total -= 1
            if not queue:
                del self._queues[key]

    def _try(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> bool:
        """True once the reply is handled: sent, or its peer is gone."""
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer disconnected meanwhile
            self._drop(frames[0], str(exc))
        return True

    def _drop(self, identity: bytes, why: str) -> None:
        self.dropped += 1
        logger.debug("reply to peer %s dropped: %s", identity.hex()[:16], why)
