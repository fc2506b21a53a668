"""The environment record every benchmark JSON carries: machine, versions, the transfer
configuration (kvrdma's backend defaults, `UCX_*`/`NIXL_*` variables, transparent huge
pages) and the git commit."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ucx_version() -> str | None:
    """The UCX library NIXL loads (read from /proc/self/maps; an agent is made if needed)."""
    try:
        maps = Path("/proc/self/maps").read_text()
        if "libucp" not in maps:
            import nixl

            nixl.nixl_agent(f"env-{os.getpid()}", nixl.nixl_agent_config(enable_prog_thread=False))
            maps = Path("/proc/self/maps").read_text()
    except Exception:
        return None
    paths = sorted({ln.split()[-1] for ln in maps.splitlines() if "libucp" in ln})
    for p in paths:
        with contextlib.suppress(OSError, AttributeError):
            lib = ctypes.CDLL(p)
            lib.ucp_get_version_string.restype = ctypes.c_char_p
            return f"{lib.ucp_get_version_string().decode()} ({Path(p).name})"
    return None


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _git() -> dict[str, Any]:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "kvrdma"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return {"commit": rev or None, "kvrdma_dirty": bool(dirty)}
    except OSError:
        return {"commit": None, "kvrdma_dirty": None}


def _thp() -> dict[str, str | None]:
    """The kernel's transparent huge page settings (the selected value of each)."""
    out: dict[str, str | None] = {}
    for name in ("enabled", "defrag"):
        try:
            text = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text()
            out[name] = text.split("[", 1)[1].split("]", 1)[0] if "[" in text else text.strip()
        except (OSError, IndexError):
            out[name] = None
    return out


def environment() -> dict[str, Any]:
    """Machine, versions and the transfer configuration the results depend on."""
    import torch

    from kvrdma.backend import BackendConfig
    from kvrdma.config import ExtraConfig
    from kvrdma.nixl_backend import SKIP_MERGE_MIN_BYTES

    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        line = next(
            ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")
        )
        mem = round(int(line.split()[1]) / 2**20, 1)
    nixl_wheels = {
        d: _version(d) for d in ("nixl", "nixl-cu12", "nixl-cu13") if _version(d) is not None
    }
    loaded = [m for m in ("nixl_cu12", "nixl_cu13") if m in sys.modules]
    bc = BackendConfig(name="x")
    ec = ExtraConfig()
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "memory_gib": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "matplotlib": _version("matplotlib"),
        "nixl": nixl_wheels,
        "nixl_module_loaded": loaded,
        "ucx": _ucx_version(),
        "env": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith(("UCX_", "NIXL_", "GLIBC_TUNABLES", "OMP_"))
        },
        "kvrdma_backend_defaults": {
            "backends": list(bc.backends),
            "progress_thread": bc.progress_thread,
            "capture_telemetry": bc.capture_telemetry,
            "worker_num_threads": ec.num_threads,
            "split_batch_size": bc.split_batch_size,
            "skip_desc_merge_min_bytes": SKIP_MERGE_MIN_BYTES,
            "hugepages": ec.hugepages,
        },
        "transparent_hugepages": _thp(),
        "transport_note": "same host: READ data over UCX cma (process_vm_readv), "
        "notifications and wire-up over tcp on lo; transfer() copies synchronously",
        "git": _git(),
    }
