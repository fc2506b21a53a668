"""Creating and destroying NIXL agents: the only module that imports nixl (lazily, when an
agent is built).

An agent gets its backend plugins with fallbacks where a setting is only an optimisation,
and a retired agent is dropped without being called again.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import weakref
from typing import Any

from kvrdma.errors import TransferError
from kvrdma.nixl import transport
from kvrdma.nixl.checks import describe
from kvrdma.nixl.protocol import BackendConfig

logger = logging.getLogger(__name__)

# UCX setting kvrdma turns on unless the environment says otherwise: without it a READ
# between two processes on one GPU (no NVLink peer access) is emulated over TCP, while the
# pipelined protocol it enables turns the READ into a cuda_ipc copy; DRAM reads keep cma.
UCX_DEFAULTS = {"UCX_RMA_PPLN_ENABLE": "y"}

# The init key NIXL's own Python API uses for `num_threads`, per backend plugin.
_THREAD_KEYS = {
    "UCX": "num_threads",
    "OBJ": "num_threads",
    "LIBFABRIC": "num_threads",
    "GDS_MT": "thread_count",
    "UCCL": "num_cpus",
}


def copy_threads(config: BackendConfig) -> int:
    """UCX copy threads an agent built from `config` starts (see `kvrdma.nixl.standby`)."""
    return config.num_threads if "UCX" in config.backends else 0


def new_agent(config: BackendConfig, name: str) -> Any:
    try:
        import nixl
    except ImportError as exc:
        raise TransferError(
            f"cannot create agent {name!r}: the nixl package is not installed or "
            f"failed to load ({exc})"
        ) from exc
    for key, value in UCX_DEFAULTS.items():  # UCX reads them when the agent's context starts
        os.environ.setdefault(key, value)
    sync: dict[str, Any] = {}
    if config.num_threads > 0:
        # the copy threads progress their own UCX workers while this thread opens and closes
        # endpoints on every worker (peers loaded and removed): under RW sync NIXL makes the
        # workers thread-safe (UCX MULTI mode) where it otherwise assumes one thread at a time
        sync["sync_mode"] = nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
    conf = nixl.nixl_agent_config(
        enable_prog_thread=config.progress_thread,
        capture_telemetry=config.capture_telemetry,
        num_threads=config.num_threads,
        backends=[],
        **sync,
    )
    try:
        agent = nixl.nixl_agent(name, conf)
        plugins = list(agent.get_plugin_list())
    except Exception as exc:
        raise TransferError(f"cannot create NIXL agent {name!r}: {exc}") from exc
    for b in config.backends:
        if b not in plugins:
            raise TransferError(
                f"cannot create agent {name!r}: NIXL backend plugin {b!r} not found "
                f"(available: {sorted(plugins)}; NIXL_PLUGIN_DIR may point elsewhere)"
            )
        _create_backend(agent, name, b, config)
    return agent


def destroy_agent(box: list[Any], handles: list[Any]) -> None:
    """Drop the NIXL agent in `box` (its only holder) without calling it: its handles are
    marked released first (a release could progress the agent's transport and land data),
    then the agent goes."""
    for h in handles:
        if hasattr(h, "_released"):
            with contextlib.suppress(Exception):
                h._released = True
    handles.clear()
    if not box or box[0] is None:  # destroyed already
        return
    alive = weakref.ref(box[0])
    box.clear()
    if alive() is not None:  # in a reference cycle: only a full collection (slow) frees it
        gc.collect()


def _create_backend(agent: Any, name: str, backend: str, config: BackendConfig) -> None:
    """Create one backend plugin, falling back rather than failing where a setting is only
    an optimisation: UCX with threads also gets `split_batch_size` (started without it if
    the plugin turns it down); UCX without a transport that can detect peer failure (e.g.
    `UCX_TLS` without tcp) only starts with error handling off."""
    init: dict[str, str] = {}
    if config.num_threads > 0 and backend in _THREAD_KEYS:
        init[_THREAD_KEYS[backend]] = str(config.num_threads)
    split: dict[str, str] = {}
    if backend == "UCX" and config.num_threads > 0 and config.split_batch_size is not None:
        # read by UCX's thread-pool engine; get_plugin_params("UCX") lists neither this
        # nor num_threads, so there is nothing to check it against before trying
        split = {"split_batch_size": str(config.split_batch_size)}
    attempts: list[tuple[dict[str, str], str | None]] = [({**init, **split}, None)]
    if split:
        attempts.append((init, "without split_batch_size (NIXL's default split)"))
    if backend == "UCX":
        lax = {"ucx_error_handling_mode": "none"}
        note = "ucx_error_handling_mode=none (a dead peer shows as PROC until your deadline)"
        attempts.append(({**init, **split, **lax}, note))
        if split:
            attempts.append(({**init, **lax}, f"{note}, without split_batch_size"))
    errors: list[str] = []
    for params, fallback in attempts:
        try:
            agent.create_backend(backend, params)
        except Exception as exc:
            errors.append(f"{fallback or 'as configured'}: {describe(exc)}")
            continue
        if backend == "UCX":
            _log_transport(name)
        if fallback is not None:
            logger.warning(
                "agent %r: NIXL backend %s failed to start as configured (%s); started %s",
                name,
                backend,
                errors[0],
                fallback,
            )
        return
    hint = ""
    if backend == "UCX":
        problems = transport.device_problems()
        hint = (
            f"; UCX_NET_DEVICES: {'; '.join(problems)}"
            if problems
            else "; check UCX_TLS (on a host with NVIDIA GPUs NIXL also wants a CUDA transport "
            "in it, e.g. cuda_copy)"
        )
    raise TransferError(
        f"agent {name!r}: NIXL backend {backend!r} failed to start ({'; '.join(errors)}){hint}"
    )


def _log_transport(name: str) -> None:
    """Say what UCX can carry this agent's transfers over: a warning where `UCX_TLS` names an
    RDMA transport and TCP is all that is left (UCX falls back without a word)."""
    t = transport.describe()
    meant_rdma = t.tls not in ("", "all") and t.kind != "rdma" and "allows no RDMA" not in t.why
    log = logger.warning if meant_rdma else logger.info
    log(
        "agent %r: UCX transport %s (UCX_TLS=%r, UCX_NET_DEVICES=%r)%s",
        name,
        t.kind,
        t.tls,
        t.devices,
        f": {t.why}" if t.why else "",
    )
