"""The handshake agent: how a reader learns where a peer's KV blocks live and how they are cut.

`wire` holds the versioned msgspec messages; `server` is the ZMQ ROUTER that answers for the
published ranks (`entries` checks a rank before it is served, `replies` builds the answer to a
request); `client` is the validating, caching fetcher and `publisher` a worker's side of the
sidecar's publish socket, both built on `requester`'s bounded DEALER round trip. `endpoints`
spells ZMQ addresses, `auth` holds the CURVE keys, `vllm_peer` tells vLLM's side channel apart.
"""

from kvrdma.handshake.client import HandshakeClient, RefreshResult
from kvrdma.handshake.publisher import SidecarPublisher
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
