"""vLLM's `VllmConfig` → kvrdma's validated `KVTransferConfig` and compatibility hash, and
the worker's place in vLLM's tensor-parallel group."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvrdma.config import KVTransferConfig, load_kv_transfer_config
from kvrdma.errors import ConfigError
from kvrdma.metadata import compat_hash

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# the vLLM KVTransferConfig fields kvrdma reads; the rest (kv_rank, kv_buffer_size...) are
# vLLM's own business and never reach kvrdma's strict top-level key check
_FIELDS = (
    "kv_connector",
    "kv_role",
    "engine_id",
    "kv_buffer_device",
    "kv_ip",
    "kv_port",
    "kv_connector_module_path",
    "enable_permute_local_kv",
    "kv_load_failure_policy",
    "kv_connector_extra_config",
)


def kvrdma_config(vllm_config: VllmConfig) -> KVTransferConfig:
    """The engine's `--kv-transfer-config`, validated by kvrdma (ConfigError names the key)."""
    src = vllm_config.kv_transfer_config
    if src is None:
        raise ValueError("KvrdmaConnector needs vllm_config.kv_transfer_config")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(vllm_config.parallel_config, name, 1) or 1
        if size > 1:  # its caches hold every rank's share of the tokens: moved whole, mixed
            raise ConfigError(
                f"parallel_config.{name}: kvrdma moves KV caches split by tensor parallelism "
                f"only; expected 1, got {size} (vLLM's NixlConnector serves context parallelism)"
            )
    raw: dict[str, Any] = {}
    for key in _FIELDS:
        value = getattr(src, key, None)
        if value is not None:
            raw[key] = value
    return load_kv_transfer_config(raw)


def cache_layout_name(vllm_config: VllmConfig) -> str:
    """The unified KV layout order the engine resolved (`LBHNC` when none was set)."""
    name = getattr(vllm_config.cache_config, "kv_cache_layout", None) or "LBHNC"
    return {"HND": "LBHNC", "NHD": "LBNHC"}.get(str(name), str(name))


def engine_compat_hash(vllm_config: VllmConfig) -> str:
    """What must match between P and D: model, dtypes, geometry, layout."""
    import vllm

    mc = vllm_config.model_config
    layout = cache_layout_name(vllm_config)
    return compat_hash(
        version=f"vllm-{vllm.__version__}",
        model=str(mc.model),
        dtype=str(mc.dtype),
        total_num_kv_heads=mc.get_total_num_kv_heads(),
        head_dim=mc.get_head_size(),
        num_layers=mc.get_num_layers(vllm_config.parallel_config),
        attn_backend=layout,
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
        cross_layer=layout.startswith("B"),
    )


def parallel_ranks() -> tuple[int, int]:
    """(TP rank, TP size) from vLLM's process groups; (0, 1) when none were set up."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
