"""The dashboard and the rules, proven against a real Prometheus scraping a running target.

`promtool check rules` and `promtool test rules` must pass. Then a target serving kvrdma
metrics (with faults injected) is scraped every second by Prometheus with the recording and
alert rules loaded, and every expression of every dashboard panel, every template variable,
every recording rule (its expression and its recorded series) and every alert rule must
return data through the HTTP API; every alert must be active (pending or firing).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "metrics" / "prometheus"
RULE_FILES = sorted(PROM_DIR.glob("*_rules.yml"))
RULE_TESTS = sorted((PROM_DIR / "tests").glob("*.yml"))
DATA_TIMEOUT_S = 40.0

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from metrics.dashboard import panel_expressions, render, variable_queries  # noqa: E402


@dataclass(frozen=True)
class MetricsTarget:
    command: list[str]
    # True when the target's faults push every alert over its threshold; when False, alert
    # expressions are queried with their numeric comparisons removed (data, not alerts).
    trips_every_alert: bool = True
    # False for a target that moves no stage-to-stage traffic (the `kvrdma_stage_*` panels).
    moves_stages: bool = True
    # alerts whose condition the target never meets: they must stay inactive
    quiet_alerts: frozenset[str] = frozenset()


@pytest.fixture(params=["demo", "scripted"])
def metrics_target(request: pytest.FixtureRequest) -> Callable[[int], MetricsTarget]:
    """The process Prometheus scrapes, given the port to serve /metrics on.

    "demo": the real `kvrdma demo` (P and D rank processes with real NIXL, the parent
    aggregating their metrics like the sidecar), with steady traffic and a producer killed
    and restarted mid-run, so transfer, failure, invalid-block, handshake and endpoint-down
    series all move. It cannot push every alert over its
    threshold, so alert expressions are checked for data without their comparisons.
    "scripted": a small target that drives every alert over its threshold.
    """
    if request.param == "demo":
        demo = shlex.split(
            "--no-progress --fault restart-producer --fault-at 0.25 --requests 400 "
            "--request-interval 0.1 --read-deadline 1 --linger 120 "
            "--model-shape layers=2,heads=4,head_dim=32"
        )
        return lambda port: MetricsTarget(
            [sys.executable, "-m", "kvrdma", "demo", "--metrics-port", str(port), *demo],
            trips_every_alert=False,
            moves_stages=False,
            quiet_alerts=frozenset({"KvrdmaAgentNotReady"}),  # its sidecar is always ready
        )
    script = Path(__file__).with_name("_metrics_target.py")
    return lambda port: MetricsTarget([sys.executable, str(script), "--metrics-port", str(port)])


def substitute(expr: str) -> str:
    """Grafana's variables as Grafana would expand them with "All" selected."""
    expr = re.sub(r"\$\{?__(?:rate_interval|interval|range)\}?", "1m", expr)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def without_threshold(expr: str) -> str:
    """`expr` with every comparison against a number removed (`a > 0.05` -> `a`)."""
    return re.sub(r"\s*(?:[<>]=?|[=!]=)\s*(?:bool\s+)?[-+]?[0-9][0-9.e+-]*", "", expr)


def rules() -> list[dict[str, Any]]:
    return [
        rule
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
    ]


def test_substitute_and_without_threshold() -> None:
    assert substitute('rate(x{a=~"$engine_id", b=~"${role}"}[$__rate_interval])') == (
        'rate(x{a=~".*", b=~".*"}[1m])'
    )
    assert without_threshold("a == 0 and on (x) b > 0") == "a and on (x) b"
    assert without_threshold("r:x:ratio_rate5m > 0.05") == "r:x:ratio_rate5m"


def test_promtool_check_rules(promtool: str) -> None:
    out = subprocess.run(
        [promtool, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(RULE_FILES)


def test_promtool_test_rules(promtool: str) -> None:
    assert RULE_TESTS
    out = subprocess.run(
        [promtool, "test", "rules", *map(str, RULE_TESTS)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(180)
def test_every_dashboard_and_rule_expression_has_live_data(
    promtool: str,
    start_process: Callable[..., subprocess.Popen[bytes]],
    start_prometheus: Callable[..., Any],
    metrics_target: Callable[[int], MetricsTarget],
    unused_tcp_port: int,
    wait_for: Callable[..., None],
) -> None:
    port = unused_tcp_port
    target = metrics_target(port)
    proc = start_process(target.command)
    metrics_url = f"http://127.0.0.1:{port}/metrics"

    def target_up() -> bool:
        assert proc.poll() is None, f"target exited with {proc.returncode}"
        with urllib.request.urlopen(metrics_url, timeout=2) as resp:
            return bool(resp.status == 200)

    wait_for("the metrics target to serve /metrics", target_up, timeout=60)
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        exposition = resp.read()
    lint = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True)
    assert lint.returncode == 0, (lint.stdout + lint.stderr).decode()

    prom = start_prometheus([f"127.0.0.1:{port}"], RULE_FILES)
    dashboard = json.loads(render())
    checks: dict[str, Callable[[], bool]] = {}
    for title, expr in panel_expressions(dashboard):
        if "kvrdma_stage_" in expr and not target.moves_stages:
            continue
        e = substitute(expr)
        checks[f"panel {title!r}: {e}"] = lambda e=e: prom.has_data(e)
    for name, query in variable_queries(dashboard):
        if "kvrdma_stage_" in query and not target.moves_stages:
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", substitute(query))
        assert m, query
        selector, label = m.groups()
        checks[f"variable {name}: {query}"] = lambda s=selector, lbl=label: bool(
            prom.api(f"label/{lbl}/values", **{"match[]": s})
        )
    alerts = set()
    for rule in rules():
        if "record" in rule:
            checks[f"recording rule {rule['record']} expr"] = lambda e=rule["expr"]: prom.has_data(
                e
            )
            checks[f"recorded series {rule['record']}"] = lambda n=rule["record"]: prom.has_data(n)
        else:
            alerts.add(rule["alert"])
            if "kvrdma_stage_" in rule["expr"] and not target.moves_stages:
                continue
            e = rule["expr"] if target.trips_every_alert else without_threshold(rule["expr"])
            checks[f"alert {rule['alert']}: {e}"] = lambda e=e: prom.has_data(e)

    def rules_healthy() -> bool:
        groups = prom.api("rules")["groups"]
        states = [r["health"] for g in groups for r in g["rules"]]
        return len(states) == len(rules()) and set(states) == {"ok"}

    def active() -> set[str]:
        return {a["labels"]["alertname"] for a in prom.api("alerts")["alerts"]}

    def alerts_active() -> bool:
        return active() >= alerts

    checks["every rule evaluated without error"] = rules_healthy
    if target.trips_every_alert:
        checks["every alert pending or firing"] = alerts_active

    pending = dict(checks)
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while pending and time.monotonic() < deadline:
        assert proc.poll() is None, f"target exited with {proc.returncode}"
        pending = {name: check for name, check in pending.items() if not check()}
        if pending:
            time.sleep(0.5)
    assert not pending, (
        f"{len(pending)} of {len(checks)} checks returned no data within {DATA_TIMEOUT_S:.0f}s:\n"
        + "\n".join(pending)
        + f"\n--- targets: {prom.api('targets')['activeTargets']}\n--- prometheus log:\n"
        + prom.log_tail()
    )
    assert not active() & target.quiet_alerts, "an alert fired whose condition the target lacks"
