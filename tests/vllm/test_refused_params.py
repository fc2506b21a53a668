"""`kvrdma.vllm.refusals.release_named_by`: the producer request refused `kv_transfer_params`
still name, from the fields a release needs alone, each checked as for a load; anything else
about the params is never read."""

from __future__ import annotations

from typing import Any

import pytest

from kvrdma.errors import ConfigError
from kvrdma.vllm.params import RemoteEngine
from kvrdma.vllm.refusals import release_named_by

pytestmark = pytest.mark.timeout(10)

NAMED = {
    "do_remote_prefill": True,
    "remote_block_ids": "not blocks",  # what D refused: a release reads none
    "remote_engine_id": "P",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "remote_request_id": "r1",
    "remote_num_tokens": -1,
}


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_release_names_the_params_producer_and_request_and_no_block(mode: str) -> None:
    release = release_named_by(NAMED | {"transfer_mode": mode, "tp_size": 2})
    assert release.remote == RemoteEngine("P", "10.0.0.7", 5600, 2)
    assert (release.remote_request_id, release.push) == ("r1", mode == "push")
    assert (release.local_block_ids, release.remote_block_ids, release.report) == ((), (), False)


def test_absent_transfer_mode_and_tp_size_are_a_valid_loads_defaults() -> None:
    release = release_named_by(NAMED)
    assert (release.push, release.remote.tp_size) == (False, 1)


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"remote_engine_id": None}, "remote_engine_id"),
        ({"remote_engine_id": 7}, "remote_engine_id"),
        ({"remote_host": " "}, "remote_host"),
        ({"remote_port": "5600"}, "remote_port"),
        ({"remote_port": 0}, "remote_port"),
        ({"remote_port": True}, "remote_port"),
        ({"remote_request_id": None}, "remote_request_id"),
        ({"remote_request_id": ["r1"]}, "remote_request_id"),
        ({"tp_size": 0}, "tp_size"),
        ({"transfer_mode": "bogus"}, "transfer_mode"),
        ({"transfer_mode": None}, "transfer_mode"),
    ],
)
def test_a_field_a_release_needs_that_a_load_would_refuse_names_no_release(
    bad: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=f"kv_transfer_params.{field}"):
        release_named_by(NAMED | bad)
