"""The parity table of tests/unit/vllm_config_cases.py, checked against vLLM 0.32 itself.

tests/unit checks kvrdma's reading of each config against the table's `meaning`; here vLLM's
own `KVTransferConfig` and its Nixl connector's reading of `kv_connector_extra_config`
(the defaults and conversions its scheduler and worker apply) must give the same meaning,
so the two agree with each other.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest
from vllm.config.kv_transfer import KVTransferConfig as VllmKVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlPullConnector,
    NixlPushConnector,
)

from kvrdma.config import load_kv_transfer_config
from kvrdma.config_vllm import PULL_CONNECTORS, PUSH_CONNECTORS
from tests.unit.vllm_config_cases import CASES, Case

pytestmark = pytest.mark.timeout(60)


def served_config(raw: dict[str, Any]) -> tuple[VllmKVTransferConfig, VllmKVTransferConfig]:
    """(the config vLLM's scheduler reads, the one the Nixl/kvrdma connector gets)."""
    top = VllmKVTransferConfig(**json.loads(json.dumps(raw)))
    if top.kv_connector != "MultiConnector":
        return top, top
    [child] = [
        c
        for c in top.kv_connector_extra_config["connectors"]
        if c.get("kv_connector") in PULL_CONNECTORS + PUSH_CONNECTORS
    ]
    # As MultiConnector builds each child: its own keys plus the parent's engine id.
    return top, VllmKVTransferConfig(
        **{**child, "engine_id": child.get("engine_id", top.engine_id)}
    )


def vllm_meaning(raw: dict[str, Any], keys: Any) -> dict[str, Any]:
    top, ours = served_config(raw)
    get = ours.get_from_extra_config
    # Each line reads a key the way vLLM 0.32's NixlConnector scheduler/worker reads it.
    table = {
        "kv_connector": ours.kv_connector,
        "kv_role": ours.kv_role,
        "engine_id": ours.engine_id,
        "kv_port": ours.kv_port,
        "kv_buffer_device": ours.kv_buffer_device,
        "enable_permute_local_kv": ours.enable_permute_local_kv,
        "kv_load_failure_policy": top.kv_load_failure_policy,
        "extra.kv_lease_duration": get("kv_lease_duration", 30),
        "extra.enforce_handshake_compat": bool(get("enforce_handshake_compat", True)),
        "extra.backends": list(get("backends", ["UCX"])),
        "extra.num_threads": get("num_threads", 4),
        "extra.kv_recompute_threshold": int(get("kv_recompute_threshold", 64)),
        "extra.decoder_kv_blocks_ttl": get("decoder_kv_blocks_ttl", 480),
        "extra.engine_ttl": get("engine_ttl", 3600.0),
        # vLLM pushes when the connector class does; KvrdmaConnector passes the key through
        "extra.transfer_mode": "push"
        if ours.kv_connector == "NixlPushConnector"
        else get("transfer_mode", "pull"),
        "extra.push_registration_timeout": get(
            "push_registration_timeout", get("decoder_kv_blocks_ttl", 480)
        ),
        # kvrdma's own key: vLLM passes it to the connector as given
        "extra.integrity_checksums": get("integrity_checksums", False),
    }
    return {key: table[key] for key in keys if key in table}


ACCEPTED = [c for c in CASES if c.vllm == "same"]


@pytest.mark.parametrize("case", ACCEPTED, ids=[c.id for c in ACCEPTED])
def test_vllm_reads_each_accepted_config_as_the_table_says(case: Case) -> None:
    assert vllm_meaning(case.raw, case.meaning) == {
        k: v for k, v in case.meaning.items() if k != "extra.read_deadline"
    }
    _, ours = served_config(case.raw)
    if ours.kv_connector == "NixlPushConnector":
        assert KVConnectorFactory.get_connector_class(ours) is NixlPushConnector
    elif ours.kv_connector != "KvrdmaConnector":
        assert KVConnectorFactory.get_connector_class(ours) is NixlPullConnector
    elif importlib.util.find_spec("kvrdma.vllm") is not None:  # the connector, once merged
        assert KVConnectorFactory.get_connector_class(ours).__name__ == "KvrdmaConnector"


REFUSED = [c for c in CASES if c.vllm == "refuses"]


@pytest.mark.parametrize("case", REFUSED, ids=[c.id for c in REFUSED])
def test_configs_vllm_refuses_kvrdma_refuses_by_key(case: Case) -> None:
    with pytest.raises(ValueError, match=case.key):  # pydantic's ValidationError
        VllmKVTransferConfig(**case.raw)
    with pytest.raises(Exception, match=f"^{case.key}"):
        load_kv_transfer_config(case.raw, environ={})


ONLY_KVRDMA_REFUSES = [c for c in CASES if c.vllm == "runs"]


@pytest.mark.parametrize("case", ONLY_KVRDMA_REFUSES, ids=[c.id for c in ONLY_KVRDMA_REFUSES])
def test_configs_only_kvrdma_refuses_are_valid_vllm_configs(case: Case) -> None:
    # A deliberate difference (push, D->P, XPU, a MultiConnector kvrdma cannot serve): vLLM's
    # config accepts it, kvrdma refuses with a reason, checked in tests/unit.
    VllmKVTransferConfig(**case.raw)
    assert case.why


def test_the_table_is_realistic_and_broad() -> None:
    assert len(CASES) >= 30
    assert {c.vllm for c in CASES} == {"same", "refuses", "runs"}
