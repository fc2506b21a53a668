"""The read planner (SPEC §2–5), pure: no torch, no NIXL, no state kept between calls.

`build_read_plan` turns a local worker's metadata and one remote engine's (by rank) into a
`kvrdma.descriptors.ReadPlan`; `transfer_info` is the TP/block-size mapping it plans from.
`build` orchestrates, `regions` holds one rule per region kind (attention, MLA, per-head,
Mamba), `unified` the rules only vLLM's unified orders have.
"""

from kvrdma.plan.build import build_read_plan, build_source_plan, transfer_info

__all__ = ["build_read_plan", "build_source_plan", "transfer_info"]
