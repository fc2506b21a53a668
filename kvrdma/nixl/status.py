"""Reading a posted transfer's state as NIXL's `check_xfer_state` does, for less per call.

`nixl_agent.check_xfer_state` asks the binding for the status, then compares it with two
status constants looked up on every call. `state_check` makes the same call and comparisons
on a bound method and constants looked up once per agent; where the installed nixl has no
such binding (another version, a stand-in agent) it returns `check_xfer_state` itself.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

__all__ = ["state_check"]


def state_check(agent: Any) -> Callable[[Any], str]:
    """A function of a NIXL transfer handle answering as `agent.check_xfer_state` does:
    "PROC", "DONE" or "ERR". It holds the agent's binding: drop it with the agent."""
    try:
        status = agent.agent.getXferStatus
        binding = sys.modules[type(agent.agent).__module__]
        in_prog, done = binding.NIXL_IN_PROG.value, binding.NIXL_SUCCESS.value
    except (AttributeError, KeyError):
        fallback: Callable[[Any], str] = agent.check_xfer_state
        return fallback

    def check(handle: Any) -> str:
        # the handle's integer is read afresh each call: it is never kept past its release
        state = status(handle._handle).value  # an int compares faster than the enum
        if state == in_prog:
            return "PROC"
        return "DONE" if state == done else "ERR"

    return check
