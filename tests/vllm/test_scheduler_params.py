"""What the scheduler side makes of a request's `kv_transfer_params`, driven by vLLM's real
`Scheduler` (no workers: a step's connector metadata is what the workers would be told):
which producer request a decoder waits for, when it loads and when it computes itself,
which id a producer's decoders name its request by, and that a request leaves nothing
behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _harness import (
    EngineSpec,
    kv_cache_config,
    prompt,
    requires_vllm,
    vllm_config,
    write_model_dir,
)

from kvrdma.notify import MAX_NOTIF_BYTES, MAX_REQUEST_ID_BYTES, encode
from kvrdma.vllm.params import KvrdmaConnectorMetadata

pytestmark = [pytest.mark.vllm, requires_vllm, pytest.mark.timeout(120)]

BLOCK = 32
PUSH = {
    "do_remote_prefill": True,
    "remote_engine_id": "P",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "transfer_mode": "push",
}
PULL = {**PUSH, "transfer_mode": "pull", "remote_block_ids": [[1, 2, 3, 4, 5]]}


def _scheduler(tmp_path: Path, role: str, **extra: Any) -> Any:
    """vLLM's scheduler of an engine with kvrdma's connector in `role`."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.structured_output import StructuredOutputManager

    spec = EngineSpec(str(write_model_dir(tmp_path / "model")), role, "D", 0, extra=extra)
    cfg = vllm_config(spec)
    init_none_hash(sha256)
    layers = cfg.model_config.get_num_layers(cfg.parallel_config)
    page = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=16, dtype=torch.float32)
    pages = {f"model.layers.{i}.self_attn.attn": page for i in range(layers)}
    with set_current_vllm_config(cfg):
        return Scheduler(
            cfg, kv_cache_config(cfg, pages, 64), StructuredOutputManager(cfg), block_size=BLOCK
        )


def _add(scheduler: Any, rid: str, params: dict[str, Any], tokens: list[int] | None = None) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": dict(params)})
    sampling.update_from_generation_config({}, 2)
    hasher = get_request_block_hasher(BLOCK, sha256)
    request = Request(rid, tokens or prompt(rid), sampling, None, block_hasher=hasher)
    scheduler.add_request(request)


def _told(scheduler: Any) -> tuple[KvrdmaConnectorMetadata, dict[str, int]]:
    """One step's connector metadata and the tokens it schedules per request."""
    out = scheduler.schedule()
    return out.kv_connector_metadata, dict(out.num_scheduled_tokens)


def test_a_load_must_name_a_producer_request_its_notifications_can_carry(
    tmp_path: Path,
) -> None:
    """Without `remote_request_id` every push expected before prefill would wait for one
    producer request (named "None") and load whatever arrived under it; one too long for a
    done notification would leave the producer holding its blocks for a lease. Both loads
    are refused."""
    s = _scheduler(tmp_path, "kv_consumer")
    _add(s, "d1", PUSH)
    _add(s, "d2", PULL | {"remote_request_id": "y" * (MAX_REQUEST_ID_BYTES + 1)})
    meta, _ = _told(s)
    assert not meta.recv
    assert sorted(meta.refused) == ["d1", "d2"]
    assert all("remote_request_id" in no.reason for no in meta.refused.values())


def test_remote_block_ids_null_is_a_push_expected_before_prefill(tmp_path: Path) -> None:
    """vLLM's proxies send null for an absent field: the decoder still expects the push,
    rather than compute the prompt itself while the producer holds its blocks."""
    s = _scheduler(tmp_path, "kv_consumer")
    _add(s, "absent", PUSH | {"remote_request_id": "x1"})
    _add(s, "null", PUSH | {"remote_request_id": "x2", "remote_block_ids": None})
    meta, _ = _told(s)
    assert sorted(meta.recv) == ["absent", "null"]
    assert meta.recv["null"].push and meta.recv["null"].remote_request_id == "x2"


@pytest.mark.parametrize("params", [PULL | {"remote_num_tokens": 150}, PUSH], ids=["pull", "push"])
def test_the_samples_of_a_request_with_n_above_1_load_once_and_compute_the_rest(
    tmp_path: Path, params: dict[str, Any]
) -> None:
    """vLLM gives each sample of a request with `n` 2 the request's params: one loads the
    producer's KV (a second READ could find its blocks freed by the first; a producer
    writes a request into one expectation per decoder rank), the other computes its
    prompt; neither fails."""
    s = _scheduler(tmp_path, "kv_consumer")
    tokens = prompt("n2")
    for child in ("0_n2", "1_n2"):
        _add(s, child, params | {"remote_request_id": "p1"}, tokens)
    meta, scheduled = _told(s)
    assert list(meta.recv) == ["0_n2"] and not meta.refused
    assert scheduled.get("1_n2") == len(tokens)


def test_a_retried_load_of_a_finished_one_is_still_refused(tmp_path: Path) -> None:
    """Only a load running alongside is left to its sibling: params loaded by a request
    that ended are refused, as the producer freed those blocks."""
    from vllm.v1.request import RequestStatus

    s = _scheduler(tmp_path, "kv_consumer")
    params = PULL | {"remote_request_id": "p1", "remote_num_tokens": 150}
    _add(s, "first", params)
    meta, _ = _told(s)
    assert list(meta.recv) == ["first"]
    s.finish_requests("first", RequestStatus.FINISHED_ABORTED)
    _add(s, "again", params)
    meta, _ = _told(s)
    assert list(meta.refused) == ["again"] and "'first'" in meta.refused["again"].reason


def test_a_producer_names_a_request_by_an_id_its_notifications_can_carry(
    tmp_path: Path,
) -> None:
    """vLLM takes request ids from clients: one too long for a done notification is named
    by its digest, and the workers map that back to the request."""
    from vllm.v1.request import RequestStatus

    s = _scheduler(tmp_path, "kv_producer")
    rid = "x" * (4 * MAX_REQUEST_ID_BYTES)
    _add(s, rid, {"do_remote_decode": True})
    _told(s)
    request = s.requests[rid]
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    request.num_computed_tokens = request.num_prompt_tokens
    blocks = s.kv_cache_manager.get_blocks(rid).get_block_ids()
    hold, params = s.connector.request_finished_all_groups(request, blocks)
    named = params["remote_request_id"]
    assert hold and named != rid and len(named.encode()) <= MAX_REQUEST_ID_BYTES
    assert len(encode("done", named, expected=1, sender_engine="D" * 256, sender_rank=0)) <= (
        MAX_NOTIF_BYTES
    )
    meta, _ = _told(s)
    assert meta.push_rids == {named: rid} and named in meta.send


def test_a_request_that_produces_and_loads_leaves_nothing_when_aborted_unscheduled(
    tmp_path: Path,
) -> None:
    """A `kv_both` engine pushing layer by layer: a request that would both load its prompt
    and push its KV on, aborted while it waits, is forgotten whole."""
    from vllm.v1.request import RequestStatus

    s = _scheduler(tmp_path, "kv_both", transfer_mode="push")
    _add(s, "x", PUSH | {"remote_request_id": "x1", "do_remote_decode": True})
    s.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    _told(s)
    side = s.connector.scheduler_side
    assert not side._producing and not side._push_key and not side._params


def test_a_sample_that_computes_its_prompt_stops_heartbeating_the_producer(
    tmp_path: Path,
) -> None:
    """A sample that waited a step (the step's token budget taken) was heartbeated meanwhile
    for the producer request its sibling loads: once it computes its prompt, those
    heartbeats stop (they would hold the producer's blocks for as long as it lives)."""
    s = _scheduler(tmp_path, "kv_consumer")
    tokens, params = prompt("n2"), PULL | {"remote_request_id": "p1", "remote_num_tokens": 150}
    _add(s, "0_n2", params, tokens)
    for i in (1, 2):  # two long prompts fill the first step's 1,024 tokens
        _add(s, f"long{i}", {}, list(range(i, 600 + i)))
    _add(s, "1_n2", params, tokens)
    heartbeated, forgotten = set(), set()
    for _ in range(6):
        meta, _ = _told(s)
        heartbeated |= set(meta.keep_alive)
        forgotten |= meta.forget
    assert "1_n2" in heartbeated and "1_n2" in forgotten


def test_a_producer_names_its_ranks_agents_and_a_decoder_reads_only_from_them(
    tmp_path: Path,
) -> None:
    """P's params name the agents of its ranks (from its workers' handshake payloads, in
    sidecar mode too): a decoder hands them to its read, so a P restarted since (same agent
    names, other blocks) fails it instead of landing another request's KV. Params without
    them (a stock producer) load unchecked; malformed ones are refused naming the key."""
    import msgspec
    from vllm.v1.request import RequestStatus

    from kvrdma.metadata import agent_tag
    from kvrdma.testing.metadata import worker_metadata
    from kvrdma.vllm.params import KvrdmaHandshakeMetadata

    p = _scheduler(tmp_path, "kv_producer", publish_address="ipc:///nonexistent/pub.sock")
    metas = [worker_metadata("D", r, 2) for r in (1, 0)]
    payloads = {(0, m.tp_rank): KvrdmaHandshakeMetadata(msgspec.msgpack.encode(m)) for m in metas}
    p.connector.set_xfer_handshake_metadata_pp_aware(payloads)
    _add(p, "r", {"do_remote_decode": True})
    _told(p)
    request = p.requests["r"]
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    request.num_computed_tokens = request.num_prompt_tokens
    blocks = p.kv_cache_manager.get_blocks("r").get_block_ids()
    _, params = p.connector.request_finished_all_groups(request, blocks)
    tags = [agent_tag(m) for m in sorted(metas, key=lambda m: m.tp_rank)]
    assert params["remote_agents"] == tags

    d = _scheduler(tmp_path, "kv_consumer")
    named = PULL | {"remote_num_tokens": 150}
    _add(d, "named", named | {"remote_request_id": "p1", "remote_agents": tags})
    _add(d, "stock", named | {"remote_request_id": "p2"})
    _add(d, "bad", named | {"remote_request_id": "p3", "remote_agents": ["?"]})
    meta, _ = _told(d)
    assert meta.recv["named"].remote_agents == tuple(tags)
    assert meta.recv["stock"].remote_agents == ()
    assert "kv_transfer_params.remote_agents" in meta.refused["bad"].reason


def test_a_pushed_sample_aborted_while_waiting_leaves_its_sibling_the_producer_request(
    tmp_path: Path,
) -> None:
    """Three samples of a pushed request: the first loads it; the second, aborted before it
    was scheduled, tells the producer nothing and takes nothing over, so the third computes
    its prompt too rather than expect the producer request a second time (which the decoder
    rank refuses)."""
    from vllm.v1.request import RequestStatus

    s = _scheduler(tmp_path, "kv_consumer")
    tokens, params = prompt("n3"), PUSH | {"remote_request_id": "p1"}
    _add(s, "0_n3", params, tokens)
    for i in (1, 2):  # two long prompts fill the first step's 1,024 tokens
        _add(s, f"long{i}", {}, list(range(i, 600 + i)))
    for child in ("1_n3", "2_n3"):
        _add(s, child, params, tokens)
    meta, _ = _told(s)
    assert list(meta.recv) == ["0_n3"]
    s.finish_requests("1_n3", RequestStatus.FINISHED_ABORTED)
    loads = []
    for _ in range(4):
        meta, _ = _told(s)
        loads += list(meta.recv)
    assert loads == []
