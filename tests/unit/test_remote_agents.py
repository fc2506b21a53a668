"""`remote_agents`: which producer processes held a request's blocks, checked against the
agents an added engine serves now."""

from __future__ import annotations

from typing import Any

import pytest

from kvrdma.errors import ConfigError
from kvrdma.metadata import AGENT_TAG_CHARS, agent_tag
from kvrdma.remote import Remote, restarted_since
from kvrdma.testing.metadata import worker_metadata


def _remote(*names: str, ranks: tuple[int, ...] = (0, 1)) -> Remote:
    metas = {r: worker_metadata("P", r, 2, agent_name=names[i]) for i, r in enumerate(ranks)}
    return Remote("P", metas, {}, None, {}, {})  # type: ignore[arg-type]


def test_the_agents_that_hold_the_blocks_now_pass_by_checksum_or_tag() -> None:
    r = _remote("a0", "a1")
    full = {rank: m.agent_metadata_sha256 for rank, m in r.metas.items()}
    assert restarted_since(r, full) is None
    assert restarted_since(r, [agent_tag(r.metas[0]), agent_tag(r.metas[1])]) is None
    assert len(agent_tag(r.metas[0])) == AGENT_TAG_CHARS
    assert restarted_since(r, None) is None  # not named: not checked


def test_ranks_this_rank_does_not_use_are_not_checked() -> None:
    r = _remote("a1", ranks=(1,))
    named = [agent_tag(worker_metadata("P", 0, 2, agent_name="gone")), agent_tag(r.metas[1])]
    assert restarted_since(r, named) is None


def test_a_rank_serving_another_agent_is_named_with_the_engine() -> None:
    before = _remote("a0", "a1")
    named = {rank: agent_tag(m) for rank, m in before.metas.items()}
    after = _remote("a0", "a1-restarted")  # a restart keeping the name changes the blob too
    why = restarted_since(after, named)
    assert why is not None
    assert why.startswith("engine 'P' restarted since its blocks were named: rank 1 held")
    assert "'a1-restarted'" in why and "ranks [1]" in why


@pytest.mark.parametrize(
    "named",
    [
        "0123456789abcdef",  # a string is no list
        {0: "0123456789abcde"},  # too short
        {0: "0123456789ABCDEF"},  # not lowercase
        {"0": "0123456789abcdef"},
        {True: "0123456789abcdef"},
        {-1: "0123456789abcdef"},
        [None],
        5,
    ],
)
def test_malformed_names_are_refused_naming_the_argument(named: Any) -> None:
    with pytest.raises(ConfigError, match="remote_agents"):
        restarted_since(_remote("a0", "a1"), named)


def test_names_of_no_rank_this_rank_uses_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"remote_agents: names producer ranks \[5\]"):
        restarted_since(_remote("a0", "a1"), {5: "0123456789abcdef"})
