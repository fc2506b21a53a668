"""Which producer requests this consumer engine has already loaded (or told to let go).

A producer frees a request's blocks once its readers are done, so a second load of the same
`kv_transfer_params` (a proxy retrying a decode, or sending it twice) would READ blocks
that may hold another prompt's KV by then: the scheduler refuses such a load instead.
"""

from __future__ import annotations

# producer requests remembered, oldest forgotten first: a client naming ever new ids must
# not grow the engine's memory without bound
MAX_CLAIMS = 65536


class LoadClaims:
    """(producer engine, producer request) -> the local request that loads it."""

    def __init__(self, capacity: int = MAX_CLAIMS) -> None:
        self.capacity = capacity
        self._by_remote: dict[tuple[str, str], str] = {}

    def holder(self, engine_id: str, remote_request_id: str) -> str | None:
        """The local request that claimed this producer request, if any."""
        return self._by_remote.get((engine_id, remote_request_id))

    def hold(self, engine_id: str, remote_request_id: str, request_id: str) -> None:
        """Record that `request_id` loads this producer request now, whoever did before."""
        self._by_remote.pop((engine_id, remote_request_id), None)
        self.claim(engine_id, remote_request_id, request_id)

    def claim(self, engine_id: str, remote_request_id: str, request_id: str) -> str | None:
        """Record that `request_id` loads this producer request; returns the local request
        that claimed it first, or None when it is new."""
        key = (engine_id, remote_request_id)
        earlier = self._by_remote.get(key)
        if earlier is not None:
            return earlier
        if len(self._by_remote) >= self.capacity:
            del self._by_remote[next(iter(self._by_remote))]
        self._by_remote[key] = request_id
        return None
