"""`kvrdma agent` as a real process against publishers and peers that try to wedge it."""

from __future__ import annotations

import argparse
import json
import resource
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvrdma.cli import hosts
from kvrdma.cli.agent import SidecarSettings, configure_parser, settings_from_args
from kvrdma.errors import ConfigError, HandshakeError
from kvrdma.handshake import HandshakeClient, SidecarPublisher
from kvrdma.handshake.wire import MetadataRequest
from kvrdma.metadata import RegionMeta, WorkerMetadata, sha256_hex
from tests.integration.sidecar_helpers import (
    CONFIG,
    ENGINE,
    HOST,
    Agent,
    crash_handshake_thread,
    dry_run,
    http_get,
    in_process_sidecar,
    rss_bytes,
    worker,
)

pytestmark = pytest.mark.timeout(120)

RSS_GROWTH_LIMIT = 48 << 20


def handled(agent: Agent) -> float:
    """Handshake requests the agent has answered so far, whatever the outcome."""
    _, text = http_get(agent.http + "/metrics")
    key = "kvrdma_handshake_requests_total{"
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))


def big_worker(rank: int, size: int) -> WorkerMetadata:
    blob = bytes([rank + 1]) * size
    return msgspec.structs.replace(
        worker(rank), agent_metadata=blob, agent_metadata_sha256=sha256_hex(blob)
    )


def fetch_ok(ctx: zmq.Context[zmq.Socket[bytes]], agent: Agent, *expected: WorkerMetadata) -> None:
    with HandshakeClient(context=ctx, timeout=5.0, tp_size=2, compat_hash="d" * 64) as peer:
        got = peer.fetch(HOST, agent.side_port, ENGINE, [0, 1], use_cache=False)
    assert got == {w.tp_rank: w for w in expected}


def test_unservable_and_foreign_publishes_are_refused_and_the_agent_keeps_serving(
    agent: Agent, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    near_top = msgspec.structs.replace(
        worker(0),
        cache_layout="blocks_first",
        num_blocks=2,
        regions=[RegionMeta(2**64 - 4096, 2, 4096, "attn", 2)],
    )
    foreign = msgspec.structs.replace(worker(1), engine_id="someone-else")
    with SidecarPublisher(agent.publish, context=ctx, timeout=5.0) as pub:
        with pytest.raises(HandshakeError, match="64-bit address space"):
            pub.publish(near_top)
        with pytest.raises(HandshakeError, match="wrong_engine"):
            pub.publish(foreign)
        pub.publish(worker(0))
        pub.publish(worker(1))
    fetch_ok(ctx, agent, worker(0), worker(1))
    assert http_get(agent.http + "/healthz")[0] == 200


def test_peers_that_never_read_cannot_grow_the_agent(
    agent: Agent, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    ranks = (big_worker(0, 128 << 10), big_worker(1, 128 << 10))
    with SidecarPublisher(agent.publish, context=ctx, timeout=5.0) as pub:
        for w in ranks:
            pub.publish(w)
    fetch_ok(ctx, agent, *ranks)
    rss_before = rss_bytes(agent.proc.pid)
    sink = ctx.socket(zmq.DEALER)  # sends and never reads: replies pile up on the agent's side
    sink.setsockopt(zmq.LINGER, 0)
    sink.setsockopt(zmq.RCVHWM, 1)
    sink.setsockopt(zmq.RCVBUF, 4096)
    try:
        sink.connect(f"tcp://{HOST}:{agent.side_port}")
        repeated = msgspec.msgpack.encode(MetadataRequest(engine_id=ENGINE, ranks=[0] * 1024))
        distinct = msgspec.msgpack.encode(MetadataRequest(engine_id=ENGINE, ranks=[0, 1]))
        for _ in range(1000):
            sink.send(repeated)
            sink.send(distinct)  # a 256 KiB reply each
        deadline = time.monotonic() + 60
        while handled(agent) < 2001:
            assert time.monotonic() < deadline, "the agent did not handle every request"
            time.sleep(0.2)
        growth = rss_bytes(agent.proc.pid) - rss_before
        fetch_ok(ctx, agent, *ranks)  # other peers are still served meanwhile
    finally:
        sink.close(linger=0)
    assert growth < RSS_GROWTH_LIMIT, f"agent RSS grew {growth / 2**20:.0f} MiB"


def test_a_publish_for_another_dp_rank_is_refused_naming_it(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    # Peers ask DP rank 1 on its own port: stored here, that rank would be acked and never served.
    with (
        in_process_sidecar() as sidecar,
        SidecarPublisher(sidecar.endpoints()["publish"], context=ctx, timeout=5.0) as pub,
    ):
        with pytest.raises(HandshakeError, match=r"wrong_engine.*dp_index 0 only, got dp_index 1"):
            pub.publish(msgspec.structs.replace(worker(0), dp_index=1))
        pub.publish(worker(0))
        assert sidecar.server.published() == {(ENGINE, 0): [0]}


def test_engine_id_longer_than_a_peer_can_request_is_a_config_error() -> None:
    config = json.loads(CONFIG)
    config["engine_id"] = "e" * 257
    res = dry_run("--config", json.dumps(config))
    assert res.returncode != 0
    assert "engine_id: expected at most 256 characters" in res.stderr


def test_healthz_fails_once_the_handshake_thread_is_gone() -> None:
    with in_process_sidecar() as sidecar:
        url = f"http://{HOST}:{sidecar.http_port}/healthz"
        assert http_get(url)[0] == 200
        crash_handshake_thread(sidecar)
        status, body = http_get(url)
        assert status == 503 and "handshake server stopped" in body


def agent_settings(*argv: str, **env: str) -> SidecarSettings:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return settings_from_args(parser.parse_args(["--config", CONFIG, *argv]), environ=env)


@pytest.mark.parametrize(
    "address", ["tcp://0.0.0.0:5600", "tcp://*:5600", "tcp://10.1.2.3:5600", "tcp://[::]:5600"]
)
def test_a_publish_address_other_hosts_reach_is_a_config_error(address: str) -> None:
    """Whoever reaches the publish socket can publish or unpublish the engine's ranks (CURVE
    admits every peer's client key alike): it must stay on this host."""
    with pytest.raises(ConfigError, match=r"--publish: expected ipc://PATH or tcp://(.|\n)*"):
        agent_settings("--publish", address)


@pytest.mark.parametrize(
    "address", ["tcp://127.0.0.1:5600", "tcp://[::1]:5600", "tcp://127.0.0.1:0", "ipc:///x/p"]
)
def test_a_local_publish_address_is_accepted(address: str) -> None:
    assert agent_settings("--publish", address).publish == address


@pytest.mark.parametrize(
    "address", ["tcp://127.0.0.1:99999", "tcp://127.0.0.1:abc", "tcp://127.0.0.1:", "tcp://[::1]:*"]
)
def test_a_publish_port_that_is_no_port_number_is_a_config_error(address: str) -> None:
    """libzmq binds 99999 as another port and refuses `abc` naming no flag, so both are refused
    while the settings are resolved, where --dry-run sees them too."""
    with pytest.raises(ConfigError, match=r"--publish: expected tcp://HOST:PORT with PORT an"):
        agent_settings("--publish", address)


def open_files_limit(pid: int) -> tuple[int, int]:
    """Process `pid`'s (soft, hard) open-files limit, as /proc shows it."""
    with open(f"/proc/{pid}/limits") as f:
        row = next(line for line in f if line.startswith("Max open files"))
    soft, hard = row.split()[3:5]
    return int(soft), int(hard)


def test_the_agent_raises_its_open_files_limit_to_the_hard_limit(tmp_path: Path) -> None:
    """Connections past a share of the soft limit are shed as idle: a container's usual
    soft limit of 1024 would cap the agent at a few hundred peers."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 512:
        pytest.skip(f"hard open-files limit {hard} leaves nothing to raise")
    top = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    agent = Agent(tmp_path, nofile=(256, top))
    try:
        assert open_files_limit(agent.proc.pid) == (top, top)
        assert http_get(agent.http + "/healthz")[0] == 200
    finally:
        agent.stop()


@pytest.mark.parametrize(
    ("variable", "value"),
    [("KVRDMA_METRICS_PORT", "9400"), ("KVRDMA_WORKER_METRICS", "127.0.0.1:9400")],
)
def test_an_own_metrics_endpoint_from_the_environment_is_blamed_on_its_variable(
    variable: str, value: str
) -> None:
    """--worker-metrics was never given, so the error must name the variable to change."""
    with pytest.raises(ConfigError, match=rf"^\${variable}: http://\S+ is this agent's own") as err:
        agent_settings("--http-port", "9400", **{variable: value})
    assert "--worker-metrics" not in str(err.value)


def own_address() -> str:
    """An address of this host other than loopback: the one its route off the host leaves from."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.7", 9))  # a UDP connect sends nothing
        except OSError:
            pytest.skip("no route off this host, so no address of its own but loopback")
        return str(probe.getsockname()[0])


def own_hostname() -> str:
    try:
        socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        pytest.skip(f"this host's name {socket.gethostname()!r} does not resolve")
    return socket.gethostname()


@pytest.mark.parametrize(
    "host",
    ["127.0.0.2", "[0:0:0:0:0:0:0:1]", "0.0.0.0", "[::ffff:127.0.0.1]", "LocalHost", own_hostname,
     own_address],
)  # fmt: skip
def test_a_worker_endpoint_reaching_the_agents_own_http_port_is_a_config_error(
    host: str | Callable[[], str],
) -> None:
    """Listening on 0.0.0.0, as in the pods, the agent answers on every address of this host,
    and scraping itself each /metrics request would start another."""
    endpoint = f"{host() if callable(host) else host}:19400"
    with pytest.raises(ConfigError, match=r"--worker-metrics: http://\S+ is this agent's own"):
        agent_settings(
            "--http-host", "0.0.0.0", "--http-port", "19400", "--worker-metrics", endpoint
        )


def test_a_worker_on_the_agents_port_at_an_address_it_does_not_listen_on_is_accepted() -> None:
    """An agent listening on 127.0.0.1 only and a rank on 127.0.0.2 (or ::1) at the same port
    are two servers."""
    endpoints = "127.0.0.2:19400,[::1]:19400"
    settings = agent_settings("--http-port", "19400", "--worker-metrics", endpoints)
    assert len(settings.worker_metrics) == 2
    with pytest.raises(ConfigError, match=r"is this agent's own"):
        agent_settings("--http-port", "19400", "--worker-metrics", "localhost:19400")


def test_worker_endpoints_on_other_hosts_or_ports_are_accepted() -> None:
    endpoints = "198.51.100.7:19400,127.0.0.1:19401,no-such-host.invalid:19402"
    assert agent_settings("--http-port", "19400", "--worker-metrics", endpoints).worker_metrics


def test_an_unresolvable_worker_host_on_the_agents_http_port_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whether it is this host is unknown, so it is refused, with a lookup that gives up instead
    of waiting out an unreachable DNS server."""

    real = socket.getaddrinfo

    def no_such_host(host: str, *args: Any) -> Any:
        if host != "h":
            return real(host, *args)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
    with pytest.raises(ConfigError, match=r"--worker-metrics: cannot tell whether (.|\n)*'h' does"):
        agent_settings("--http-port", "19400", "--worker-metrics", "h:19400")
    unblock = threading.Event()

    def hanging(host: str, *args: Any) -> Any:
        if host != "h":
            return real(host, *args)
        unblock.wait(10)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    monkeypatch.setattr(hosts, "RESOLVE_TIMEOUT_S", 0.2)
    try:
        with pytest.raises(ConfigError, match=r"does not resolve \(the resolver gave no answer"):
            agent_settings("--http-port", "19400", "--worker-metrics", "h:19400")
    finally:
        unblock.set()


@pytest.mark.parametrize("host", ["198.51.100.7", "no-such-interface"])
def test_a_side_channel_host_the_agent_cannot_bind_is_refused_by_dry_run(host: str) -> None:
    """The handshake server would fail to bind it at start: --dry-run says so first, naming
    the flag, or the variable it came from."""
    res = dry_run("--config", CONFIG, "--host", host)
    assert res.returncode != 0
    assert f"--host: expected a host name, address or interface of this host to bind the side " \
        f"channel on, got {host!r}: " in res.stderr  # fmt: skip
    res = dry_run("--config", CONFIG, VLLM_NIXL_SIDE_CHANNEL_HOST=host)
    assert res.returncode != 0
    assert "$VLLM_NIXL_SIDE_CHANNEL_HOST (--host): expected" in res.stderr


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    "host",
    [
        "lo",
        "127.0.0.1",
        "localhost",
        "0.0.0.0",
        pytest.param("::1", marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6")),
    ],
)
def test_side_channel_hosts_zmq_binds_are_accepted(host: str) -> None:
    """Interface names too: ZMQ binds them, though no resolver knows them."""
    assert agent_settings("--host", host).host == host


@pytest.mark.parametrize("http_host", ["no such host", "198.51.100.7"])
def test_an_http_host_the_agent_cannot_listen_on_is_blamed_on_http_host(http_host: str) -> None:
    """The settings refuse it already; settings made in code reach the bind, whose error must
    name the flag at fault all the same."""
    with pytest.raises(ConfigError, match=r"--http-host: expected a host name or address of th"):
        agent_settings("--http-host", http_host)
    with (
        pytest.raises(ConfigError, match=rf"^--http-host: cannot serve HTTP on {http_host}:0: "),
        in_process_sidecar(http_host=http_host),
    ):
        pass


def test_an_http_port_in_use_is_blamed_on_http_port() -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        with (
            pytest.raises(ConfigError, match=rf"^--http-port: cannot serve HTTP on {HOST}:{port}"),
            in_process_sidecar(http_port=port),
        ):
            pass
