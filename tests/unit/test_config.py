"""kvrdma.config: vLLM-compatible kv_transfer_config, side-channel env, kv_transfer_params."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrdma import defaults
from kvrdma.config import (
    ENV_SIDE_CHANNEL_HOST,
    ENV_SIDE_CHANNEL_PORT,
    ExtraConfig,
    KVTransferConfig,
    KVTransferParams,
    load_kv_transfer_config,
)
from kvrdma.errors import ConfigError
from kvrdma.lease import EXPIRY_SAFETY_SECONDS
from tests.unit.vllm_config_cases import CASES, Case

MINIMAL: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
NO_ENV: dict[str, str] = {}


def load(raw: Any, environ: dict[str, str] | None = None) -> KVTransferConfig:
    return load_kv_transfer_config(raw, environ=NO_ENV if environ is None else environ)


def with_extra(**extra: Any) -> dict[str, Any]:
    return {**MINIMAL, "kv_connector_extra_config": extra}


# --- sources and defaults -------------------------------------------------------------------


@pytest.fixture(params=["dict", "json-string", "path-string", "path-object"])
def as_source(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    def convert(raw: dict[str, Any]) -> Any:
        if request.param == "dict":
            return raw
        if request.param == "json-string":
            return json.dumps(raw)
        path = tmp_path / "kv.json"
        path.write_text(json.dumps(raw, indent=2), encoding="utf-8")
        return str(path) if request.param == "path-string" else path

    return convert


def test_minimal_config_has_vllm_defaults(as_source: Any) -> None:
    cfg = load(as_source(MINIMAL))
    assert cfg.kv_connector == "NixlConnector"
    assert cfg.kv_role == "kv_both"
    assert uuid.UUID(cfg.engine_id).version == 4
    assert cfg.kv_buffer_device == "cuda"
    assert cfg.kv_buffer_size == 1e9
    assert cfg.kv_rank is None
    assert cfg.kv_parallel_size == 1
    assert (cfg.kv_ip, cfg.kv_port) == ("127.0.0.1", 14579)
    assert cfg.kv_connector_module_path is None
    assert cfg.enable_permute_local_kv is False
    assert cfg.kv_load_failure_policy == "fail"
    assert cfg.extra == ExtraConfig()
    assert cfg.extra.backends == ("UCX",)
    assert cfg.extra.num_threads == defaults.ucx_num_threads()
    assert cfg.extra.hugepages == "advise"
    assert cfg.extra.integrity_checksums is False
    assert cfg.extra.kv_lease_duration == defaults.KV_LEASE_SECONDS
    assert cfg.extra.enforce_handshake_compat is True
    assert cfg.extra.enable_cross_layers_blocks is False
    assert cfg.extra.read_deadline == defaults.READ_DEADLINE_SECONDS
    assert cfg.extra.handshake_timeout == defaults.HANDSHAKE_TIMEOUT_SECONDS
    assert cfg.extra.handshake_retries == defaults.HANDSHAKE_RETRIES
    assert (cfg.side_channel_host, cfg.side_channel_base_port) == ("localhost", 5600)


@pytest.mark.parametrize("engine_id", [None, "absent"])
def test_engine_id_is_a_fresh_uuid4_when_absent_or_null(engine_id: str | None) -> None:
    raw = dict(MINIMAL) if engine_id == "absent" else {**MINIMAL, "engine_id": None}
    first, second = load(raw), load(raw)
    assert uuid.UUID(first.engine_id).version == 4
    assert first.engine_id != second.engine_id


def test_explicit_engine_id_is_kept() -> None:
    assert load({**MINIMAL, "engine_id": "prefill-0"}).engine_id == "prefill-0"


def test_kvrdma_connector_alias_is_accepted() -> None:
    assert load({**MINIMAL, "kv_connector": "KvrdmaConnector"}).kv_connector == "KvrdmaConnector"


@pytest.mark.parametrize(
    ("role", "producer", "consumer"),
    [("kv_producer", True, False), ("kv_consumer", False, True), ("kv_both", True, True)],
)
def test_role_properties(role: str, producer: bool, consumer: bool) -> None:
    cfg = load({**MINIMAL, "kv_role": role})
    assert (cfg.is_producer, cfg.is_consumer) == (producer, consumer)


FULL: dict[str, Any] = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_consumer",
    "engine_id": "decode-7",
    "kv_buffer_device": "cpu",
    "kv_buffer_size": 2e9,
    "kv_rank": 1,
    "kv_parallel_size": 2,
    "kv_ip": "10.0.0.2",
    "kv_port": 15000,
    "kv_connector_module_path": "my.connectors",
    "enable_permute_local_kv": True,
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {
        "backends": ["UCX", "GDS"],
        "num_threads": 0,
        "kv_lease_duration": 60,
        "enforce_handshake_compat": False,
        "enable_cross_layers_blocks": True,
        "read_deadline": 12.5,
        "post_budget": 0.002,
        "handshake_timeout": 2,
        "handshake_retries": 0,
        "hugepages": "collapse",
        "integrity_checksums": True,
        "kv_recompute_threshold": 0,
        "decoder_kv_blocks_ttl": 60,
        "engine_ttl": 600.5,
        "transfer_mode": "pull",
        "push_registration_timeout": 45,
        "publish_address": "tcp://10.0.0.1:5601",
    },
}


def test_every_vllm_field_is_typed_and_kept(as_source: Any) -> None:
    cfg = load(as_source(FULL))
    assert cfg.to_dict() == {
        **FULL,
        "kv_connector_extra_config": {
            **FULL["kv_connector_extra_config"],
            "kv_lease_duration": 60.0,
            "handshake_timeout": 2.0,
            "decoder_kv_blocks_ttl": 60.0,
            "push_registration_timeout": 45.0,
        },
    }
    assert cfg.extra.backends == ("UCX", "GDS")
    assert isinstance(cfg.extra.kv_lease_duration, float)


def test_to_dict_round_trips_and_is_json() -> None:
    cfg = load(FULL)
    assert load(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_describe_names_every_field_and_the_side_channel() -> None:
    text = load(FULL, {ENV_SIDE_CHANNEL_HOST: "p0.local"}).describe()
    assert "kv_role = 'kv_consumer'" in text
    assert "kv_connector_extra_config.read_deadline = 12.5" in text
    assert "side_channel_host = 'p0.local'" in text
    assert "side_channel_base_port = 5600" in text


def test_config_is_frozen() -> None:
    cfg = load(MINIMAL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kv_role = "kv_producer"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "expected"), [("True", True), ("true", True), ("False", False), (" FALSE ", False)]
)
def test_cross_layers_flag_accepts_string_spellings(text: str, expected: bool) -> None:
    extra = load(with_extra(enable_cross_layers_blocks=text)).extra
    assert extra.enable_cross_layers_blocks is expected


def test_null_extra_config_and_null_extra_values_mean_defaults() -> None:
    assert load({**MINIMAL, "kv_connector_extra_config": None}).extra == ExtraConfig()
    assert load(with_extra(num_threads=None, backends=None)).extra == ExtraConfig()


def test_unknown_extra_keys_are_kept_and_warned(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvrdma.config"):
        cfg = load(with_extra(tp_ratio_hint=2, backends=["UCX"]))
    assert dict(cfg.extra.other) == {"tp_ratio_hint": 2}
    assert cfg.to_dict()["kv_connector_extra_config"]["tp_ratio_hint"] == 2
    [record] = caplog.records
    assert "kv_connector_extra_config" in record.getMessage()
    assert "'tp_ratio_hint'" in record.getMessage()


# --- parity with vLLM 0.32 (the same table runs against vLLM itself in tests/vllm) ----------


def meaning_of(cfg: KVTransferConfig, keys: Any) -> dict[str, Any]:
    """The `meaning` entries of tests/unit/vllm_config_cases.py, read from kvrdma's config."""
    out: dict[str, Any] = {}
    for key in keys:
        value = getattr(cfg.extra, key[6:]) if key.startswith("extra.") else getattr(cfg, key)
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_vllm_configs_mean_the_same_or_are_refused_by_key(case: Case) -> None:
    if case.meaning:
        assert meaning_of(load(case.raw), case.meaning) == case.meaning
        return
    with pytest.raises(ConfigError) as info:
        load(json.dumps(case.raw))
    message = str(info.value)
    assert message.startswith(f"{case.key}: ") or message.startswith(f"{case.key} is refused")
    assert case.why in message


def test_multi_connector_child_is_extracted_and_said_so(caplog: pytest.LogCaptureFixture) -> None:
    [case] = [c for c in CASES if c.id == "multi-offload-and-kvrdma-short-lease"]
    with caplog.at_level(logging.INFO, logger="kvrdma.config_vllm"):
        cfg = load(case.raw)
    assert cfg.multi_connector_children == ("OffloadingConnector", "KvrdmaConnector")
    assert "multi_connector_children = ['OffloadingConnector', 'KvrdmaConnector']" in (
        cfg.describe()
    )
    assert "kvrdma serves its child 1 (KvrdmaConnector)" in caplog.text
    assert "(OffloadingConnector) are vLLM's own" in caplog.text
    assert load(cfg.to_dict()) == cfg  # the extracted child stands on its own


def test_multi_connector_child_policy_yields_to_the_parent_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    child = {**MINIMAL, "kv_load_failure_policy": "fail"}
    raw = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [child]},
    }
    with caplog.at_level(logging.WARNING, logger="kvrdma.config_vllm"):
        assert load(raw).kv_load_failure_policy == "recompute"
    assert "connectors[0].kv_load_failure_policy='fail' is ignored" in caplog.text


@pytest.mark.parametrize("children", [None, [], "NixlConnector", [["NixlConnector"]]])
def test_malformed_multi_connector_children_are_named(children: Any) -> None:
    raw = {**MINIMAL, "kv_connector": "MultiConnector", "kv_connector_extra_config": {}}
    if children is not None:
        raw["kv_connector_extra_config"] = {"connectors": children}
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.connectors"):
        load(raw)


@pytest.mark.parametrize(
    ("value", "flag"),
    [("false", True), ("0", True), ("", False), (0, False), (1, True), (None, False)],
)
def test_handshake_compat_is_read_with_vllms_truthiness_and_warned(
    caplog: pytest.LogCaptureFixture, value: Any, flag: bool
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvrdma.config_vllm"):
        cfg = load(with_extra(enforce_handshake_compat=value))
    assert cfg.extra.enforce_handshake_compat is flag
    assert f"enforce_handshake_compat: {value!r} is not a JSON boolean" in caplog.text


@pytest.mark.parametrize(
    ("value", "port"), [("14580", 14580), (" 14580 ", 14580), ("14580.0", 14580), (14580.0, 14580)]
)
def test_kv_port_takes_pydantics_lax_spellings(value: Any, port: int) -> None:
    assert load({**MINIMAL, "kv_port": value}).kv_port == port


@pytest.mark.parametrize(
    ("value", "flag"),
    [
        ("yes", True),
        ("On", True),
        ("t", True),
        (1, True),
        ("no", False),
        ("OFF", False),
        (0, False),
    ],
)
def test_permute_flag_takes_pydantics_lax_spellings(value: Any, flag: bool) -> None:
    assert load({**MINIMAL, "enable_permute_local_kv": value}).enable_permute_local_kv is flag


def test_kvrdma_connector_without_its_module_path_is_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvrdma.config_vllm"):
        load({**MINIMAL, "kv_connector": "KvrdmaConnector"})
    assert "vLLM loads it only with kv_connector_module_path 'kvrdma.vllm'" in caplog.text


# --- errors: every one names the field path, the value and what is allowed -------------------

BAD_VALUES: list[tuple[dict[str, Any], str, str, str]] = [
    # (raw config, field path, value as shown, what is allowed)
    ({"kv_role": "kv_both"}, "kv_connector", "no value", "one of 'NixlConnector'"),
    ({**MINIMAL, "kv_connector": "P2pNccl"}, "kv_connector", "'P2pNccl'", "one of"),
    ({"kv_connector": "NixlConnector"}, "kv_role", "no value", "'kv_producer', 'kv_consumer'"),
    ({**MINIMAL, "kv_role": "both"}, "kv_role", "'both'", "'kv_both'"),
    ({**MINIMAL, "engine_id": ""}, "engine_id", "''", "a non-empty string"),
    ({**MINIMAL, "engine_id": 7}, "engine_id", "7", "a non-empty string"),
    # no peer could request a longer one
    ({**MINIMAL, "engine_id": "e" * 257}, "engine_id", "'eee", "at most 256 characters"),
    ({**MINIMAL, "kv_buffer_device": "gpu"}, "kv_buffer_device", "'gpu'", "'cuda', 'cpu'"),
    ({**MINIMAL, "kv_buffer_size": -1}, "kv_buffer_size", "-1", "a number of bytes >= 0"),
    ({**MINIMAL, "kv_buffer_size": "1e9"}, "kv_buffer_size", "'1e9'", "a number of bytes"),
    ({**MINIMAL, "kv_rank": -1}, "kv_rank", "-1", "an integer >= 0"),
    ({**MINIMAL, "kv_rank": True}, "kv_rank", "True", "an integer >= 0"),
    ({**MINIMAL, "kv_parallel_size": 0}, "kv_parallel_size", "0", "an integer >= 1"),
    ({**MINIMAL, "kv_ip": 10}, "kv_ip", "10", "a non-empty string"),
    ({**MINIMAL, "kv_port": 0}, "kv_port", "0", "an integer in 1..65535"),
    ({**MINIMAL, "kv_port": 70000}, "kv_port", "70000", "an integer in 1..65535"),
    ({**MINIMAL, "kv_port": "145x"}, "kv_port", "'145x'", "an integer in 1..65535"),
    ({**MINIMAL, "kv_port": True}, "kv_port", "True", "an integer in 1..65535"),
    ({**MINIMAL, "kv_port": 14579.5}, "kv_port", "14579.5", "an integer in 1..65535"),
    ({**MINIMAL, "kv_connector_module_path": ""}, "kv_connector_module_path", "''", "module path"),
    ({**MINIMAL, "enable_permute_local_kv": "si"}, "enable_permute_local_kv", "'si'", "boolean"),
    ({**MINIMAL, "enable_permute_local_kv": 2}, "enable_permute_local_kv", "2", "a boolean"),
    ({**MINIMAL, "kv_load_failure_policy": "abort"}, "kv_load_failure_policy", "'abort'", "'fail'"),
    ({**MINIMAL, "kv_connector_extra_config": [1]}, "kv_connector_extra_config", "[1]", "object"),
    # the default 3 retries cut a 20 ms handshake_timeout into 5 ms attempts
    (
        with_extra(handshake_timeout=0.02),
        "kv_connector_extra_config.handshake_retries",
        "3",
        "an integer in 0..1 with handshake_timeout 0.02",
    ),
    *[
        (with_extra(**{key: value}), f"kv_connector_extra_config.{sub}", shown, allowed)
        for key, value, sub, shown, allowed in [
            ("backends", "UCX", "backends", "'UCX'", "a non-empty list"),
            ("backends", [], "backends", "[]", "a non-empty list"),
            ("backends", ["UCX", ""], "backends[1]", "''", "a non-empty backend name"),
            ("backends", [1], "backends[0]", "1", "a non-empty backend name"),
            ("num_threads", "four", "num_threads", "'four'", "an integer in 0..256"),
            ("num_threads", -1, "num_threads", "-1", "an integer in 0..256"),
            ("num_threads", True, "num_threads", "True", "an integer in 0..256"),
            ("num_threads", 4.0, "num_threads", "4.0", "an integer in 0..256"),
            ("kv_lease_duration", 0, "kv_lease_duration", "0", "a number of seconds > 0"),
            ("kv_lease_duration", "30", "kv_lease_duration", "'30'", "a number of seconds > 0"),
            ("kv_lease_duration", False, "kv_lease_duration", "False", "seconds > 0"),
            ("kv_lease_duration", math.inf, "kv_lease_duration", "inf", "seconds > 0"),
            # readers end a READ EXPIRY_SAFETY_SECONDS before the lease: none could start
            ("kv_lease_duration", 0.25, "kv_lease_duration", "0.25", "seconds > 0.25 (a READ"),
            ("kv_lease_duration", 0.1, "kv_lease_duration", "0.1", "seconds > 0.25 (a READ"),
            ("kv_recompute_threshold", "x", "kv_recompute_threshold", "'x'", "an integer"),
            ("engine_ttl", -1, "engine_ttl", "-1", "a number of seconds >= 0"),
            ("decoder_kv_blocks_ttl", "8", "decoder_kv_blocks_ttl", "'8'", "seconds > 0"),
            ("transfer_mode", "sideways", "transfer_mode", "'sideways'", "'pull'"),
            ("enable_cross_layers_blocks", 0, "enable_cross_layers_blocks", "0", "a boolean"),
            ("read_deadline", 0, "read_deadline", "0", "a number of seconds > 0"),
            ("read_deadline", 30, "read_deadline", "30", "< kv_lease_duration (30)"),
            ("read_deadline", 45.5, "read_deadline", "45.5", "< kv_lease_duration (30)"),
            ("handshake_timeout", 0, "handshake_timeout", "0", "seconds in (0, 3600]"),
            ("handshake_timeout", "5", "handshake_timeout", "'5'", "seconds in (0, 3600]"),
            # a handshake client refuses longer: caught when loaded, not at the first connect
            ("handshake_timeout", 7200, "handshake_timeout", "7200", "seconds in (0, 3600]"),
            # JSON integers have no size limit; no float holds this one
            ("kv_lease_duration", 10**400, "kv_lease_duration", "1000", "seconds > 0"),
            ("read_deadline", -(10**400), "read_deadline", "-1000", "seconds > 0"),
            ("handshake_retries", -1, "handshake_retries", "-1", "an integer in 0..1000"),
            ("handshake_retries", 1.5, "handshake_retries", "1.5", "an integer in 0..1000"),
            # a UCX worker per thread: a million exhaust the host's shared memory while building
            ("num_threads", 10**6, "num_threads", "1000000", "an integer in 0..256"),
            # past 1024 attempts a retried handshake's doubling backoff overflows
            ("handshake_retries", 10**9, "handshake_retries", "1000000000", "in 0..1000"),
            # 5 ms attempts: no peer a few milliseconds away can answer in time
            ("handshake_retries", 1000, "handshake_retries", "1000", "in 0..499 with"),
            ("publish_address", 42, "publish_address", "42", "a ZMQ address"),
            ("publish_address", " ", "publish_address", "' '", "a ZMQ address"),
            ("hugepages", "yes", "hugepages", "'yes'", "'off', 'advise', 'collapse'"),
            ("hugepages", True, "hugepages", "True", "one of 'off', 'advise', 'collapse'"),
            ("hugepages", "ADVISE", "hugepages", "'ADVISE'", "'off', 'advise', 'collapse'"),
            ("integrity_checksums", 1, "integrity_checksums", "1", "a boolean"),
            ("integrity_checksums", "on", "integrity_checksums", "'on'", "a boolean"),
        ]
    ],
]


@pytest.mark.parametrize(
    ("raw", "path", "shown", "allowed"), BAD_VALUES, ids=[f"{c[1]}={c[2]}" for c in BAD_VALUES]
)
def test_bad_value_names_field_value_and_allowed(
    raw: dict[str, Any], path: str, shown: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load(raw)
    message = str(info.value)
    assert message.startswith(f"{path}: expected ")
    assert f"got {shown}" in message
    assert allowed in message


@pytest.mark.parametrize(
    ("extra", "key", "value"),
    [
        ({"num_threads": 256}, "num_threads", 256),
        ({"handshake_retries": 499}, "handshake_retries", 499),  # 10 ms attempts of 5 s
        ({"handshake_timeout": 3600, "handshake_retries": 1000}, "handshake_retries", 1000),
        ({"handshake_timeout": 0.005, "handshake_retries": 0}, "handshake_timeout", 0.005),
    ],
)
def test_bounded_keys_accept_their_limits(extra: dict[str, Any], key: str, value: Any) -> None:
    assert getattr(load(with_extra(**extra)).extra, key) == value


def test_publish_address_is_read_not_called_unknown(caplog: pytest.LogCaptureFixture) -> None:
    """The vLLM connector publishes to this address (sidecar mode): not an unused key."""
    with caplog.at_level(logging.WARNING, logger="kvrdma.config"):
        cfg = load(with_extra(publish_address="ipc:///run/kvrdma/publish.sock"))
    assert cfg.extra.publish_address == "ipc:///run/kvrdma/publish.sock"
    assert not cfg.extra.other and not caplog.records


@pytest.mark.parametrize("mode", ["off", "advise", "collapse"])
def test_hugepages_modes_are_accepted(mode: str) -> None:
    cfg = load(with_extra(hugepages=mode))
    assert cfg.extra.hugepages == mode
    assert cfg.extra.to_dict()["hugepages"] == mode


def test_hugepages_error_names_the_field_and_the_choices() -> None:
    with pytest.raises(ConfigError) as info:
        load(with_extra(hugepages="always"))
    assert str(info.value) == (
        "kv_connector_extra_config.hugepages: expected one of 'off', 'advise', 'collapse', "
        "got 'always'"
    )


@pytest.mark.parametrize(("cpus", "want"), [(1, 1), (2, 2), (3, 3), (4, 4), (64, 4)])
def test_default_num_threads_is_one_per_usable_cpu_up_to_4(
    monkeypatch: pytest.MonkeyPatch, cpus: int, want: int
) -> None:
    monkeypatch.setattr(defaults.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert defaults.ucx_num_threads() == want
    assert ExtraConfig().num_threads == want
    assert load(with_extra(num_threads=7)).extra.num_threads == 7


@pytest.mark.parametrize(
    ("lease", "deadline"), [(1, 0.5), (5, 2.5), (10, 5.0), (20, 10.0), (30, 10.0), (600, 10.0)]
)
def test_default_read_deadline_follows_a_short_lease(lease: float, deadline: float) -> None:
    assert load(with_extra(kv_lease_duration=lease)).extra.read_deadline == deadline
    assert defaults.read_deadline_for(lease) == deadline


def test_explicit_read_deadline_is_kept_below_the_lease_and_refused_at_or_over_it() -> None:
    assert load(with_extra(kv_lease_duration=5, read_deadline=4)).extra.read_deadline == 4
    for deadline in (5, 6):
        with pytest.raises(ConfigError, match=r"read_deadline: .*< kv_lease_duration \(5\)"):
            load(with_extra(kv_lease_duration=5, read_deadline=deadline))


def test_unknown_top_level_key_is_named_with_allowed_keys_and_a_hint() -> None:
    with pytest.raises(ConfigError) as info:
        load({**MINIMAL, "kv_rol": "kv_both"})
    message = str(info.value)
    assert "unknown key 'kv_rol'" in message
    assert "did you mean 'kv_role'?" in message
    assert "allowed keys: kv_connector, kv_role, engine_id" in message
    assert "kv_load_failure_policy" in message


def test_non_string_keys_are_rejected() -> None:
    with pytest.raises(ConfigError, match=r"kv_transfer_config: keys must be strings, got 3"):
        load({**MINIMAL, 3: "x"})
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config: keys must be strings"):
        load({**MINIMAL, "kv_connector_extra_config": {None: 1}})


# --- sources: JSON errors, files ------------------------------------------------------------


def test_json_syntax_error_in_string_names_string_and_position() -> None:
    with pytest.raises(ConfigError) as info:
        load('{"kv_connector": "NixlConnector",, }')
    assert str(info.value) == (
        "kv_transfer_config: invalid JSON in string at line 1 column 34 (char 33): "
        "Expecting property name enclosed in double quotes"
    )


def test_json_syntax_error_in_file_names_path_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "kv_connector": "NixlConnector",\n  "kv_role": kv_both\n}\n')
    with pytest.raises(ConfigError) as info:
        load(str(path))
    assert f"invalid JSON in '{path}' at line 3 column 14" in str(info.value)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.json"
    with pytest.raises(ConfigError, match=r"no such file: '.*absent\.json'"):
        load(str(path))
    with pytest.raises(ConfigError, match=r"no such file"):
        load(path)


def test_directory_is_not_a_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"cannot read '{tmp_path}'")):
        load(tmp_path)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            '{"kv_role": "kv_both", "kv_role": "kv_producer"}',
            "duplicate key 'kv_role' in JSON string",
        ),
        ('{"kv_buffer_size": NaN}', "non-finite number NaN in JSON string"),
        ('{"kv_buffer_size": -Infinity}', "non-finite number -Infinity"),
    ],
)
def test_json_that_python_would_accept_silently_is_rejected(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load(text)


def test_json_file_must_hold_an_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(
        ConfigError, match=r"kv_transfer_config: expected a JSON object, got \[1, 2\]"
    ):
        load(path)


@pytest.mark.parametrize("source", ["", "   ", 42, None, b"{}"])
def test_unusable_source_is_rejected(source: Any) -> None:
    with pytest.raises(ConfigError, match=r"kv_transfer_config: expected a JSON string, a path"):
        load(source)


# --- environment: side channel --------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "host", "base"),
    [
        ({}, "localhost", 5600),
        ({ENV_SIDE_CHANNEL_HOST: "10.1.2.3"}, "10.1.2.3", 5600),
        ({ENV_SIDE_CHANNEL_PORT: "7000"}, "localhost", 7000),
        ({ENV_SIDE_CHANNEL_PORT: " 65535 "}, "localhost", 65535),
    ],
)
def test_side_channel_from_environment(environ: dict[str, str], host: str, base: int) -> None:
    cfg = load(MINIMAL, environ)
    assert (cfg.side_channel_host, cfg.side_channel_base_port) == (host, base)


@pytest.mark.parametrize(("dp_index", "port"), [(0, 7000), (1, 7001), (7, 7007)])
def test_side_channel_port_is_base_plus_dp_index(dp_index: int, port: int) -> None:
    cfg = load(MINIMAL, {ENV_SIDE_CHANNEL_PORT: "7000"})
    assert cfg.side_channel_port(dp_index) == port
    assert cfg.side_channel_port() == 7000


@pytest.mark.parametrize("value", ["abc", "0", "70000", "", "-1", "56.0", "٥٦٠٠"])
def test_bad_side_channel_port_env_is_named(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(MINIMAL, {ENV_SIDE_CHANNEL_PORT: value})
    assert str(info.value) == (
        f"VLLM_NIXL_SIDE_CHANNEL_PORT: expected an integer in 1..65535, got {value!r}"
    )


def test_empty_side_channel_host_env_is_named() -> None:
    with pytest.raises(ConfigError, match=r"VLLM_NIXL_SIDE_CHANNEL_HOST: expected .*got ''"):
        load(MINIMAL, {ENV_SIDE_CHANNEL_HOST: ""})


@pytest.mark.parametrize(
    ("dp_index", "fragment"),
    [(-1, "an integer >= 0, got -1"), (True, "got True"), (6, "an integer in 0..5")],
)
def test_bad_dp_index(dp_index: Any, fragment: str) -> None:
    cfg = load(MINIMAL, {ENV_SIDE_CHANNEL_PORT: "65530"})
    with pytest.raises(ConfigError, match=rf"^dp_index: expected .*{fragment}"):
        cfg.side_channel_port(dp_index)


def test_environ_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SIDE_CHANNEL_HOST, "from-os")
    monkeypatch.setenv(ENV_SIDE_CHANNEL_PORT, "6100")
    cfg = load_kv_transfer_config(MINIMAL)
    assert (cfg.side_channel_host, cfg.side_channel_port(2)) == ("from-os", 6102)
    assert load(MINIMAL, {}).side_channel_base_port == 5600  # injected mapping wins


# --- property: every valid config survives to_dict -> parse ---------------------------------

seconds = st.floats(min_value=0.001, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def valid_configs(draw: st.DrawFn) -> dict[str, Any]:
    lease = draw(st.floats(min_value=EXPIRY_SAFETY_SECONDS, max_value=1e6, exclude_min=True))
    timeout = draw(st.floats(min_value=1e-3, max_value=3600.0))
    extra: dict[str, Any] = {
        "backends": draw(
            st.lists(st.sampled_from(["UCX", "GDS", "POSIX", "LIBFABRIC"]), min_size=1)
        ),
        "num_threads": draw(st.integers(0, 64)),
        "kv_lease_duration": lease,
        "read_deadline": draw(st.floats(min_value=lease / 1000, max_value=lease, exclude_max=True)),
        "enforce_handshake_compat": draw(st.booleans()),
        "enable_cross_layers_blocks": draw(st.booleans()),
        "handshake_timeout": timeout,
        "handshake_retries": draw(st.integers(0, min(10, max(0, int(timeout / 0.01) - 1)))),
        "hugepages": draw(st.sampled_from(["off", "advise", "collapse"])),
        "integrity_checksums": draw(st.booleans()),
        "opaque_" + draw(st.text("abc", min_size=1, max_size=3)): draw(st.integers()),
    }
    return {
        "kv_connector": draw(st.sampled_from(["NixlConnector", "KvrdmaConnector"])),
        "kv_role": draw(st.sampled_from(["kv_producer", "kv_consumer", "kv_both"])),
        "engine_id": draw(st.uuids()).hex,
        "kv_buffer_device": draw(st.sampled_from(["cuda", "cpu"])),
        "kv_rank": draw(st.none() | st.integers(0, 8)),
        "kv_port": draw(st.integers(1, 65535)),
        "kv_load_failure_policy": draw(st.sampled_from(["recompute", "fail"])),
        "kv_connector_extra_config": extra,
    }


@given(valid_configs())
def test_property_valid_configs_round_trip(raw: dict[str, Any]) -> None:
    cfg = load(json.dumps(raw))
    assert load(cfg.to_dict()) == cfg
    assert cfg.extra.read_deadline < cfg.extra.kv_lease_duration


# --- kv_transfer_params ---------------------------------------------------------------------

D_SIDE: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-0",
    "remote_block_ids": [[1, 2, 3], [7]],
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "remote_request_id": "cmpl-1",
    "tp_size": 2,
}


@pytest.mark.parametrize("raw", [None, {}])
def test_params_defaults(raw: dict[str, Any] | None) -> None:
    params = KVTransferParams.from_dict(raw)
    assert params == KVTransferParams()
    assert (params.do_remote_prefill, params.do_remote_decode, params.tp_size) == (False, False, 1)
    assert params.remote_block_ids == ()
    assert not params.needs_read


def test_params_consumer_side_typed() -> None:
    params = KVTransferParams.from_dict(D_SIDE)
    assert params.remote_block_ids == ((1, 2, 3), (7,))
    assert params.num_remote_blocks == 4
    assert params.needs_read
    assert (params.remote_host, params.remote_port, params.tp_size) == ("10.0.0.1", 5600, 2)
    assert params.to_dict() == D_SIDE


@pytest.mark.parametrize(
    ("blocks", "groups"),
    [([4, 5, 6], ((4, 5, 6),)), ([[4, 5], []], ((4, 5), ())), ([], ()), ((1,), ((1,),))],
)
def test_flat_block_ids_are_one_group(blocks: Any, groups: tuple[tuple[int, ...], ...]) -> None:
    params = KVTransferParams.from_dict({**D_SIDE, "remote_block_ids": blocks})
    assert params.remote_block_ids == groups


def test_unknown_params_are_kept_and_nulls_are_absent() -> None:
    raw = {"do_remote_decode": True, "dcp_size": 1, "_p_side_truncated": True, "remote_host": None}
    params = KVTransferParams.from_dict(raw)
    assert params.do_remote_decode and params.remote_host is None
    assert dict(params.other) == {"dcp_size": 1, "_p_side_truncated": True}
    assert KVTransferParams.from_dict(params.to_dict()) == params


@pytest.mark.parametrize("empty", [[], [[], []]])
def test_remote_prefill_without_blocks_needs_no_endpoint(empty: list[Any]) -> None:
    params = KVTransferParams.from_dict({"do_remote_prefill": True, "remote_block_ids": empty})
    assert params.do_remote_prefill and not params.needs_read


BAD_PARAMS: list[tuple[dict[str, Any], str, str, str]] = [
    ({"do_remote_prefill": "true"}, "do_remote_prefill", "'true'", "a boolean"),
    ({"do_remote_decode": 1}, "do_remote_decode", "1", "a boolean"),
    ({"remote_engine_id": ""}, "remote_engine_id", "''", "a non-empty string"),
    ({"remote_host": 5}, "remote_host", "5", "a non-empty string"),
    ({"remote_request_id": ["x"]}, "remote_request_id", "['x']", "a non-empty string"),
    ({"remote_port": 0}, "remote_port", "0", "an integer in 1..65535"),
    ({"remote_port": "5600"}, "remote_port", "'5600'", "an integer in 1..65535"),
    ({"tp_size": 0}, "tp_size", "0", "an integer in 1..1048576"),
    ({"tp_size": 2.0}, "tp_size", "2.0", "an integer in 1..1048576"),
    ({"tp_size": 2**40}, "tp_size", "1099511627776", "an integer in 1..1048576"),
    ({"remote_block_ids": "1,2"}, "remote_block_ids", "'1,2'", "a list of block ids"),
    ({"remote_block_ids": 5}, "remote_block_ids", "5", "one per KV-cache group"),
    ({"remote_block_ids": [1, -1]}, "remote_block_ids[1]", "-1", "an integer >= 0"),
    ({"remote_block_ids": [1, True]}, "remote_block_ids[1]", "True", "an integer >= 0"),
    ({"remote_block_ids": [1, [2]]}, "remote_block_ids[1]", "[2]", "an integer >= 0"),
    ({"remote_block_ids": [[1], [2, "x"]]}, "remote_block_ids[1][1]", "'x'", "an integer >= 0"),
    ({"remote_block_ids": [[1], 2]}, "remote_block_ids[1]", "2", "a list of block ids"),
]


@pytest.mark.parametrize(
    ("raw", "key", "shown", "allowed"), BAD_PARAMS, ids=[f"{c[1]}={c[2]}" for c in BAD_PARAMS]
)
def test_bad_params_name_field_value_and_allowed(
    raw: dict[str, Any], key: str, shown: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as info:
        KVTransferParams.from_dict(raw)
    message = str(info.value)
    assert message.startswith(f"kv_transfer_params.{key}: expected ")
    assert f"got {shown}" in message
    assert allowed in message


@pytest.mark.parametrize(
    "missing", ["remote_engine_id", "remote_request_id", "remote_host", "remote_port"]
)
@pytest.mark.parametrize("how", ["absent", "null"])
def test_remote_prefill_with_blocks_requires_endpoint(missing: str, how: str) -> None:
    raw = dict(D_SIDE)
    if how == "absent":
        del raw[missing]
    else:
        raw[missing] = None
    with pytest.raises(ConfigError) as info:
        KVTransferParams.from_dict(raw)
    assert str(info.value).startswith(
        f"kv_transfer_params.{missing}: required when do_remote_prefill is true"
    )
    assert str(info.value).endswith("got None" if how == "null" else "got no value")


def test_params_must_be_an_object() -> None:
    with pytest.raises(ConfigError, match=r"^kv_transfer_params: expected a JSON object, got \[\]"):
        KVTransferParams.from_dict([])  # type: ignore[arg-type]


@given(
    st.fixed_dictionaries(
        {
            "do_remote_prefill": st.booleans(),
            "do_remote_decode": st.booleans(),
            "remote_block_ids": st.lists(st.lists(st.integers(0, 2**31), max_size=5), max_size=3),
            "remote_engine_id": st.text(min_size=1).filter(str.strip),
            "remote_host": st.sampled_from(["localhost", "10.0.0.1", "p0.svc"]),
            "remote_port": st.integers(1, 65535),
            "remote_request_id": st.uuids().map(str),
            "tp_size": st.integers(1, 64),
        }
    )
)
def test_property_params_round_trip(raw: dict[str, Any]) -> None:
    params = KVTransferParams.from_dict(raw)
    assert KVTransferParams.from_dict(params.to_dict()) == params
    assert params.to_dict() == raw
