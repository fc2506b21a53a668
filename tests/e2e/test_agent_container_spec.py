"""The agent image as shipped (agent/): its build file, its entrypoint, its example configs,
and `kvrdma agent` started exactly as the manifests' sidecar container spec starts it.

The container-spec test renders deploy/k8s/base, takes each role's `kvrdma-agent` init
container and runs `agent/entrypoint.sh` (the image's ENTRYPOINT) with the container's args
and env, the kubelet's `$(VAR)` expansion applied, and only what a laptop lacks substituted:
loopback for the pod IP and 0.0.0.0, free ports for the side channel and HTTP, a temporary
directory for the shared volume (publish socket and effective config) and the rendered
ConfigMap's content for the mounted config file. It checks /healthz, /readyz (503, then 200
once a worker publishes its rank), /metrics (with an engine rank's /metrics, served where the
pod's `KVRDMA_METRICS_PORT` says, merged in), a peer's handshake on the side channel, and
that SIGTERM ends the agent within a second.

Skips, each with its reason: no kustomize >= 5 renderer (the container-spec test only);
the `kvrdma` command not able to build its parser yet (tests that run the real agent through
the entrypoint, which execs `kvrdma agent`); no shellcheck (the lint test only).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from agent_cli import kvrdma_shim

from kvrdma import defaults
from kvrdma.config import load_kv_transfer_config

ROOT = Path(__file__).resolve().parents[2]
AGENT_DIR = ROOT / "agent"
ENTRYPOINT = AGENT_DIR / "entrypoint.sh"
CONTAINERFILE = AGENT_DIR / "Containerfile"
EXAMPLES = {
    "producer": AGENT_DIR / "examples" / "producer.json",
    "consumer": AGENT_DIR / "examples" / "consumer.json",
    "both": AGENT_DIR / "examples" / "both.json",
}
BASE = ROOT / "deploy" / "k8s" / "base"
MIN_KUSTOMIZE = (5, 0)
TIMEOUT_S = 90  # one subprocess: python start-up and imports on a slow 2-core machine
START_TIMEOUT_S = 60
STOP_LIMIT_S = 1.0  # the contract: SIGTERM ends the agent within a second
MOUNTED_CONFIG = "/etc/kvrdma/kv_transfer_config.json"


# ------------------------------------------------------------------------------ Containerfile
def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Containerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_containerfile_builds_a_non_root_agent_image_from_python_slim() -> None:
    steps = instructions()
    assert steps[0] == ("FROM", "python:3.11-slim")
    runs = [args for word, args in steps if word == "RUN"]
    torch_step = next(i for i, r in enumerate(runs) if "torch==" in r)
    package_step = next(i for i, r in enumerate(runs) if re.search(r"pip install /src\b", r))
    assert torch_step < package_step, "CPU torch must be installed before the package"
    assert "TORCH_INDEX_URL" in runs[torch_step]
    args = {a.split("=")[0]: a.split("=", 1)[1] for w, a in steps if w == "ARG" and "=" in a}
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert "import kvrdma, nixl" in runs[package_step], "the image must import nixl"
    (user,) = [a for w, a in steps if w == "USER"]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    assert any(f"--uid {uid}" in r for r in runs), "the USER uid must exist in the image"
    (entry,) = [a for w, a in steps if w == "ENTRYPOINT"]
    assert json.loads(entry) == ["kvrdma-agent-entrypoint"]
    copies = [a.split() for w, a in steps if w == "COPY"]
    assert any(
        c[-2:] == ["agent/entrypoint.sh", "/usr/local/bin/kvrdma-agent-entrypoint"] for c in copies
    )
    ignore = (AGENT_DIR / "Containerfile.dockerignore").read_text().splitlines()
    assert "*" in ignore, "the context filter must exclude everything not COPYed"
    for copy in copies:
        for source in [c for c in copy[:-1] if not c.startswith("--")]:
            assert (ROOT / source).exists(), f"COPY source {source} is missing (context: repo root)"
            assert f"!{source.rstrip('/')}" in ignore, f"the context filter drops {source}"
    exposed = {int(p) for w, a in steps if w == "EXPOSE" for p in a.split()}
    assert exposed == {defaults.SIDE_CHANNEL_PORT, defaults.AGENT_HTTP_PORT}
    env = " ".join(a for w, a in steps if w == "ENV")
    assert f"KVRDMA_CONFIG_FILE={MOUNTED_CONFIG}" in env
    assert f"chown {uid}:{gid} {defaults.PUBLISH_DIR}" in " ".join(runs)


# ------------------------------------------------------------------------------ entrypoint
def test_entrypoint_is_valid_posix_sh() -> None:
    proc = subprocess.run(
        ["sh", "-n", str(ENTRYPOINT)], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr
    assert os.access(ENTRYPOINT, os.X_OK), "entrypoint.sh must be executable"
    assert ENTRYPOINT.read_text().startswith("#!/bin/sh\n")


def test_entrypoint_passes_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (Debian package shellcheck)")
    proc = subprocess.run(
        [shellcheck, "--shell=sh", str(ENTRYPOINT)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def recording_kvrdma(directory: Path) -> Path:
    """A fake `kvrdma` that prints its arguments as JSON: the entrypoint's logic alone."""
    fake = directory / "kvrdma"
    fake.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" -c '
        "'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n"
    )
    fake.chmod(0o755)
    return directory


def run_entrypoint(
    args: list[str], env: Mapping[str, str], bin_dir: Path
) -> subprocess.CompletedProcess[str]:
    path = f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(
        ["sh", str(ENTRYPOINT), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={"PATH": path, **env},
        cwd=ROOT,
    )


def test_entrypoint_fills_engine_id_and_writes_the_effective_config(tmp_path: Path) -> None:
    bin_dir = recording_kvrdma(tmp_path)
    effective = tmp_path / "run" / "kv_transfer_config.json"
    effective.parent.mkdir()
    env = {
        "KVRDMA_CONFIG_FILE": str(EXAMPLES["consumer"]),
        "KVRDMA_ENGINE_ID": "ignored-the-file-has-one",
        "KVRDMA_EFFECTIVE_CONFIG": str(effective),
        "KVRDMA_LOG_LEVEL": "INFO",
    }
    proc = run_entrypoint(["--expected-ranks", "2"], env, bin_dir)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [
        "--log-level", "INFO", "agent", "--config", str(effective), "--expected-ranks", "2"
    ]  # fmt: skip
    assert json.loads(effective.read_text()) == json.loads(EXAMPLES["consumer"].read_text())
    assert "'decode-0' wins over KVRDMA_ENGINE_ID" in proc.stderr
    assert oct(effective.stat().st_mode & 0o777) == oct(0o644)

    no_id = tmp_path / "no_id.json"
    raw = json.loads(EXAMPLES["producer"].read_text())
    del raw["engine_id"]
    no_id.write_text(json.dumps(raw))
    env = {**env, "KVRDMA_CONFIG_FILE": str(no_id), "KVRDMA_ENGINE_ID": "kvrdma-prefill-5f6b"}
    proc = run_entrypoint([], env, bin_dir)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(effective.read_text()) == {**raw, "engine_id": "kvrdma-prefill-5f6b"}
    assert proc.stderr == ""


def test_entrypoint_config_sources_in_order(tmp_path: Path) -> None:
    bin_dir = recording_kvrdma(tmp_path)
    absent = str(tmp_path / "absent.json")
    inline = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    # an explicit --config wins and nothing is rewritten
    proc = run_entrypoint(
        ["--config", "/x.json", "--dry-run"],
        {"KVRDMA_CONFIG_FILE": str(EXAMPLES["both"]), "KVRDMA_EFFECTIVE_CONFIG": absent},
        bin_dir,
    )
    assert json.loads(proc.stdout) == [
        "--log-level", "WARNING", "agent", "--config", "/x.json", "--dry-run"
    ]  # fmt: skip
    assert not Path(absent).exists()
    # no file: the env JSON, engine id filled in, handed over inline
    proc = run_entrypoint(
        ["--dry-run"],
        {
            "KVRDMA_CONFIG_FILE": absent,
            "KVRDMA_KV_TRANSFER_CONFIG": inline,
            "KVRDMA_ENGINE_ID": "pod-1",
        },
        bin_dir,
    )
    argv = json.loads(proc.stdout)
    assert argv[:4] == ["--log-level", "WARNING", "agent", "--config"]
    assert json.loads(argv[4]) == {**json.loads(inline), "engine_id": "pod-1"}
    # bad JSON goes to the agent unchanged, for its error message with line and column
    proc = run_entrypoint(
        [], {"KVRDMA_CONFIG_FILE": absent, "KVRDMA_KV_TRANSFER_CONFIG": "{oops"}, bin_dir
    )
    assert json.loads(proc.stdout)[3:5] == ["--config", "{oops"]
    # nothing at all: exit 2 naming every place looked at
    proc = run_entrypoint([], {"KVRDMA_CONFIG_FILE": absent}, bin_dir)
    assert proc.returncode == 2
    assert absent in proc.stderr and "KVRDMA_KV_TRANSFER_CONFIG" in proc.stderr
    assert proc.stdout == ""
    # a command instead of options runs that command
    proc = run_entrypoint(["echo", "debug shell"], {"KVRDMA_CONFIG_FILE": absent}, bin_dir)
    assert (proc.returncode, proc.stdout) == (0, "debug shell\n")


def test_entrypoint_refuses_an_unknown_log_level_naming_the_variable(tmp_path: Path) -> None:
    bin_dir = recording_kvrdma(tmp_path)
    proc = run_entrypoint(["--config", "/x.json"], {"KVRDMA_LOG_LEVEL": "TRACE"}, bin_dir)
    assert proc.returncode == 2
    assert "KVRDMA_LOG_LEVEL: expected DEBUG, INFO, WARNING, ERROR or CRITICAL" in proc.stderr
    assert proc.stdout == "", "kvrdma must not run"
    for known in ("debug", "warn"):  # Python's aliases too
        proc = run_entrypoint(["--config", "/x.json"], {"KVRDMA_LOG_LEVEL": known}, bin_dir)
        assert json.loads(proc.stdout)[:2] == ["--log-level", known]


# ------------------------------------------------------------------------------ examples
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_configs_are_valid_and_vllm_shaped(name: str) -> None:
    raw = json.loads(EXAMPLES[name].read_text())
    assert raw["kv_connector"] == "NixlConnector"
    assert raw["kv_role"] == {"producer": "kv_producer", "consumer": "kv_consumer"}.get(
        name, "kv_both"
    )
    assert raw["engine_id"], "the agent answers for one engine id: examples must set it"
    config = load_kv_transfer_config(str(EXAMPLES[name]), environ={})
    assert config.extra.backends == ("UCX",)
    assert config.side_channel_port() == defaults.SIDE_CHANNEL_PORT


# ------------------------------------------------------------------------------ the real agent


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_dry_run_loads_each_example_through_the_entrypoint(name: str, tmp_path: Path) -> None:
    bin_dir = kvrdma_shim(tmp_path)
    env = {
        "KVRDMA_CONFIG_FILE": str(EXAMPLES[name]),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(defaults.SIDE_CHANNEL_PORT),
    }
    proc = run_entrypoint(["--dry-run"], env, bin_dir)
    assert proc.returncode == 0, proc.stderr
    settings = json.loads(proc.stdout)
    raw = json.loads(EXAMPLES[name].read_text())
    assert settings["engine_id"] == raw["engine_id"]
    assert settings["kv_role"] == raw["kv_role"]
    assert (settings["host"], settings["port"]) == ("127.0.0.1", defaults.SIDE_CHANNEL_PORT)
    assert settings["http_port"] == defaults.AGENT_HTTP_PORT
    assert settings["publish"] == defaults.PUBLISH_ADDRESS


def test_dry_run_rejects_a_broken_config_with_its_location(tmp_path: Path) -> None:
    bin_dir = kvrdma_shim(tmp_path)
    broken = tmp_path / "broken.json"
    broken.write_text('{"kv_connector": "NixlConnector",\n "kv_role": "kv_reader"}')
    proc = run_entrypoint(
        ["--dry-run"], {"KVRDMA_CONFIG_FILE": str(broken), "KVRDMA_ENGINE_ID": "p"}, bin_dir
    )
    assert proc.returncode == 2
    assert "kv_role" in proc.stderr and "kv_reader" in proc.stderr


# ------------------------------------------------------------------------------ container spec
def _version_tuple(text: str) -> tuple[int, ...] | None:
    match = re.search(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(g or 0) for g in match.groups()) if match else None


@functools.cache
def rendered_base() -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    command: list[str] | None = None
    if kubectl:
        proc = subprocess.run(
            [kubectl, "version", "--client", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        info = json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else {}
        version = _version_tuple(str(info.get("kustomizeVersion", "")))
        if version is not None and version >= MIN_KUSTOMIZE:
            command = [kubectl, "kustomize", str(BASE)]
    if command is None and shutil.which("kustomize"):
        command = ["kustomize", "build", str(BASE)]
    if command is None:
        pytest.skip("no kubectl with kustomize >= 5 (nor kustomize) on PATH to render the base")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion of command/args: `$$` escapes, unknown refs stay."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def distinct_free_ports(n: int) -> list[int]:
    """`n` different free TCP ports on 127.0.0.1: each socket stays bound until all are
    chosen (one `free_port` after another may return the same port twice)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_ports(n: int, avoid: Sequence[int] = ()) -> list[int]:
    """`n` consecutive free TCP ports on 127.0.0.1 (base + rank, as the engine ranks use),
    none of `avoid`."""
    for _ in range(50):
        base = free_port()
        if base + n > 65535 or any(base <= p < base + n for p in avoid):
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return list(range(base, base + n))
    raise RuntimeError(f"no {n} consecutive free ports")


def http_get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as exc:
        with exc:  # closes the response it wraps (an unclosed one warns, and warnings fail)
            return exc.code, exc.headers.get("Content-Type", ""), exc.read()


class AgentLaunch:
    """The sidecar container of one role, turned into a local command line and environment."""

    def __init__(self, role: str, workdir: Path, bin_dir: Path) -> None:
        objs = rendered_base()
        (dep,) = [
            o
            for o in objs
            if o["kind"] == "Deployment"
            and o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == role
        ]
        spec = dep["spec"]["template"]["spec"]
        (self.container,) = [c for c in spec["initContainers"] if c["name"] == "kvrdma-agent"]
        self.engine_id = f"{dep['metadata']['name']}-6d5f9-k2x7q"
        self.side_port, self.http_port = distinct_free_ports(2)
        # the shared emptyDir (publish socket, effective config): a short path, ipc:// paths
        # are limited to ~107 bytes
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvrdma-run-"))
        self.publish = f"ipc://{self.run_dir}/publish.sock"
        self.mounted = workdir / "kv_transfer_config.json"
        volumes = {v["name"]: v for v in spec["volumes"]}
        (config_mount,) = [
            m for m in self.container["volumeMounts"] if MOUNTED_CONFIG.startswith(m["mountPath"])
        ]
        cm_name = volumes[config_mount["name"]]["configMap"]["name"]
        (cm,) = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == cm_name]
        self.mounted.write_text(cm["data"][Path(MOUNTED_CONFIG).name])

        fields = {"status.podIP": "127.0.0.1", "metadata.name": self.engine_id}
        env: dict[str, str] = {}
        for var in self.container["env"]:
            if "value" in var:
                env[var["name"]] = str(var["value"])
            else:
                env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        # what differs on this machine: ports, the volume paths
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(defaults.SIDE_CHANNEL_PORT)
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_port)
        assert env["KVRDMA_CONFIG_FILE"] == MOUNTED_CONFIG
        env["KVRDMA_CONFIG_FILE"] = str(self.mounted)
        assert env["KVRDMA_EFFECTIVE_CONFIG"].startswith(defaults.PUBLISH_DIR + "/")
        env["KVRDMA_EFFECTIVE_CONFIG"] = env["KVRDMA_EFFECTIVE_CONFIG"].replace(
            defaults.PUBLISH_DIR, str(self.run_dir), 1
        )
        self.effective = Path(env["KVRDMA_EFFECTIVE_CONFIG"])
        self.expected_ranks = int(env["KVRDMA_TP_SIZE"])
        # the engine ranks' /metrics: base + rank on loopback, free ports here
        assert env[defaults.ENV_METRICS_PORT] == str(defaults.WORKER_METRICS_PORT)
        self.worker_ports = free_ports(self.expected_ranks, (self.side_port, self.http_port))
        env[defaults.ENV_METRICS_PORT] = str(self.worker_ports[0])
        substitute = {
            "0.0.0.0": "127.0.0.1",
            str(defaults.AGENT_HTTP_PORT): str(self.http_port),
            defaults.PUBLISH_ADDRESS: self.publish,
        }
        self.args = [
            substitute.get(a, a) for a in (expand(str(x), env) for x in self.container["args"])
        ]
        assert str(self.http_port) in self.args and self.publish in self.args
        path = f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
        self.env = {"PATH": path + os.environ["PATH"], **env}

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"


def worker_metadata(engine_id: str, rank: int, tp_size: int) -> Any:
    from kvrdma.testing import worker_metadata

    return worker_metadata(engine_id, rank, tp_size, agent_name=f"{engine_id}-rank{rank}")


@pytest.fixture
def agent_process(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    bin_dir = kvrdma_shim(tmp_path)
    launch = AgentLaunch(request.param, tmp_path, bin_dir)
    out, err = tmp_path / "agent.out", tmp_path / "agent.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            ["sh", str(ENTRYPOINT), *launch.args],
            stdout=stdout,
            stderr=stderr,
            env=launch.env,
            cwd=tmp_path,
        )
    try:
        yield launch, proc, err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=TIMEOUT_S)
        shutil.rmtree(launch.run_dir, ignore_errors=True)


def wait_healthy(launch: AgentLaunch, proc: subprocess.Popen[bytes], err: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the agent exited with {proc.returncode}:\n{err.read_text()}")
        try:
            if http_get(launch.url(defaults.HEALTHZ_PATH))[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    pytest.fail(f"/healthz did not answer 200 within {START_TIMEOUT_S} s:\n{err.read_text()}")


@pytest.mark.parametrize("agent_process", ["prefill", "decode"], indirect=True)
def test_agent_started_as_the_container_spec_serves_probes_metrics_and_peers(
    agent_process: Any,
) -> None:
    from prometheus_client import CollectorRegistry

    from kvrdma.telemetry import KvrdmaMetrics, MetricsServer, start_http_server

    launch, proc, err = agent_process
    # the engine's rank 0 serves its /metrics where the pod's KVRDMA_METRICS_PORT says;
    # any further ranks stay down
    worker = CollectorRegistry()
    KvrdmaMetrics(registry=worker, engine_id=launch.engine_id, role="producer", tp_rank=0)
    rank0: MetricsServer = start_http_server(worker, "127.0.0.1", launch.worker_ports[0])[0]
    try:
        wait_healthy(launch, proc, err)
        serves_probes_metrics_and_peers(launch, proc, err)
    finally:
        rank0.shutdown()


def serves_probes_metrics_and_peers(
    launch: AgentLaunch, proc: subprocess.Popen[bytes], err: Path
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from kvrdma.handshake import HandshakeClient, SidecarPublisher

    # the engine container's --kv-transfer-config: the mounted config with the pod's id
    effective = json.loads(launch.effective.read_text())
    assert effective == {**json.loads(launch.mounted.read_text()), "engine_id": launch.engine_id}

    status, ctype, body = http_get(launch.url(defaults.HEALTHZ_PATH))
    assert status == 200 and ctype.startswith("application/json")
    status, _, body = http_get(launch.url(defaults.READYZ_PATH))
    assert status == 503, "no worker has published yet"
    assert json.loads(body)["missing_ranks"] == list(range(launch.expected_ranks))

    status, ctype, body = http_get(launch.url(defaults.METRICS_PATH))
    assert status == 200 and ctype.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert families["kvrdma_agent_ready"].samples[0].value == 0
    # the engine ranks' series merged in, and each rank's endpoint reported
    up = {s.labels["endpoint"]: s.value for s in families["kvrdma_worker_endpoint_up"].samples}
    assert up == {
        f"http://127.0.0.1:{port}/metrics": float(rank == 0)
        for rank, port in enumerate(launch.worker_ports)
    }
    (registered,) = families["kvrdma_registered_bytes"].samples
    assert registered.labels["engine_id"] == launch.engine_id

    # an engine worker publishes each rank through the shared volume's socket
    with SidecarPublisher(launch.publish, timeout=10) as publisher:
        for rank in range(launch.expected_ranks):
            ack = publisher.publish(worker_metadata(launch.engine_id, rank, launch.expected_ranks))
        assert list(ack.published_ranks) == list(range(launch.expected_ranks))
    status, _, body = http_get(launch.url(defaults.READYZ_PATH))
    assert status == 200, body
    assert json.loads(body)["ready"] is True
    families = {
        f.name: f
        for f in text_string_to_metric_families(
            http_get(launch.url(defaults.METRICS_PATH))[2].decode()
        )
    }
    assert families["kvrdma_agent_ready"].samples[0].value == 1

    # a peer handshakes on the side channel from VLLM_NIXL_SIDE_CHANNEL_HOST/PORT
    with HandshakeClient(timeout=10, tp_size=launch.expected_ranks) as client:
        got = client.fetch(
            "127.0.0.1", launch.side_port, launch.engine_id, range(launch.expected_ranks)
        )
    assert got[0].agent_name == f"{launch.engine_id}-rank0"

    # the kubelet's SIGTERM: the agent is PID 1 of its container (the entrypoint execs it)
    proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    try:
        code = proc.wait(timeout=STOP_LIMIT_S + 0.5)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the agent was still running {STOP_LIMIT_S + 0.5} s after SIGTERM")
    elapsed = time.monotonic() - start
    assert code == 0, err.read_text()
    assert elapsed <= STOP_LIMIT_S, f"SIGTERM to exit took {elapsed:.2f} s"
