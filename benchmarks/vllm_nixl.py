"""`vllm_nixl`: KvrdmaConnector against vLLM 0.32's own NixlConnector, side by side.

P and D engines (vLLM's `Scheduler` and its runner's connector calls, no model) in their own
processes, CPU tensors, real NIXL, one model, layout and block shape; D admits all requests
at once, pulls and checks every block. Runs under `$VLLM_VENV/bin/python` (`.venv-vllm`).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import traceback
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import harness as h  # noqa: E402
from kvrdma.testing import free_port  # noqa: E402

CONNECTORS = ("KvrdmaConnector", "NixlConnector")
LAYERS, HEADS, HEAD, BLOCK, PROMPT = 4, 8, 64, 32, 150  # float32: 512 KiB per block
PER_REQ = -(-PROMPT // BLOCK)  # blocks per request
SCHED = ["get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "request_finished_all_groups", "update_connector_output"]  # fmt: skip
WORKER = ["start_load_kv", "get_transfer_results"]  # the runner's get_finished goes through it
METHODS = (*SCHED, *WORKER, "all")
MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
         "num_attention_heads": 8, "num_key_value_heads": HEADS, "head_dim": HEAD,
         "num_hidden_layers": LAYERS, "vocab_size": 1000, "torch_dtype": "float32"}  # fmt: skip


class Engine:
    """vLLM's Scheduler + one worker-role connector over vLLM-allocated caches (TP 1)."""

    def __init__(self, name: str, role: str, model_dir: str, blocks: int) -> None:
        import torch
        import vllm.config as vc
        import vllm.distributed.kv_transfer as kt
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils as ku
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        mod = "kvrdma.vllm" if name == CONNECTORS[0] else None
        kv = {"kv_connector": name, "kv_connector_module_path": mod, "kv_role": role}
        model = vc.ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=256)
        self.cfg = vc.VllmConfig(model_config=model, device_config=vc.DeviceConfig("cpu"),
            scheduler_config=vc.SchedulerConfig(max_model_len=256, is_encoder_decoder=False),
            cache_config=vc.CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            kv_transfer_config=vc.KVTransferConfig(**kv, kv_buffer_device="cpu"))  # fmt: skip
        self.cfg.cache_config.kv_cache_layout = "LBHNC"
        self.cfg.cache_config.num_gpu_blocks = blocks
        ku.init_none_hash(sha256)
        self.hasher = ku.get_request_block_hasher(BLOCK, sha256)
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                                 dtype=torch.float32)  # fmt: skip
        layers = {f"model.layers.{i}.self_attn.attn": spec for i in range(LAYERS)}
        (kvc,) = ku.get_kv_cache_configs(
            self.cfg, [layers], [spec.page_size_bytes * LAYERS * blocks]
        )
        cpus = os.sched_getaffinity(0)
        with vc.set_current_vllm_config(self.cfg):
            init_distributed_environment(1, 0, f"file://{model_dir}/{role}-{name}", 0, "gloo")
            ensure_model_parallel_initialized(1, 1)
            self.sched = Scheduler(self.cfg, kvc, StructuredOutputManager(self.cfg), BLOCK)
            kt.ensure_kv_transfer_initialized(self.cfg, kvc)  # vLLM's worker connector
        self.wc = kt.get_kv_transfer_group()
        os.sched_setaffinity(0, cpus)  # NixlConnector pins a CPU engine to one core per node
        self.caches = list(allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout.LBHNC).items())
        fill = torch.arange(blocks, dtype=torch.float32).view(-1, 1, 1, 1) * 8
        for i, (_, c) in enumerate(self.caches if role == "kv_producer" else ()):  # D: zeros
            c.copy_((fill + i).expand_as(c))  # what D checks every loaded block against
        self.wc.register_kv_caches(dict(self.caches))
        md = self.wc.get_handshake_metadata()
        self.sched.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): md})
        self.spent = h.time_methods(self.wc, WORKER, h.time_methods(self.sched.connector, SCHED))

    def round(self, conn: Any, work: list[tuple[str, list[int], dict]], timeout: float) -> dict:
        """Admit all, step until each finished (P: sends params, then waits for releases)."""
        from vllm.forward_context import set_forward_context
        from vllm.sampling_params import SamplingParams
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        self.spent.update(dict.fromkeys(self.spent, 0.0))
        t0, end, loaded, wrong, steps = time.perf_counter(), time.monotonic() + timeout, 0.0, 0, 0
        finished, sent, params = {}, set(), {rid: p for rid, _, p in work}
        for rid, prompt, p in work:
            sp = SamplingParams(max_tokens=1, ignore_eos=True, extra_args={"kv_transfer_params": p})
            sp.update_from_generation_config({}, 2)
            self.sched.add_request(Request(rid, prompt, sp, None, block_hasher=self.hasher))
        producer = self.cfg.kv_transfer_config.is_kv_producer
        while len(finished) < len(work) or (producer and len(sent) < len(work)):
            if time.monotonic() > end:
                raise TimeoutError(f"{len(finished)}/{len(work)} finished, {len(sent)} released")
            out, steps = self.sched.schedule(), steps + 1
            connector = KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(out)
            with set_forward_context(None, self.cfg), connector as kv:  # the runner's sequence
                rids = list(out.num_scheduled_tokens)  # the forward would run here
            reqs = [self.sched.requests[r] for r in rids]
            sampled = [[7] if q.num_computed_tokens >= q.num_prompt_tokens else [] for q in reqs]
            mro = ModelRunnerOutput(rids, {r: i for i, r in enumerate(rids)}, sampled,
                                    kv_connector_output=kv)  # fmt: skip
            eco = self.sched.update_from_output(out, mro)
            time.sleep(0 if out.total_num_scheduled_tokens else 0.001)  # idle: yield the CPU
            done = {o.request_id: o.kv_transfer_params
                    for outs in eco.values() for o in outs.outputs if o.finish_reason}  # fmt: skip
            sent |= kv.finished_sending or set()
            for rid in kv.finished_recving or ():  # each loaded block holds P's fill of its source
                loaded = time.perf_counter() - t0
                ids = zip(self.sched.kv_cache_manager.get_block_ids(rid)[0],
                          params[rid]["remote_block_ids"][0], strict=True)  # fmt: skip
                wrong += sum(not (c[d] == r * 8 + i).all() for d, r in ids
                             for i, (_, c) in enumerate(self.caches))  # fmt: skip
            if producer and len(finished) < len(work) <= len(finished) + len(done):
                conn.send(("params", finished | done))
            finished |= done
        spent = {**self.spent, "all": sum(self.spent.values())}
        per_step = {m: t / steps for m, t in spent.items()}
        return {"load_s": loaded, "per_step": per_step, "wrong_blocks": wrong}


def serve(conn: Any, name: str, role: str, model_dir: str, blocks: int, port: int) -> None:
    """One engine in a spawned process: runs ("round", work, timeout) until anything else."""
    os.environ |= {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    try:
        engine = Engine(name, role, model_dir, blocks)
        conn.send(("ready", None))
        while conn.poll(1800) and (cmd := conn.recv())[0] == "round":
            conn.send(("done", engine.round(conn, cmd[1], cmd[2])))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _recv(conn: Any, timeout: float, what: str) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"no {what} within {timeout} s")
    if (msg := conn.recv())[0] == "error":
        raise RuntimeError(msg[1])
    return msg[1]


def _round(p: Any, d: Any, tag: str, n: int, timeout: float) -> dict[str, Any]:
    prompts = {f"{tag}-{i}": [hash((tag, i, k)) % 996 + 3 for k in range(PROMPT)] for i in range(n)}
    p.send(("round", [(r, q, {"do_remote_decode": True}) for r, q in prompts.items()], timeout))
    params = json.loads(json.dumps(_recv(p, timeout, "params from P")))  # as a proxy passes
    d.send(("round", [(r, q, params[r]) for r, q in prompts.items()], timeout))
    return {"d": _recv(d, timeout, "D's round"), "p": _recv(p, timeout, "P's round")}


def measure(quick: bool) -> dict[str, Any]:
    """Start both pairs, then alternate their rounds; a pair's failure is recorded, not retried."""
    n, rounds, timeout = (4, 2, 120.0) if quick else (64, 6, 300.0)
    ctx, procs, errors = mp.get_context("spawn"), {}, {}
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONNECTORS}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(MODEL))
        for c, role in [(c, r) for c in CONNECTORS for r in ("kv_producer", "kv_consumer")]:
            mine, theirs = ctx.Pipe()
            args = (theirs, c, role, tmp, n * 6, free_port())
            procs[c, role] = (mine, ctx.Process(target=serve, args=args))
            procs[c, role][1].start()
        try:
            for r in range(rounds):
                for c in [c for c in CONNECTORS[:: 1 if r % 2 else -1] if c not in errors]:
                    p, d = procs[c, "kv_producer"][0], procs[c, "kv_consumer"][0]
                    try:
                        for x in (p, d) if r == 0 else ():
                            _recv(x, 300, f"{c}'s engine start")
                        runs[c].append(_round(p, d, f"{c[:5]}{r}", n, timeout))
                    except (RuntimeError, TimeoutError, OSError) as exc:
                        errors[c] = str(exc)
        finally:
            for conn, proc in procs.values():
                with contextlib.suppress(OSError):
                    conn.send(("stop",))
                proc.join(20)
                proc.kill()
    rows = {}
    for c, tb in [(c, errors.get(c, "")) for c in CONNECTORS]:
        kept = runs[c][1:]  # the first round is first contact
        rows[c] = {"connector": c, "error": tb.strip().splitlines()[-1] if tb else None,
            "traceback": tb[-4000:] or None, "rounds": len(kept), "us_per_step": {m: {
                x: h.summarize([s[x]["per_step"][m] for s in kept], 1e6, 1) for x in "dp"}
                for m in METHODS},
            "blocks_per_second": h.summarize([n * PER_REQ / s["d"]["load_s"] for s in kept]),
            "wrong_blocks": sum(s["d"]["wrong_blocks"] for s in runs[c])}  # fmt: skip
    per = [{"method": m, **{c: r["us_per_step"][m] for c, r in rows.items()}} for m in METHODS]
    cols = "; ".join(f"{c[:-9]} {x.upper()}*: {c}.{x}.median" for c in CONNECTORS for x in "dp")
    return {
        "parameters": {"requests": n, "blocks_per_request": PER_REQ, "model": MODEL, "vllm":
                       version("vllm"), "block_bytes": LAYERS * BLOCK * HEADS * 2 * HEAD * 4},
        "results": list(rows.values()),
        "tables": [h.table(f"Blocks moved per second, {n} concurrent requests", rows.values(),
                           "connector: connector; blocks/s*: blocks_per_second.median; "
                           "wrong blocks: wrong_blocks; error: error"),
                   h.table("Connector µs per engine step, median", per, f"method: method; {cols}")],
        "summary": [f"{c} could not run: {r['error']}" for c, r in rows.items() if r["error"]],
    }  # fmt: skip


def run(ctx: Any) -> dict[str, Any]:
    """run.py's entry: `measure` under the vLLM venv's Python, or a recorded skip."""
    python = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
    if not python.exists():
        why = f"skipped: no vLLM venv ({python} is missing: `make setup-vllm`, or VLLM_VENV=DIR)"
        return {"skipped": why, "parameters": {}, "results": [], "summary": [why]}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [python, __file__, f"{tmp}/result.json", *["--quick"][: int(ctx.quick)]]
        subprocess.run(cmd, check=True, timeout=1200, env={**os.environ, "PYTHONPATH": str(ROOT)})
        return {"vllm_python": str(python), **json.loads(Path(f"{tmp}/result.json").read_text())}


if __name__ == "__main__":  # python vllm_nixl.py RESULT_JSON [--quick], in the vLLM venv
    Path(sys.argv[1]).write_text(json.dumps(measure("--quick" in sys.argv[2:])))
