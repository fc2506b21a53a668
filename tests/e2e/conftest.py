"""Generic e2e fixtures: free ports, background processes, and a real Prometheus server.

`start_prometheus(targets, rule_files)` runs Debian's `prometheus` on 127.0.0.1 with a
1-second scrape and rule-evaluation interval and a storage directory under `tmp_path`;
`start_process(cmd)` runs a command in the background. Both are always stopped at teardown
(terminate, then kill). `unused_tcp_port` and `wait_for(what, ready, timeout)` help with the
rest. Tests needing `prometheus`/`promtool` skip when they are missing (`make sysdeps`
installs them).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

# below the ephemeral range: no bind to port 0 takes a port handed out here before it is bound
from kvrdma.testing import free_port

ROOT = Path(__file__).resolve().parents[2]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def wait_until(what: str, ready: Callable[[], bool], timeout: float, interval: float = 0.2) -> None:
    """Poll `ready` until it returns True, or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ready():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"`{name}` not installed (Debian package prometheus; run `make sysdeps`)")
    return path


@pytest.fixture
def unused_tcp_port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def wait_for() -> Callable[..., None]:
    """`wait_for(what, ready, timeout)`: poll `ready()` until True or fail the test."""
    return wait_until


@pytest.fixture(scope="session")
def promtool() -> str:
    return _binary("promtool")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return _binary("prometheus")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def start_process(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start `cmd` in the background (output to a log under tmp_path); stopped at teardown."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(cmd: Sequence[str], *, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = tmp_path / f"process-{len(procs)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                list(cmd),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
            )
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            _stop(proc)


class Prometheus:
    """A running Prometheus server and a small client for its HTTP API."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"
        self.log = log

    get = staticmethod(http_get)

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        status, body = http_get(url)
        doc = json.loads(body)
        if status != 200 or doc.get("status") != "success":
            raise AssertionError(f"GET {url} -> {status}: {doc.get('error', body[:300])}")
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the result as a list of {metric, value} (scalars wrapped)."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def has_data(self, expr: str) -> bool:
        """True when `expr` returns at least one sample with a finite value."""
        return any(math.isfinite(float(r["value"][1])) for r in self.query(expr))

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture
def start_prometheus(tmp_path: Path, prometheus_binary: str) -> Iterator[Callable[..., Prometheus]]:
    """Start Prometheus scraping `targets` (host:port) every second with `rule_files` loaded."""
    started: list[Prometheus] = []

    def start(targets: Sequence[str], rule_files: Sequence[Path] = ()) -> Prometheus:
        port = free_port()
        workdir = tmp_path / f"prometheus-{len(started)}"
        workdir.mkdir()
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [str(p.resolve()) for p in rule_files],
            "scrape_configs": [{"job_name": "kvrdma",
                                "static_configs": [{"targets": list(targets)}]}],
        }  # fmt: skip
        config_file = workdir / "prometheus.yml"
        config_file.write_text(json.dumps(config, indent=2))  # JSON is YAML
        log = workdir / "prometheus.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    prometheus_binary,
                    f"--config.file={config_file}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )
        server = Prometheus(proc, port, log)
        started.append(server)

        def ready() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited with {proc.returncode}:\n{server.log_tail()}")
            return http_get(f"{server.url}/-/ready", timeout=1)[0] == 200

        wait_until("prometheus to be ready", ready, timeout=30)
        return server

    try:
        yield start
    finally:
        for server in started:
            _stop(server.proc)
