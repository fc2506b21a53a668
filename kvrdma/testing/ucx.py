"""`UCX_TLS` values kvrdma sets itself (fault injection, tests), valid with or without GPUs.

NIXL's UCX backend refuses a transport list without a CUDA transport when NVIDIA GPUs are
present ("Invalid UCX_TLS=tcp … does not enable CUDA memory support"), while on a host
without GPUs a CUDA transport is merely unavailable. So a "TCP only" list names `cuda_copy`
exactly when a GPU is there: host memory still moves over TCP, device memory is staged
through `cuda_copy`.
"""

from __future__ import annotations

import functools


@functools.cache
def nvidia_gpu_present() -> bool:
    """A CUDA device is visible (the test NIXL applies); False when torch cannot tell."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a broken CUDA install is not a reason to fail here
        return False


def tcp_only() -> str:
    """`UCX_TLS` for "host memory over TCP only" that NIXL accepts on this host."""
    return "tcp,cuda_copy" if nvidia_gpu_present() else "tcp"
