"""What a producer's `kv_transfer_params` name: the blocks holding the tokens it computed.

The scheduler is driven directly (its request bookkeeping is plain logic): a finished
prefill's blocks as vLLM hands them over, including the lookahead slots it allocates past
the prompt for speculative decoding, which a decoder pairing blocks from the end must not
see.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from _harness import requires_vllm
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import RequestStatus

from kvrdma.config import KVTransferConfig, KVTransferParams
from kvrdma.errors import ConfigError
from kvrdma.vllm.params import RecvSpec, RemoteEngine, expiry_of, pair_groups
from kvrdma.vllm.scheduler import KvrdmaScheduler

pytestmark = [pytest.mark.vllm, requires_vllm]

BLOCK = 16


def _scheduler() -> KvrdmaScheduler:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=None)
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)],
        select_transfer_block_ids=lambda ids: tuple(ids),
    )
    parallel = SimpleNamespace(
        tensor_parallel_size=1, decode_context_parallel_size=1, pipeline_parallel_size=1
    )
    vllm_config = SimpleNamespace(parallel_config=parallel, max_concurrent_batches=1)
    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "KvrdmaConnector",
            "kv_connector_module_path": "kvrdma.vllm",
            "kv_role": "kv_producer",
            "engine_id": "p",
        }
    )
    return KvrdmaScheduler(vllm_config, kv_cache_config, config)  # type: ignore[arg-type]


def test_lookahead_blocks_past_the_computed_tokens_are_not_named() -> None:
    """A prefill of 32 tokens with 3 lookahead slots holds a third block: the params name the
    two holding the prompt, so a decoder's two blocks pair with them, not shifted by one."""
    s = _scheduler()
    request = SimpleNamespace(
        request_id="r",
        kv_transfer_params={"do_remote_decode": True},
        num_computed_tokens=32,
        num_prompt_tokens=32,
        prompt_token_ids=list(range(32)),
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
    )
    s.on_new_request(request)  # type: ignore[arg-type]
    hold, params = s.request_finished(request, [[11, 12, 13]])  # type: ignore[arg-type]
    assert hold and params is not None
    assert params["remote_block_ids"] == [[11, 12]]
    assert params["remote_num_tokens"] == 32
    spec = RecvSpec(
        ((1, 2),),
        tuple(tuple(g) for g in params["remote_block_ids"]),
        "r",
        RemoteEngine("p", "h", 1, 1),
        span=(2,),
    )
    assert pair_groups(spec) == ([1, 2], [11, 12])


def test_null_blocks_pair_only_with_null_blocks_or_are_skipped() -> None:
    """A local null block (padding) is never read into; a real local block facing the
    producer's null block (a sliding window it dropped) would keep whatever it held, another
    request's KV, while the load reports success: the load fails and vLLM recomputes it."""

    def spec(local: tuple[int, ...], remote: tuple[int, ...]) -> RecvSpec:
        return RecvSpec((local,), (remote,), "r", RemoteEngine("p", "h", 1, 1), span=(3,))

    assert pair_groups(spec((0, 2, 3), (0, 12, 13))) == ([2, 3], [12, 13])
    assert pair_groups(spec((0, 2, 3), (11, 12, 13))) == ([2, 3], [12, 13])
    with pytest.raises(ConfigError, match=r"null block pairs with this engine's block 1"):
        pair_groups(spec((1, 2, 3), (0, 12, 13)))


@pytest.mark.parametrize("value", [10**400, -(10**400), float("inf"), "soon", True])
def test_an_expiry_that_is_no_finite_number_is_refused_naming_the_field(value: object) -> None:
    """An integer past a float's range too (an engine in the client's process gets it as is):
    a `ConfigError`, which fails the load, never another exception into vLLM's scheduler."""
    params = KVTransferParams.from_dict({"remote_blocks_expiry_time": value})
    with pytest.raises(ConfigError, match=r"^kv_transfer_params.remote_blocks_expiry_time: "):
        expiry_of(params)
