"""An offline vLLM engine for connector tests: vLLM's real `Scheduler` (which builds the
scheduler-side `KvrdmaConnector` through `KVConnectorFactory`), a worker-side connector over
caches allocated by vLLM's own `allocate_kv_cache`, and a deterministic stand-in model
runner that writes known KV for every scheduled token.

`serve(conn, spec)` runs one engine in its own process and answers commands over a pipe;
the test process drives a P engine and a D engine through `EngineProc`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import multiprocessing as mp
import os
import queue
import random
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _children import WARNINGS, probe

from kvrdma.testing import (
    free_port,  # noqa: F401  (tests take free_port from here)
    stop_process,
)

# the tier needs vLLM (a CPU build: see VLLM.md); its modules only look for it here, since
# the engines import it in their own processes
requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed in this environment"
)

BLOCK_SIZE = 32
# well under the default lease (30 s): a producer frees a request's blocks this soon only
# when the decoder told it
PROMPT_FREE_SECONDS = 5.0
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


def prompt(rid: str, *, step: int = 53, offset: int = 7) -> list[int]:
    """150 tokens (5 blocks of 32, the last partial), distinct per request: no prefix hits
    (a test file's own `step` and `offset` keep its requests apart from another file's).
    Every token is drawn from a generator seeded by all three, so two requests share a
    block only by a 900**32 chance."""
    rng = random.Random(f"{step}/{offset}/{rid}")
    return [rng.randrange(900) + offset for _ in range(150)]


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
    tp_size: int = 1
    mla: bool = False
    hybrid: bool = False  # layer 1 is a Mamba layer (HMA groups overlay one buffer)
    step_delay: float = 0.0  # a slow model: seconds per step while requests run
    # stepped as vLLM's engine core steps it: only while `Scheduler.has_requests()` (an idle
    # engine's connector is not called at all), and with one rank a step that ran no model
    # and has nothing to report passes its scheduler no connector output (UniProcExecutor);
    # else every loop steps it and a KVOutputAggregator always builds the output
    like_engine_core: bool = False
    env: dict[str, str] = field(default_factory=dict)  # set while the engine is built
    # the config of an engine scheduling asynchronously (two batches in flight); the harness
    # still steps it one batch at a time
    async_scheduling: bool = False
    block_size: int = BLOCK_SIZE


def vllm_config(spec: EngineSpec) -> Any:
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
        cache_config=CacheConfig(block_size=spec.block_size, enable_prefix_caching=True),
        scheduler_config=sched,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv,
    )
    cfg.cache_config.kv_cache_layout = spec.layout
    if spec.async_scheduling:
        cfg.scheduler_config.async_scheduling = True
    cfg.cache_config.num_gpu_blocks = spec.num_blocks
    return cfg


def kv_value(token: int, pos: int, layer: int) -> float:
    """The stand-in model's KV base value for one token at one position in one layer."""
    return float((token * 7 + pos * 13 + layer * 101) % 4093)


class Engine:
    """Scheduler + one worker connector per TP rank + stand-in runner, stepped by hand."""

    def __init__(self, spec: EngineSpec) -> None:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        from kvrdma.vllm.config import kvrdma_config
        from kvrdma.vllm.worker import KvrdmaWorkerSide

        self.spec = spec
        self.cfg = vllm_config(spec)
        self.cfg.parallel_config.tensor_parallel_size = spec.tp_size
        init_none_hash(sha256)
        mc = self.cfg.model_config
        self.layers = [
            f"model.layers.{i}.self_attn.attn"
            for i in range(mc.get_num_layers(self.cfg.parallel_config))
            if not (spec.hybrid and i == 1)
        ]
        self.mamba = ["model.layers.1.mixer"] if spec.hybrid else []
        self.total_heads = 1 if spec.mla else mc.get_total_num_kv_heads()
        self.rank_heads = max(1, self.total_heads // spec.tp_size)
        self.kvc = kv_cache_config(self.cfg, self._specs(), spec.num_blocks)
        with set_current_vllm_config(self.cfg):
            self.sched = Scheduler(
                self.cfg, self.kvc, StructuredOutputManager(self.cfg), block_size=spec.block_size
            )
            self.wcs = []
            for rank in range(spec.tp_size):
                wc = KVConnectorFactory.create_connector(self.cfg, KVConnectorRole.WORKER, self.kvc)
                # vLLM's process groups are not set up offline: each rank is told its place
                wc._worker = KvrdmaWorkerSide(
                    self.cfg, self.kvc, kvrdma_config(self.cfg), tp_rank=rank,
                    tp_size=spec.tp_size,
                )  # fmt: skip
                if spec.mla:
                    wc._worker.use_mla = True
                self.wcs.append(wc)
        layout = KVCacheLayout[spec.layout]
        self.caches = [allocate_kv_cache(self.kvc, torch.device("cpu"), layout) for _ in self.wcs]
        for wc, caches in zip(self.wcs, self.caches, strict=True):
            wc.register_kv_caches(caches)
        mds = {(0, r): wc.get_handshake_metadata() for r, wc in enumerate(self.wcs)}
        self.sched.connector.set_xfer_handshake_metadata_pp_aware(mds)
        self.aggregator = KVOutputAggregator(spec.tp_size)
        self.free_blocks_at_start = self.sched.kv_cache_manager.block_pool.get_num_free_blocks()
        self.computed: dict[str, int] = {}  # request -> prompt tokens the runner computed
        self.stats_seen: list[dict[str, Any]] = []  # each step's aggregated connector stats
        self.load_seconds = 0.0  # the longest start_load_kv call so far (on any rank)
        self.steps = 0  # steps so far

    def _specs(self) -> dict[str, Any]:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

        mc = self.cfg.model_config
        cls = MLAAttentionSpec if self.spec.mla else FullAttentionSpec
        kw: dict[str, Any] = {"head_size_v": 0} if self.spec.mla else {}
        spec = cls(
            block_size=self.spec.block_size,
            num_kv_heads=self.rank_heads,
            head_size=2 * mc.get_head_size() if self.spec.mla else mc.get_head_size(),
            dtype=torch.float32,
            **kw,
        )
        specs: dict[str, Any] = {n: spec for n in self.layers}
        if self.spec.hybrid:
            from vllm.v1.kv_cache_interface import MambaSpec

            for n in self.mamba:
                specs[n] = MambaSpec(
                    block_size=self.spec.block_size,
                    # conv and SSM state, split over TP ranks as a real Mamba layer's are
                    shapes=((3, 256 // self.spec.tp_size), (4 // self.spec.tp_size, 16, 40)),
                    dtypes=(torch.float32, torch.float32),
                    page_size_padded=spec.page_size_bytes,
                )
        return specs

    def group_of(self, layer: str) -> int:
        return next(i for i, g in enumerate(self.kvc.kv_cache_groups) if layer in g.layer_names)

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
            block_hasher=get_request_block_hasher(self.spec.block_size, sha256),
        )  # fmt: skip
        self.sched.add_request(req)

    def block_ids(self, req_id: str) -> list[int]:
        groups = self.block_groups(req_id)
        return groups[self.group_of(self.layers[0])] if groups else []

    def block_groups(self, req_id: str) -> list[list[int]]:
        return [list(g) for g in self.sched.kv_cache_manager.get_block_ids(req_id) or ()]

    def snapshot(self, groups: list[list[int]]) -> bytes:
        """The blocks' logical content `[L, blocks, all KV heads, N, C]` gathered over the
        ranks (MLA: rank 0's copy), then each Mamba layer's state pages, as bytes: comparable
        across TP sizes. `groups`: block ids per KV-cache group (the null block 0 skipped)."""
        import torch

        def ids(layer: str) -> torch.Tensor:
            g = groups[self.group_of(layer)] if len(groups) > 1 else groups[0]
            return torch.tensor([b for b in g if b], dtype=torch.long)

        replicated = self.spec.mla or self.rank_heads * self.spec.tp_size > self.total_heads
        ranks = self.caches[:1] if replicated else self.caches
        parts = [
            torch.cat([c[n].index_select(0, ids(n)) for c in ranks], dim=1) for n in self.layers
        ]
        parts += [self.caches[0][n].index_select(0, ids(n)) for n in self.mamba]
        return b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)

    def _write_kv(self, req_id: str, n: int, layer: str) -> None:
        """The runner's write of one layer's KV (its state, for a Mamba layer) for the
        request's `n` tokens of this step, on every rank."""
        import torch

        req = self.sched.requests[req_id]
        ids = self.block_groups(req_id)[self.group_of(layer)]
        tokens = req.all_token_ids
        end = req.num_computed_tokens
        if layer in self.mamba:  # the recurrent state after `end` tokens, in its block
            state = [b for b in ids if b][-1]
            value = float(sum((t % 97) * (i + 1) for i, t in enumerate(tokens[:end])) % 65521)
            for caches in self.caches:
                page = caches[layer][state].view(-1)
                page.view(torch.float32)[:] = value + torch.arange(page.numel() // 4)
            return
        li = self.layers.index(layer)
        for rank, caches in enumerate(self.caches):
            first_head = (rank * self.total_heads) // self.spec.tp_size
            some = caches[layer]
            h = torch.arange(some.shape[1], dtype=torch.float32).view(-1, 1) + first_head
            c = torch.arange(some.shape[3], dtype=torch.float32).view(1, -1)
            pattern = h * 64 + c
            size = self.spec.block_size
            for pos in range(end - n, end):
                blk, slot = ids[pos // size], pos % size
                caches[layer][blk, :, slot, :] = kv_value(tokens[pos], pos, li) * 1024 + pattern

    def _forward(self, scheduled: dict[str, int]) -> None:
        """A model runner's forward: each layer's KV written, then saved to the connector
        (as vLLM's attention layers do), then the connector waits for its saves."""
        for rid, n in scheduled.items():
            req = self.sched.requests[rid]
            end = req.num_computed_tokens
            if end - n < req.num_prompt_tokens:
                done = min(end, req.num_prompt_tokens) - (end - n)
                self.computed[rid] = self.computed.get(rid, 0) + done
        for layer in (*self.layers, *self.mamba):
            for rid, n in scheduled.items():
                self._write_kv(rid, n, layer)
            if layer in self.mamba:  # only attention layers save to the connector
                continue
            for wc, caches in zip(self.wcs, self.caches, strict=True):
                wc.save_kv_layer(layer, caches[layer], None)
        for wc in self.wcs:
            wc.wait_for_save()

    def step(self) -> tuple[Any, Any, set[int]]:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self.steps += 1
        out = self.sched.schedule()
        req_ids = list(out.num_scheduled_tokens)
        for wc in self.wcs:
            wc.bind_connector_metadata(out.kv_connector_metadata)
            t0 = time.perf_counter()
            wc.start_load_kv(None)
            self.load_seconds = max(self.load_seconds, time.perf_counter() - t0)
        self._forward({rid: out.num_scheduled_tokens[rid] for rid in req_ids})
        sampled = []
        for rid in req_ids:
            req = self.sched.requests[rid]
            done_prompt = req.num_computed_tokens >= req.num_prompt_tokens
            sampled.append([(len(req.all_token_ids) * 31) % 900 + 10] if done_prompt else [])
        outputs = []
        for wc in self.wcs:
            res = wc.get_transfer_results(out.finished_req_ids)
            kv_out = KVConnectorOutput(
                finished_sending=res.finished_sending or None,
                finished_recving=res.finished_recving or None,
                invalid_block_ids=wc.get_block_ids_with_load_errors(),
                failed_recving=res.failed_recving,
                kv_connector_stats=wc.get_kv_connector_stats(),
                kv_connector_worker_meta=wc.build_connector_worker_meta(),
            )
            wc.clear_connector_metadata()
            outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=sampled,
                    kv_connector_output=kv_out,
                )
            )
            if self.spec.like_engine_core and not req_ids and kv_out.is_empty():
                outputs[-1].kv_connector_output = None  # vLLM's `with_kv_conn_output_only`
        if self.spec.like_engine_core and len(outputs) == 1:
            mro = outputs[0]
        else:
            mro = self.aggregator.aggregate(outputs)
        kv = mro.kv_connector_output or KVConnectorOutput()
        if kv.kv_connector_stats is not None:
            self.stats_seen.append(kv.kv_connector_stats.to_dict())
        eco = self.sched.update_from_output(out, mro)
        return kv, eco, set(kv.invalid_block_ids)

    @property
    def busy(self) -> bool:
        return bool(self.sched.requests) or any(wc.worker_side.worker.has_work for wc in self.wcs)

    def close(self) -> None:
        for wc in self.wcs:
            wc.shutdown()
        if self.sched.connector is not None:
            self.sched.connector.shutdown()


def kv_cache_config(cfg: Any, specs: dict[str, Any], num_blocks: int) -> Any:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    page = next(iter(specs.values())).page_size_bytes
    (kvc,) = get_kv_cache_configs(cfg, [specs], [page * len(specs) * num_blocks])
    return kvc


def serve(conn: Any, specs: dict[str, EngineSpec]) -> None:
    """Run engines in this process: step them continuously, answer commands, report events."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    engines: dict[str, Engine] = {}
    logging.getLogger("kvrdma").addHandler(WARNINGS)
    try:
        for key, spec in specs.items():
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_port)
            saved = {k: os.environ.get(k) for k in spec.env}
            os.environ.update(spec.env)
            try:
                engines[key] = Engine(spec)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        conn.send(("ready", {k: e.free_blocks_at_start for k, e in engines.items()}))
        _loop(conn, engines)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        for e in engines.values():
            e.close()


def _loop(conn: Any, engines: dict[str, Engine]) -> None:
    while True:
        while conn.poll(0):
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            if cmd[0] == "add":
                _, key, rid, prompt, max_tokens, params_json = cmd
                params = json.loads(params_json) if params_json else None
                engines[key].add(rid, prompt, max_tokens, params)
            elif cmd[0] == "stats":
                from _children import connector_stats

                conn.send(("stats", cmd[1], *connector_stats(engines[cmd[1]])))
            elif cmd[0] == "probe":
                conn.send(("probe", cmd[1], probe(engines[cmd[1]], cmd[2])))
            elif cmd[0] == "abort":  # the client went away: vLLM aborts the request
                from vllm.v1.request import RequestStatus

                engines[cmd[1]].sched.finish_requests(cmd[2], RequestStatus.FINISHED_ABORTED)
                conn.send(("aborted", cmd[1]))
            elif cmd[0] == "break_post":  # every rank's next post raises `cmd[2]`
                from _children import break_next_post

                break_next_post(engines[cmd[1]], cmd[2], cmd[3])
                conn.send(("broken", cmd[1]))
            elif cmd[0] == "corrupt":  # overwrite a block of the first layer on every rank
                eng = engines[cmd[1]]
                for caches in eng.caches:
                    caches[eng.layers[0]][cmd[2]].fill_(-1.0)
                conn.send(("corrupted", cmd[1]))
        busy = False
        for eng in engines.values():
            busy |= eng.busy
            if eng.spec.step_delay and eng.sched.running:
                time.sleep(eng.spec.step_delay)
            if not eng.spec.like_engine_core or eng.sched.has_requests():
                _step(conn, eng)
        if not busy:
            time.sleep(0.002)


def _step(conn: Any, eng: Engine) -> None:
    kv, eco, invalid = eng.step()
    for rid in kv.finished_recving or ():
        # the runner has not touched a request in the step its load finished
        ids = eng.block_ids(rid) if rid in eng.sched.requests else []
        snap = eng.snapshot(eng.block_groups(rid)) if ids else b""
        conn.send(("recv_done", rid, ids, snap, sorted(invalid), sorted(kv.failed_recving)))
    for rid in kv.finished_sending or ():
        conn.send(("sent", rid))
    for outs in eco.values():
        for o in outs.outputs:
            if o.finish_reason is None:
                continue
            params = o.kv_transfer_params
            blocks = params.get("remote_block_ids") if params else None
            snap = eng.snapshot(blocks) if blocks else b""
            computed = eng.computed.pop(o.request_id, 0)
            msg = (str(o.finish_reason), json.dumps(params), list(o.new_token_ids), snap, computed)
            conn.send(("finished", o.request_id, *msg))


class EngineProc:
    """Engines in a child process (spawned: NIXL and vLLM state stay separate). Start every
    process first, then call `ready()`: importing vLLM dominates the start."""

    def __init__(self, specs: dict[str, EngineSpec]) -> None:
        ctx = mp.get_context("spawn")
        self.specs = specs
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, specs), daemon=True)
        self.proc.start()
        self.events: list[tuple] = []
        self.free_at_start: dict[str, int] = {}
        # messages are taken off the pipe as they come, whichever engine a test waits on: a
        # child blocked sending into a full pipe stops stepping, so its agents stop serving
        self._inbox: queue.Queue[tuple | None] = queue.Queue()
        threading.Thread(target=self._take_messages, name="engine-inbox", daemon=True).start()

    def _take_messages(self) -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:
                self._inbox.put(self.conn.recv())
        self._inbox.put(None)  # the process closed its end

    def ready(self, timeout: float = 240.0) -> EngineProc:
        _, self.free_at_start = self.wait("ready", timeout=timeout)
        return self

    def _recv(self, timeout: float) -> tuple:
        try:
            msg = self._inbox.get(timeout=timeout)
        except queue.Empty:
            alive = "alive" if self.proc.is_alive() else f"dead ({self.proc.exitcode})"
            raise TimeoutError(
                f"no message from the engines within {timeout}s (process {alive})"
            ) from None
        if msg is None:
            self._inbox.put(None)  # every later wait hears it too
            raise EOFError(f"the engines' process closed its pipe (exit code {self.proc.exitcode})")
        if msg[0] == "error":
            raise RuntimeError(f"engine failed:\n{msg[1]}")
        return msg

    def add(self, key: str, rid: str, prompt: list[int], max_tokens: int, params: Any) -> None:
        text = json.dumps(params) if params is not None else ""
        self.conn.send(("add", key, rid, prompt, max_tokens, text))

    def wait(self, kind: str, rid: str | None = None, timeout: float = 60.0) -> tuple:
        deadline = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self.events):
                if ev[0] == kind and (rid is None or ev[1] == rid):
                    return self.events.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                seen = [e[:2] for e in self.events]
                raise TimeoutError(f"no {kind!r} event for {rid!r} within {timeout}s; got {seen}")
            self.events.append(self._recv(left))

    def stats(self, key: str, timeout: float = 30.0) -> tuple[dict, dict, dict]:
        self.conn.send(("stats", key))
        _, _, reduced, vllm_samples, kvrdma_samples = self.wait("stats", key, timeout=timeout)
        return reduced, vllm_samples, kvrdma_samples

    def probe(self, key: str, what: str, timeout: float = 30.0) -> Any:
        """One value read off engine `key` (see `_children.probe`)."""
        self.conn.send(("probe", key, what))
        return self.wait("probe", key, timeout=timeout)[2]

    def abort(self, key: str, rid: str) -> None:
        """Abort request `rid` of engine `key` as vLLM does when its client goes away."""
        self.conn.send(("abort", key, rid))
        self.wait("aborted", key)

    def corrupt(self, key: str, block: int) -> None:
        """Overwrite `block` of engine `key`'s first layer; returns once it is done."""
        self.conn.send(("corrupt", key, block))
        self.wait("corrupted", key)

    def break_post(self, key: str, error: str, *, push: bool = False) -> None:
        """Make each rank of engine `key` raise `error` (a class name) on its next READ
        post (`push`: its next notification), as an unexpected failure inside NIXL's
        bindings would."""
        self.conn.send(("break_post", key, error, push))
        self.wait("broken", key)

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """The engines' process stopped (every thread) for the block: it may run again any
        moment after, as a stalled engine does."""
        stop_process(self.proc.pid or 0)
        try:
            yield
        finally:
            os.kill(self.proc.pid or 0, signal.SIGCONT)

    def free_blocks(self, key: str) -> int:
        return int(self.probe(key, "free_blocks"))

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


@contextlib.contextmanager
def started(
    p_specs: dict[str, EngineSpec], d_specs: dict[str, EngineSpec]
) -> Iterator[tuple[EngineProc, EngineProc]]:
    """P's and D's engine processes, ready; D stopped, then P, after the block."""
    p, d = EngineProc(p_specs), EngineProc(d_specs)
    try:
        yield p.ready(), d.ready()
    finally:
        d.stop()
        p.stop()
