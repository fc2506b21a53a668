"""vLLM 0.32's reading of `--kv-transfer-config`, for the keys whose meaning is not plain JSON.

vLLM builds its `KVTransferConfig` with pydantic in lax mode (``"kv_port": "14580"`` is the
integer 14580, ``"enable_permute_local_kv": "yes"`` is true) and its Nixl connectors read
`kv_connector_extra_config` with Python truthiness (``"enforce_handshake_compat": "false"``
is true). `kvrdma.config` calls these helpers so that a config vLLM accepts means the same
here, and a config kvrdma cannot honour (D→P transfers) is refused by name.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from kvrdma.config_checks import bad_value
from kvrdma.errors import ConfigError

__all__ = [
    "MULTI_CONNECTOR",
    "PULL_CONNECTORS",
    "PUSH_CONNECTORS",
    "lax_bool",
    "lax_int",
    "select_connector",
    "transfer_mode_of",
    "truthy",
]

logger = logging.getLogger(__name__)

# The names vLLM 0.32 loads its pull-mode NixlConnector under, plus kvrdma's own class
# (which pulls or pushes as `transfer_mode` says).
PULL_CONNECTORS: Final = ("NixlConnector", "NixlPullConnector", "KvrdmaConnector")
PUSH_CONNECTORS: Final = ("NixlPushConnector",)
MULTI_CONNECTOR: Final = "MultiConnector"
KVRDMA_MODULE: Final = "kvrdma.vllm"

_EXTRA = "kv_connector_extra_config"
# pydantic's lax str -> bool table (case-insensitive, no surrounding blanks).
_TRUE_WORDS: Final = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_WORDS: Final = frozenset({"0", "off", "f", "false", "n", "no"})
_INT_TEXT: Final = re.compile(r"\s*[+-]?[0-9]+(\.0*)?\s*", re.ASCII)


def lax_bool(path: str, value: object) -> bool:
    """A boolean as pydantic reads one: true/false, 0/1, or yes/no/on/off/t/f/y/n words."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE_WORDS | _FALSE_WORDS:
        return value.lower() in _TRUE_WORDS
    raise bad_value(path, 'a boolean (true/false, 0/1, "yes"/"no", "on"/"off")', value)


def lax_int(path: str, value: object, lo: int, hi: int) -> int:
    """An integer in lo..hi as pydantic reads one: also `14580.0` and the string `"14580"`."""
    expected = f"an integer in {lo}..{hi} (a number or a string of digits)"
    number: int | None = None
    if isinstance(value, bool):
        number = None  # JSON true is not a port, whatever pydantic makes of it
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and _INT_TEXT.fullmatch(value):
        number = int(float(value)) if "." in value else int(value)
    if number is None or not lo <= number <= hi:
        raise bad_value(path, expected, value)
    return number


def truthy(path: str, value: object) -> bool:
    """Python truthiness, as vLLM's Nixl connector tests `if extra.get(key):`.

    A value that is not a JSON boolean is logged, since ``"false"`` then means true.
    """
    flag = bool(value)
    if not isinstance(value, bool):
        logger.warning(
            "%s: %r is not a JSON boolean; read as %s, as vLLM does (any non-empty string "
            "is true); write %s to say it plainly",
            path,
            value,
            str(flag).lower(),
            str(flag).lower(),
        )
    return flag


def select_connector(raw: Mapping[str, Any]) -> tuple[Mapping[str, Any], tuple[str, ...]]:
    """The config kvrdma serves and, for a `MultiConnector`, the names of all its children.

    vLLM builds each child's `KVTransferConfig` from the child's own keys plus the parent's
    `engine_id`, while its scheduler applies the parent's `kv_load_failure_policy`: the
    extracted config takes the same values.
    """
    if raw.get("kv_connector") != MULTI_CONNECTOR:
        return raw, ()
    extra = raw.get(_EXTRA)
    children = extra.get("connectors") if isinstance(extra, Mapping) else None
    path = f"{_EXTRA}.connectors"
    if isinstance(children, (str, bytes)) or not isinstance(children, Sequence) or not children:
        raise bad_value(path, "a non-empty list of child connector configs", children)
    names = []
    for i, child in enumerate(children):
        if not isinstance(child, Mapping):
            raise bad_value(f"{path}[{i}]", "a JSON object (a child kv_transfer_config)", child)
        names.append(str(child.get("kv_connector")))
    ours = [i for i, name in enumerate(names) if name in PULL_CONNECTORS + PUSH_CONNECTORS]
    if len(ours) != 1:
        raise ConfigError(
            f"{path}: expected exactly one child whose kv_connector is one of "
            f"{', '.join(PULL_CONNECTORS + PUSH_CONNECTORS)} (the one kvrdma serves), got "
            f"{len(ours)} among {names}"
        )
    child = dict(children[ours[0]])
    for key in ("engine_id", "kv_load_failure_policy"):
        parent_value = raw.get(key)
        if parent_value is None:
            continue
        if key == "kv_load_failure_policy" and child.get(key, parent_value) != parent_value:
            logger.warning(
                "%s[%d].%s=%r is ignored: vLLM's scheduler applies the MultiConnector's %r",
                path,
                ours[0],
                key,
                child[key],
                parent_value,
            )
            child[key] = parent_value
        child.setdefault(key, parent_value)
    logger.info(
        "kv_connector MultiConnector: kvrdma serves its child %d (%s); the other children "
        "(%s) are vLLM's own",
        ours[0],
        names[ours[0]],
        ", ".join(n for i, n in enumerate(names) if i != ours[0]) or "none",
    )
    return child, tuple(names)


def transfer_mode_of(raw: Mapping[str, Any]) -> str | None:
    """The transfer mode the connector named in `raw` implies ("push" for vLLM's push
    connector), refusing what kvrdma cannot do (D→P transfers) or would do differently from
    vLLM (a pull connector told to push); None: as `kv_connector_extra_config` says."""
    name = raw.get("kv_connector")
    if name == "KvrdmaConnector" and raw.get("kv_connector_module_path") is None:
        logger.warning(
            "kv_connector KvrdmaConnector without kv_connector_module_path: vLLM loads it "
            "only with kv_connector_module_path %r",
            KVRDMA_MODULE,
        )
    extra = raw.get(_EXTRA)
    extra = extra if isinstance(extra, Mapping) else {}
    bidirectional = extra.get("bidirectional_kv_xfer")
    if bidirectional is not None and truthy(f"{_EXTRA}.bidirectional_kv_xfer", bidirectional):
        raise ConfigError(
            f"{_EXTRA}.bidirectional_kv_xfer is refused: kvrdma moves KV blocks from prefill "
            f"to decode only (D→P transfers are not implemented); got {bidirectional!r}"
        )
    mode = extra.get("transfer_mode")
    if name in PUSH_CONNECTORS:
        if mode not in (None, "push"):
            raise bad_value(f"{_EXTRA}.transfer_mode", f"'push' (kv_connector is {name})", mode)
        return "push"
    if mode == "push" and name != "KvrdmaConnector":
        raise ConfigError(
            f"{_EXTRA}.transfer_mode is refused: 'push' with kv_connector {name!r}, which "
            "vLLM runs in pull mode; name KvrdmaConnector or NixlPushConnector to push"
        )
    return None
