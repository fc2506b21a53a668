"""`kvrdma agent` as a process on a testbed host, the way a pod runs its sidecar.

The agent binds its side channel on the host's address (peers on other hosts handshake
there) and its publish socket on the host's loopback (only the engine's own ranks, on the
same host, publish to it).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time

from kvrdma.errors import KvrdmaError
from kvrdma.testing.netns import Host

__all__ = ["SidecarProcess"]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies, so a
    killed test run leaves no agent behind (its namespace is swept by the next run)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class SidecarProcess:
    """A running `kvrdma agent` for engine `engine_id` inside `host`'s namespace."""

    def __init__(
        self, host: Host, engine_id: str, *, ranks: int, log: str = "", timeout: float = 60.0
    ) -> None:
        config = json.dumps(
            {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": engine_id}
        )
        argv = ["ip", "netns", "exec", host.netns, sys.executable, "-m", "kvrdma", "agent"]
        argv += ["--config", config, "--host", host.address, "--port", "0", "--http-port", "0"]
        argv += ["--publish", "tcp://127.0.0.1:0", "--expected-ranks", str(ranks)]
        self.host = host
        self._log = log
        # stdout carries only the "listening" line; the logs go to `log` (nobody drains a pipe)
        with open(log or os.devnull, "ab") as err:
            self._proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        try:
            endpoints = self._await_listening(timeout)
        except BaseException:
            self.close()
            raise
        self.port = int(endpoints["side_channel"].rsplit(":", 1)[1])
        self.publish_address: str = endpoints["publish"]

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _await_listening(self, timeout: float) -> dict[str, str]:
        """The agent's "listening" line; its output is read raw (a buffered reader would hide
        a line from select)."""
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        end = time.monotonic() + timeout
        buf = b""
        while True:
            *lines, buf = buf.split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError):
                    msg = json.loads(line)
                    if isinstance(msg, dict) and msg.get("event") == "listening":
                        return msg
            left = end - time.monotonic()
            if left <= 0 or self._proc.poll() is not None:
                raise KvrdmaError(
                    f"kvrdma agent on {self.host.netns} not listening within {timeout:g} s "
                    f"(exit code {self._proc.poll()}); output: {buf[-2000:]!r}; log: {self._log!r}"
                )
            if select.select([fd], [], [], min(left, 0.2))[0]:
                chunk = os.read(fd, 65536)
                buf += chunk if chunk else b""

    def close(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; idempotent."""
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(grace)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
