"""The scheduler-side half of `KvrdmaConnector` (one per engine, in the engine core).

It decides which requests pull KV from a producer and which hold their blocks for readers,
turns those decisions into per-step `KvrdmaConnectorMetadata`, and serves the workers'
kvrdma metadata on the engine's side channel (or leaves that to the `kvrdma agent` sidecar
when the workers publish to it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvrdma.config import KVTransferConfig, KVTransferParams
from kvrdma.errors import ConfigError
from kvrdma.handshake.auth import CurveKeys
from kvrdma.metadata import agent_tag
from kvrdma.notify import MAX_REQUEST_ID_BYTES
from kvrdma.vllm.claims import LoadClaims
from kvrdma.vllm.owed import owed_in
from kvrdma.vllm.params import (
    KeepAlive,
    KvrdmaConnectorMetadata,
    RecvSpec,
    RefusedLoad,
    agents_of,
    computed_tokens_of,
    expiry_of,
    notifiable_id,
    parse_params,
    producer_params,
    producer_request_of,
    pushed,
    pushed_before_prefill,
    release_of,
    remote_engine_of,
    workers_of,
)
from kvrdma.vllm.refusals import (
    BadParams,
    claimed_before,
    first_release,
    loaded_by_sibling,
    refused_params,
    shorter_than_producer,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvrdma.handshake import HandshakeServer

logger = logging.getLogger(__name__)

PUBLISH_ENV = "KVRDMA_PUBLISH_ADDRESS"


def sidecar_mode(config: KVTransferConfig) -> bool:
    """Workers publish to the pod's `kvrdma agent`, which serves the side channel."""
    return bool(os.environ.get(PUBLISH_ENV) or config.extra.publish_address)


class KvrdmaScheduler:
    """Per-request pull/hold decisions and the side channel; no NIXL, no tensors."""

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: KVTransferConfig
    ) -> None:
        pc = vllm_config.parallel_config
        self.config = config
        self.kv_cache_config = kv_cache_config
        self.engine_id = config.engine_id
        self.host = config.side_channel_host
        self.port = config.side_channel_port(int(getattr(pc, "data_parallel_index", 0) or 0))
        # the side channel's keys, as the agent's (loaded now: a bad directory stops the start)
        self._curve = CurveKeys.from_env()
        self.tp_size = pc.tensor_parallel_size
        self.dcp_size = pc.decode_context_parallel_size
        self.pp_size = pc.pipeline_parallel_size
        # layer-wise push needs each forward to end (and its requests to finish) before the
        # next is scheduled: with overlapping batches a request whose push began could be
        # preempted and its blocks reused while WRITEs read them; micro-batches save a layer
        # once per micro-batch
        self.layerwise = vllm_config.max_concurrent_batches == 1 and not getattr(
            pc, "use_ubatching", False
        )
        if config.extra.transfer_mode == "push" and config.is_producer and not self.layerwise:
            logger.info(
                "push mode: requests are pushed whole when they end; layer by layer needs one "
                "batch in flight (vLLM's --no-async-scheduling, no pipeline parallelism or "
                "micro-batching)"
            )
        self._recv: dict[str, RecvSpec] = {}
        self._send: dict[str, tuple[tuple[int, ...], ...]] = {}
        self._keep_alive: dict[str, KeepAlive] = {}
        self._forget: set[str] = set()
        self._heartbeating: set[str] = set()
        # request -> the id its push goes by (`transfer_id`, else its own), until it is sent
        self._push_key: dict[str, str] = {}
        # layer-wise push producer: requests not finished, their blocks so far, those whose
        # push began in their last prefill step, and those of them dropped since
        self._producing: dict[str, Request] = {}
        self._blocks: dict[str, list[list[int]]] = {}
        self._layerwise: set[str] = set()
        self._push_layers: dict[str, tuple[tuple[int, ...], ...]] = {}
        self._abort_push: set[str] = set()
        self._push_rids: dict[str, str] = {}  # this step's push ids -> request ids
        self._server: HandshakeServer | None = None
        self._agents: tuple[str, ...] = ()  # its workers' agents by TP rank (`agent_tag`)
        # requests' validated kv_transfer_params, until they finish; requests whose params
        # were refused, until allocated, and then their loads, failed by the workers
        self._params: dict[str, KVTransferParams] = {}
        self._bad_params: dict[str, BadParams] = {}
        self._refused: dict[str, RefusedLoad] = {}
        self._claims = LoadClaims()  # producer requests loaded (or let go) so far
        self.notifications_owed = False  # by some worker, as of the last step (`owed`)
        # hybrid models: the decoder recomputes the last prompt token itself (a recurrent
        # state cannot be rolled back), so the prefill stops one token short of it
        self.backoff = 1 if _has_mamba(kv_cache_config) else 0

    # ---- consumer side ---------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        """Validate the request's `kv_transfer_params` once, here: the later hooks run inside
        vLLM's scheduling loop, where an exception ends the engine."""
        raw = request.kv_transfer_params
        if raw is None:
            return
        rid = request.request_id
        try:
            params = parse_params(raw)
        except ConfigError as exc:
            bad = refused_params(rid, raw, exc, self.config.kv_load_failure_policy)
            if bad is not None:
                self._bad_params[rid] = bad
            return
        assert params is not None  # raw is not None
        if params.do_remote_decode and not self.config.is_producer:
            logger.warning(
                "request %r: do_remote_decode ignored: kv_role %r serves no KV to other "
                "engines, so its blocks are freed when it ends",
                rid,
                self.config.kv_role,
            )
            params = dataclasses.replace(params, do_remote_decode=False)
        if params.do_remote_prefill and not self.config.is_consumer:
            logger.warning(
                "request %r: do_remote_prefill ignored: kv_role %r reads no KV from other "
                "engines, so it computes the prompt itself",
                rid,
                self.config.kv_role,
            )
            params = dataclasses.replace(params, do_remote_prefill=False)
            raw["do_remote_prefill"] = False
        self._params[rid] = params
        if params.do_remote_decode and self.backoff:
            _truncate_prompt(request, self.backoff)
        if params.do_remote_decode and self.config.extra.transfer_mode == "push":
            self._push_key[rid] = self._key_for(rid, raw)
            if self.layerwise:
                self._producing[rid] = request
        if params.needs_read and params.remote_request_id:
            remote = remote_engine_of(params)
            self._keep_alive[rid] = KeepAlive(params.remote_request_id, remote)
            self._heartbeating.add(rid)
        elif pushed_before_prefill(raw, params):
            # nothing to heartbeat (the producer may not have it yet), but an abort must
            # still tell it (`_forget`)
            self._heartbeating.add(rid)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        rid = request.request_id
        end = self._prompt_end(request)
        if rid not in self._bad_params:  # else claimed, for its load to fail
            params = self._params.get(rid)
            raw = request.kv_transfer_params
            if params is None or not raw.get("do_remote_prefill"):
                return 0, False
            if not (params.needs_read or pushed_before_prefill(raw, params)):
                return 0, False  # nothing to read: vLLM would wait for it forever
            if loaded_by_sibling(self._claims, rid, params, self._params):
                return 0, False
            computed = computed_tokens_of(params)
            end = end if computed is None else min(end, computed)  # never past P's tokens
        count = end - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _prompt_end(self, request: Request) -> int:
        """The prompt tokens a decoder loads (all but those it recomputes itself)."""
        n = len(request.prompt_token_ids or ())
        return n - self.backoff if n > self.backoff else n

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        bad = self._bad_params.pop(rid, None)
        if bad is not None:
            release = first_release(self._claims, rid, bad.release)
            if num_external_tokens > 0:
                engine = "" if bad.release is None else bad.release.remote.engine_id
                local = self._loaded_blocks(blocks)
                self._refused[rid] = RefusedLoad(local, bad.reason, engine, release)
            elif release is not None:  # nothing to load: only the producer is told
                self._recv[rid] = release
            return
        params = self._params.get(rid)
        raw = request.kv_transfer_params
        if params is None or not raw.get("do_remote_prefill"):
            return
        if params.needs_read or pushed_before_prefill(raw, params):
            if not num_external_tokens and loaded_by_sibling(
                self._claims, rid, params, self._params
            ):
                self._keep_alive.pop(rid, None)  # the sibling's load tells the producer:
                self._forget.add(rid)  # heartbeats sent already stop
                raw["do_remote_prefill"] = False
                return
            local = self._loaded_blocks(blocks) if num_external_tokens > 0 else ()
            spec = RecvSpec(
                local_block_ids=local,
                remote_block_ids=params.remote_block_ids,
                remote_request_id=producer_request_of(params),
                remote=remote_engine_of(params),
                remote_expires_at=expiry_of(params),
                push=pushed(params),
                report=num_external_tokens > 0,
                span=self._span(blocks),
                remote_agents=agents_of(params),
            )
            short = shorter_than_producer(params, self._prompt_end(request)) if local else None
            # claimed even when short: told below
            claimed = claimed_before(self._claims, rid, params)
            if claimed is not None:  # the first load freed the producer's blocks
                if local:
                    self._refused[rid] = RefusedLoad(local, claimed, spec.remote.engine_id)
                else:  # nothing to load, so nothing to heartbeat for
                    self._keep_alive.pop(rid, None)
                    self._forget.add(rid)
            elif short is not None:  # told at once, else the producer holds them a lease
                release = release_of(spec)
                self._refused[rid] = RefusedLoad(local, short, spec.remote.engine_id, release)
            else:
                self._recv[rid] = spec
        raw["do_remote_prefill"] = False  # one transfer per request

    def _span(self, blocks: KVCacheBlocks) -> tuple[int, ...]:
        """The blocks the request holds per transferred group (`RecvSpec.span`)."""
        return tuple(len(g) for g in self._transfer_groups(blocks.get_block_ids()))

    def _loaded_blocks(self, blocks: KVCacheBlocks) -> tuple[tuple[int, ...], ...]:
        """The blocks a load fills: those past the local prefix-cache hit."""
        local = blocks.get_unhashed_block_ids_all_groups()
        if local:
            local = self.kv_cache_config.select_transfer_block_ids(local)
        return tuple(tuple(g) for g in local)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.notifications_owed = owed_in(output.kv_connector_worker_meta)
        for req_id in output.finished_recving or ():
            self._heartbeating.discard(req_id)
        for req_id in output.finished_sending or ():
            self._push_key.pop(req_id, None)

    def _key_for(self, rid: str, raw: Mapping[str, Any]) -> str:
        """The id a decoder names this push by: `transfer_id` when the proxy chose one (it
        cannot know the id vLLM gives the request), else the request's own, made unique
        when another push goes by it (D learns it from P's params)."""
        key, taken = raw.get("transfer_id"), set(self._push_key.values())
        if key is not None and (
            not isinstance(key, str) or key in taken or notifiable_id(key) != key
        ):
            logger.warning(
                "request %r: kv_transfer_params.transfer_id must be a non-empty string of at "
                "most %d bytes no other push uses, got %.80r; the push goes by the request id",
                rid,
                MAX_REQUEST_ID_BYTES,
                key,
            )
            key = None
        key = notifiable_id(rid) if key is None else key
        while key in taken:  # the request's own id is another push's transfer_id
            key = notifiable_id(f"{rid}.{os.urandom(4).hex()}")
        return key

    # ---- producer side ---------------------------------------------------------------
    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        bad = self._bad_params.pop(rid, None)
        if bad is not None and (release := first_release(self._claims, rid, bad.release)):
            self._recv[rid] = release  # never allocated: the producer is still told
        params = self._params.pop(rid, None)
        raw = request.kv_transfer_params
        if params is None:
            return False, None
        if rid in self._heartbeating:  # aborted while waiting for its KV
            self._heartbeating.discard(rid)
            self._keep_alive.pop(rid, None)
            self._forget.add(rid)
        if raw.get("do_remote_prefill"):
            # never allocated (so never produced either): an empty read still tells the
            # producer to free its blocks
            self._producing.pop(rid, None)
            self._push_key.pop(rid, None)
            asked = params.needs_read or pushed_before_prefill(raw, params)
            if asked and loaded_by_sibling(self._claims, rid, params, self._params):
                asked = False  # the sibling's load tells the producer
            if asked and (pushed(params) or claimed_before(self._claims, rid, params) is None):
                self._recv[rid] = RecvSpec(
                    (), params.remote_block_ids, producer_request_of(params),
                    remote_engine_of(params), push=pushed(params), report=False,
                    remote_agents=agents_of(params),
                )  # fmt: skip
            raw["do_remote_prefill"] = False
            return False, None
        if not params.do_remote_decode:
            return False, None
        self._producing.pop(rid, None)
        self._blocks.pop(rid, None)
        key = self._push_key.get(rid) or notifiable_id(rid)
        began = rid in self._layerwise  # its push runs: its blocks stay until it ends
        self._layerwise.discard(rid)
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            if began:  # the workers map its push id since it began
                self._abort_push.add(key)
            else:
                self._push_key.pop(rid, None)
            return began, None
        groups = self._held_blocks(block_ids, request.num_computed_tokens)
        hold = any(groups) or began
        if hold and not began:
            self._send[key] = groups
            self._push_rids[key] = rid
        if not hold:
            self._push_key.pop(rid, None)
        return hold, producer_params(
            block_ids=groups,
            engine_id=self.engine_id,
            request_id=key,
            host=self.host,
            port=self.side_channel_port,
            tp_size=self.tp_size,
            dcp_size=self.dcp_size,
            pp_size=self.pp_size,
            num_tokens=request.num_computed_tokens if hold else 0,
            # the workers' hold (and lease) starts a step later: this end is on the safe side
            expires_at=time.monotonic() + self.config.extra.kv_lease_duration if hold else None,
            transfer_mode=self.config.extra.transfer_mode,
            agents=self._agents,
        )

    def _held_blocks(
        self, groups: Sequence[Sequence[int]], tokens: int
    ) -> tuple[tuple[int, ...], ...]:
        """The blocks holding the first `tokens` tokens' KV: allocation may reach past them
        (lookahead slots), and a decoder pairs the last blocks with its own."""
        from vllm.v1.kv_cache_interface import MambaSpec

        kept = []
        for spec, ids in zip(self.kv_cache_config.kv_cache_groups, groups, strict=False):
            size = spec.kv_cache_spec.block_size
            mamba = isinstance(spec.kv_cache_spec, MambaSpec)
            kept.append(list(ids) if mamba else list(ids[: -(-tokens // size)]))
        return self._transfer_groups(kept)

    def _transfer_groups(self, block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        if not block_ids:
            return ()
        if len(block_ids) == len(self.kv_cache_config.kv_cache_groups):
            block_ids = self.kv_cache_config.select_transfer_block_ids(block_ids)
        return tuple(tuple(int(b) for b in g) for g in block_ids)

    # ---- per step --------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvrdmaConnectorMetadata:
        if self._producing:
            self._plan_layerwise(scheduler_output)
        meta = KvrdmaConnectorMetadata(
            recv=self._recv,
            send=self._send,
            keep_alive=self._keep_alive,
            forget=self._forget,
            push_layers=self._push_layers,
            abort_push=self._abort_push,
            push_rids=self._push_rids,
            refused=self._refused,
        )
        self._recv, self._send, self._keep_alive, self._forget = {}, {}, {}, set()
        self._refused = {}
        self._push_layers, self._abort_push, self._push_rids = {}, set(), {}
        return meta

    def _plan_layerwise(self, out: SchedulerOutput) -> None:
        """Push producers' requests whose prefill ends in this step are pushed layer by layer
        during its forward. Only those that finish with it (`max_tokens` 1, as a P/D proxy
        sends them): a request that runs on could be preempted, and its blocks reused,
        while a WRITE still reads them."""
        for new in out.scheduled_new_reqs:
            if new.req_id in self._producing:
                self._blocks[new.req_id] = [list(g) for g in new.block_ids]
        cached = out.scheduled_cached_reqs
        for rid, more in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if rid not in self._producing or more is None:
                continue
            if rid in cached.resumed_req_ids or rid not in self._blocks:
                self._blocks[rid] = [list(g) for g in more]
            else:
                for have, add in zip(self._blocks[rid], more, strict=True):
                    have.extend(add)
        for rid, req in self._producing.items():
            n = out.num_scheduled_tokens.get(rid, 0)
            ends = req.num_computed_tokens < req.num_prompt_tokens <= req.num_computed_tokens + n
            if ends and req.max_tokens == 1 and rid not in self._layerwise:
                self._layerwise.add(rid)
                key = self._push_key.get(rid, rid)
                self._push_layers[key] = self._held_blocks(
                    self._blocks.get(rid, []), req.num_prompt_tokens
                )
                self._push_rids[key] = rid

    # ---- side channel ----------------------------------------------------------------
    def set_handshake_metadata(self, metadata: Mapping[tuple[int, int], Any]) -> None:
        """Serve every worker's kvrdma metadata on this engine's side channel (in sidecar mode
        the agent does), and name its agents in the params of the requests it holds."""
        metas = workers_of(metadata)
        self._agents = tuple(agent_tag(m) for m in metas)  # the agents holding its blocks
        if sidecar_mode(self.config):
            logger.info("workers publish to the kvrdma agent; no in-process side channel")
            return
        from kvrdma.handshake import HandshakeServer

        if self._server is None:
            self._server = HandshakeServer(
                self.host,
                self.port,
                enforce_compat=self.config.extra.enforce_handshake_compat,
                curve=self._curve,
            )
        for m in metas:
            self._server.publish(m)
        logger.info(
            "kvrdma side channel for engine %r at %s (%d ranks)",
            self.engine_id,
            self._server.address,
            len(metas),
        )

    @property
    def side_channel_port(self) -> int:
        """The bound port (differs from the configured one only when that was 0)."""
        return self._server.port if self._server is not None else self.port

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


def _has_mamba(kv_cache_config: KVCacheConfig) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return any(isinstance(g.kv_cache_spec, MambaSpec) for g in kv_cache_config.kv_cache_groups)


def _truncate_prompt(request: Request, n: int) -> None:
    """Prefill all but the last `n` prompt tokens (once, even if the request is preempted)."""
    raw = request.kv_transfer_params
    if raw.get("_kvrdma_truncated") or request.num_prompt_tokens <= n:
        return
    if request.prompt_token_ids is None:
        return
    del request.prompt_token_ids[-n:]
    del request._all_token_ids[-n:]
    request.num_prompt_tokens -= n
    request.max_tokens = 1
    raw["_kvrdma_truncated"] = True
