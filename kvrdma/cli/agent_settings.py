"""`kvrdma agent`'s flags and the settings they resolve to, with the environment and the config.

Every value the agent would refuse at start is refused here, so `--dry-run` catches it too.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import os
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvrdma import defaults
from kvrdma.cli.hosts import is_local, listen_problem, resolve, side_channel_problem
from kvrdma.config import (
    ENV_SIDE_CHANNEL_HOST,
    ENV_SIDE_CHANNEL_PORT,
    KVTransferConfig,
    load_kv_transfer_config,
)
from kvrdma.errors import ConfigError
from kvrdma.handshake.auth import ENV_CURVE_DIR, CurveKeys
from kvrdma.handshake.endpoints import loopback_tcp, tcp_port
from kvrdma.handshake.wire import MAX_RANKS_PER_REQUEST
from kvrdma.scrape import DEFAULT_TIMEOUT_SECONDS, endpoint_url, worker_metrics_port

ENV_CONFIG = "KVRDMA_KV_TRANSFER_CONFIG"
ENV_WORKER_METRICS = "KVRDMA_WORKER_METRICS"
_MAX_WORKER_METRICS_TIMEOUT = 60.0


@dataclass(frozen=True)
class SidecarSettings:
    """Everything the agent needs, resolved from flags, environment and the config."""

    engine_id: str
    kv_role: str
    enforce_compat: bool
    host: str
    base_port: int  # 0 = any free port
    dp_index: int
    http_host: str
    http_port: int
    publish: str
    expected_ranks: int
    curve_dir: str = ""  # CURVE key directory; "" = plaintext side channel
    worker_metrics: tuple[str, ...] = ()  # the engine ranks' /metrics URLs, merged into ours
    worker_metrics_timeout: float = DEFAULT_TIMEOUT_SECONDS

    @property
    def port(self) -> int:
        """The side-channel port: base port + DP index (0 stays 0: any free port)."""
        return self.base_port + self.dp_index if self.base_port else 0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "port": self.port}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the `kvrdma agent` flags to `parser`."""
    parser.add_argument(
        "--config",
        help="vLLM kv_transfer_config: a JSON string or a path to a JSON file "
        f"(default: ${ENV_CONFIG}); engine_id is required",
    )
    parser.add_argument(
        "--host",
        help=f"side-channel bind host (default: ${ENV_SIDE_CHANNEL_HOST} or "
        f"{defaults.SIDE_CHANNEL_HOST})",
    )
    parser.add_argument(
        "--port",
        type=int,
        help=f"side-channel base port; the agent binds base + dp-index, 0 = any free port "
        f"(default: ${ENV_SIDE_CHANNEL_PORT} or {defaults.SIDE_CHANNEL_PORT})",
    )
    parser.add_argument("--dp-index", type=int, default=0, help="data-parallel index (default 0)")
    parser.add_argument(
        "--http-host",
        default="127.0.0.1",
        help="bind host of /healthz, /readyz, /metrics (default 127.0.0.1; pods use 0.0.0.0)",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=defaults.AGENT_HTTP_PORT,
        help=f"HTTP port, 0 = any free port (default {defaults.AGENT_HTTP_PORT})",
    )
    parser.add_argument(
        "--publish",
        default=defaults.PUBLISH_ADDRESS,
        help="address workers publish their metadata to: ipc://PATH (its directory is "
        f"created) or tcp://127.0.0.1:PORT (default {defaults.PUBLISH_ADDRESS})",
    )
    parser.add_argument(
        "--expected-ranks",
        type=int,
        default=1,
        help="TP ranks that must be published before /readyz answers 200 (default 1)",
    )
    parser.add_argument(
        "--curve-dir",
        help=f"CURVE key directory (made by 'kvrdma keygen'): encrypt the handshake and publish "
        f"sockets and admit only clients with an authorized key (default: ${ENV_CURVE_DIR}; "
        "unset = plaintext)",
    )
    parser.add_argument(
        "--worker-metrics",
        action="append",
        metavar="URL[,URL...]",
        help="an engine rank's /metrics endpoint (HOST:PORT or http://HOST:PORT[/PATH]) whose "
        "series this agent's /metrics merges in, with kvrdma_worker_endpoint_up per endpoint; "
        f"repeat or comma-separate (default: ${ENV_WORKER_METRICS}, comma-separated; else, "
        f"with ${defaults.ENV_METRICS_PORT} set, 127.0.0.1:PORT+RANK for each expected rank)",
    )
    parser.add_argument(
        "--worker-metrics-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help="how long one scrape waits for all worker endpoints together; one that has not "
        f"answered by then reads as down (default {DEFAULT_TIMEOUT_SECONDS:g}; keep it below "
        "Prometheus' scrape timeout, leaving time to parse the answers)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config, print the effective settings as JSON and exit",
    )


def settings_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> SidecarSettings:
    """Resolve flags, environment and config into settings; raises ConfigError."""
    env = os.environ if environ is None else environ
    source = args.config if args.config is not None else env.get(ENV_CONFIG)
    if source is None or not str(source).strip():
        raise ConfigError(
            f"--config: expected a kv_transfer_config JSON string or file path (or ${ENV_CONFIG}), "
            "got nothing"
        )
    config = _load_config(source, env)
    host = args.host if args.host is not None else config.side_channel_host
    if not host or not host.strip():
        raise ConfigError(f"--host: expected a host name or address, got {host!r}")
    problem = side_channel_problem(host)
    if problem is not None:
        flag = "--host" if args.host is not None else f"${ENV_SIDE_CHANNEL_HOST} (--host)"
        raise ConfigError(
            f"{flag}: expected a host name, address or interface of this host to bind the side "
            f"channel on, got {host!r}: {problem}"
        )
    base_port = args.port if args.port is not None else config.side_channel_base_port
    _check_port("--port", base_port)
    if args.dp_index < 0:
        raise ConfigError(f"--dp-index: expected an integer >= 0, got {args.dp_index}")
    if base_port and base_port + args.dp_index > 65535:
        raise ConfigError(
            f"--dp-index: base port {base_port} + dp-index {args.dp_index} exceeds 65535"
        )
    _check_port("--http-port", args.http_port)
    problem = listen_problem(args.http_host)
    if problem is not None:
        raise ConfigError(
            f"--http-host: expected a host name or address of this host to serve HTTP on, "
            f"got {args.http_host!r}: {problem}"
        )
    if not 1 <= args.expected_ranks <= MAX_RANKS_PER_REQUEST:  # the most a peer can ask for
        raise ConfigError(
            f"--expected-ranks: expected an integer in 1..{MAX_RANKS_PER_REQUEST}, "
            f"got {args.expected_ranks}"
        )
    curve_dir = args.curve_dir if args.curve_dir is not None else env.get(ENV_CURVE_DIR, "")
    if curve_dir:
        CurveKeys.load(curve_dir)  # refuse a missing or broken key directory before starting
    publish = str(args.publish)
    if publish.startswith("tcp://") and tcp_port(publish) is None:
        raise ConfigError(
            f"--publish: expected tcp://HOST:PORT with PORT an integer in 0..65535 "
            f"(0 = any free port), got {publish!r}"
        )
    if not (publish.startswith("ipc://") and len(publish) > 6) and not loopback_tcp(publish):
        # whoever reaches it can publish or unpublish the engine's ranks: it stays on this host
        raise ConfigError(
            f"--publish: expected ipc://PATH or tcp://HOST:PORT with a loopback HOST "
            f"(127.0.0.1, [::1]), got {publish!r}"
        )
    timeout = args.worker_metrics_timeout
    if not 0 < timeout <= _MAX_WORKER_METRICS_TIMEOUT:
        raise ConfigError(
            f"--worker-metrics-timeout: expected seconds in (0, {_MAX_WORKER_METRICS_TIMEOUT:g}], "
            f"got {timeout}"
        )
    return SidecarSettings(
        engine_id=config.engine_id,
        kv_role=config.kv_role,
        enforce_compat=config.extra.enforce_handshake_compat,
        host=host,
        base_port=base_port,
        dp_index=args.dp_index,
        http_host=args.http_host,
        http_port=args.http_port,
        publish=publish,
        expected_ranks=args.expected_ranks,
        curve_dir=str(curve_dir),
        worker_metrics=_worker_metrics(
            args.worker_metrics, env, args.expected_ranks, (args.http_host, args.http_port)
        ),
        worker_metrics_timeout=timeout,
    )


def _listened(http_host: str) -> set[str]:
    """The addresses the agent's HTTP server listens on; empty for every address of this host."""
    listens = {a for _, a in resolve(http_host)} if http_host else set()
    if any(ipaddress.ip_address(a).is_unspecified for a in listens):
        return set()
    return listens


def _check_not_self(what: str, url: str, http_port: int, listened: Callable[[], set[str]]) -> None:
    """Refuse a worker endpoint that reaches this agent's own HTTP server (on `http_port`, at
    `listened()`: see `_listened`), by any name or address of this machine it listens on,
    naming where it came from (`what`): each scrape would start another scrape of itself."""
    parts = urllib.parse.urlsplit(url)
    if not http_port or parts.port != http_port:
        return
    listens = listened()
    host = parts.hostname or ""
    try:
        addresses = resolve(host)
    except OSError as exc:
        raise ConfigError(
            f"{what}: cannot tell whether {url} is this agent's own /metrics (--http-port "
            f"{http_port}): {host!r} does not resolve ({exc}); expected an engine rank's "
            "endpoint whose host resolves"
        ) from None
    for family, address in addresses:
        if address in listens if listens else is_local(family, address):
            where = host if address == host else f"{host} resolves to {address}"
            raise ConfigError(
                f"{what}: {url} is this agent's own /metrics ({where}, an address of this "
                f"host; --http-port {http_port}); expected the engine ranks' endpoints"
            )


def _worker_metrics(
    flags: Sequence[str] | None, env: Mapping[str, str], ranks: int, http: tuple[str, int]
) -> tuple[str, ...]:
    """The engine ranks' /metrics URLs: `--worker-metrics`, else `$KVRDMA_WORKER_METRICS`, else
    127.0.0.1:`$KVRDMA_METRICS_PORT` + rank for each expected rank (where the ranks serve)."""
    if flags is not None:
        what, values = "--worker-metrics", list(flags)
    elif env.get(ENV_WORKER_METRICS, "").strip():
        what, values = f"${ENV_WORKER_METRICS}", [env[ENV_WORKER_METRICS]]
    else:
        ports = [worker_metrics_port(rank, env) for rank in range(ranks)]
        what, values = f"${defaults.ENV_METRICS_PORT}", [f"127.0.0.1:{p}" for p in ports if p]
    urls: list[str] = []
    http_host, http_port = http
    listened = functools.cache(lambda: _listened(http_host))  # looked up once, if at all
    for item in (part.strip() for value in values for part in value.split(",")):
        if not item:
            continue
        try:
            url = endpoint_url(item)
        except ValueError as exc:
            raise ConfigError(f"{what}: {exc}") from None
        if url in urls:
            raise ConfigError(f"{what}: endpoint {item!r} is listed twice (as {url})")
        _check_not_self(what, url, http_port, listened)
        urls.append(url)
    return tuple(urls)


def _load_config(source: str, env: Mapping[str, str]) -> KVTransferConfig:
    config = load_kv_transfer_config(source, environ=env)
    # The parser invents a random engine_id when none is given (vLLM does the same); a sidecar
    # must answer for the id its workers publish, so it has to be set: two loads disagree
    # exactly when it was invented.
    if load_kv_transfer_config(source, environ=env).engine_id != config.engine_id:
        raise ConfigError(
            "engine_id: expected the engine id the workers use (the sidecar answers for it), "
            "got none in the kv_transfer_config"
        )
    return config


def _check_port(flag: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ConfigError(f"{flag}: expected an integer in 0..65535, got {port}")
