"""`kvrdma agent`: the handshake server as its own process (a Kubernetes sidecar).

The engine's workers publish their `WorkerMetadata` to the agent over a local socket
(`--publish`, ipc:// in a shared volume or tcp loopback; see `SidecarPublisher`), and the agent
answers peers' handshakes for them on the side channel (`--host`, `--port` + `--dp-index`).
HTTP on `--http-host:--http-port` serves `/healthz` (503 once the handshake thread is gone),
`/readyz` (all `--expected-ranks` TP ranks published, each with that TP size, and the handshake
thread running; 503 with the missing ranks or the problem otherwise)
and `/metrics`: the agent's own series merged with the engine ranks' `--worker-metrics`
endpoints, so one scrape of the pod reads every rank (`kvrdma.scrape`).
SIGTERM or SIGINT stops it within a second, exit status 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvrdma import defaults, telemetry
from kvrdma.config import (
    ENV_SIDE_CHANNEL_HOST,
    ENV_SIDE_CHANNEL_PORT,
    KVTransferConfig,
    load_kv_transfer_config,
)
from kvrdma.errors import ConfigError, KvrdmaError
from kvrdma.handshake.auth import ENV_CURVE_DIR, CurveKeys
from kvrdma.handshake.endpoints import loopback_tcp
from kvrdma.handshake.monitors import raise_open_files_limit
from kvrdma.handshake.server import CONNECTION_DROPS, HandshakeServer
from kvrdma.handshake.wire import MAX_RANKS_PER_REQUEST
from kvrdma.http_server import EndpointServer, Responder, Response, metrics_responder
from kvrdma.scrape import (
    DEFAULT_TIMEOUT_SECONDS,
    aggregated_registry,
    endpoint_url,
    worker_metrics_port,
)
from kvrdma.telemetry import metric_family

logger = logging.getLogger(__name__)

ENV_CONFIG = "KVRDMA_KV_TRANSFER_CONFIG"
ENV_WORKER_METRICS = "KVRDMA_WORKER_METRICS"
_MAX_WORKER_METRICS_TIMEOUT = 60.0
_LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", "::"})
_JSON = "application/json"


# ---------------------------------------------------------------------------- settings
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
        "Prometheus' scrape timeout)",
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
    base_port = args.port if args.port is not None else config.side_channel_base_port
    _check_port("--port", base_port)
    if args.dp_index < 0:
        raise ConfigError(f"--dp-index: expected an integer >= 0, got {args.dp_index}")
    if base_port and base_port + args.dp_index > 65535:
        raise ConfigError(
            f"--dp-index: base port {base_port} + dp-index {args.dp_index} exceeds 65535"
        )
    _check_port("--http-port", args.http_port)
    if not 1 <= args.expected_ranks <= MAX_RANKS_PER_REQUEST:  # the most a peer can ask for
        raise ConfigError(
            f"--expected-ranks: expected an integer in 1..{MAX_RANKS_PER_REQUEST}, "
            f"got {args.expected_ranks}"
        )
    curve_dir = args.curve_dir if args.curve_dir is not None else env.get(ENV_CURVE_DIR, "")
    if curve_dir:
        CurveKeys.load(curve_dir)  # refuse a missing or broken key directory before starting
    publish = str(args.publish)
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
        worker_metrics=_not_self(
            _worker_metrics(args.worker_metrics, env, args.expected_ranks), args.http_port
        ),
        worker_metrics_timeout=timeout,
    )


def _not_self(urls: tuple[str, ...], http_port: int) -> tuple[str, ...]:
    """Refuse a worker endpoint on this agent's own HTTP port: each scrape would start
    another scrape of itself."""
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        if http_port and parts.port == http_port and parts.hostname in _LOCAL_HOSTS:
            raise ConfigError(
                f"--worker-metrics: {url} is this agent's own /metrics (--http-port "
                f"{http_port}); expected the engine ranks' endpoints"
            )
    return urls


def _worker_metrics(
    flags: Sequence[str] | None, env: Mapping[str, str], ranks: int
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
    for item in (part.strip() for value in values for part in value.split(",")):
        if not item:
            continue
        try:
            url = endpoint_url(item)
        except ValueError as exc:
            raise ConfigError(f"{what}: {exc}") from None
        if url in urls:
            raise ConfigError(f"{what}: endpoint {item!r} is listed twice (as {url})")
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


# ---------------------------------------------------------------------------- the agent
class AgentCollector(Collector):
    """Reads a handshake server's counters at scrape time (the sidecar's own metrics).

    Names, help texts and labels come from the catalogue (`telemetry.AGENT_DOCS`).
    `readiness()` returns (ready, details), as `Sidecar.readiness` does.
    """

    def __init__(
        self,
        server: HandshakeServer,
        readiness: Callable[[], tuple[bool, Any]],
        own: tuple[str, int] | None = None,
    ) -> None:
        self._server = server
        self._readiness = readiness
        self._own = own  # the (engine_id, dp_index) this agent answers for

    def collect(self) -> Iterator[Metric]:
        stats = self._server.stats
        requests = metric_family(telemetry.AGENT_REQUESTS)
        for outcome in telemetry.AGENT_REQUEST_OUTCOMES:
            requests.add_metric([outcome], stats[f"requests_{outcome}"])
        yield requests
        publishes = metric_family(telemetry.AGENT_PUBLISHES)
        for outcome in telemetry.AGENT_PUBLISH_OUTCOMES:
            key = "unpublish_ok" if outcome == "unpublished" else f"publish_{outcome}"
            publishes.add_metric([outcome], stats[key])
        yield publishes
        dropped = metric_family(telemetry.AGENT_DROPPED_CONNECTIONS)
        for (sock, why), key in CONNECTION_DROPS.items():
            dropped.add_metric([sock.value, why.value], stats[key])
        yield dropped
        ranks = metric_family(telemetry.AGENT_PUBLISHED_RANKS)
        served = self._server.published()
        if self._own is not None:  # its own engine reads 0, not absent, with no rank published
            served.setdefault(self._own, [])
        for (engine_id, dp_index), published in served.items():
            ranks.add_metric([engine_id, str(dp_index)], len(published))
        yield ranks
        ready, _ = self._readiness()
        ready_family = metric_family(telemetry.AGENT_READY)
        ready_family.add_metric([], int(ready))
        yield ready_family


def agent_registry(
    settings: SidecarSettings, collector: Collector, *, own: CollectorRegistry | None = None
) -> CollectorRegistry:
    """What the agent's `/metrics` serves: its own series (`collector` and build info, in
    `own`) merged with its `--worker-metrics` endpoints' at scrape time."""
    own = own if own is not None else CollectorRegistry()
    own.register(collector)
    telemetry.build_info(own)
    return aggregated_registry(
        settings.worker_metrics, local=own, timeout=settings.worker_metrics_timeout
    )


class Sidecar:
    """The handshake server, its publish socket and the HTTP endpoints, started together."""

    def __init__(
        self, settings: SidecarSettings, *, registry: CollectorRegistry | None = None
    ) -> None:
        self.settings = settings
        self.server = HandshakeServer(
            settings.host,
            settings.port,
            enforce_compat=settings.enforce_compat,
            publish_address=settings.publish,
            curve=CurveKeys.load(settings.curve_dir) if settings.curve_dir else None,
            engine_id=settings.engine_id,
            dp_index=settings.dp_index,
        )
        self.registry = agent_registry(
            settings,
            AgentCollector(self.server, self.readiness, (settings.engine_id, settings.dp_index)),
            own=registry,
        )
        try:
            self._http = EndpointServer(
                settings.http_host,
                settings.http_port,
                _responder_for(self),
                name="agent-http",
                quick_paths=frozenset({defaults.HEALTHZ_PATH, defaults.READYZ_PATH}),
            )
        except OSError as exc:
            self.server.close()
            raise ConfigError(
                f"--http-port: cannot serve HTTP on {settings.http_host}:{settings.http_port}: "
                f"{exc}"
            ) from exc
        self.http_port = self._http.port
        self._closed = False

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, the JSON body of /readyz)."""
        s = self.settings
        metas = self.server.published_metadata(s.engine_id, s.dp_index)
        published = sorted(metas)
        missing = sorted(set(range(s.expected_ranks)) - set(published))
        # Ranks of a larger TP size than --expected-ranks would be asked for by peers and
        # never be waited for: the two settings disagree, which no restart fixes.
        sizes = sorted({meta.tp_size for meta in metas.values()} - {s.expected_ranks})
        alive = self.server.alive  # a dead handshake thread answers no peer routed here
        ready = alive and not missing and not sizes
        body: dict[str, Any] = {
            "ready": ready,
            "engine_id": s.engine_id,
            "dp_index": s.dp_index,
            "expected_ranks": s.expected_ranks,
            "published_ranks": published,
            "missing_ranks": missing,
        }
        if not alive:
            body["problem"] = "handshake server stopped"
        elif sizes:
            body["problem"] = (
                f"published ranks report tp_size {sizes}; expected {s.expected_ranks} "
                "(--expected-ranks must equal the engine's tensor-parallel size)"
            )
        return ready, body

    def endpoints(self) -> dict[str, str]:
        return {
            "side_channel": self.server.address,
            "publish": self.server.publish_address or "",
            "http": f"http://{self.settings.http_host}:{self.http_port}",
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._http.close()
        self.server.close()


def _responder_for(agent: Sidecar) -> Responder:
    metrics = metrics_responder(agent.registry)

    def respond(path: str, headers: Mapping[str, str]) -> Response:
        if path == defaults.HEALTHZ_PATH:
            # A dead handshake thread answers nobody: fail the liveness probe so it restarts.
            if not agent.server.alive:
                return Response(503, _JSON, b'{"status": "handshake server stopped"}\n')
            return Response(200, _JSON, b'{"status": "ok"}\n')
        if path == defaults.READYZ_PATH:
            ready, body = agent.readiness()
            return Response(200 if ready else 503, _JSON, (json.dumps(body) + "\n").encode())
        if path == defaults.METRICS_PATH:
            return metrics(path, headers)
        return Response(404, "text/plain; charset=utf-8", b"not found\n")

    return respond


# ---------------------------------------------------------------------------- entry points
def run(args: argparse.Namespace) -> int:
    """Run the agent until SIGTERM/SIGINT (or print the settings with --dry-run)."""
    settings = settings_from_args(args)
    if args.dry_run:
        print(json.dumps(settings.to_json(), indent=2, sort_keys=True))
        return 0
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("signal %d received, shutting down", signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        raise_open_files_limit()  # before the handshake server sizes its connection bound
        agent = Sidecar(settings)
        try:
            print(json.dumps({"event": "listening", **agent.endpoints()}), flush=True)
            logger.info(
                "kvrdma agent for engine %s serving %s, merging worker metrics from %s",
                settings.engine_id,
                agent.endpoints(),
                list(settings.worker_metrics) or "none",
            )
            while not stop.wait(0.1):
                pass
        finally:
            agent.close()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvrdma.cli.agent`: the agent without the `kvrdma` dispatcher."""
    parser = argparse.ArgumentParser(prog="kvrdma agent", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    configure_parser(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return run(args)
    except KvrdmaError as exc:
        print(f"kvrdma agent: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
