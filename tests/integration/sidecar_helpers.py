"""The `kvrdma agent` that integration tests drive: its configuration, the metadata its ranks
publish, the agent as a real process (`Agent`) or in this process (`in_process_sidecar`), and
reads of its HTTP endpoints."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvrdma.cli.agent import Sidecar, SidecarSettings
from kvrdma.metadata import RegionMeta, WorkerMetadata
from kvrdma.testing import worker_metadata

NOFILE = resource.RLIMIT_NOFILE

HOST = "127.0.0.1"
ENGINE = "prefill-sidecar"
CONFIG = json.dumps(
    {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "engine_id": ENGINE,
        "kv_connector_extra_config": {"enforce_handshake_compat": True},
    }
)
REPO = Path(__file__).resolve().parents[2]


def worker(rank: int, tp: int = 2) -> WorkerMetadata:
    regions = [RegionMeta(0x1000_0000 * (rank + 1) + i * 0x10_0000, 32, 2048) for i in range(2)]
    fields = {"agent_name": f"{ENGINE}-{rank}", "regions": regions, "compat_hash": "d" * 64}
    return worker_metadata(ENGINE, rank, tp, num_blocks=32, **fields)


def agent_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvrdma.cli.agent", *args]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "KVRDMA_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


_KEEPER = """
import sys, time
from kvrdma.handshake.publisher import KeepPublished
from tests.integration.sidecar_helpers import worker
address, tp, every, *ranks = sys.argv[1:]
kept = [
    KeepPublished(lambda r=int(r): worker(r, int(tp)), address, every=float(every)) for r in ranks
]
print("published", flush=True)
time.sleep(120)
"""


def keeping_published(address: str, *ranks: int, tp: int, every: float) -> subprocess.Popen[str]:
    """A process keeping `ranks` of `ENGINE` published to `address` (`KeepPublished`, every
    `every` seconds) until it is killed; returned once they were first published."""
    child = subprocess.Popen(
        [sys.executable, "-c", _KEEPER, address, str(tp), str(every), *map(str, ranks)],
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    if child.stdout.readline().strip() != "published":
        stop(child)
        pytest.fail(f"ranks {ranks} were not published to {address}")
    return child


def stop(child: subprocess.Popen[str]) -> None:
    """Kill `child` (as the OOM killer would) and reap it."""
    child.kill()
    child.communicate(timeout=10)


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.read().decode()


class Agent:
    """`kvrdma agent` as a real process on free ports, expecting ranks 0 and 1 of `ENGINE`;
    `extra` flags follow the others. Its ipc publish socket lies in a directory under
    `tmp_path` that the agent must make itself. `nofile`: the (soft, hard) open-files limit
    it starts with, when given."""

    def __init__(self, tmp_path: Path, *extra: str, nofile: tuple[int, int] | None = None) -> None:
        self.publish = f"ipc://{tmp_path}/shared/kvrdma/publish.sock"  # directory not there yet
        self.proc = subprocess.Popen(
            agent_command(
                "--config",
                CONFIG,
                "--host",
                HOST,
                "--port",
                "0",
                "--http-port",
                "0",
                "--publish",
                self.publish,
                "--expected-ranks",
                "2",
                *extra,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            preexec_fn=None if nofile is None else lambda: resource.setrlimit(NOFILE, nofile),
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 20)
        if not ready:
            self.stop()
            pytest.fail("the agent printed no startup line within 20 s")
        line = self.proc.stdout.readline()
        if not line:
            err = self.stop()
            pytest.fail(f"the agent exited at startup: {err}")
        self.endpoints: dict[str, str] = json.loads(line)
        assert self.endpoints["event"] == "listening"
        self.http = self.endpoints["http"]
        self.side_port = int(self.endpoints["side_channel"].rsplit(":", 1)[1])

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        _, err = self.proc.communicate(timeout=10)
        return err


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` (the agent's, in tests that bound its growth)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@contextlib.contextmanager
def in_process_sidecar(
    worker_metrics: tuple[str, ...] = (), http_host: str = HOST, http_port: int = 0
) -> Iterator[Sidecar]:
    """An agent for one rank of `ENGINE`, in this process, on free ports (HTTP on `http_host`,
    `http_port`), merging the `worker_metrics` endpoints into its /metrics; closed after."""
    settings = SidecarSettings(
        engine_id=ENGINE,
        kv_role="kv_producer",
        enforce_compat=True,
        host=HOST,
        base_port=0,
        dp_index=0,
        http_host=http_host,
        http_port=http_port,
        publish="tcp://127.0.0.1:0",
        expected_ranks=1,
        worker_metrics=worker_metrics,
    )
    sidecar = Sidecar(settings, registry=CollectorRegistry())
    try:
        yield sidecar
    finally:
        sidecar.close()


def crash_handshake_thread(sidecar: Sidecar) -> None:
    """Stop the serving thread the way a crash would, leaving every socket open."""
    sidecar.server._stop.set()
    sidecar.server._thread.join(timeout=5)


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def dry_run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        agent_command("--dry-run", *args),
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env(**env),
    )
