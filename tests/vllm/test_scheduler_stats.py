"""What vLLM's own scheduler records of a decoder's loads through KvrdmaConnector: its
prefix-cache statistics split cached prompt tokens by where their KV came from
(`vllm:prompt_tokens_cached_by_source`), and a load from a producer engine comes from a peer,
as with vLLM's NixlConnector."""

from __future__ import annotations

from pathlib import Path

import pytest
from _harness import EngineSpec, kv_cache_config, requires_vllm, vllm_config, write_model_dir
from vllm.config import set_current_vllm_config
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

pytestmark = [pytest.mark.timeout(120), requires_vllm]


def test_a_remote_prefill_counts_its_tokens_as_cached_by_a_peer(tmp_path: Path) -> None:
    spec = EngineSpec(str(write_model_dir(tmp_path)), "kv_consumer", "D-stats", 0)
    cfg = vllm_config(spec)
    mc = cfg.model_config
    attn = FullAttentionSpec(
        block_size=spec.block_size,
        num_kv_heads=mc.get_total_num_kv_heads(),
        head_size=mc.get_head_size(),
        dtype=mc.dtype,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    kvc = kv_cache_config(cfg, dict.fromkeys(layers, attn), spec.num_blocks)
    init_none_hash(sha256)
    with set_current_vllm_config(cfg):
        sched = Scheduler(
            cfg, kvc, StructuredOutputManager(cfg), block_size=spec.block_size, log_stats=True
        )
    params = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
        "remote_engine_id": "P-stats", "remote_request_id": "p-1", "remote_host": "127.0.0.1",
        "remote_port": 1, "tp_size": 1, "remote_num_tokens": 80,
    }  # fmt: skip
    sp = SamplingParams(max_tokens=2, extra_args={"kv_transfer_params": params})
    sp.update_from_generation_config({}, 2)
    hasher = get_request_block_hasher(spec.block_size, sha256)
    sched.add_request(Request("d-1", list(range(10, 90)), sp, None, block_hasher=hasher))
    sched.schedule()  # the request waits for its 80 tokens' KV from the producer
    stats = sched.connector_prefix_cache_stats
    assert stats is not None
    assert stats.hits_by_source == {CacheHitSource.P2P: 80}
    sched.connector.shutdown()
