"""One request, one reply, within a deadline: the DEALER round trip the handshake clients share.

Every attempt sends the same request on a fresh DEALER socket and attempts share one overall
deadline; replies that may change soon are retried with backoff. An attempt that got no reply
within its share keeps waiting beside the next: a busy server's late reply answers the same
request, so it is taken rather than queued for again. A later request never sees it: the
sockets are closed when the request returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import zmq

from kvrdma.defaults import MAX_HANDSHAKE_TIMEOUT
from kvrdma.errors import (
    ConfigError,
    HandshakeError,
    HandshakeRefused,
    HandshakeTimeout,
    ProtocolError,
)
from kvrdma.handshake.auth import CurveKeys, secure_client
from kvrdma.handshake.wire import Codec

__all__ = [
    "MAX_TIMEOUT_SECONDS",
    "Clock",
    "NoConnection",
    "NoReply",
    "Requester",
    "RetryableReply",
    "Waiting",
    "check_timeout",
]

logger = logging.getLogger(__name__)

R = TypeVar("R")
A = TypeVar("A")
Clock = Callable[[], float]

_RECONNECT_IVL_MS = 20
# attempts of one request waiting for a reply at once (the oldest is given up past this)
_MAX_WAITING = 8
_BACKOFF_MAX_SECONDS = 0.5
MAX_TIMEOUT_SECONDS = MAX_HANDSHAKE_TIMEOUT


def check_timeout(timeout: object, name: str = "timeout") -> float:
    """`timeout` as seconds, or a `ConfigError` naming `name` (checked before anything is sent)."""
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout <= MAX_TIMEOUT_SECONDS  # also false for nan
    ):
        raise ConfigError(
            f"{name}: expected a number of seconds in (0, {MAX_TIMEOUT_SECONDS:g}], got {timeout!r}"
        )
    return float(timeout)


class NoReply(Exception):
    """One attempt got no reply within its share of the deadline."""


class NoConnection(NoReply):
    """A retry found no connection up within its share, so it sent nothing."""


class RetryableReply(Exception):
    """One attempt got a reply that may change if asked again (e.g. rank not published yet);
    `code` is the reply's: what the peer refused with if it still says so at the deadline."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class Requester(Generic[R]):
    """Send one request per fresh DEALER and wait for one reply; retry within a deadline."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        codec: Codec[R],
        *,
        timeout: float,
        retries: int,
        backoff: float,
        clock: Clock,
        curve: CurveKeys | None = None,
    ) -> None:
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigError(f"retries: expected an integer >= 0, got {retries!r}")
        self.ctx = ctx
        self.codec = codec
        self.timeout = check_timeout(timeout)
        self.retries = retries
        self.backoff = backoff
        self.clock = clock
        self.curve = curve

    def call(
        self,
        endpoint: str,
        payload: bytes,
        accept: Callable[[R], A],
        what: str,
        timeout: float | None = None,
    ) -> A:
        """Return `accept(reply)`; `accept` raises `RetryableReply` to retry, or HandshakeError."""

        def decoded(parts: list[bytes]) -> A:
            return accept(self._decode(parts, endpoint, what))

        return self.exchange(endpoint, [payload], decoded, what, timeout)

    def exchange(
        self,
        endpoint: str,
        frames: list[bytes],
        accept: Callable[[list[bytes]], A],
        what: str,
        timeout: float | None = None,
    ) -> A:
        """Return `accept(reply frames)` of the first reply to `frames`, sent up to
        `1 + retries` times within `timeout` (a late reply to an earlier attempt counts);
        `accept` raises `RetryableReply` to ask again, or HandshakeError."""
        total = self.timeout if timeout is None else check_timeout(timeout)
        start = self.clock()
        deadline = start + total
        attempts = self.retries + 1
        last = "no attempt was made"
        answered = False
        refused: str | None = None  # the code of the last attempt's retryable reply
        made = unsent = 0
        waiting = Waiting()
        try:
            for attempt in range(attempts):
                remaining = deadline - self.clock()
                if remaining <= 0:
                    break
                made += 1
                share = remaining / (attempts - attempt)
                try:
                    parts = self._attempt(endpoint, frames, share, what, waiting, attempt > 0)
                    return accept(parts)
                except NoReply as exc:
                    last, refused = str(exc), None
                    unsent += isinstance(exc, NoConnection)
                except RetryableReply as exc:
                    waiting.close()  # answered: earlier attempts' replies would say no more
                    answered = True
                    last, refused = str(exc), exc.code
                    if attempt + 1 < attempts:  # no attempt follows the last one to wait for
                        pause = min(self.backoff * 2**attempt, _BACKOFF_MAX_SECONDS)
                        time.sleep(max(0.0, min(pause, deadline - self.clock())))
                logger.debug("%s: attempt %d/%d failed: %s", what, attempt + 1, attempts, last)
        finally:
            waiting.close()
        if answered:
            took = self.clock() - start
            text = f"{what} failed after {made} attempt(s) in {took:.3g} s: {last}"
            raise HandshakeError(text) if refused is None else HandshakeRefused(text, refused)
        hint = (
            "; CURVE is on: a server without CURVE, with other keys, or that does not admit "
            "this client's key never answers"
            if self.curve is not None
            else ""
        )
        tried = f"{made} attempt(s)" + (f", {unsent} found no connection up" if unsent else "")
        raise HandshakeTimeout(f"{what}: no reply within {total:g} s ({tried}){hint}")

    def _decode(self, parts: list[bytes], endpoint: str, what: str) -> R:
        if len(parts) != 1:
            raise HandshakeError(
                f"{what}: expected 1 reply frame, got {len(parts)} from {endpoint}"
            )
        try:
            return self.codec.decode(parts[0], endpoint)
        except ProtocolError as exc:
            raise HandshakeError(f"{what}: {exc}") from exc

    def _attempt(
        self,
        endpoint: str,
        frames: list[bytes],
        seconds: float,
        what: str,
        waiting: Waiting,
        retry: bool,
    ) -> list[bytes]:
        """Send `frames` on a fresh DEALER and return the first reply to it or to any of the
        earlier attempts in `waiting`; `NoReply` if none within `seconds` (this attempt's
        DEALER then waits there too).

        A first attempt queues `frames` to go out as the connection comes up (no wait on this
        thread). A retry sends only once a connection is up, taking earlier attempts' replies
        meanwhile, so a server that was down and comes back gets the first attempt's request
        and the retry's, not one per retry made while it was down."""
        deadline = self.clock() + seconds
        sock = self.ctx.socket(zmq.DEALER)
        try:
            self._connect(sock, endpoint, what, retry)
            while True:
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK if retry else 0, copy=False)
                    break
                except zmq.Again:  # a retry with no connection up yet
                    left = deadline - self.clock()
                    if left <= 0:
                        raise NoConnection(
                            f"no connection to {endpoint} within {seconds:.3g} s"
                        ) from None
                    parts = waiting.reply(left, writable=sock)
                    if parts is not None:
                        sock.close(linger=0)
                        return parts
        except BaseException:
            sock.close(linger=0)
            raise
        waiting.add(sock)  # sent: it waits for the reply with the others
        parts = waiting.reply(deadline - self.clock())
        if parts is None:
            raise NoReply(f"no reply from {endpoint} within {seconds:.3g} s")
        return parts

    def _connect(self, sock: zmq.Socket[bytes], endpoint: str, what: str, retry: bool) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.codec.max_frame_bytes)
        sock.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_IVL_MS)
        if retry:  # queue nothing before a connection is up
            sock.setsockopt(zmq.IMMEDIATE, 1)
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        if self.curve is not None:
            secure_client(sock, self.curve)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise HandshakeError(f"{what}: cannot connect to {endpoint}: {exc}") from exc


class Waiting:
    """The DEALERs of one request's attempts that still wait for a reply (at most
    `_MAX_WAITING`, the oldest closed first); `close()` closes them all."""

    def __init__(self) -> None:
        self._socks: list[zmq.Socket[bytes]] = []

    def add(self, sock: zmq.Socket[bytes]) -> None:
        self._socks.append(sock)
        if len(self._socks) > _MAX_WAITING:
            self._socks.pop(0).close(linger=0)

    def reply(
        self, seconds: float, writable: zmq.Socket[bytes] | None = None
    ) -> list[bytes] | None:
        """The first reply any of the DEALERs gets within `seconds` (that one is closed), or
        None; None as soon as `writable` (an attempt waiting for its connection) can send."""
        poller = zmq.Poller()
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        if writable is not None:
            poller.register(writable, zmq.POLLOUT)
        ready = dict(poller.poll(max(1, int(seconds * 1000))))
        for sock in self._socks:
            if sock in ready:
                self._socks.remove(sock)
                try:
                    return sock.recv_multipart(zmq.NOBLOCK)
                finally:
                    sock.close(linger=0)
        return None

    def close(self) -> None:
        for sock in self._socks:
            sock.close(linger=0)
        self._socks.clear()
