"""A remote engine as a consumer rank reads it: its loaded agents, read plan and prepared lists,
and whether the blocks a request names are still held by the processes it runs now.

`load_agents` and `prepare_remote` never unload an agent they did not load themselves: a rank
another add left loaded (the kept ranks of an engine a retirement dropped) stays loaded when a
later step fails, for closing a connection to a stopped peer makes UCX abort it when it resumes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvrdma.descriptors import ReadPlan
from kvrdma.errors import ConfigError
from kvrdma.integrity import LandedChecksums
from kvrdma.metadata import AGENT_TAG_CHARS, WorkerMetadata, agent_checksum, checked_agents
from kvrdma.nixl.protocol import DescList, MemType, RegisteredMemory, TransferBackend
from kvrdma.state import WorkerState

__all__ = ["NamedAgents", "Remote", "load_agents", "prepare_remote", "restarted_since"]

# what names the agents that held a request's blocks: rank -> checksum, or a list by rank
NamedAgents = Mapping[int, str] | Sequence[str]


@dataclass
class Remote:
    engine_id: str
    metas: dict[int, WorkerMetadata]
    agents: dict[int, str]
    plan: ReadPlan
    local_lists: dict[int, DescList]
    remote_lists: dict[int, DescList]
    # one-byte "ack" READs carry the done notification to ranks this worker reads nothing
    # from: a READ is tracked to completion, a bare send_notif on a link that is not yet
    # wired up would wait for this worker's next progress call
    ack_lists: dict[int, DescList] = field(default_factory=dict)
    # integrity mode: the checksum check of this engine's reads, and its landing table's
    # registration
    checks: LandedChecksums | None = None
    checks_reg: RegisteredMemory | None = None


def load_agents(
    reader: TransferBackend,
    metas: Mapping[int, WorkerMetadata],
    ranks: Collection[int],
    loaded: Collection[str],
) -> dict[int, str]:
    """Load the agents of `ranks` (those in `metas`); if one fails, unload those loaded here
    (not in `loaded`, the agents loaded before) and raise."""
    agents: dict[int, str] = {}
    try:
        for rank in ranks:
            if rank in metas:
                agents[rank] = reader.add_remote(metas[rank].agent_metadata)
    except Exception:
        unload_new(reader, agents.values(), loaded)
        raise
    return agents


def unload_new(reader: TransferBackend, agents: Collection[str], loaded: Collection[str]) -> None:
    """Unload the `agents` not in `loaded`."""
    for a in set(agents) - set(loaded):
        reader.remove_remote(a)


def prepare_remote(
    s: WorkerState,
    engine: str,
    metas: Mapping[int, WorkerMetadata],
    plan: ReadPlan,
    checks: LandedChecksums | None,
    loaded: Collection[str],
) -> Remote:
    """Load the engine's agents and prepare its lists; on failure release what was prepared,
    unload the agents not in `loaded` (those loaded before the add) and raise."""
    assert s.metadata is not None  # checked by the caller
    mem = MemType(s.metadata.mem_type)
    rmem = MemType(next(iter(metas.values())).mem_type)
    agents = load_agents(s.reader, metas, plan.notify_ranks, loaded)
    checks_reg: RegisteredMemory | None = None
    ack_lists: dict[int, DescList] = {}
    local_lists: dict[int, DescList] = {}
    remote_lists: dict[int, DescList] = {}
    try:
        checks_reg = s.reader.register(checks.row(), mem) if checks is not None else None
        for src in plan.sources:
            local_lists[src.remote_rank] = s.reader.prep_local(src.local_rows, mem)
            remote_lists[src.remote_rank] = s.reader.prep_remote(
                agents[src.remote_rank], src.remote_rows, rmem
            )
        for rank, agent in agents.items():
            r0 = metas[rank].regions[0]
            one = np.array([[r0.base_addr, 1, r0.device_id]], dtype=np.uint64)
            ack_lists[rank] = s.reader.prep_remote(agent, one, rmem)
    except Exception:
        for dl in (*local_lists.values(), *remote_lists.values(), *ack_lists.values()):
            dl.release()
        unload_new(s.reader, agents.values(), loaded)
        if checks_reg is not None:
            checks_reg.release()
        raise
    return Remote(
        engine, dict(metas), agents, plan, local_lists, remote_lists, ack_lists, checks, checks_reg
    )


def restarted_since(remote: Remote, named: NamedAgents | None) -> str | None:
    """Why a request whose blocks the producer agents `named` held cannot be moved with
    `remote` as added now (a rank serves another agent: its process restarted, and the ids
    name another request's blocks there), or None; None too when nothing is named.
    `ConfigError` when `named` is malformed or names none of the ranks this rank uses."""
    if named is None:
        return None
    agents = checked_agents("remote_agents", named)
    used = {r: t for r, t in agents.items() if r in remote.metas}
    if not used:
        raise ConfigError(
            f"remote_agents: names producer ranks {sorted(agents)[:8]} of engine "
            f"{remote.engine_id!r}, none of those this rank uses ({sorted(remote.metas)})"
        )
    now = {r: agent_checksum(remote.metas[r]) for r in used}
    moved = [r for r, tag in sorted(used.items()) if not now[r].startswith(tag)]
    if not moved:
        return None
    r, n = moved[0], AGENT_TAG_CHARS
    return (
        f"engine {remote.engine_id!r} restarted since its blocks were named: rank {r} held "
        f"them in agent {used[r][:n]}..., it serves agent {remote.metas[r].agent_name!r} "
        f"({now[r][:n]}...) now (ranks {moved}); not read, for those block ids hold another "
        "request's KV there"
    )
