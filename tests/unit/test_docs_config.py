"""docs/config.md names exactly the keys and environment variables kvrdma reads, with their
defaults and bounds as the code has them."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvrdma import config, defaults
from kvrdma.config import ExtraConfig, KVTransferConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "config.md"
PACKAGE = ROOT / "kvrdma"
_SECTIONS = {
    "top": "## `kv_transfer_config`",
    "extra": "## `kv_connector_extra_config`",
    "env": "## Environment",
}
# upper-case strings in kvrdma that look like environment variables but are wire names
_NOT_ENVIRONMENT = {"KVRDMA_HASH", "NIXL_INIT_AGENT", "VLLM_GET_META"}
_ENV_NAME = re.compile(r"^(KVRDMA|VLLM|UCX|NIXL|GLIBC)_[A-Z0-9_]+$")
# defaults the doc states in words: computed at load, or keys with no value of their own
_PROSE_DEFAULTS = {
    "top": {"kv_connector", "kv_role", "engine_id"},
    "extra": {"num_threads", "read_deadline", "connectors", "bidirectional_kv_xfer"},
}


def _rows(section: str) -> dict[str, list[str]]:
    """The table under `section`'s heading: first cell's key -> the row's cells."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(_SECTIONS[section] + "\n")
    end = text.find("\n## ", start + 1)
    rows: dict[str, list[str]] = {}
    for line in text[start : end if end > 0 else None].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        key = re.fullmatch(r"`([A-Za-z0-9_]+)`", cells[0]) if line.startswith("|") else None
        if key:
            assert key[1] not in rows, f"docs/config.md: {key[1]} is listed twice"
            rows[key[1]] = cells
    return rows


def _extra_keys_read_in_code() -> set[str]:
    """`extra.get("key")` and `extra.other.get("key")` anywhere in kvrdma: keys read past
    `ExtraConfig`'s checks (e.g. by config_vllm before them)."""
    keys = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and re.search(r"\bextra(\.other)?$", ast.unparse(node.func.value))
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                keys.add(node.args[0].value)
    return keys


def _environment_in_code() -> set[str]:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            value = node.value if isinstance(node, ast.Constant) else None
            if isinstance(value, str) and _ENV_NAME.match(value) and value not in _NOT_ENVIRONMENT:
                names.add(value)
    return names


READ_KEYS: dict[str, set[str]] = {
    "top": set(config._TOP_KEYS),
    "extra": set(config._EXTRA_CHECKS) | _extra_keys_read_in_code(),
    "env": _environment_in_code(),
}


@pytest.mark.parametrize("section", list(_SECTIONS))
def test_doc_lists_exactly_what_kvrdma_reads(section: str) -> None:
    documented = set(_rows(section))
    assert not READ_KEYS[section] - documented, "read by kvrdma, missing from docs/config.md"
    assert not documented - READ_KEYS[section], "in docs/config.md, not read by kvrdma"


def test_code_scans_find_what_they_look_for() -> None:
    """The scans behind the check above see the keys and variables known to be read there."""
    assert {"connectors", "bidirectional_kv_xfer"} <= _extra_keys_read_in_code()
    assert {config.ENV_SIDE_CHANNEL_PORT, defaults.ENV_METRICS_PORT} <= _environment_in_code()


def _actual_defaults(section: str) -> dict[str, Any]:
    if section == "extra":
        return ExtraConfig().to_dict()
    return {f.name: f.default for f in dataclasses.fields(KVTransferConfig)}


@pytest.mark.parametrize("section", ["top", "extra"])
def test_documented_defaults_are_the_codes(section: str) -> None:
    actual = _actual_defaults(section)
    for key, cells in _rows(section).items():
        literal = re.fullmatch(r"`([^`]+)`", cells[2])
        if key in _PROSE_DEFAULTS[section]:
            assert literal is None, f"{key}: a literal default, expected words"
            continue
        assert literal, f"{key}: default {cells[2]!r} is not a `JSON` literal"
        value = json.loads(literal[1])
        if key == "kv_connector_extra_config":  # the default holds every key's default
            assert ExtraConfig.from_dict(value) == ExtraConfig()
        else:
            assert value == actual[key], f"{key}: docs/config.md says {literal[1]}"


def test_documented_computed_defaults_and_bounds_are_the_codes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    extra, top, env = _rows("extra"), _rows("top"), _rows("env")
    monkeypatch.setattr(defaults.os, "sched_getaffinity", lambda pid: set(range(1024)))
    assert extra["num_threads"][2] == f"one per usable CPU, at most {defaults.ucx_num_threads()}"
    lease_share = round(1 / defaults.READ_DEADLINE_LEASE_FRACTION)
    assert extra["read_deadline"][2] == (
        f"min({defaults.READ_DEADLINE_SECONDS:g}, `kv_lease_duration` / {lease_share})"
    )
    assert extra["num_threads"][3] == f"0..{defaults.MAX_NUM_THREADS}"
    assert extra["handshake_timeout"][3] == f"(0, {defaults.MAX_HANDSHAKE_TIMEOUT:g}]"
    floor = defaults.MIN_HANDSHAKE_ATTEMPT_SECONDS
    assert extra["handshake_retries"][3].startswith(
        f"0..{defaults.MAX_HANDSHAKE_RETRIES}, and at most `handshake_timeout` / {floor:g} − 1"
    )
    assert f"at most {defaults.MAX_ENGINE_ID_LENGTH} characters" in top["engine_id"][3]
    assert env[config.ENV_SIDE_CHANNEL_HOST][1] == f'`"{defaults.SIDE_CHANNEL_HOST}"`'
    assert env[config.ENV_SIDE_CHANNEL_PORT][1] == f"`{defaults.SIDE_CHANNEL_PORT}`"
