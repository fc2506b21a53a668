"""kvrdma as a vLLM KV connector: ``--kv-transfer-config '{"kv_connector": "KvrdmaConnector",
"kv_connector_module_path": "kvrdma.vllm", "kv_role": "kv_producer"}'``.

Importing this package is cheap (vLLM resolves the class while building its config and in
the API server): the connector and vLLM's base classes load on first attribute access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrdma.vllm.connector import KvrdmaConnector

__all__ = ["KvrdmaConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvrdmaConnector":
        from kvrdma.vllm.connector import KvrdmaConnector

        return KvrdmaConnector
    raise AttributeError(f"module 'kvrdma.vllm' has no attribute {name!r}")
