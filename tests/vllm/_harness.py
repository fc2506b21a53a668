"""An offline vLLM engine for connector tests: vLLM's real `Scheduler` (which builds the
scheduler-side `KvrdmaConnector` through `KVConnectorFactory`), a worker-side connector over
caches allocated by vLLM's own `allocate_kv_cache`, and a deterministic stand-in model
runner that writes known KV for every scheduled token.

`serve(conn, spec)` runs one engine in its own process and answers commands over a pipe;
the test process drives a P engine and a D engine through `EngineProc`.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "num_hidden_layers": 3,
    "vocab_size": 1000,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return path


@dataclass
class EngineSpec:
    model_dir: str
    kv_role: str
    engine_id: str
    side_port: int
    layout: str = "LBHNC"
    policy: str = "fail"
    num_blocks: int = 64
    extra: dict[str, Any] = field(default_factory=dict)
    connector_name: str = "KvrdmaConnector"


def _vllm_config(spec: EngineSpec) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(
        model=spec.model_dir,
        tokenizer=spec.model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=1024,
    )
    sched = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=1024,
        max_model_len=1024,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    kv = KVTransferConfig(
        kv_connector=spec.connector_name,
        kv_connector_module_path="kvrdma.vllm",
        kv_role=spec.kv_role,
        engine_id=spec.engine_id,
        kv_load_failure_policy=spec.policy,
        kv_connector_extra_config=dict(spec.extra),
    )
    cfg = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=sched,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv,
    )
    cfg.cache_config.kv_cache_layout = spec.layout
    cfg.cache_config.num_gpu_blocks = spec.num_blocks
    return cfg


def kv_value(token: int, pos: int, layer: int) -> float:
    """The stand-in model's KV for one token at one position in one layer."""
    return float((token * 7 + pos * 13 + layer * 101) % 4093)


class Engine:
    """Scheduler + worker connector + stand-in runner, stepped by hand."""

    def __init__(self, spec: EngineSpec) -> None:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        self.spec = spec
        self.cfg = _vllm_config(spec)
        init_none_hash(sha256)
        mc = self.cfg.model_config
        self.layers = [
            f"model.layers.{i}.self_attn.attn"
            for i in range(mc.get_num_layers(self.cfg.parallel_config))
        ]
        attn = FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=mc.get_total_num_kv_heads(),
            head_size=mc.get_head_size(),
            dtype=torch.float32,
        )
        self.kvc = _kv_cache_config(self.cfg, {n: attn for n in self.layers}, spec.num_blocks)
        with set_current_vllm_config(self.cfg):
            self.sched = Scheduler(
                self.cfg, self.kvc, StructuredOutputManager(self.cfg), block_size=BLOCK_SIZE
            )
            self.wc = KVConnectorFactory.create_connector(
                self.cfg, KVConnectorRole.WORKER, self.kvc
            )
        self.caches = allocate_kv_cache(self.kvc, torch.device("cpu"), KVCacheLayout[spec.layout])
        self.wc.register_kv_caches(self.caches)
        md = self.wc.get_handshake_metadata()
        self.sched.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): md})
        self.free_blocks_at_start = self.sched.kv_cache_manager.block_pool.get_num_free_blocks()
        self.requests: dict[str, Any] = {}

    def add(self, req_id: str, prompt: list[int], max_tokens: int, params: dict | None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": params} if params is not None else None
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        sp.update_from_generation_config({}, 2)
        req = Request(
            req_id, list(prompt), sp, None, mm_features=None,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        )  # fmt: skip
        self.sched.add_request(req)
        self.requests[req_id] = req

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(req_id)[0])

    def snapshot(self, block_ids: list[int]) -> bytes:
        """The bytes of these blocks in every layer (vLLM's [B, H, N, C] views)."""
        import torch

        idx = torch.tensor(block_ids, dtype=torch.long)
        return b"".join(
            self.caches[n].index_select(0, idx).contiguous().view(torch.uint8).numpy().tobytes()
            for n in self.layers
        )

    def _write_kv(self, req_id: str, n: int) -> None:
        req = self.sched.requests[req_id]
        ids = self.block_ids(req_id)
        tokens = req.all_token_ids
        end = req.num_computed_tokens
        for pos in range(end - n, end):
            blk, slot = ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            for li, name in enumerate(self.layers):
                self.caches[name][blk, :, slot, :] = kv_value(tokens[pos], pos, li)

    def step(self) -> tuple[Any, Any, Any]:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.sched.schedule()
        self.wc.bind_connector_metadata(out.kv_connector_metadata)
        self.wc.start_load_kv(None)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            n = out.num_scheduled_tokens[rid]
            self._write_kv(rid, n)
            req = self.sched.requests[rid]
            done_prompt = req.num_computed_tokens >= req.num_prompt_tokens
            sampled.append([(len(req.all_token_ids) * 31) % 900 + 10] if done_prompt else [])
        res = self.wc.get_transfer_results(out.finished_req_ids)
        invalid = self.wc.get_block_ids_with_load_errors()
        stats = self.wc.get_kv_connector_stats()
        self.wc.clear_connector_metadata()
        kv_out = KVConnectorOutput(
            finished_sending=res.finished_sending or None,
            finished_recving=res.finished_recving or None,
            invalid_block_ids=invalid,
            failed_recving=res.failed_recving,
            kv_connector_stats=stats,
        )
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )
        eco = self.sched.update_from_output(out, mro)
        return out, res, (eco, invalid)

    def close(self) -> None:
        self.wc.shutdown()
        if self.sched.connector is not None:
            self.sched.connector.shutdown()


def _kv_cache_config(cfg: Any, specs: dict[str, Any], num_blocks: int) -> Any:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    page = next(iter(specs.values())).page_size_bytes
    (kvc,) = get_kv_cache_configs(cfg, [specs], [page * len(specs) * num_blocks])
    return kvc


def serve(conn: Any, spec: EngineSpec) -> None:
    """Run one engine in this process: step continuously, answer commands, report events."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_port)
    try:
        eng = Engine(spec)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", eng.free_blocks_at_start))
    try:
        _loop(conn, eng)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        eng.close()


def _loop(conn: Any, eng: Engine) -> None:
    while True:
        while conn.poll(0):
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            if cmd[0] == "add":
                _, rid, prompt, max_tokens, params_json = cmd
                eng.add(rid, prompt, max_tokens, json.loads(params_json) if params_json else None)
            elif cmd[0] == "free_blocks":
                conn.send(
                    ("free_blocks", eng.sched.kv_cache_manager.block_pool.get_num_free_blocks())
                )
        busy = bool(eng.sched.requests) or eng.wc.worker_side.worker.has_work
        waiting_snap = {
            r: eng.block_ids(r)
            for r in eng.sched.requests
            if eng.sched.requests[r].status.name == "WAITING_FOR_REMOTE_KVS"
        }
        _, res, (eco, invalid) = eng.step()
        for rid in res.finished_recving:
            ids = waiting_snap.get(rid) or []
            conn.send(("recv_done", rid, ids, eng.snapshot(ids) if ids else b"", sorted(invalid)))
        for rid in res.finished_sending:
            conn.send(("sent", rid))
        for outs in eco.values():
            for o in outs.outputs:
                if o.finish_reason is not None:
                    params = o.kv_transfer_params
                    snap = (
                        eng.snapshot(params["remote_block_ids"][0])
                        if params and params.get("remote_block_ids")
                        else b""
                    )
                    conn.send(
                        (
                            "finished",
                            o.request_id,
                            str(o.finish_reason),
                            json.dumps(params),
                            list(o.new_token_ids),
                            snap,
                        )
                    )
        if not busy:
            time.sleep(0.002)


class EngineProc:
    """A P or D engine in a child process (spawned: NIXL and vLLM state stay separate)."""

    def __init__(self, spec: EngineSpec) -> None:
        ctx = mp.get_context("spawn")
        self.spec = spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, spec), daemon=True)
        self.proc.start()
        self.events: list[tuple] = []
        self.free_blocks_at_start = -1

    def ready(self, timeout: float = 180.0) -> EngineProc:
        """Wait for the engine to be built (vLLM's import dominates: start P and D first)."""
        _, free = self.wait("ready", timeout=timeout)
        self.free_blocks_at_start = free
        return self

    def _recv(self, timeout: float) -> tuple:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no message from the engine within {timeout}s")
        msg = self.conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"engine failed:\n{msg[1]}")
        return msg

    def add(self, rid: str, prompt: list[int], max_tokens: int, params: dict | None) -> None:
        self.conn.send(
            ("add", rid, prompt, max_tokens, json.dumps(params) if params is not None else "")
        )

    def wait(self, kind: str, rid: str | None = None, timeout: float = 60.0) -> tuple:
        deadline = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self.events):
                if ev[0] == kind and (
                    rid is None or ev[1] == rid or kind in ("ready", "free_blocks")
                ):
                    return self.events.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"no {kind!r} event for {rid!r} within {timeout}s; "
                    f"got {[e[:2] for e in self.events]}"
                )
            self.events.append(self._recv(left))

    def free_blocks(self, timeout: float = 30.0) -> int:
        self.conn.send(("free_blocks",))
        return int(self.wait("free_blocks", timeout=timeout)[1])

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("stop",))
            self.proc.join(20)
        self.kill()
