"""Realistic `--kv-transfer-config`s for vLLM 0.32's Nixl connectors, with what each means.

One table, two readers: `tests/unit/test_config.py` checks that kvrdma reads each config
with the `meaning` given (or refuses it naming `key`), and `tests/vllm/test_config_parity.py`
checks the same table against vLLM's own `KVTransferConfig` and its Nixl connector's defaults.

`vllm` says what vLLM does with the config: "same" (accepts it, with `meaning`), "refuses"
(its config validation raises too) or "runs" (vLLM accepts it, kvrdma refuses on purpose:
D→P transfers, a device or a child it cannot serve, a pull connector told to push).

`meaning` keys: a top-level field name, or `extra.<key>` for `kv_connector_extra_config`;
`kv_connector` is the connector kvrdma serves (a MultiConnector's Nixl/kvrdma child).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

P = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
D = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
KVRDMA = {"kv_connector": "KvrdmaConnector", "kv_connector_module_path": "kvrdma.vllm"}
OFFLOAD_CHILD = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30},
}
# vLLM's NixlConnector defaults, as its scheduler and worker read them.
DEFAULTS: dict[str, Any] = {
    "kv_port": 14579,
    "enable_permute_local_kv": False,
    "kv_load_failure_policy": "fail",
    "extra.kv_lease_duration": 30,
    "extra.enforce_handshake_compat": True,
    "extra.backends": ["UCX"],
    "extra.kv_recompute_threshold": 64,
    "extra.decoder_kv_blocks_ttl": 480,
    "extra.engine_ttl": 3600,
}
# The `kv_connector_extra_config` keys vLLM 0.32's Nixl connectors (and MultiConnector) read;
# kvrdma's own keys are the others it reads.
VLLM_EXTRA_KEYS = frozenset(
    {
        "backends",
        "num_threads",
        "kv_lease_duration",
        "enforce_handshake_compat",
        "enable_cross_layers_blocks",
        "kv_recompute_threshold",
        "bidirectional_kv_xfer",
        "decoder_kv_blocks_ttl",
        "engine_ttl",
        "push_registration_timeout",
        "connectors",
    }
)


@dataclass(frozen=True)
class Case:
    id: str
    raw: dict[str, Any]
    vllm: Literal["same", "refuses", "runs"] = "same"
    meaning: dict[str, Any] = field(default_factory=dict)
    key: str = ""  # the key kvrdma's error names, for refused cases
    why: str = ""  # a fragment of kvrdma's error message saying why


def _extra(base: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {**base, "kv_connector_extra_config": extra}


def _multi(*children: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_consumer",
        **top,
        "kv_connector_extra_config": {"connectors": list(children)},
    }


_E = "kv_connector_extra_config"
CASES: list[Case] = [
    # --- connector names and roles -----------------------------------------------------
    Case("nixl-producer", P, meaning={**DEFAULTS, "kv_connector": "NixlConnector"}),
    Case("nixl-consumer", D, meaning={"kv_role": "kv_consumer", **DEFAULTS}),
    Case("nixl-both-deprecated", {**P, "kv_role": "kv_both"}, meaning={"kv_role": "kv_both"}),
    Case(
        "nixl-pull-connector",
        {**D, "kv_connector": "NixlPullConnector"},
        meaning={"kv_connector": "NixlPullConnector", "kv_role": "kv_consumer"},
    ),
    Case(
        "kvrdma-producer",
        {**KVRDMA, "kv_role": "kv_producer", "engine_id": "prefill-0"},
        meaning={"kv_connector": "KvrdmaConnector", "engine_id": "prefill-0", **DEFAULTS},
    ),
    Case(
        "kvrdma-consumer-recompute",
        {**KVRDMA, "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"},
        meaning={"kv_connector": "KvrdmaConnector", "kv_load_failure_policy": "recompute"},
    ),
    Case(
        "multi-nixl-and-offload",
        _multi({**D}, OFFLOAD_CHILD, engine_id="decode-1", kv_load_failure_policy="recompute"),
        meaning={
            "kv_connector": "NixlConnector",
            "kv_role": "kv_consumer",
            "engine_id": "decode-1",
            "kv_load_failure_policy": "recompute",
        },
    ),
    Case(
        "multi-offload-and-kvrdma-short-lease",
        _multi(OFFLOAD_CHILD, _extra({**KVRDMA, "kv_role": "kv_producer"}, kv_lease_duration=10)),
        meaning={
            "kv_connector": "KvrdmaConnector",
            "kv_role": "kv_producer",
            "extra.kv_lease_duration": 10,
            "extra.read_deadline": 5.0,
            "kv_load_failure_policy": "fail",
        },
    ),
    Case(
        "kvrdma-integrity-checksums",
        _extra({**KVRDMA, "kv_role": "kv_consumer"}, integrity_checksums=True),
        meaning={"kv_connector": "KvrdmaConnector", "extra.integrity_checksums": True},
    ),
    Case(
        "multi-without-nixl-child",
        _multi(OFFLOAD_CHILD),
        vllm="runs",
        key=f"{_E}.connectors",
        why="expected exactly one child whose kv_connector is one of NixlConnector",
    ),
    Case(
        "multi-with-two-nixl-children",
        _multi(D, {**KVRDMA, "kv_role": "kv_consumer"}),
        vllm="runs",
        key=f"{_E}.connectors",
        why="got 2 among",
    ),
    Case("no-role", {"kv_connector": "NixlConnector"}, vllm="refuses", key="kv_role"),
    Case("role-typo", {**P, "kv_role": "producer"}, vllm="refuses", key="kv_role"),
    # --- leases and the read deadline that follows them ----------------------------------
    Case(
        "lease-5s",
        _extra(D, kv_lease_duration=5),
        meaning={"extra.kv_lease_duration": 5, "extra.read_deadline": 2.5},
    ),
    Case(
        "lease-10s",
        _extra(P, kv_lease_duration=10),
        meaning={"extra.kv_lease_duration": 10, "extra.read_deadline": 5.0},
    ),
    Case(
        "lease-10s-explicit-deadline-at-lease",
        _extra(D, kv_lease_duration=10, read_deadline=10),
        vllm="runs",
        key=f"{_E}.read_deadline",
        why="< kv_lease_duration (10)",
    ),
    # --- pydantic's lax top-level values ----------------------------------------------------
    Case("kv-port-string", {**P, "kv_port": "14580"}, meaning={"kv_port": 14580}),
    Case(
        "permute-string-true",
        {**D, "enable_permute_local_kv": "true"},
        meaning={"enable_permute_local_kv": True},
    ),
    Case(
        "permute-bool",
        {**D, "enable_permute_local_kv": True},
        meaning={"enable_permute_local_kv": True},
    ),
    Case(
        "buffer-device-cpu", {**P, "kv_buffer_device": "cpu"}, meaning={"kv_buffer_device": "cpu"}
    ),
    Case(
        "buffer-device-xpu",
        {**P, "kv_buffer_device": "xpu"},
        vllm="runs",
        key="kv_buffer_device",
        why="'cuda', 'cpu'",
    ),
    Case(
        "failure-policy-typo",
        {**D, "kv_load_failure_policy": "retry"},
        vllm="refuses",
        key="kv_load_failure_policy",
    ),
    # --- kv_connector_extra_config as vLLM's Nixl connector reads it ------------------------
    Case(
        "compat-string-false-means-true",
        _extra(D, enforce_handshake_compat="false"),
        meaning={"extra.enforce_handshake_compat": True},
    ),
    Case(
        "compat-string-0-means-true",
        _extra(D, enforce_handshake_compat="0"),
        meaning={"extra.enforce_handshake_compat": True},
    ),
    Case(
        "compat-off",
        _extra(D, enforce_handshake_compat=False),
        meaning={"extra.enforce_handshake_compat": False},
    ),
    Case(
        "threads-and-backends",
        _extra(P, num_threads=8, backends=["UCX", "GDS"]),
        meaning={"extra.num_threads": 8, "extra.backends": ["UCX", "GDS"]},
    ),
    Case(
        "recompute-threshold-string",
        _extra(D, kv_recompute_threshold="128"),
        meaning={"extra.kv_recompute_threshold": 128},
    ),
    Case(
        "ttls",
        _extra(D, decoder_kv_blocks_ttl=600, engine_ttl=900, bidirectional_kv_xfer=False),
        meaning={"extra.decoder_kv_blocks_ttl": 600, "extra.engine_ttl": 900},
    ),
    Case(
        "engine-ttl-off",
        _extra(D, engine_ttl=0),
        meaning={"extra.engine_ttl": 0},
    ),
    Case(
        "bidirectional",
        _extra(D, bidirectional_kv_xfer=True, kv_recompute_threshold=32),
        vllm="runs",
        key=f"{_E}.bidirectional_kv_xfer",
        why="D→P transfers are not implemented",
    ),
    # --- push mode --------------------------------------------------------------------------
    Case(
        "push-connector",
        {**P, "kv_connector": "NixlPushConnector"},
        meaning={"kv_connector": "NixlPushConnector", "extra.transfer_mode": "push"},
    ),
    Case(
        "push-registration-timeout",
        _extra({**D, "kv_connector": "NixlPushConnector"}, push_registration_timeout=30),
        meaning={"extra.push_registration_timeout": 30, "extra.transfer_mode": "push"},
    ),
    Case(
        "kvrdma-push",
        _extra({**P, **KVRDMA}, transfer_mode="push"),
        meaning={"kv_connector": "KvrdmaConnector", "extra.transfer_mode": "push"},
    ),
    Case(
        "transfer-mode-push-with-a-pull-connector",
        _extra(P, transfer_mode="push"),
        vllm="runs",
        key=f"{_E}.transfer_mode",
        why="which vLLM runs in pull mode",
    ),
    Case(
        "multi-with-push-child",
        _multi(OFFLOAD_CHILD, {**P, "kv_connector": "NixlPushConnector"}),
        meaning={"kv_connector": "NixlPushConnector", "extra.transfer_mode": "push"},
    ),
]
