"""The harness's prompts: distinct requests must never share a block of tokens, else D's
prefix cache serves part of a load and a test sees fewer blocks loaded than it expects."""

from __future__ import annotations

from _harness import BLOCK_SIZE, prompt


def test_prompts_of_distinct_requests_share_no_first_block() -> None:
    rids = [f"warm-{i:06x}" for i in range(3000)]
    firsts = {tuple(prompt(rid)[:BLOCK_SIZE]) for rid in rids}
    assert len(firsts) == len(rids)


def test_a_files_own_step_and_offset_keep_its_prompts_apart() -> None:
    assert prompt("r", step=41, offset=11)[:BLOCK_SIZE] != prompt("r")[:BLOCK_SIZE]
    assert all(0 < t < 1000 for t in prompt("r", step=41, offset=11))
