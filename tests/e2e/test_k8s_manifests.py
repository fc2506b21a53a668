"""The Kubernetes manifests in deploy/k8s: rendered, schema-validated, cross-checked with the code.

Every overlay (and the base) is rendered with `kubectl kustomize` (or a standalone
`kustomize build`, kustomize >= 5) and every object validated with `kubernetes-validate`
against the oldest Kubernetes with GA native sidecars and the newest the validator knows.
Then the rendered objects are checked against the constants the code uses
(`kvrdma.defaults`), the real `kvrdma agent` argument parser and a `--dry-run` of the agent
through the image's entrypoint with each role's mounted config: the engine runs `vllm serve`
with kvrdma's connector (never vLLM's NixlConnector, which would bind the agent's side
channel), and the agent is given the engine ranks' `/metrics` endpoints to merge.

Skips, each with its reason: no kustomize >= 5 renderer on PATH; metrics/ files not written
yet (the monitoring render only); the `kvrdma` command not able to build its parser yet (the
tests that run the entrypoint, which execs `kvrdma agent`).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from agent_cli import cli_problem, kvrdma_shim

from kvrdma import defaults
from kvrdma.config import load_kv_transfer_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
ENTRYPOINT = ROOT / "agent" / "entrypoint.sh"
CONTAINERFILE = ROOT / "agent" / "Containerfile"
ENGINE_CONTAINERFILE = ROOT / "deploy" / "engine" / "Containerfile"
WORKLOADS = {
    "base": K8S / "base",
    "rdma-ib": K8S / "overlays" / "rdma-ib",
    "tcp": K8S / "overlays" / "tcp",
    "efa": K8S / "overlays" / "efa",
}
OVERLAYS = [name for name in WORKLOADS if name != "base"]
MONITORING = K8S / "monitoring"
# what the monitoring ConfigMaps must be generated from (key in the ConfigMap -> file)
METRICS_FILES = {
    "kvrdma-grafana-dashboard": {"kvrdma.json": ROOT / "metrics" / "grafana" / "kvrdma.json"},
    "kvrdma-prometheus-rules": {
        "alert_rules.yml": ROOT / "metrics" / "prometheus" / "alert_rules.yml",
        "recording_rules.yml": ROOT / "metrics" / "prometheus" / "recording_rules.yml",
    },
}

MIN_KUSTOMIZE = (5, 0)
RENDER_TIMEOUT_S = 120
AGENT_TIMEOUT_S = 90
# Native sidecars (restartPolicy on init containers) are GA from 1.33; validate against that
# and against the newest version the validator ships.
K8S_VERSIONS = ("1.33.0", kubernetes_validate.latest_version())
# Custom resources kubernetes-validate has no schema for; checked structurally below instead.
NO_SCHEMA = {("monitoring.coreos.com/v1", "PodMonitor")}

ROLE_LABEL = "app.kubernetes.io/component"
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
PEER = {"prefill": "decode", "decode": "prefill"}
AGENT = "kvrdma-agent"
ENGINE = "engine"
CONNECTOR = {"kv_connector": "KvrdmaConnector", "kv_connector_module_path": "kvrdma.vllm"}
AGENT_UID = 10001
BACKENDS = {"base": ["UCX"], "rdma-ib": ["UCX"], "tcp": ["UCX"], "efa": ["LIBFABRIC"]}
CONFIG_KEY = "kv_transfer_config.json"


# ------------------------------------------------------------------------------ rendering
def _version_tuple(text: str) -> tuple[int, ...] | None:
    match = re.search(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(g or 0) for g in match.groups()) if match else None


@functools.cache
def _renderer() -> tuple[tuple[str, ...] | None, str]:
    """(command prefix that renders a kustomization dir, description or why there is none)."""
    problems = []
    kubectl = shutil.which("kubectl")
    if kubectl:
        proc = subprocess.run(
            [kubectl, "version", "--client", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        info = json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else {}
        kustomize = str(info.get("kustomizeVersion", ""))
        version = _version_tuple(kustomize)
        if version is not None and version >= MIN_KUSTOMIZE:
            client = info.get("clientVersion", {}).get("gitVersion", "?")
            return (kubectl, "kustomize"), f"kubectl {client} (kustomize {kustomize})"
        problems.append(f"{kubectl} bundles kustomize {kustomize or 'of unknown version'}")
    standalone = shutil.which("kustomize")
    if standalone:
        proc = subprocess.run([standalone, "version"], capture_output=True, text=True, timeout=30)
        version = _version_tuple(proc.stdout)
        if version is not None and version >= MIN_KUSTOMIZE:
            return (standalone, "build"), f"kustomize {proc.stdout.strip()}"
        problems.append(f"{standalone} is version {proc.stdout.strip() or '?'}")
    needed = ".".join(map(str, MIN_KUSTOMIZE))
    return None, (
        f"no kustomize >= {needed} renderer: "
        + ("; ".join(problems) if problems else "neither kubectl nor kustomize on PATH")
        + " (Debian bookworm's kubernetes-client 1.20 bundles kustomize 2.0)"
    )


def renderer() -> tuple[str, ...]:
    command, why = _renderer()
    if command is None:
        pytest.skip(why)
    return command


@functools.cache
def _render(path: Path, unrestricted: bool) -> tuple[dict[str, Any], ...]:
    command = [*renderer(), str(path)]
    if unrestricted:
        command += ["--load-restrictor", "LoadRestrictionsNone"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=RENDER_TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(command)} failed:\n{proc.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def render(name: str) -> list[dict[str, Any]]:
    return list(_render(WORKLOADS[name], False))


def missing_metrics_files() -> list[str]:
    return [
        str(path.relative_to(ROOT))
        for files in METRICS_FILES.values()
        for path in files.values()
        if not path.is_file()
    ]


def render_monitoring() -> list[dict[str, Any]]:
    missing = missing_metrics_files()
    if missing:
        pytest.skip(f"metrics files not written yet: {', '.join(missing)}")
    return list(_render(MONITORING, True))


# ------------------------------------------------------------------------------ object access
def objects(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def deployments(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """role (prefill/decode) -> Deployment."""
    out = {}
    for dep in objects(objs, "Deployment").values():
        role = dep["spec"]["template"]["metadata"]["labels"][ROLE_LABEL]
        assert role not in out, f"two Deployments for role {role}"
        out[role] = dep
    return out


def pod_spec(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]


def container(dep: dict[str, Any], name: str) -> dict[str, Any]:
    spec = pod_spec(dep)
    found = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"{dep['metadata']['name']}: expected one container {name!r}"
    return found[0]


def env_values(c: dict[str, Any], fields: Mapping[str, str] | None = None) -> dict[str, str]:
    """The container's env as strings; fieldRef values taken from `fields` (fieldPath -> value)."""
    fields = fields or {}
    out = {}
    for var in c.get("env", []):
        if "value" in var:
            out[var["name"]] = str(var["value"])
        elif "fieldRef" in var.get("valueFrom", {}):
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            out[var["name"]] = fields.get(path, f"<{path}>")
    return out


def env_source(c: dict[str, Any], name: str) -> dict[str, Any]:
    found = [v for v in c.get("env", []) if v["name"] == name]
    assert len(found) == 1, f"container {c['name']}: expected one env var {name}"
    return found[0]


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion of command/args: `$$` escapes, unknown refs stay."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR.sub(one, text)


def resolved_args(c: dict[str, Any], fields: Mapping[str, str] | None = None) -> list[str]:
    env = env_values(c, fields)
    return [expand(str(arg), env) for arg in c.get("args", [])]


def option(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag:
            assert i + 1 < len(args), f"{flag} without a value in {args}"
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def port_number(c: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    found = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == port]
    assert found, f"container {c['name']} has no port named {port!r}"
    return int(found[0])


def mount_path(c: dict[str, Any], volume: str) -> str | None:
    paths = [m["mountPath"] for m in c.get("volumeMounts", []) if m["name"] == volume]
    return paths[0] if paths else None


def volume_of(dep: dict[str, Any], c: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """(the volume whose mount holds `path` in container `c`, the path inside the volume)."""
    best = None
    for m in c.get("volumeMounts", []):
        root = m["mountPath"].rstrip("/") + "/"
        if path.startswith(root) and (best is None or len(root) > len(best[1])):
            best = (m["name"], root)
    assert best is not None, f"{path} is on no volume of container {c['name']}"
    volumes = {v["name"]: v for v in pod_spec(dep)["volumes"]}
    return volumes[best[0]], path[len(best[1]) :]


def labels_match(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors expected: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def config_of(objs: list[dict[str, Any]], dep: dict[str, Any]) -> tuple[str, str]:
    """(the agent's mounted kv_transfer_config text, its path in the container)."""
    agent = container(dep, AGENT)
    path = env_values(agent)["KVRDMA_CONFIG_FILE"]
    volume, key = volume_of(dep, agent, path)
    assert "configMap" in volume, f"{path} is not on a ConfigMap volume: {volume}"
    maps = objects(objs, "ConfigMap")
    name = volume["configMap"]["name"]
    assert name in maps, f"the config volume names ConfigMap {name}, not in the render"
    assert key in maps[name]["data"], f"ConfigMap {name} has no key {key}"
    return maps[name]["data"][key], path


def pod_fields(dep: dict[str, Any]) -> dict[str, str]:
    return {"status.podIP": "127.0.0.1", "metadata.name": f"{dep['metadata']['name']}-7c9d-x2"}


def workload_cases() -> Iterator[Any]:
    for name in WORKLOADS:
        for role in ROLES:
            yield pytest.param(name, role, id=f"{name}-{role}")


# ------------------------------------------------------------------------------ rendering tests
def validate_all(objs: list[dict[str, Any]]) -> list[str]:
    """Validate every object strictly; returns 'Kind/name' of objects with no schema."""
    unchecked = []
    for obj in objs:
        what = f"{obj['kind']}/{obj['metadata']['name']}"
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                assert (obj["apiVersion"], obj["kind"]) in NO_SCHEMA, (
                    f"{what}: no schema for {obj['apiVersion']} in Kubernetes {version}"
                )
                unchecked.append(what)
                break
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{what} invalid for Kubernetes {version} at {where}: {exc.message}")
    return unchecked


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workloads_render_and_validate(name: str) -> None:
    objs = render(name)
    kinds = sorted({o["kind"] for o in objs})
    assert kinds == ["ConfigMap", "Deployment", "Namespace", "NetworkPolicy", "Service"]
    assert validate_all(objs) == []
    namespaces = {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"}
    assert namespaces == {objects(objs, "Namespace").popitem()[0]}


def test_monitoring_renders_validates_and_is_generated_from_metrics() -> None:
    objs = render_monitoring()
    assert validate_all(objs) == ["PodMonitor/kvrdma"]
    maps = objects(objs, "ConfigMap")
    assert set(maps) == set(METRICS_FILES)
    for name, files in METRICS_FILES.items():
        data = maps[name]["data"]
        assert set(data) == set(files)
        for key, path in files.items():
            # byte for byte the file in metrics/ (what the metrics tests check)
            assert data[key].encode() == path.read_bytes(), f"{name}.{key} differs from {path}"
        size = sum(len(v.encode()) for v in data.values())
        assert size < 1024 * 1024, f"ConfigMap {name} is {size} bytes; the API limit is 1 MiB"
    assert maps["kvrdma-grafana-dashboard"]["metadata"]["labels"]["grafana_dashboard"] == "1"
    json.loads(maps["kvrdma-grafana-dashboard"]["data"]["kvrdma.json"])
    for key in ("alert_rules.yml", "recording_rules.yml"):
        assert "groups" in yaml.safe_load(maps["kvrdma-prometheus-rules"]["data"][key])
    workload_ns = objects(render("base"), "Namespace").popitem()[0]
    assert {o["metadata"]["namespace"] for o in objs} == {workload_ns}
    check_pod_monitor(objects(objs, "PodMonitor")["kvrdma"], render("base"))


def test_monitoring_configmaps_point_at_metrics_and_nothing_is_copied() -> None:
    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    generated = {}
    for gen in kustomization["configMapGenerator"]:
        sources = {}
        for entry in gen["files"]:
            key, _, rel = entry.partition("=")
            sources[key] = (MONITORING / rel).resolve()
        generated[gen["name"]] = sources
    assert generated == METRICS_FILES
    assert (
        kustomization["namespace"]
        == yaml.safe_load((WORKLOADS["base"] / "kustomization.yaml").read_text())["namespace"]
    )
    basenames = {p.name for files in METRICS_FILES.values() for p in files.values()}
    copies = [p for p in K8S.rglob("*") if p.name in basenames]
    assert not copies, f"copies of metrics/ files under deploy/k8s: {copies}"


# ------------------------------------------------------------------------------ cross-checks
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_each_role_has_engine_and_native_agent_sidecar(name: str) -> None:
    deps = deployments(render(name))
    assert set(deps) == set(ROLES)
    for role, dep in deps.items():
        spec = pod_spec(dep)
        assert [c["name"] for c in spec["initContainers"]] == [AGENT]
        assert [c["name"] for c in spec["containers"]] == [ENGINE]
        agent = container(dep, AGENT)
        assert agent["restartPolicy"] == "Always", "the agent must be a native sidecar"
        assert agent["image"].split(":")[0] == "kvrdma/agent"
        assert "command" not in agent, "the image's entrypoint must run (it resolves the config)"
        selector = dep["spec"]["selector"]
        assert labels_match(selector, dep["spec"]["template"]["metadata"]["labels"])
        assert selector["matchLabels"][ROLE_LABEL] == role


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_probes_and_http_port_match_what_the_agent_serves(name: str) -> None:
    for dep in deployments(render(name)).values():
        agent = container(dep, AGENT)
        args = resolved_args(agent)
        assert option(args, "--http-port") == str(defaults.AGENT_HTTP_PORT)
        assert option(args, "--http-host") == "0.0.0.0", "kubelet probes come from the node"
        assert port_number(agent, "metrics") == defaults.AGENT_HTTP_PORT
        expected = {
            "startupProbe": defaults.HEALTHZ_PATH,
            "livenessProbe": defaults.HEALTHZ_PATH,
            "readinessProbe": defaults.READYZ_PATH,
        }
        for probe, path in expected.items():
            get = agent[probe]["httpGet"]
            assert get["path"] == path, f"{probe} path"
            assert port_number(agent, get["port"]) == defaults.AGENT_HTTP_PORT, f"{probe} port"


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_side_channel_port_and_host_match_the_config_defaults(name: str) -> None:
    objs = render(name)
    services = objects(objs, "Service")
    for role, dep in deployments(objs).items():
        for c in (container(dep, AGENT), container(dep, ENGINE)):
            port = env_values(c)["VLLM_NIXL_SIDE_CHANNEL_PORT"]
            assert port == str(defaults.SIDE_CHANNEL_PORT), f"{c['name']} side-channel port"
            host = env_source(c, "VLLM_NIXL_SIDE_CHANNEL_HOST")
            assert host["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        agent = container(dep, AGENT)
        assert option(resolved_args(agent), "--port") is None, "the port comes from the env"
        assert option(resolved_args(agent), "--dp-index") in (None, "0")
        assert port_number(agent, "side-channel") == defaults.SIDE_CHANNEL_PORT
        svc = services[f"kvrdma-{role}-side-channel"]
        assert svc["spec"]["clusterIP"] == "None"
        assert labels_match({"matchLabels": svc["spec"]["selector"]}, pod_labels(dep))
        (sp,) = svc["spec"]["ports"]
        assert sp["port"] == defaults.SIDE_CHANNEL_PORT
        # by number: the port is on an init container (see services.yaml)
        assert sp["targetPort"] == defaults.SIDE_CHANNEL_PORT


def pod_labels(dep: dict[str, Any]) -> dict[str, str]:
    return dep["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_publish_socket_is_on_a_volume_both_containers_share(name: str) -> None:
    for dep in deployments(render(name)).values():
        agent, engine = container(dep, AGENT), container(dep, ENGINE)
        assert option(resolved_args(agent), "--publish") == defaults.PUBLISH_ADDRESS
        assert env_values(engine)["KVRDMA_PUBLISH_ADDRESS"] == defaults.PUBLISH_ADDRESS
        socket_path = defaults.PUBLISH_ADDRESS.removeprefix("ipc://")
        v_agent, _ = volume_of(dep, agent, socket_path)
        v_engine, _ = volume_of(dep, engine, socket_path)
        assert v_agent is v_engine and "emptyDir" in v_agent
        assert mount_path(agent, v_agent["name"]) == defaults.PUBLISH_DIR
        assert mount_path(engine, v_agent["name"]) == defaults.PUBLISH_DIR


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_tp_size_agrees_between_agent_engine_and_gpus(name: str) -> None:
    for dep in deployments(render(name)).values():
        agent, engine = container(dep, AGENT), container(dep, ENGINE)
        ranks = option(resolved_args(agent), "--expected-ranks")
        assert ranks is not None and ranks.isdigit()
        assert env_values(engine)["KVRDMA_TP_SIZE"] == ranks
        assert "--tensor-parallel-size" in expand(engine["args"][0], env_values(engine))
        assert f'--tensor-parallel-size "{ranks}"' in resolved_args(engine)[0]
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == ranks


@pytest.mark.parametrize(("name", "role"), list(workload_cases()))
def test_kv_transfer_config_per_role(name: str, role: str) -> None:
    objs = render(name)
    dep = deployments(objs)[role]
    agent, engine = container(dep, AGENT), container(dep, ENGINE)
    text, _ = config_of(objs, dep)
    raw = json.loads(text)
    assert raw["kv_role"] == ROLES[role]
    assert {k: raw.get(k) for k in CONNECTOR} == CONNECTOR, "the engine must load kvrdma.vllm"
    assert raw["kv_connector_extra_config"]["backends"] == BACKENDS[name]
    # one ConfigMap per Deployment: the engine id must come from the pod, not the file
    assert "engine_id" not in raw
    assert env_source(agent, "KVRDMA_ENGINE_ID")["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.name"
    )
    # the engine reads the agent's effective config from the shared volume
    effective = env_values(agent)["KVRDMA_EFFECTIVE_CONFIG"]
    v_agent, _ = volume_of(dep, agent, effective)
    v_engine, _ = volume_of(dep, engine, effective)
    assert v_agent is v_engine and "emptyDir" in v_agent
    command = resolved_args(engine)[0]
    assert f'--kv-transfer-config "$(cat {effective})"' in command
    # what the entrypoint does to it passes the real validation with the pod's environment
    env = env_values(agent, pod_fields(dep))
    config = load_kv_transfer_config({**raw, "engine_id": env["KVRDMA_ENGINE_ID"]}, environ=env)
    assert config.side_channel_port() == defaults.SIDE_CHANNEL_PORT
    assert config.side_channel_host == "127.0.0.1"
    assert config.extra.backends == tuple(BACKENDS[name])


@pytest.mark.parametrize(("name", "role"), list(workload_cases()))
def test_engine_runs_vllm_serve_with_the_kvrdma_connector(name: str, role: str) -> None:
    objs = render(name)
    dep = deployments(objs)[role]
    engine = container(dep, ENGINE)
    assert engine["image"].split(":")[0] == "kvrdma/engine", "the image of deploy/engine"
    assert engine["command"] == ["/bin/sh", "-c"]
    (command,) = resolved_args(engine)
    assert command.startswith('exec vllm serve "')
    text, _ = config_of(objs, dep)
    # nothing in the engine may select vLLM's own Nixl connectors: they bind the side-channel
    # port the agent holds and publish nothing to it
    for where in (command, text, json.dumps(engine.get("env", []))):
        assert "Nixl" not in where and "MultiConnector" not in where
    env = env_values(engine)
    assert env["KVRDMA_PUBLISH_ADDRESS"] == defaults.PUBLISH_ADDRESS, "publish to the agent"
    side = [p for p in engine.get("ports", []) if p["containerPort"] == defaults.SIDE_CHANNEL_PORT]
    assert not side, "only the agent listens on the side channel"


def test_engine_image_adds_kvrdma_to_the_vllm_image() -> None:
    text = re.sub(r"\\\n", " ", ENGINE_CONTAINERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    steps = [
        (word.upper(), rest.strip())
        for line in lines
        if line and not line.startswith("#")
        for word, _, rest in [line.partition(" ")]
    ]
    args = {a.split("=")[0]: a.split("=", 1)[1] for w, a in steps if w == "ARG" and "=" in a}
    assert re.fullmatch(r"vllm/vllm-openai:v0\.32\.\d+", args["VLLM_IMAGE"])
    assert ("FROM", "${VLLM_IMAGE}") in steps
    (install,) = [a for w, a in steps if w == "RUN" and "pip install" in a]
    assert "pip install /src/kvrdma" in install and "import kvrdma.vllm" in install
    ignore = (ENGINE_CONTAINERFILE.parent / "Containerfile.dockerignore").read_text().splitlines()
    assert "*" in ignore
    for copy in [a.split() for w, a in steps if w == "COPY"]:
        for source in copy[:-1]:
            assert (ROOT / source).exists(), f"COPY source {source} is missing"
            assert f"!{source}" in ignore, f"the context filter drops {source}"


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_agent_is_given_the_engine_ranks_metrics_endpoints(name: str) -> None:
    for dep in deployments(render(name)).values():
        agent, engine = container(dep, AGENT), container(dep, ENGINE)
        base = env_values(engine)[defaults.ENV_METRICS_PORT]
        assert base == str(defaults.WORKER_METRICS_PORT)
        assert env_values(agent)[defaults.ENV_METRICS_PORT] == base, "agent and engine agree"
        ranks = int(env_values(engine)["KVRDMA_TP_SIZE"])
        worker_ports = set(range(int(base), int(base) + ranks))
        taken = {
            p["containerPort"]
            for c in pod_spec(dep)["initContainers"] + pod_spec(dep)["containers"]
            for p in c.get("ports", [])
        }
        assert not worker_ports & taken, "the ranks' ports are pod-local, not container ports"
        assert {defaults.SIDE_CHANNEL_PORT, defaults.AGENT_HTTP_PORT}.isdisjoint(worker_ports)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_resources_and_agent_security_context(name: str) -> None:
    for dep in deployments(render(name)).values():
        for c in (container(dep, AGENT), container(dep, ENGINE)):
            res = c["resources"]
            assert {"cpu", "memory"} <= set(res["requests"]), c["name"]
            assert "memory" in res["limits"], c["name"]
        ctx = container(dep, AGENT)["securityContext"]
        assert ctx["runAsNonRoot"] is True
        assert ctx["runAsUser"] == AGENT_UID
        assert ctx["allowPrivilegeEscalation"] is False
        assert ctx["readOnlyRootFilesystem"] is True
        assert ctx["capabilities"]["drop"] == ["ALL"]
    users = re.findall(r"^USER\s+(\S+)", CONTAINERFILE.read_text(), re.MULTILINE)
    assert users == [f"{AGENT_UID}:{AGENT_UID}"], "the image runs as the uid the pods expect"


def policy_admits(rule: dict[str, Any], port: int, c_ports: dict[str, int]) -> bool:
    if "ports" not in rule:
        return True
    for p in rule["ports"]:
        if p.get("protocol", "TCP") != "TCP":
            continue
        lo = c_ports[p["port"]] if isinstance(p["port"], str) else p["port"]
        if lo <= port <= p.get("endPort", lo):
            return True
    return False


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_network_policy_admits_side_channel_only_from_peer_pods(name: str) -> None:
    objs = render(name)
    deps = deployments(objs)
    policies = objects(objs, "NetworkPolicy").values()
    for role, dep in deps.items():
        labels = pod_labels(dep)
        selecting = [p for p in policies if labels_match(p["spec"]["podSelector"], labels)]
        assert selecting, f"no NetworkPolicy selects the {role} pods"
        c_ports = {
            p["name"]: p["containerPort"]
            for c in pod_spec(dep)["initContainers"] + pod_spec(dep)["containers"]
            for p in c.get("ports", [])
        }
        peer_admitted = metrics_admitted = False
        for policy in selecting:
            assert "Ingress" in policy["spec"]["policyTypes"]
            for rule in policy["spec"].get("ingress", []):
                sources = rule.get("from")
                if policy_admits(rule, defaults.SIDE_CHANNEL_PORT, c_ports):
                    assert sources, f"{role}: a rule admits the side channel from anywhere"
                    for src in sources:
                        assert set(src) == {"podSelector"}, f"{role}: side channel from {src}"
                        sel = src["podSelector"]
                        assert labels_match(sel, pod_labels(deps[PEER[role]])), src
                        assert not labels_match(sel, labels), f"{role}: admits its own role"
                    peer_admitted = True
                if policy_admits(rule, defaults.AGENT_HTTP_PORT, c_ports) and sources:
                    metrics_admitted |= any(
                        s.get("namespaceSelector", {}).get("matchLabels", {})
                        == {"kubernetes.io/metadata.name": "monitoring"}
                        for s in sources
                    )
        assert peer_admitted, f"{role}: the {PEER[role]} pods cannot reach the side channel"
        assert metrics_admitted, f"{role}: Prometheus (namespace monitoring) cannot scrape"


def check_pod_monitor(monitor: dict[str, Any], workload: list[dict[str, Any]]) -> None:
    spec = monitor["spec"]
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["path"] == defaults.METRICS_PATH
    deps = deployments(workload)
    for role, dep in deps.items():
        assert labels_match(spec["selector"], pod_labels(dep)), f"{role} pods not scraped"
        scraped = [
            port_number(c, endpoint["port"])
            for c in pod_spec(dep)["initContainers"] + pod_spec(dep)["containers"]
            if any(p.get("name") == endpoint["port"] for p in c.get("ports", []))
        ]
        assert scraped == [defaults.AGENT_HTTP_PORT], f"{role}: scraped ports {scraped}"


def test_pod_monitor_and_metrics_service_scrape_the_agent_port() -> None:
    workload = render("base")
    (monitor,) = [
        d
        for d in yaml.safe_load_all((MONITORING / "podmonitor.yaml").read_text())
        if d and d["kind"] == "PodMonitor"
    ]
    check_pod_monitor(monitor, workload)
    svc = objects(workload, "Service")["kvrdma-metrics"]
    (sp,) = svc["spec"]["ports"]
    assert sp["port"] == defaults.AGENT_HTTP_PORT
    for dep in deployments(workload).values():
        assert labels_match({"matchLabels": svc["spec"]["selector"]}, pod_labels(dep))
        assert sp["targetPort"] == defaults.AGENT_HTTP_PORT  # by number, as above
        assert port_number(container(dep, AGENT), "metrics") == defaults.AGENT_HTTP_PORT


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_transport_environment_of_each_overlay(name: str) -> None:
    objs = render(name)
    maps = objects(objs, "ConfigMap")
    for dep in deployments(objs).values():
        engine, agent = container(dep, ENGINE), container(dep, AGENT)
        (ref,) = [e["configMapRef"]["name"] for e in engine["envFrom"]]
        env = maps[ref].get("data", {})
        assert "envFrom" not in agent, "the agent moves no KV bytes: no transport env"
        requests = engine["resources"]["requests"]
        caps = engine.get("securityContext", {}).get("capabilities", {}).get("add", [])
        tls = env.get("UCX_TLS", "").split(",") if env.get("UCX_TLS") else []
        assert "glibc.malloc.hugetlb=1" in env_values(engine).get("GLIBC_TUNABLES", "")
        if name == "base":
            assert env == {}, "the base leaves transport selection to UCX"
            assert "rdma/ib" not in requests and "vpc.amazonaws.com/efa" not in requests
        elif name == "rdma-ib":
            assert "rc" in tls and "cuda_copy" in tls and "tcp" not in tls
            assert env["UCX_NET_DEVICES"]
            assert requests["rdma/ib"] == engine["resources"]["limits"]["rdma/ib"] == "1"
            assert "IPC_LOCK" in caps
        elif name == "tcp":
            assert "tcp" in tls and "cuda_copy" in tls
            assert not {"rc", "rc_x", "dc", "dc_x", "ud"} & set(tls)
            assert "rdma/ib" not in requests and not caps
        elif name == "efa":
            assert env["FI_PROVIDER"] == "efa"
            assert not any(k.startswith("UCX_") for k in env)
            efa = "vpc.amazonaws.com/efa"
            assert requests[efa] == engine["resources"]["limits"][efa] == "1"
            assert "IPC_LOCK" in caps


# ------------------------------------------------------------------------------ the real agent
def sidecar_module() -> Any:
    if importlib.util.find_spec("kvrdma.cli.agent") is None:
        pytest.skip("kvrdma.cli.agent does not exist yet")
    import kvrdma.cli.agent

    return kvrdma.cli.agent


@pytest.mark.parametrize(("name", "role"), list(workload_cases()))
def test_agent_args_parse_with_the_real_parser(name: str, role: str) -> None:
    sidecar = sidecar_module()
    dep = deployments(render(name))[role]
    parser = argparse.ArgumentParser(prog="kvrdma agent", exit_on_error=False)
    sidecar.configure_parser(parser)
    args = parser.parse_args(resolved_args(container(dep, AGENT)))
    assert args.http_port == defaults.AGENT_HTTP_PORT
    assert args.publish == defaults.PUBLISH_ADDRESS
    assert args.expected_ranks == int(env_values(container(dep, ENGINE))["KVRDMA_TP_SIZE"])
    assert args.config is None, "the entrypoint supplies --config from the mounted file"
    assert args.dry_run is False


def test_kvrdma_agent_help_lists_every_flag_the_manifests_use() -> None:
    problem = cli_problem()
    if problem:
        pytest.skip(problem)
    proc = subprocess.run(
        [sys.executable, "-m", "kvrdma", "agent", "--help"],
        capture_output=True,
        text=True,
        timeout=AGENT_TIMEOUT_S,
        cwd=ROOT,
    )
    flags = {
        arg.split("=")[0]
        for name in WORKLOADS
        for dep in deployments(render(name)).values()
        for arg in resolved_args(container(dep, AGENT))
        if arg.startswith("--")
    }
    assert flags
    for flag in sorted(flags | {"--config", "--dry-run"}):
        assert flag in proc.stdout, f"`kvrdma agent --help` does not mention {flag}"


@pytest.mark.parametrize(("name", "role"), list(workload_cases()))
def test_dry_run_through_the_entrypoint_with_the_mounted_config(
    name: str, role: str, tmp_path: Path
) -> None:
    objs = render(name)
    dep = deployments(objs)[role]
    agent = container(dep, AGENT)
    text, _ = config_of(objs, dep)
    bin_dir = kvrdma_shim(tmp_path)
    mounted = tmp_path / CONFIG_KEY
    mounted.write_text(text)
    effective = tmp_path / "effective.json"
    fields = pod_fields(dep)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
        + os.environ.get("PATH", ""),
        **env_values(agent, fields),
        "KVRDMA_CONFIG_FILE": str(mounted),
        "KVRDMA_EFFECTIVE_CONFIG": str(effective),
    }
    proc = subprocess.run(
        ["sh", str(ENTRYPOINT), *resolved_args(agent, fields), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=AGENT_TIMEOUT_S,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    settings = json.loads(proc.stdout)
    assert settings["engine_id"] == fields["metadata.name"]
    assert settings["kv_role"] == ROLES[role]
    assert settings["host"] == "127.0.0.1"
    assert settings["port"] == defaults.SIDE_CHANNEL_PORT
    assert settings["http_host"] == "0.0.0.0"
    assert settings["http_port"] == defaults.AGENT_HTTP_PORT
    assert settings["publish"] == defaults.PUBLISH_ADDRESS
    assert settings["expected_ranks"] == int(env["KVRDMA_TP_SIZE"])
    # the agent merges every engine rank's /metrics (base port + TP rank, on loopback)
    base = int(env[defaults.ENV_METRICS_PORT])
    assert settings["worker_metrics"] == [
        f"http://127.0.0.1:{base + rank}/metrics" for rank in range(settings["expected_ranks"])
    ]
    # the file the engine's --kv-transfer-config reads: the mounted config plus the engine id
    written = json.loads(effective.read_text())
    assert written == {**json.loads(text), "engine_id": fields["metadata.name"]}
