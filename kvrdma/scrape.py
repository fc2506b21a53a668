"""Scrape-time aggregation: one `/metrics` that merges a pod's worker ranks' endpoints.

Each worker rank serves its own registry on a pod-local port (`worker_metrics_port`); the
sidecar (`kvrdma agent --worker-metrics`) serves `aggregated_registry(endpoints,
local=its_own_registry)`. On every scrape the workers' endpoints are fetched concurrently
under one deadline, so a slow or dead worker costs the scrape at most `timeout` seconds and
shows as `kvrdma_worker_endpoint_up{endpoint} 0` instead of hanging it; the answers that
arrived in time are parsed after it (`kvrdma.metrics_text`), so the time a large answer takes
to parse never makes it late. `metrics/README.md` explains the choice.

One parent owning its child processes (`kvrdma demo`) may instead use prometheus-client's
multiprocess mode: children set `PROMETHEUS_MULTIPROC_DIR` before importing
`prometheus_client`, and the parent serves `multiprocess_registry(that_dir)`.
"""

from __future__ import annotations

import http.client
import io
import logging
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from kvrdma import defaults
from kvrdma.errors import ConfigError
from kvrdma.metrics_text import parse_families
from kvrdma.telemetry import ENDPOINT_UP, metric_family

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

DEFAULT_TIMEOUT_SECONDS = 2.0
MAX_BODY_BYTES = 64 << 20  # far above any worker's exposition; a runaway body is cut off
_CHUNK = 64 << 10


def endpoint_url(endpoint: str) -> str:
    """`host:port`, `http://host:port` or a full URL -> the URL of its `/metrics` page.

    Raises `ValueError` naming what was expected for anything else.
    """
    text = endpoint.strip()
    url = text if "://" in text else f"http://{text}"
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(f"expected HOST:PORT or http://HOST:PORT[/PATH], got {endpoint!r}")
    if parts.path in ("", "/"):
        url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/metrics", parts.query, ""))
    return url


class DeadlineReader(io.RawIOBase):
    """A socket's bytes, readable only until `deadline` (one budget for the whole read, where
    a socket timeout restarts with every byte). `makefile` is all `http.client.HTTPResponse`
    asks of a socket, so a response's headers and body can be read under it too."""

    def __init__(self, sock: socket.socket, deadline: float, what: str = "request") -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline
        self._what = what

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{self._what} not received before the read deadline")
        self._sock.settimeout(remaining)
        return self._sock.recv_into(buffer)

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(self)


def _fetch(url: str, deadline: float) -> str:
    """The body at `url`, or an exception once `deadline` (monotonic) passes."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(f"no time left to fetch {url}")
    parts = urllib.parse.urlsplit(url)
    connection = (
        http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    )
    conn = connection(parts.netloc, timeout=remaining)
    try:
        conn.connect()
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", target, headers={"Connection": "close"})
        reader = DeadlineReader(conn.sock, deadline, url)
        with http.client.HTTPResponse(reader, method="GET") as resp:  # type: ignore[arg-type]
            resp.begin()
            if not 200 <= resp.status < 300:
                raise http.client.HTTPException(f"{url}: HTTP {resp.status} {resp.reason}")
            chunks: list[bytes] = []
            size = 0
            while chunk := resp.read1(_CHUNK):
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise ValueError(f"{url}: body larger than {MAX_BODY_BYTES} bytes")
                chunks.append(chunk)
    finally:
        conn.close()
    return b"".join(chunks).decode("utf-8")


def _in_thread(fn: Callable[..., _T], *args: object) -> Future[_T]:
    """`fn(*args)` on a daemon thread: a straggler never holds up the interpreter's exit."""
    future: Future[_T] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="kvrdma-scrape", daemon=True).start()
    return future


class WorkerAggregator:
    """A collector that merges a local registry with the workers' `/metrics` at scrape time.

    Families of the same name and type become one (series differ by `tp_rank`/`role`; an
    exact duplicate such as the shared `kvrdma_build_info` is kept once), `_created` series
    are dropped (a worker's text exposition writes them as gauges `x_created`), and so is a
    worker's family that would expose a name an earlier family already exposes (a gauge
    `x_total` beside a counter `x`), with a warning. A worker that
    does not answer within `timeout` (for all endpoints together) has no series and
    `kvrdma_worker_endpoint_up{endpoint} 0`; the answers received in time are parsed once the
    fetches are over, so parsing neither counts against the deadline nor slows a fetch.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        local: CollectorRegistry | None = None,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout: expected seconds > 0, got {timeout!r}")
        self._endpoints: list[str] = []
        self._urls: dict[str, str] = {}
        for endpoint in endpoints:
            self.add_endpoint(endpoint)
        self._local = local
        self._timeout = timeout
        self._was_up: dict[str, bool] = {}
        self._clashes: set[tuple[str, str, str]] = set()

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    def add_endpoint(self, endpoint: str) -> None:
        """Scrape one more worker from now on (e.g. a restarted rank on a new port)."""
        if endpoint not in self._urls:
            self._urls[endpoint] = endpoint_url(endpoint)
            self._endpoints.append(endpoint)

    def describe(self) -> Iterable[Metric]:
        return ()  # no fetch at registration time

    def _scrape_all(self) -> list[list[Metric] | None]:
        deadline = time.monotonic() + self._timeout
        futures = [_in_thread(_fetch, self._urls[e], deadline) for e in self._endpoints]
        wait_futures(futures, timeout=max(0.0, deadline - time.monotonic()))
        return [self._result(e, f) for e, f in zip(self._endpoints, futures, strict=True)]

    def _result(self, endpoint: str, future: Future[str]) -> list[Metric] | None:
        """The families of what `endpoint` answered in time, or None (logged) if it did not
        answer in time or answered what is not a text exposition."""
        if not future.done():
            exc: BaseException | None = TimeoutError(f"no answer within {self._timeout:g} s")
        else:
            exc = future.exception()
        if exc is None:
            try:
                families = _without_created(parse_families(future.result()))
            except ValueError as bad:
                exc = bad
            else:
                self._was_up[endpoint] = True
                return families
        if not isinstance(exc, OSError | ValueError | http.client.HTTPException):
            logger.error("worker metrics endpoint %s: unexpected %r", endpoint, exc)
        elif self._was_up.get(endpoint, True):
            logger.warning("worker metrics endpoint %s not scraped: %s", endpoint, exc)
        self._was_up[endpoint] = False
        return None

    def collect(self) -> Iterator[Metric]:
        sources: list[tuple[str, Iterable[Metric]]] = []
        if self._local:
            sources.append(("the local registry", self._local.collect()))
        if not self._endpoints:
            yield from _merge(sources, self._clashes)
            return
        up = metric_family(ENDPOINT_UP)
        for endpoint, scraped in zip(self._endpoints, self._scrape_all(), strict=True):
            up.add_metric([endpoint], 0.0 if scraped is None else 1.0)
            sources.append((f"worker metrics endpoint {endpoint}", scraped or ()))
        yield from _merge([("this agent", [up]), *sources], self._clashes)


_CREATED_BY = ("counter", "summary", "histogram")
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "summary": ("_count", "_sum", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "info": ("_info",),
}


def _without_created(families: list[Metric]) -> list[Metric]:
    """`families` less the gauges (or untyped families) a text exposition writes for its
    counters', summaries' and histograms' `_created` series, which `_merge` drops from
    families collected directly too: Prometheus would store each as one more series per child
    that no kvrdma rule or panel reads, and the agent's own counters have none."""
    created = {f.name + "_created" for f in families if f.type in _CREATED_BY}
    return [f for f in families if f.type not in ("gauge", "unknown") or f.name not in created]


def _exposed_names(family: Metric) -> list[str]:
    """Every name `family` may show in an exposition: its own and its type's sample names."""
    return [family.name] + [family.name + s for s in _SUFFIXES.get(family.type, ())]


def _merge(
    sources: Iterable[tuple[str, Iterable[Metric]]], reported: set[tuple[str, str, str]]
) -> Iterator[Metric]:
    """Families of the same name and type become one; exact duplicate series and `_created`
    are dropped, and so is a family that would expose a name another family already owns.

    `sources` are (what they come from, their families), the first owning a name keeping it;
    `reported` holds the clashes already logged, each logged once.
    """
    merged: dict[str, Metric] = {}
    owners: dict[str, tuple[str, str]] = {}  # exposed name -> (family name, type) owning it
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for source, families in sources:
        for family in families:
            names = _exposed_names(family)
            mine = (family.name, family.type)
            clash = next((owners[n] for n in names if owners.get(n, mine) != mine), None)
            if clash is not None:
                if (source, *mine) not in reported:
                    reported.add((source, *mine))
                    logger.warning(
                        "%s: %s %s clashes with %s %s; dropped",
                        source, family.type, family.name, clash[1], clash[0],
                    )  # fmt: skip
                continue
            out = merged.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            owners.update(dict.fromkeys(names, mine))
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if not s.name.endswith("_created") and key not in seen:
                    seen.add(key)
                    out.samples.append(s)
    return (m for m in merged.values() if m.samples)


def aggregated_registry(
    endpoints: Sequence[str],
    *,
    local: CollectorRegistry | None = None,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
) -> CollectorRegistry:
    """The registry the sidecar serves: `local` (its own metrics) merged with its workers'.

    `endpoints` are `host:port` or URLs of the workers' metrics servers (pod-local, e.g.
    `127.0.0.1:9401`); `timeout` bounds the fetch of all of them together. Do not register
    `local` anywhere else you serve from this registry.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerAggregator(endpoints, local=local, timeout=timeout))
    return registry


def worker_metrics_port(tp_rank: int, environ: Mapping[str, str] | None = None) -> int | None:
    """Where an engine rank serves its `/metrics` (on 127.0.0.1): `$KVRDMA_METRICS_PORT` +
    `tp_rank`, the endpoints `kvrdma agent` merges; None when the variable is unset or empty."""
    env = os.environ if environ is None else environ
    raw = env.get(defaults.ENV_METRICS_PORT, "").strip()
    if not raw:
        return None
    # the base alone decides, so that every rank of an engine accepts or refuses it alike
    if not raw.isdigit() or int(raw) < 1 or int(raw) + tp_rank > 65535:
        raise ConfigError(
            f"{defaults.ENV_METRICS_PORT}: expected a base port of at least 1 such that base "
            f"+ TP rank {tp_rank} is at most 65535, got {raw!r}"
        )
    return int(raw) + tp_rank


def multiprocess_registry(path: str) -> CollectorRegistry:
    """A registry over every process writing to a multiprocess directory.

    For a parent that owns its metric-writing children (they set `PROMETHEUS_MULTIPROC_DIR`
    to `path` before importing prometheus_client, and the parent calls
    `prometheus_client.multiprocess.mark_process_dead(pid, path)` when one exits). Counters
    and histograms are summed over processes; gauges over live processes.
    """
    registry = CollectorRegistry(auto_describe=False)
    MultiProcessCollector(registry, path=path)
    return registry
