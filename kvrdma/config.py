"""vLLM-compatible `--kv-transfer-config`, side-channel environment and `kv_transfer_params`.

Every bad value raises `ConfigError` naming the field path, the value received and what is
allowed, e.g. ``kv_connector_extra_config.num_threads: expected an integer >= 0, got 'four'``.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Literal, cast

from kvrdma import config_vllm, defaults
from kvrdma.config_checks import (
    MISSING,
    bad_value,
    check_bool,
    check_choice,
    check_int,
    check_keys,
    check_number,
    check_str,
    get_value,
    show,
)
from kvrdma.errors import ConfigError
from kvrdma.hugepages import MODES as HUGEPAGE_MODES
from kvrdma.lease import check_lease_duration

__all__ = [
    "BUFFER_DEVICES",
    "CONNECTOR_NAMES",
    "ENV_SIDE_CHANNEL_HOST",
    "ENV_SIDE_CHANNEL_PORT",
    "FAILURE_POLICIES",
    "HUGEPAGE_MODES",
    "ROLES",
    "ExtraConfig",
    "FailurePolicy",
    "KVTransferConfig",
    "KVTransferParams",
    "Role",
    "load_kv_transfer_config",
]

logger = logging.getLogger(__name__)

Role = Literal["kv_producer", "kv_consumer", "kv_both"]
FailurePolicy = Literal["recompute", "fail"]

CONNECTOR_NAMES: Final = config_vllm.PULL_CONNECTORS + config_vllm.PUSH_CONNECTORS
ROLES: Final = ("kv_producer", "kv_consumer", "kv_both")
BUFFER_DEVICES: Final = ("cuda", "cpu")
FAILURE_POLICIES: Final = ("recompute", "fail")
ENV_SIDE_CHANNEL_HOST: Final = "VLLM_NIXL_SIDE_CHANNEL_HOST"
ENV_SIDE_CHANNEL_PORT: Final = "VLLM_NIXL_SIDE_CHANNEL_PORT"

_ROOT = "kv_transfer_config"
_EXTRA = "kv_connector_extra_config"
_PARAMS = "kv_transfer_params"
_REMOTE_ENDPOINT_KEYS: Final = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)


# --- kv_connector_extra_config -------------------------------------------------------------


@dataclass(frozen=True)
class ExtraConfig:
    """The `kv_connector_extra_config` keys kvrdma reads, plus unknown ones kept as given."""

    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = field(default_factory=defaults.ucx_num_threads)
    kv_lease_duration: float = defaults.KV_LEASE_SECONDS
    enforce_handshake_compat: bool = True
    enable_cross_layers_blocks: bool = False
    read_deadline: float = defaults.READ_DEADLINE_SECONDS  # from_dict shortens it for short leases
    # about the longest one call spends posting READs; the rest of a large request is posted
    # by the following get_finished calls (kvrdma.posting). 0, or num_threads 0 (NIXL then
    # copies inside the post): every request whole at once
    post_budget: float = defaults.POST_BUDGET_SECONDS
    handshake_timeout: float = defaults.HANDSHAKE_TIMEOUT_SECONDS
    handshake_retries: int = defaults.HANDSHAKE_RETRIES
    hugepages: str = defaults.HUGEPAGES
    # per-block checksums at hold, checked after each READ (kvrdma.integrity); off: no cost
    integrity_checksums: bool = False
    # vLLM's D->P (bidirectional) settings: validated and kept for the connector.
    kv_recompute_threshold: int = 64
    decoder_kv_blocks_ttl: float = 480.0
    # the vLLM connector removes a remote engine unused for this long (0: never)
    engine_ttl: float = 3600.0
    # "push": producers WRITE into the blocks decoders expect (docs/push.md); a decoder waits
    # `push_registration_timeout` for a pushed request (None: `decoder_kv_blocks_ttl`)
    transfer_mode: str = "pull"
    push_registration_timeout: float | None = None
    # sidecar mode: the ZMQ address workers publish their metadata to (`kvrdma agent`)
    publish_address: str | None = None
    other: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)

    @classmethod
    def from_dict(cls, raw: object, path: str = _EXTRA) -> ExtraConfig:
        if raw is MISSING or raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise bad_value(path, "a JSON object", raw)
        for key in raw:
            if not isinstance(key, str):
                raise ConfigError(f"{path}: keys must be strings, got {show(key)}")
        values = {
            key: check(f"{path}.{key}", raw[key])
            for key, check in _EXTRA_CHECKS.items()
            if get_value(raw, key) is not MISSING or (key in _NULL_IS_A_VALUE and key in raw)
        }
        lease = values.get("kv_lease_duration", defaults.KV_LEASE_SECONDS)
        if "read_deadline" not in values:
            values["read_deadline"] = defaults.read_deadline_for(lease)
        elif values["read_deadline"] >= lease:
            raise ConfigError(
                f"{path}.read_deadline: expected a number of seconds > 0 and < "
                f"kv_lease_duration ({lease:g}), got {show(raw['read_deadline'])} (a READ "
                "must end before the producer's lease frees its blocks)"
            )
        _check_attempts(path, values)
        other = {k: v for k, v in raw.items() if k not in _EXTRA_CHECKS and k not in _VETTED}
        for key in other:
            logger.warning(
                "%s: unknown key %r kept but not used by kvrdma (kvrdma reads: %s)",
                path,
                key,
                ", ".join(_EXTRA_CHECKS),
            )
        return cls(**values, other=MappingProxyType(dict(other)))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.other)
        out.update((key, getattr(self, key)) for key in _EXTRA_CHECKS)
        out["backends"] = list(self.backends)
        return out


def _backends(path: str, value: object) -> tuple[str, ...]:
    expected = 'a non-empty list of backend names (e.g. ["UCX"])'
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise bad_value(path, expected, value)
    return tuple(
        check_str(f"{path}[{i}]", name, "a non-empty backend name") for i, name in enumerate(value)
    )


_SECONDS = "a number of seconds > 0"
_TIMEOUT = f"a number of seconds in (0, {defaults.MAX_HANDSHAKE_TIMEOUT:g}]"


def _check_attempts(path: str, values: Mapping[str, Any]) -> None:
    """Refuse retries that cut `handshake_timeout` into attempts too short to be answered."""
    timeout = values.get("handshake_timeout", defaults.HANDSHAKE_TIMEOUT_SECONDS)
    retries = values.get("handshake_retries", defaults.HANDSHAKE_RETRIES)
    attempts = int(round(timeout / defaults.MIN_HANDSHAKE_ATTEMPT_SECONDS, 6))
    most = min(defaults.MAX_HANDSHAKE_RETRIES, max(0, attempts - 1))
    if retries > most:
        raise ConfigError(
            f"{path}.handshake_retries: expected an integer in 0..{most} with handshake_timeout "
            f"{timeout:g} (each of the 1 + handshake_retries attempts needs at least "
            f"{defaults.MIN_HANDSHAKE_ATTEMPT_SECONDS:g} s), got {show(retries)}"
        )


_EXTRA_CHECKS: Final[dict[str, Callable[[str, Any], Any]]] = {
    "backends": _backends,
    "num_threads": lambda p, v: check_int(p, v, lo=0, hi=defaults.MAX_NUM_THREADS),
    "kv_lease_duration": check_lease_duration,
    "enforce_handshake_compat": config_vllm.truthy,
    "enable_cross_layers_blocks": lambda p, v: check_bool(p, v, strings=True),
    "read_deadline": lambda p, v: check_number(p, v, _SECONDS, positive=True),
    "post_budget": lambda p, v: check_number(p, v, "a number of seconds >= 0", positive=False),
    "handshake_timeout": lambda p, v: check_number(
        p, v, _TIMEOUT, positive=True, most=defaults.MAX_HANDSHAKE_TIMEOUT
    ),
    "handshake_retries": lambda p, v: check_int(p, v, 0, defaults.MAX_HANDSHAKE_RETRIES),
    "hugepages": lambda p, v: check_choice(p, v, HUGEPAGE_MODES),
    "integrity_checksums": lambda p, v: check_bool(p, v, strings=True),
    "kv_recompute_threshold": lambda p, v: config_vllm.lax_int(p, v, 0, 2**31 - 1),
    "decoder_kv_blocks_ttl": lambda p, v: check_number(p, v, _SECONDS, positive=True),
    # vLLM's meaning: 0 never drops an idle engine
    "engine_ttl": lambda p, v: check_number(p, v, "a number of seconds >= 0", positive=False),
    "transfer_mode": lambda p, v: check_choice(p, v, ("pull", "push")),
    "push_registration_timeout": lambda p, v: check_number(p, v, _SECONDS, positive=True),
    "publish_address": lambda p, v: check_str(p, v, "a ZMQ address (e.g. ipc:///run/pub.sock)"),
}
# vLLM reads this key with `.get(key, True)`: an explicit null is a (false) value there too.
_NULL_IS_A_VALUE: Final = frozenset({"enforce_handshake_compat"})
# Keys config_vllm has vetted (only their pull/one-way values get this far): not "unknown".
_VETTED: Final = frozenset({"bidirectional_kv_xfer"})


# --- the whole kv_transfer_config ----------------------------------------------------------


_TOP_CHECKS: Final[dict[str, Callable[[str, Any], Any]]] = {
    "kv_buffer_device": lambda p, v: check_choice(p, v, BUFFER_DEVICES),
    "kv_buffer_size": lambda p, v: check_number(p, v, "a number of bytes >= 0", positive=False),
    "kv_rank": lambda p, v: check_int(p, v, lo=0),
    "kv_parallel_size": lambda p, v: check_int(p, v, lo=1),
    "kv_ip": check_str,
    "kv_port": lambda p, v: config_vllm.lax_int(p, v, 1, 65535),
    "kv_connector_module_path": lambda p, v: check_str(p, v, "a non-empty module path"),
    "enable_permute_local_kv": config_vllm.lax_bool,
    "kv_load_failure_policy": lambda p, v: check_choice(p, v, FAILURE_POLICIES),
}
_TOP_KEYS: Final = ("kv_connector", "kv_role", "engine_id", *_TOP_CHECKS, _EXTRA)


@dataclass(frozen=True)
class KVTransferConfig:
    """A validated `--kv-transfer-config` plus the side-channel address from the environment."""

    kv_connector: str
    kv_role: Role
    engine_id: str
    kv_buffer_device: str = "cuda"
    kv_buffer_size: float = 1e9
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_module_path: str | None = None
    enable_permute_local_kv: bool = False
    kv_load_failure_policy: FailurePolicy = "fail"
    extra: ExtraConfig = field(default_factory=ExtraConfig)
    side_channel_host: str = defaults.SIDE_CHANNEL_HOST
    side_channel_base_port: int = defaults.SIDE_CHANNEL_PORT
    # Every child's kv_connector when this config was taken out of a MultiConnector.
    multi_connector_children: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def from_dict(
        cls, raw: Mapping[str, Any], *, environ: Mapping[str, str] | None = None
    ) -> KVTransferConfig:
        """Validate a decoded `kv_transfer_config` object; `environ` defaults to os.environ."""
        if not isinstance(raw, Mapping):
            raise bad_value(_ROOT, "a JSON object", raw)
        raw, children = config_vllm.select_connector(raw)
        check_keys(_ROOT, raw, _TOP_KEYS)
        mode = config_vllm.transfer_mode_of(raw)
        values: dict[str, Any] = {"multi_connector_children": children}

        values["kv_connector"] = check_choice(
            "kv_connector", get_value(raw, "kv_connector"), CONNECTOR_NAMES
        )
        values["kv_role"] = check_choice("kv_role", get_value(raw, "kv_role"), ROLES)
        engine_id = get_value(raw, "engine_id")
        values["engine_id"] = (
            str(uuid.uuid4()) if engine_id is MISSING else check_str("engine_id", engine_id)
        )
        longest = defaults.MAX_ENGINE_ID_LENGTH
        if len(values["engine_id"]) > longest:  # no peer could request it
            raise bad_value("engine_id", f"at most {longest} characters", engine_id)
        for key, check in _TOP_CHECKS.items():
            value = get_value(raw, key)
            if value is not MISSING:
                values[key] = check(key, value)
        values["extra"] = ExtraConfig.from_dict(get_value(raw, _EXTRA))
        if mode is not None:
            values["extra"] = replace(values["extra"], transfer_mode=mode)
        host, port = _side_channel(os.environ if environ is None else environ)
        return cls(**values, side_channel_host=host, side_channel_base_port=port)

    @property
    def is_producer(self) -> bool:
        """True for kv_producer and kv_both: this engine serves KV blocks to readers."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """True for kv_consumer and kv_both: this engine reads KV blocks from producers."""
        return self.kv_role in ("kv_consumer", "kv_both")

    def side_channel_port(self, dp_index: int = 0) -> int:
        """The handshake port of data-parallel rank `dp_index`: base port + dp_index."""
        index = check_int("dp_index", dp_index, lo=0)
        port = self.side_channel_base_port + index
        if port > 65535:
            raise ConfigError(
                f"dp_index: expected an integer in 0..{65535 - self.side_channel_base_port} "
                f"({ENV_SIDE_CHANNEL_PORT}={self.side_channel_base_port} + dp_index must be "
                f"<= 65535), got {index}"
            )
        return port

    def to_dict(self) -> dict[str, Any]:
        """The config as vLLM-shaped JSON-ready data (environment values not included)."""
        out = {key: getattr(self, key) for key in _TOP_KEYS if key != _EXTRA}
        out[_EXTRA] = self.extra.to_dict()
        return out

    def describe(self) -> str:
        """Human-readable lines `key = value`, the side channel included."""
        lines = [f"{k} = {v!r}" for k, v in self.to_dict().items() if k != _EXTRA]
        lines += [f"{_EXTRA}.{k} = {v!r}" for k, v in self.extra.to_dict().items()]
        lines.append(f"side_channel_host = {self.side_channel_host!r}")
        lines.append(f"side_channel_base_port = {self.side_channel_base_port!r}")
        if self.multi_connector_children:
            lines.append(f"multi_connector_children = {list(self.multi_connector_children)!r}")
        return "\n".join(lines)


def _side_channel(environ: Mapping[str, str]) -> tuple[str, int]:
    host = environ.get(ENV_SIDE_CHANNEL_HOST, defaults.SIDE_CHANNEL_HOST)
    check_str(ENV_SIDE_CHANNEL_HOST, host, "a non-empty host name or address")
    raw_port = environ.get(ENV_SIDE_CHANNEL_PORT)
    if raw_port is None:
        return host, defaults.SIDE_CHANNEL_PORT
    text = raw_port.strip()
    port = int(text) if text.isascii() and text.isdigit() else None
    if port is None or not 1 <= port <= 65535:
        raise bad_value(ENV_SIDE_CHANNEL_PORT, "an integer in 1..65535", raw_port)
    return host, port


def load_kv_transfer_config(
    source: str | os.PathLike[str] | Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
) -> KVTransferConfig:
    """Parse `--kv-transfer-config`: a JSON string, a path to a JSON file, or a dict.

    A string whose first non-blank character is `{` is JSON; any other string is a path.
    """
    if isinstance(source, Mapping):
        raw: object = source
    elif isinstance(source, os.PathLike):
        raw = _read_json_file(Path(source))
    elif isinstance(source, str):
        if source.lstrip().startswith("{"):
            raw = _decode_json(source, "string")
        elif not source.strip():
            raise bad_value(_ROOT, "a JSON string, a path to a JSON file or a dict", source)
        else:
            raw = _read_json_file(Path(source))
    else:
        raise bad_value(_ROOT, "a JSON string, a path to a JSON file or a dict", source)
    if not isinstance(raw, Mapping):
        raise bad_value(_ROOT, "a JSON object", raw)
    return KVTransferConfig.from_dict(raw, environ=environ)


def _read_json_file(path: Path) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{_ROOT}: no such file: '{path}'") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{_ROOT}: cannot read '{path}': {exc}") from None
    return _decode_json(text, f"'{path}'")


def _decode_json(text: str, where: str) -> object:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise ConfigError(f"{_ROOT}: duplicate key {key!r} in JSON {where}")
            out[key] = value
        return out

    def constant(name: str) -> object:
        raise ConfigError(f"{_ROOT}: non-finite number {name} in JSON {where} (not valid JSON)")

    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{_ROOT}: invalid JSON in {where} at line {exc.lineno} column {exc.colno} "
            f"(char {exc.pos}): {exc.msg}"
        ) from None


# --- per-request kv_transfer_params --------------------------------------------------------

_PARAM_KEYS: Final = (
    "do_remote_prefill",
    "do_remote_decode",
    "remote_engine_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "remote_request_id",
    "tp_size",
)


@dataclass(frozen=True)
class KVTransferParams:
    """A request's `kv_transfer_params`; `remote_block_ids` holds one tuple per KV-cache group.

    A flat list of block ids (older vLLM) becomes a single group. Keys kvrdma does not read
    (vLLM adds e.g. `dcp_size`, `remote_blocks_expiry_time`) are kept in `other`.
    """

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: tuple[tuple[int, ...], ...] = ()
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    tp_size: int = 1
    other: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> KVTransferParams:
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise bad_value(_PARAMS, "a JSON object", raw)
        for key in raw:
            if not isinstance(key, str):
                raise ConfigError(f"{_PARAMS}: keys must be strings, got {show(key)}")
        values: dict[str, Any] = {}
        for key in ("do_remote_prefill", "do_remote_decode"):
            flag = get_value(raw, key)
            if flag is not MISSING:
                values[key] = check_bool(f"{_PARAMS}.{key}", flag)
        for key in ("remote_engine_id", "remote_host", "remote_request_id"):
            text = get_value(raw, key)
            if text is not MISSING:
                values[key] = check_str(f"{_PARAMS}.{key}", text)
        port = get_value(raw, "remote_port")
        if port is not MISSING:
            values["remote_port"] = check_int(f"{_PARAMS}.remote_port", port, lo=1, hi=65535)
        tp_size = get_value(raw, "tp_size")
        if tp_size is not MISSING:
            values["tp_size"] = check_int(
                f"{_PARAMS}.tp_size", tp_size, lo=1, hi=defaults.MAX_TP_SIZE
            )
        blocks = get_value(raw, "remote_block_ids")
        if blocks is not MISSING:
            values["remote_block_ids"] = _block_groups(f"{_PARAMS}.remote_block_ids", blocks)
        other = MappingProxyType({k: v for k, v in raw.items() if k not in _PARAM_KEYS})
        params = cls(**values, other=other)
        if params.needs_read:
            for key in _REMOTE_ENDPOINT_KEYS:
                if getattr(params, key) is None:
                    raise ConfigError(
                        f"{_PARAMS}.{key}: required when do_remote_prefill is true and "
                        f"remote_block_ids is non-empty, got {show(raw.get(key, MISSING))}"
                    )
        return params

    @property
    def needs_read(self) -> bool:
        """True when this request must pull blocks from a remote prefill engine."""
        return self.do_remote_prefill and any(self.remote_block_ids)

    @property
    def num_remote_blocks(self) -> int:
        return sum(len(group) for group in self.remote_block_ids)

    def to_dict(self) -> dict[str, Any]:
        """vLLM-shaped data: block ids as a list of per-group lists, absent fields omitted."""
        out: dict[str, Any] = dict(self.other)
        out["do_remote_prefill"] = self.do_remote_prefill
        out["do_remote_decode"] = self.do_remote_decode
        out["remote_block_ids"] = [list(group) for group in self.remote_block_ids]
        for key in ("remote_engine_id", "remote_host", "remote_port", "remote_request_id"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        out["tp_size"] = self.tp_size
        return out


def _block_groups(path: str, value: object) -> tuple[tuple[int, ...], ...]:
    expected = "a list of block ids, or a list of such lists (one per KV-cache group)"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise bad_value(path, expected, value)
    if not value:
        return ()
    if isinstance(value[0], Sequence) and not isinstance(value[0], (str, bytes)):
        return tuple(_block_list(f"{path}[{i}]", group) for i, group in enumerate(value))
    return (_block_list(path, value),)


def _block_list(path: str, value: object) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise bad_value(path, "a list of block ids", value)
    return tuple(
        check_int(f"{path}[{i}]", block, lo=0)
        for i, block in enumerate(cast(Sequence[object], value))
    )
