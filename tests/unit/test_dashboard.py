"""The Grafana dashboard, the Prometheus rules and METRICS.md agree with kvrdma.telemetry."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from kvrdma import telemetry

ROOT = Path(__file__).resolve().parents[2]
METRICS = ROOT / "metrics"
RULE_FILES = sorted((METRICS / "prometheus").glob("*_rules.yml"))
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _load(name: str) -> ModuleType:
    """Import metrics/<name>.py (metrics/ holds scripts beside the package, not installed)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"metrics.{name}")


dashboard_mod = _load("dashboard")
generate_mod = _load("generate")
DASHBOARD: dict[str, Any] = json.loads((METRICS / "grafana" / "kvrdma.json").read_text())


def rules() -> list[dict[str, Any]]:
    return [
        rule
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
    ]


def referenced_names(expr: str) -> set[str]:
    """Metric and recording-rule names a PromQL expression reads."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    clause = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"
    expr = re.sub(clause, "", expr)
    return {n for n in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr) if "kvrdma" in n}


def exported_series(name: str) -> str | None:
    """The METRIC_DOCS name a series name belongs to, or None."""
    docs = {d.name: d for d in telemetry.METRIC_DOCS}
    if name in docs:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and base in docs and docs[base].type == "histogram":
            return base
    return None


def all_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) for every dashboard query, variable query and rule."""
    out = [(f"panel {t}", e) for t, e in dashboard_mod.panel_expressions(DASHBOARD)]
    out += [(f"variable {n}", q) for n, q in dashboard_mod.variable_queries(DASHBOARD)]
    out += [(f"rule {r.get('record') or r.get('alert')}", r["expr"]) for r in rules()]
    return out


def test_referenced_names_parser() -> None:
    expr = (
        'sum without (outcome) (a:kvrdma_x:rate5m{outcome!="kvrdma_no"}) / '
        'histogram_quantile(0.9, sum by (le) (rate(kvrdma_y_bucket{a=~"$b"}[$__rate_interval])))'
        " and on (engine_id) kvrdma_z > 0"
    )
    assert referenced_names(expr) == {"a:kvrdma_x:rate5m", "kvrdma_y_bucket", "kvrdma_z"}


def test_committed_files_equal_what_the_generators_produce() -> None:
    for path, text in generate_mod.generated().items():
        assert path.read_text() == text, f"{path} is stale: run python metrics/generate.py"
    assert generate_mod.main(["--check"]) == 0


def test_every_referenced_name_is_exported_or_recorded() -> None:
    recorded = {r["record"] for r in rules() if "record" in r}
    dangling = [
        (where, name)
        for where, expr in all_expressions()
        for name in referenced_names(expr)
        if not (name in recorded if ":" in name else exported_series(name))
    ]
    assert not dangling


def test_every_exported_metric_is_on_the_dashboard() -> None:
    on_dashboard = {
        exported_series(n)
        for _, e in dashboard_mod.panel_expressions(DASHBOARD)
        for n in referenced_names(e)
    }
    assert telemetry.metric_names() - on_dashboard == set()


def test_every_worker_panel_honours_the_template_variables() -> None:
    worker_metrics = {d.name for d in telemetry.METRIC_DOCS if "engine_id" in d.labels}
    for title, expr in dashboard_mod.panel_expressions(DASHBOARD):
        names = {exported_series(n) for n in referenced_names(expr)}
        if names & worker_metrics:
            for var in ("engine_id", "role", "tp_rank"):
                assert expr.count(f'{var}=~"${var}"') == len(re.findall(r"kvrdma_\w+\{", expr)), (
                    title,
                    expr,
                )


def test_every_transfer_panel_draws_each_mode_apart() -> None:
    with_mode = {d.name for d in telemetry.METRIC_DOCS if "mode" in d.labels}
    split = 0
    for title, expr in dashboard_mod.panel_expressions(DASHBOARD):
        if {exported_series(n) for n in referenced_names(expr)} & with_mode:
            split += 1
            clauses = re.findall(r"\bby\s*\(([^)]*)\)", expr)
            assert clauses, (title, expr)
            for clause in clauses:
                assert "mode" in (label.strip() for label in clause.split(",")), (title, expr)
    assert split >= len(with_mode)


def test_every_counter_panel_says_where_it_happened() -> None:
    """Failures and outcomes are read per local engine, and per remote engine where the series
    has one: a failure summed over them cannot be traced to a pair of engines."""
    counters = {
        d.name: d for d in telemetry.METRIC_DOCS if d.type == "counter" and "engine_id" in d.labels
    }
    checked = set()
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", []):
            read = {exported_series(n) for n in referenced_names(target["expr"])} & set(counters)
            if not read:
                continue
            checked |= read
            need = {"engine_id"}
            need |= {"remote_engine"} & {label for n in read for label in counters[n].labels}
            for clause in re.findall(r"\bby\s*\(([^)]*)\)", target["expr"]):
                kept = {label.strip() for label in clause.split(",")}
                assert need <= kept, (panel["title"], target["expr"])
            for label in need:
                assert f"{{{{{label}}}}}" in target["legendFormat"], (panel["title"], target)
    assert checked == set(counters)


def test_dashboard_structure() -> None:
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("engine_id", "role", "tp_rank"):
        v = variables[name]
        assert v["type"] == "query" and v["definition"].startswith("label_values(")
        assert v["definition"].endswith(f", {name})")
        assert v["includeAll"] and v["allValue"] == ".*"
    panels = DASHBOARD["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == [
        "Throughput",
        "Latency",
        "Transfer sizes",
        "Failures and invalid blocks",
        "Handshakes",
        "Registration",
        "Peers",
        "Sidecar agent",
        "Stage-to-stage",
    ]
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"] and all(t["datasource"] == p["datasource"] for t in p["targets"])
        assert p["fieldConfig"]["defaults"]["unit"]
    text = json.dumps(DASHBOARD)
    for q in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({q}, sum by (mode, le) (rate(kvrdma_transfer_duration" in text
    assert "rate(kvrdma_transfer_bytes_sum" in text  # throughput in bytes/s
    assert "rate(kvrdma_stage_transfer_bytes_sum" in text  # stage-pair throughput
    assert "histogram_quantile(0.99, sum by (peer_stage, stage, le)" in text
    assert '"uid": "prometheus"' not in text  # no hard-coded data source


def test_every_stage_panel_honours_the_pipeline_variable() -> None:
    stage_metrics = {d.name for d in telemetry.STAGE_DOCS}
    stage_panels = 0
    for title, expr in dashboard_mod.panel_expressions(DASHBOARD):
        if {exported_series(n) for n in referenced_names(expr)} & stage_metrics:
            stage_panels += 1
            selectors = len(re.findall(r"kvrdma_\w+\{", expr))
            assert expr.count('pipeline=~"$pipeline"') == selectors, (title, expr)
    assert stage_panels == len(dashboard_mod.STAGE_PANELS)


def test_every_alert_has_a_firing_and_a_not_firing_promtool_test() -> None:
    alerts = {r["alert"] for r in rules() if "alert" in r}
    firing: set[str] = set()
    silent: set[str] = set()
    for path in (METRICS / "prometheus" / "tests").glob("*.yml"):
        doc = yaml.safe_load(path.read_text())
        assert {"../recording_rules.yml", "../alert_rules.yml"} <= set(doc["rule_files"])
        for test in doc["tests"]:
            for case in test.get("alert_rule_test", []):
                (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    assert alerts == firing == silent


def test_every_alert_has_a_row_in_the_readme() -> None:
    readme = (METRICS / "README.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `(Kvrdma\w+)` \|", readme, re.MULTILINE))
    assert rows == {r["alert"] for r in rules() if "alert" in r}


def test_alerts_are_labelled_and_annotated() -> None:
    for rule in rules():
        if "alert" in rule:
            assert rule["alert"].startswith("Kvrdma")
            assert rule["labels"]["severity"] in {"warning", "critical"}
            assert {"summary", "description"} <= set(rule["annotations"])
        else:
            assert re.fullmatch(r"[a-z_]+:kvrdma_[a-z0-9_]+:[a-z0-9_]+", rule["record"])


def test_metrics_md_lists_every_metric_bucket_and_the_vllm_mapping() -> None:
    text = (METRICS / "METRICS.md").read_text()
    for d in telemetry.METRIC_DOCS:
        labels = ", ".join(f"`{label}`" for label in d.labels)
        assert f"| `{d.name}` | {d.type} | {labels} | {d.help} |" in text
    for vllm_name, ours in telemetry.VLLM_PARITY.items():
        assert f"| `{vllm_name}` | `{ours}` |" in text
    assert "10 µs, 25 µs" in text and "1 KiB, 4 KiB" in text and "4 GiB" in text
    assert "262144, 1048576" in text


def test_readme_links_the_generated_metrics_reference() -> None:
    """The README sends readers to metrics/METRICS.md, which lists every series (above)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert "(metrics/METRICS.md)" in readme
    assert (METRICS / "METRICS.md").is_file()


# The values a label of a series can take, where kvrdma.telemetry fixes them.
LABEL_VALUES: dict[tuple[str, str], tuple[str, ...]] = {
    **{(d.name, "mode"): telemetry.TRANSFER_MODES for d in telemetry.METRIC_DOCS
       if "mode" in d.labels},
    **{(d.name, "role"): telemetry.ROLES for d in telemetry.METRIC_DOCS if "role" in d.labels},
    (telemetry.TRANSFERS.name, "outcome"): telemetry.TRANSFER_OUTCOMES,
    (telemetry.HANDSHAKES.name, "outcome"): telemetry.HANDSHAKE_OUTCOMES,
    (telemetry.REQUESTS.name, "outcome"): telemetry.REQUEST_OUTCOMES,
    (telemetry.FAILED_NOTIFICATIONS.name, "reason"): telemetry.NOTIFICATION_FAILURE_REASONS,
    (telemetry.FREED_BLOCKS.name, "reason"): telemetry.FREED_BLOCK_REASONS,
    (telemetry.AGENT_REQUESTS.name, "outcome"): telemetry.AGENT_REQUEST_OUTCOMES,
    (telemetry.AGENT_PUBLISHES.name, "outcome"): telemetry.AGENT_PUBLISH_OUTCOMES,
    (telemetry.AGENT_DROPPED_CONNECTIONS.name, "socket"): telemetry.AGENT_SOCKETS,
    (telemetry.AGENT_DROPPED_CONNECTIONS.name, "reason"): telemetry.CONNECTION_DROP_REASONS,
    (telemetry.STAGE_TRANSFERS.name, "outcome"): telemetry.STAGE_OUTCOMES,
    (telemetry.STAGE_TRANSFERS.name, "direction"): telemetry.STAGE_DIRECTIONS,
}  # fmt: skip
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = frozenset({"instance", "job"})
MATCHER = re.compile(r'([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def series_labels(name: str, recorded: dict[str, str]) -> set[str]:
    """The labels a series may carry: the catalogue's (plus `le` on buckets), or for a
    recording rule those of everything it reads (a superset: enough to catch a label that
    exists on none of them)."""
    if name in recorded:
        return {
            label for n in referenced_names(recorded[name]) for label in series_labels(n, recorded)
        }
    base = exported_series(name)
    assert base is not None, name
    docs = {d.name: d for d in telemetry.METRIC_DOCS}
    return {*docs[base].labels, *TARGET_LABELS, *(("le",) if name.endswith("_bucket") else ())}


def label_problems(expr: str, recorded: dict[str, str]) -> list[str]:
    """Labels an expression matches, groups or joins by that no series it reads carries,
    and literal label values the catalogue never exports."""
    problems = []
    for name, matchers in re.findall(r"([A-Za-z_:][\w:]*)\{([^}]*)\}", expr):
        if "kvrdma" not in name:
            continue
        have = series_labels(name, recorded)
        base = exported_series(name) or name
        for label, value in MATCHER.findall(matchers):
            if label not in have:
                problems.append(f"{name} has no label {label!r}")
            allowed = LABEL_VALUES.get((base, label))
            if allowed is None or "$" in value or re.search(r"[.*+?()\[\]\\]", value):
                continue
            problems += [
                f"{name}{{{label}}} is never {v!r}" for v in value.split("|") if v not in allowed
            ]
    read = {label for n in referenced_names(expr) for label in series_labels(n, recorded)}
    clause = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"
    for kept in re.findall(clause, expr):
        for label in filter(None, (x.strip() for x in kept.split(","))):
            if label not in read:
                problems.append(f"no series read has label {label!r} (in {kept!r})")
    return problems


def test_label_problems_finds_a_missing_label_and_an_unknown_value() -> None:
    expr = (
        'sum by (engine_id, reason) (rate(kvrdma_transfers_total{outcome="timed_out", '
        'mode=~"$mode"}[5m])) and on (remot_engine) kvrdma_handshakes_total{outcome!="refused"}'
    )
    assert label_problems(expr, {}) == [
        "kvrdma_transfers_total{outcome} is never 'timed_out'",
        "no series read has label 'reason' (in 'engine_id, reason')",
        "no series read has label 'remot_engine' (in 'remot_engine')",
    ]


def test_every_label_a_query_or_rule_reads_is_on_its_series() -> None:
    recorded = {r["record"]: r["expr"] for r in rules() if "record" in r}
    problems = [
        (where, p) for where, expr in all_expressions() for p in label_problems(expr, recorded)
    ]
    assert not problems


def test_every_label_an_alert_names_is_kept_by_its_expression() -> None:
    recorded = {r["record"]: r["expr"] for r in rules() if "record" in r}
    for rule in (r for r in rules() if "alert" in r):
        read = {
            label for n in referenced_names(rule["expr"]) for label in series_labels(n, recorded)
        }
        text = " ".join(rule["annotations"].values())
        named = set(re.findall(r"\$labels\.(\w+)", text))
        assert named <= read, (rule["alert"], named - read)


def test_every_failure_a_user_can_meet_wakes_an_alert() -> None:
    """A failure an operator must act on is read by an alert, directly or through a
    recording rule (a panel alone is seen only by whoever looks)."""
    must_alert = {
        telemetry.TRANSFERS, telemetry.INVALID_BLOCKS, telemetry.TRANSFER_DURATION,
        telemetry.HANDSHAKES, telemetry.EXPIRED_LEASES, telemetry.CONNECTED_PEERS,
        telemetry.ENDPOINT_UP, telemetry.STAGE_TRANSFERS,
    }  # fmt: skip
    recorded = {r["record"]: r["expr"] for r in rules() if "record" in r}

    def read(expr: str) -> set[str]:
        names = referenced_names(expr)
        return {exported_series(n) or n for n in names} | {
            m for n in names & recorded.keys() for m in read(recorded[n])
        }

    alerted = {n for r in rules() if "alert" in r for n in read(r["expr"])}
    assert {d.name for d in must_alert} - alerted == set()
