"""Typed checks of config values: each returns the value or raises a `ConfigError` naming the path.

Shared by `kvrdma.config` and `kvrdma.config_vllm`, so every bad value reads the same way:
``<path>: expected <what>, got <value>``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

from kvrdma.errors import ConfigError

__all__ = [
    "MISSING",
    "bad_value",
    "check_bool",
    "check_choice",
    "check_int",
    "check_keys",
    "check_number",
    "check_str",
    "get_value",
    "show",
]


class Missing:
    """The type of `MISSING`: a key that is absent (or JSON null)."""

    def __repr__(self) -> str:
        return "no value"


MISSING: Final = Missing()


def show(value: object) -> str:
    """`repr(value)`, cut to 80 characters for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def bad_value(path: str, expected: str, value: object) -> ConfigError:
    """The error for `value` at `path`, which should have been `expected`."""
    return ConfigError(f"{path}: expected {expected}, got {show(value)}")


def check_int(path: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    """An integer (not a bool) in `lo`..`hi`, either bound optional."""
    if lo is not None and hi is not None:
        expected = f"an integer in {lo}..{hi}"
    elif lo is not None:
        expected = f"an integer >= {lo}"
    else:
        expected = "an integer"
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_value(path, expected, value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad_value(path, expected, value)
    return value


def check_number(
    path: str, value: object, expected: str, *, positive: bool, most: float | None = None
) -> float:
    """A finite number >= 0 (> 0 when `positive`), at most `most` if given; `expected` words
    the error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_value(path, expected, value)
    try:
        number = float(value)
    except OverflowError:  # an int past any float: JSON has no limit on digits
        raise bad_value(path, expected, value) from None
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise bad_value(path, expected, value)
    if most is not None and number > most:
        raise bad_value(path, expected, value)
    return number


def check_bool(path: str, value: object, *, strings: bool = False) -> bool:
    """A JSON boolean, or with `strings` also "true"/"false" in any case."""
    if isinstance(value, bool):
        return value
    if strings and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise bad_value(
        path, 'a boolean (true, false, "true" or "false")' if strings else "a boolean", value
    )


def check_str(path: str, value: object, what: str = "a non-empty string") -> str:
    """A string that is not blank; `what` words the error."""
    if not isinstance(value, str) or not value.strip():
        raise bad_value(path, what, value)
    return value


def check_choice(path: str, value: object, choices: Sequence[str]) -> str:
    """One of `choices`, exactly."""
    if not isinstance(value, str) or value not in choices:
        raise bad_value(path, "one of " + ", ".join(repr(c) for c in choices), value)
    return value


def check_keys(path: str, raw: Mapping[Any, Any], allowed: Sequence[str]) -> None:
    """Refuse a key that is not a string or not `allowed`, suggesting the closest one."""
    for key in raw:
        if not isinstance(key, str):
            raise ConfigError(f"{path}: keys must be strings, got {show(key)}")
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{path}: unknown key {key!r}{hint}; allowed keys: {', '.join(allowed)}"
            )


def get_value(raw: Mapping[str, Any], key: str) -> Any:
    """The value under `key`, with JSON null treated as absent (vLLM's Optional fields)."""
    value = raw.get(key, MISSING)
    return MISSING if value is None else value
