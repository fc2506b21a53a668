"""Default ports, paths and timings shared by the code, the sidecar and the manifests.

The Kubernetes manifests and their tests cross-check against these names: change a value
here and `tests/e2e` tells you which manifest disagrees.
"""

from __future__ import annotations

import os

# vLLM's side channel: port = base + data-parallel index (VLLM_NIXL_SIDE_CHANNEL_PORT).
SIDE_CHANNEL_HOST = "localhost"
SIDE_CHANNEL_PORT = 5600

# The sidecar's HTTP server: /healthz, /readyz and /metrics on one port.
AGENT_HTTP_PORT = 9400
HEALTHZ_PATH = "/healthz"
READYZ_PATH = "/readyz"
METRICS_PATH = "/metrics"

# Each engine rank serves its own /metrics on 127.0.0.1:(base + TP rank), base from
# $KVRDMA_METRICS_PORT; the pod's sidecar merges them (`kvrdma agent` reads the same variable).
ENV_METRICS_PORT = "KVRDMA_METRICS_PORT"
WORKER_METRICS_PORT = 9401  # the base port the manifests set

# Where engine workers publish their metadata to the sidecar (a shared volume in the pod).
PUBLISH_DIR = "/var/run/kvrdma"
PUBLISH_ADDRESS = f"ipc://{PUBLISH_DIR}/publish.sock"

# What a peer can ask for: the longest engine id a handshake request names, and the longest
# handshake timeout (one still unanswered after an hour has failed).
MAX_ENGINE_ID_LENGTH = 256
MAX_TP_SIZE = 1 << 20  # ranks an engine may have: a reader lists those it handshakes with
MAX_HANDSHAKE_TIMEOUT = 3600.0
# At most this many retries: past 1024 a retried handshake's doubling backoff overflows a float.
MAX_HANDSHAKE_RETRIES = 1000
# Each handshake attempt opens a fresh socket whose connect, greeting and request take several
# network round trips: retries that cut `handshake_timeout` into shorter attempts never succeed
# against a peer a few milliseconds away.
MIN_HANDSHAKE_ATTEMPT_SECONDS = 0.01
# UCX copy threads per agent: each is a UCX worker with its own shared-memory queues, so
# thousands exhaust the host's shared memory while the agent builds, and no host copies faster
# with more threads than this.
MAX_NUM_THREADS = 256

# Timings (seconds).
KV_LEASE_SECONDS = 30.0  # producer holds finished blocks this long without a notification
READ_DEADLINE_SECONDS = 10.0  # a READ not DONE by then is failed and its blocks reported invalid
# Without an explicit read_deadline, a short lease shortens the READ's deadline to this share
# of it: the rest of the lease covers the proxy hop and the handshake before the READ starts.
READ_DEADLINE_LEASE_FRACTION = 0.5
# posting a request's READs costs the caller in proportion to its descriptors: a read whose
# post would take longer than this is posted by a background thread, this long at a time, so
# neither start_read nor a call waiting for the thread's turn is held much longer (0: every
# read posted whole by start_read)
POST_BUDGET_SECONDS = 0.002
HANDSHAKE_TIMEOUT_SECONDS = 5.0
HANDSHAKE_RETRIES = 3

# Transfer agents.
HUGEPAGES = "advise"  # kvrdma.hugepages mode for registered host memory


def ucx_num_threads() -> int:
    """UCX worker threads per agent (`num_threads`): one copy thread per usable CPU, at most
    4 (a cross-process READ copies on the reader's threads; more threads than CPUs only
    contend)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def read_deadline_for(lease_seconds: float) -> float:
    """The default `read_deadline` under a `kv_lease_duration` of `lease_seconds`."""
    return min(READ_DEADLINE_SECONDS, lease_seconds * READ_DEADLINE_LEASE_FRACTION)
