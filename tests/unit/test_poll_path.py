"""What a poll loop around `get_finished()` goes through while reads run: the empty report
(`empty_output`)."""

from __future__ import annotations

import dataclasses

from kvrdma.types import FinishedOutput, empty_output


def test_empty_output_is_a_fresh_default_output() -> None:
    out = empty_output()
    assert type(out) is FinishedOutput and out == FinishedOutput() and not out
    # every field set (one added to FinishedOutput must be added there too)
    assert vars(out).keys() == {f.name for f in dataclasses.fields(FinishedOutput)}


def test_empty_outputs_share_no_field() -> None:
    a, b = empty_output(), empty_output()
    a.finished_sending.add("s")
    a.finished_recving.add("r")
    a.invalid_block_ids["r"] = {1}
    a.failed.add("r")
    a.stats["n"] = 1
    assert b == FinishedOutput() and empty_output() == FinishedOutput()
    for f in dataclasses.fields(FinishedOutput):
        assert getattr(a, f.name) is not getattr(b, f.name), f.name
