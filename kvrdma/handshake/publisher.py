"""The worker's side of the sidecar's publish socket (`kvrdma agent --publish`).

A worker hands its `WorkerMetadata` to the sidecar, which then answers peers' handshakes for
it; every call is one bounded round trip that fails with a `HandshakeError` naming the sidecar.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

import msgspec
import zmq

from kvrdma.defaults import HANDSHAKE_RETRIES, HANDSHAKE_TIMEOUT_SECONDS
from kvrdma.errors import HandshakeError, HandshakeRefused
from kvrdma.handshake.auth import CurveKeys
from kvrdma.handshake.requester import Clock, Requester
from kvrdma.handshake.wire import (
    MAX_FRAME_BYTES,
    MAX_PUBLISH_BYTES,
    MAX_PUBLISH_TTL_S,
    Codec,
    ErrorReply,
    PublishAck,
    PublishReply,
    PublishRequest,
    UnpublishRequest,
    check_publish_ttl,
    publish_client_codec,
    with_checksum,
)
from kvrdma.metadata import WorkerMetadata

__all__ = ["PUBLISH_TTL_SECONDS", "KeepPublished", "SidecarPublisher"]

logger = logging.getLogger(__name__)

# how often a rank publishes itself again: the sidecar container can restart on its own (a
# native sidecar does) and then holds nothing until its ranks publish
REPUBLISH_SECONDS = 10.0
# a kept rank is dropped by the sidecar after this many periods without a publish: its engine
# was killed without unpublishing (a slow period or two is not enough)
EXPIRE_AFTER_PERIODS = 3
# how long the sidecar serves a publish by default: one that never expired would keep a killed
# worker's rank served, and its agent ready, for as long as the sidecar runs
PUBLISH_TTL_SECONDS = EXPIRE_AFTER_PERIODS * REPUBLISH_SECONDS


class SidecarPublisher:
    """A worker's connection to the sidecar's publish socket (`kvrdma agent --publish`)."""

    def __init__(
        self,
        address: str,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        timeout: float = HANDSHAKE_TIMEOUT_SECONDS,
        retries: int = HANDSHAKE_RETRIES,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        clock: Clock = time.monotonic,
        curve: CurveKeys | None = None,
    ) -> None:
        self.address = address
        self._own_context = context is None
        self._ctx = context if context is not None else zmq.Context()
        self._codec: Codec[PublishReply] = publish_client_codec(max_frame_bytes)
        self._req = Requester(
            self._ctx,
            self._codec,
            timeout=timeout,
            retries=retries,
            backoff=0.05,
            clock=clock,
            curve=curve,
        )
        self._closed = False

    def publish(
        self, meta: WorkerMetadata, *, timeout: float | None = None, ttl: float | None = None
    ) -> PublishAck:
        """Hand `meta` to the sidecar, to be served for `ttl` seconds unless published again
        (None: until unpublished); returns its ack (with the ranks it now holds)."""
        check_publish_ttl(ttl)
        meta = with_checksum(meta)
        what = (
            f"publishing engine {meta.engine_id!r} rank {meta.tp_rank} to the sidecar at "
            f"{self.address}"
        )
        return self._call(PublishRequest(worker=meta, ttl=ttl), what, timeout)

    def unpublish(
        self, engine_id: str, tp_rank: int, dp_index: int = 0, *, timeout: float | None = None
    ) -> PublishAck:
        what = f"unpublishing engine {engine_id!r} rank {tp_rank} at the sidecar {self.address}"
        msg = UnpublishRequest(engine_id=engine_id, tp_rank=tp_rank, dp_index=dp_index)
        return self._call(msg, what, timeout)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._own_context:
                self._ctx.term()

    def __enter__(self) -> SidecarPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _call(self, msg: msgspec.Struct, what: str, timeout: float | None) -> PublishAck:
        def accept(reply: PublishAck | ErrorReply) -> PublishAck:
            if isinstance(reply, ErrorReply):
                text = f"{what} rejected: {reply.code}: {reply.message}"
                raise HandshakeRefused(text, reply.code)
            return reply

        payload = self._codec.encode(msg)
        if len(payload) > MAX_PUBLISH_BYTES:
            raise HandshakeError(
                f"{what}: the message is {len(payload)} bytes, over the sidecar's "
                f"{MAX_PUBLISH_BYTES}-byte limit"
            )
        return self._req.call(self.address, payload, accept, what, timeout)


def publish_to_sidecar(
    meta: WorkerMetadata,
    address: str | None,
    *,
    timeout: float,
    ttl: float | None = PUBLISH_TTL_SECONDS,
) -> None:
    """Hand one rank's metadata to the pod's sidecar, served for `ttl` seconds unless published
    again (see `Worker.publish`)."""
    with _to_sidecar(address, timeout) as pub:
        pub.publish(meta, ttl=ttl)


def _to_sidecar(address: str | None, timeout: float) -> SidecarPublisher:
    """A publisher to `address`, else `$KVRDMA_PUBLISH_ADDRESS`, else the default address,
    with the keys of `$KVRDMA_CURVE_DIR` if set."""
    import os

    from kvrdma.defaults import PUBLISH_ADDRESS

    target = address or os.environ.get("KVRDMA_PUBLISH_ADDRESS") or PUBLISH_ADDRESS
    return SidecarPublisher(target, timeout=timeout, curve=CurveKeys.from_env())


class KeepPublished:
    """Publish a rank's metadata to the pod's sidecar now (raising if that fails), then again
    every `every` seconds from a daemon thread until `close()`, so a restarted sidecar knows
    the rank again without the engine restarting. Each publish lasts `EXPIRE_AFTER_PERIODS`
    periods at the sidecar, so the ranks of an engine killed without unpublishing stop being
    served; `close()` unpublishes the rank. `metadata` is read at every publish; the address
    and keys are resolved once."""

    def __init__(
        self,
        metadata: Callable[[], WorkerMetadata],
        address: str | None,
        *,
        every: float = REPUBLISH_SECONDS,
        timeout: float = 5.0,
    ) -> None:
        self._metadata, self._every, self._timeout = metadata, every, timeout
        self._ttl = min(EXPIRE_AFTER_PERIODS * every, MAX_PUBLISH_TTL_S)
        self._rank: tuple[str, int, int] | None = None  # (engine, TP, DP) last sent
        self._closed = False
        self._pub = _to_sidecar(address, timeout)
        try:
            self._publish()
        except BaseException:
            self._pub.close()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvrdma-republish", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(self._every):
            try:
                self._publish()
            except Exception as exc:  # the sidecar may be restarting: try again later
                if not failing:
                    logger.warning("publishing to the sidecar again failed (retrying): %s", exc)
                failing = True
            else:
                if failing:
                    logger.info("published to the sidecar %s again", self._pub.address)
                failing = False

    def _publish(self) -> None:
        meta = self._metadata()
        # kept before sending: a publish whose ack was lost may still have reached the sidecar
        self._rank = (meta.engine_id, meta.tp_rank, meta.dp_index)
        self._pub.publish(meta, ttl=self._ttl)

    def close(self) -> None:
        """Stop publishing and unpublish the rank, so the sidecar stops serving it (and
        answering `/readyz`) at once instead of at its ttl; waits for a publish under way, then
        for the unpublish, each at most its timeout. A sidecar it cannot reach is logged, not
        raised: its ttl drops the rank. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=self._timeout + 1.0)
        if self._thread.is_alive():  # its socket is still in use: the ttl drops the rank
            logger.warning(
                "publishing to the sidecar %s did not end within %g s: rank not unpublished",
                self._pub.address,
                self._timeout + 1.0,
            )
            return
        try:
            if self._rank is not None:
                self._pub.unpublish(*self._rank, timeout=self._timeout)
        except Exception as exc:
            logger.warning(
                "unpublishing from the sidecar failed (it drops the rank within %g s): %s",
                self._ttl,
                exc,
            )
        finally:
            self._pub.close()
