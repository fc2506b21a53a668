"""The worker's side of the sidecar's publish socket (`kvrdma agent --publish`).

A worker hands its `WorkerMetadata` to the sidecar, which then answers peers' handshakes for
it; every call is one bounded round trip that fails with a `HandshakeError` naming the sidecar.
"""

from __future__ import annotations

import time
from types import TracebackType

import msgspec
import zmq

from kvrdma.defaults import HANDSHAKE_RETRIES, HANDSHAKE_TIMEOUT_SECONDS
from kvrdma.errors import HandshakeError
from kvrdma.handshake.auth import CurveKeys
from kvrdma.handshake.requester import Clock, Requester
from kvrdma.handshake.wire import (
    MAX_FRAME_BYTES,
    MAX_PUBLISH_BYTES,
    Codec,
    ErrorReply,
    PublishAck,
    PublishReply,
    PublishRequest,
    UnpublishRequest,
    publish_client_codec,
    with_checksum,
)
from kvrdma.metadata import WorkerMetadata

__all__ = ["SidecarPublisher"]


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

    def publish(self, meta: WorkerMetadata, *, timeout: float | None = None) -> PublishAck:
        """Hand `meta` to the sidecar; returns its ack (with the ranks it now holds)."""
        meta = with_checksum(meta)
        what = (
            f"publishing engine {meta.engine_id!r} rank {meta.tp_rank} to the sidecar at "
            f"{self.address}"
        )
        return self._call(PublishRequest(worker=meta), what, timeout)

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
                raise HandshakeError(f"{what} rejected: {reply.code}: {reply.message}")
            return reply

        payload = self._codec.encode(msg)
        if len(payload) > MAX_PUBLISH_BYTES:
            raise HandshakeError(
                f"{what}: the message is {len(payload)} bytes, over the sidecar's "
                f"{MAX_PUBLISH_BYTES}-byte limit"
            )
        return self._req.call(self.address, payload, accept, what, timeout)


def publish_to_sidecar(meta: WorkerMetadata, address: str | None, *, timeout: float) -> None:
    """Hand one rank's metadata to the pod's sidecar (see `Worker.publish`)."""
    import os

    from kvrdma.defaults import PUBLISH_ADDRESS

    target = address or os.environ.get("KVRDMA_PUBLISH_ADDRESS") or PUBLISH_ADDRESS
    pub = SidecarPublisher(target, timeout=timeout, curve=CurveKeys.from_env())
    try:
        pub.publish(meta)
    finally:
        pub.close()
