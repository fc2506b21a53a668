"""A remote engine as a consumer rank reads it: its loaded agents, read plan and prepared lists.

`load_agents` and `prepare_remote` never unload an agent they did not load themselves: a rank
another add left loaded (the kept ranks of an engine a retirement dropped) stays loaded when a
later step fails, for closing a connection to a stopped peer makes UCX abort it when it resumes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from kvrdma.descriptors import ReadPlan
from kvrdma.integrity import LandedChecksums
from kvrdma.metadata import WorkerMetadata
from kvrdma.nixl.protocol import DescList, MemType, RegisteredMemory, TransferBackend
from kvrdma.state import WorkerState

__all__ = ["Remote", "load_agents", "prepare_remote"]


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
