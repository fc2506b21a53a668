"""vLLM 0.32's KV caches → the arguments of kvrdma's `Worker.register_kv_caches`.

vLLM hands one `[B, H, N, C]` view per layer, strided over a shared buffer in one of six
unified orders; kvrdma's `cache_layout="unified"` takes those views as they are, with the
order the engine resolved. Only what vLLM knows and the library cannot guess is added here:
which layers hold Mamba state (from the KV-cache groups' specs), and that an MLA cache is
one latent "head" replicated on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvrdma.errors import RegistrationError

if TYPE_CHECKING:
    import torch

ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


@dataclass
class Registration:
    """What to pass to `Worker.create` and `Worker.register_kv_caches`."""

    caches: dict[str, Any]
    block_size: int
    kv_cache_order: str
    mamba_layers: tuple[str, ...]
    total_num_kv_heads: int
    physical_blocks_per_logical: int = 1  # kernel blocks per scheduler block


def mamba_layer_names(kv_cache_config: Any) -> tuple[str, ...]:
    """Layers whose KV-cache group holds Mamba (SSM/conv) state rather than attention KV."""
    from vllm.v1.kv_cache_interface import MambaSpec

    names: list[str] = []
    for group in kv_cache_config.kv_cache_groups:
        if isinstance(group.kv_cache_spec, MambaSpec):
            names.extend(group.layer_names)
    return tuple(names)


def registration(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    order: str,
    use_mla: bool,
    total_num_kv_heads: int,
    logical_block_size: int,
    mamba_layers: tuple[str, ...] = (),
) -> Registration:
    """Check the engine's order and find the block size (the views' token dimension)."""
    if order not in ORDERS:
        raise RegistrationError(
            f"kv_cache_layout: expected one of {', '.join(ORDERS)}, got {order!r}"
        )
    if not kv_caches:
        raise RegistrationError("register_kv_caches got no KV caches")
    attention = [(k, v) for k, v in kv_caches.items() if k not in mamba_layers]
    if not attention:
        raise RegistrationError("register_kv_caches got no attention layer (only Mamba state)")
    name, first = attention[0]
    if first.dim() != 4:
        raise RegistrationError(
            f"layer {name!r}: expected vLLM's [num_blocks, heads, block_size, content] view, "
            f"got shape {tuple(first.shape)}"
        )
    kernel = int(first.shape[2])
    if kernel <= 0 or logical_block_size % kernel:
        raise RegistrationError(
            f"layer {name!r}: kernel block of {kernel} tokens does not divide the scheduler's "
            f"block_size {logical_block_size}"
        )
    return Registration(
        caches=dict(kv_caches),
        block_size=kernel,
        physical_blocks_per_logical=logical_block_size // kernel,
        kv_cache_order=order,
        mamba_layers=tuple(mamba_layers),
        total_num_kv_heads=1 if use_mla else total_num_kv_heads,
    )
