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
import errno
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvrdma import defaults, telemetry
from kvrdma.cli.agent_settings import SidecarSettings, configure_parser, settings_from_args
from kvrdma.cli.main import LOG_LEVELS, log_level
from kvrdma.errors import ConfigError, KvrdmaError
from kvrdma.handshake.auth import CurveKeys
from kvrdma.handshake.monitors import raise_open_files_limit
from kvrdma.handshake.server import CONNECTION_DROPS, HandshakeServer
from kvrdma.http_server import EndpointServer, Responder, Response, metrics_responder
from kvrdma.scrape import aggregated_registry
from kvrdma.telemetry import metric_family

logger = logging.getLogger(__name__)

__all__ = [
    "AgentCollector",
    "Sidecar",
    "SidecarSettings",
    "agent_registry",
    "configure_parser",
    "main",
    "run",
    "settings_from_args",
]

_JSON = "application/json"


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
            flag = "--http-port" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else "--http-host"
            raise ConfigError(
                f"{flag}: cannot serve HTTP on {settings.http_host}:{settings.http_port}: {exc}"
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
    parser.add_argument(
        "--log-level",
        type=log_level,
        default="WARNING",
        help=f"logging level: {', '.join(LOG_LEVELS)} (default WARNING)",
    )
    configure_parser(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return run(args)
    except KvrdmaError as exc:
        print(f"kvrdma agent: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
