"""The handshake agent: how a reader learns where a peer's KV blocks live and how they are cut.

`wire` holds the versioned msgspec messages, `server` the ZMQ ROUTER that answers for the
published ranks, `client` the validating, caching fetcher and the sidecar publisher.
"""

from kvrdma.handshake.client import HandshakeClient, RefreshResult, SidecarPublisher
from kvrdma.handshake.server import HandshakeServer
from kvrdma.handshake.wire import (
    PROTOCOL_VERSION,
    DescriptorSpan,
    ErrorReply,
    MetadataRequest,
    MetadataResponse,
    PublishAck,
    PublishRequest,
    RankDescriptors,
    UnpublishRequest,
    descriptor_spans,
)

__all__ = [
    "PROTOCOL_VERSION",
    "DescriptorSpan",
    "ErrorReply",
    "HandshakeClient",
    "HandshakeServer",
    "MetadataRequest",
    "MetadataResponse",
    "PublishAck",
    "PublishRequest",
    "RankDescriptors",
    "RefreshResult",
    "SidecarPublisher",
    "UnpublishRequest",
    "descriptor_spans",
]
