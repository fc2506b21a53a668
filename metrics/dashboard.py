"""The kvrdma Grafana dashboard, generated from code so its queries stay consistent.

`build_dashboard()` returns the dashboard model; `render()` the JSON committed as
`metrics/grafana/kvrdma.json` (regenerate with `python metrics/generate.py`). The data source
is a template variable, and `engine_id`, `role` and `tp_rank` filter every worker panel;
`pipeline` filters the stage-to-stage panels (their series carry stage labels, not engine ids).
Transfer panels draw pulled and pushed transfers (the `mode` label) as separate lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

UID = "kvrdma-transfer"
TITLE = "kvrdma — KV-cache transfer"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
# Every worker series carries these labels; each variable is multi-select with an "All" of .*
SEL = 'engine_id=~"$engine_id", role=~"$role", tp_rank=~"$tp_rank"'
VARIABLES = (
    ("engine_id", "engine", "label_values(kvrdma_registered_bytes, engine_id)"),
    ("role", "role", 'label_values(kvrdma_registered_bytes{engine_id=~"$engine_id"}, role)'),
    (
        "tp_rank",
        "TP rank",
        'label_values(kvrdma_registered_bytes{engine_id=~"$engine_id", role=~"$role"}, tp_rank)',
    ),
    ("pipeline", "pipeline", "label_values(kvrdma_stage_transfers_total, pipeline)"),
)
STAGE_SEL = 'pipeline=~"$pipeline"'


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]
    kind: str = "timeseries"


def _rate(metric: str, by: str, matchers: str = "") -> str:
    sel = SEL + (f", {matchers}" if matchers else "")
    return f"sum by ({by}) (rate({metric}{{{sel}}}[{RATE}]))"


def _quantiles(
    metric: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99), split: str = ""
) -> tuple[Target, ...]:
    """Quantiles over the selected workers and the mean per engine, each line also per value
    of the `split` label when one is named."""
    by, tag = (f"{split}, ", f" {{{{{split}}}}}") if split else ("", "")
    bucket = _rate(f"{metric}_bucket", f"{by}le")
    out = [Target(f"histogram_quantile({q}, {bucket})", f"p{round(q * 100)}{tag}") for q in qs]
    per = f"{by}engine_id"
    mean = f"{_rate(f'{metric}_sum', per)} / {_rate(f'{metric}_count', per)}"
    return (*out, Target(mean, f"mean {{{{engine_id}}}}{tag}"))


def _stage_rate(metric: str, by: str, matchers: str = "") -> str:
    sel = STAGE_SEL + (f", {matchers}" if matchers else "")
    return f"sum by ({by}) (rate({metric}{{{sel}}}[{RATE}]))"


# The receiving side names each stage pair once (a sender counts shards, a receiver requests).
_RECEIVED = 'direction="receive"'
_PAIR = "{{peer_stage}} → {{stage}}"
STAGE_PANELS = (
    Panel("Stage-to-stage bytes per second", "Packed KV bytes received, per stage pair.", "Bps",
          (Target(_stage_rate("kvrdma_stage_transfer_bytes_sum", "peer_stage, stage", _RECEIVED),
                  _PAIR),)),
    Panel("Stage transfers per second by outcome",
          "Requests received (receive) and shards offered (send) that ended, by outcome.", "ops",
          (Target(_stage_rate("kvrdma_stage_transfers_total", "direction, outcome"),
                  "{{direction}} {{outcome}}"),)),
    Panel("Stage transfer failures by outcome", "Everything that did not succeed, per pair.",
          "ops", (Target(_stage_rate("kvrdma_stage_transfers_total",
                                     "peer_stage, stage, direction, outcome",
                                     'outcome!="success"'),
                         "{{peer_stage}}/{{stage}} {{direction}} {{outcome}}"),)),
    Panel("p99 stage receive time", "Receive call until merged, per stage pair.", "s",
          (Target("histogram_quantile(0.99, "
                  + _stage_rate("kvrdma_stage_transfer_duration_seconds_bucket",
                                "peer_stage, stage, le", _RECEIVED) + ")", _PAIR),)),
    Panel("Shards offered and unread", "Shards a sending rank holds for its receivers.", "short",
          (Target("sum by (stage, peer_stage, tp_rank) "
                  f"(kvrdma_stage_offered_shards{{{STAGE_SEL}}})",
                  "{{stage}} rank {{tp_rank}} → {{peer_stage}}"),)),
    Panel("Landing slots held by given-up READs", "Slots a receiving rank cannot hand out "
          "until READs of failed receives end (a stopped sender); nonzero for long: that "
          "sender is wedged.", "short",
          (Target("sum by (stage, peer_stage, tp_rank) "
                  f"(kvrdma_stage_held_landing_slots{{{STAGE_SEL}}})",
                  "{{stage}} rank {{tp_rank}} ← {{peer_stage}}"),)),
)  # fmt: skip

ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Throughput", (
        Panel("KV bytes moved per second", "Bytes moved by successful transfers, per remote "
              "engine and mode (pull: the decoder READs; push: the producer WRITEs).", "Bps",
              (Target(_rate("kvrdma_transfer_bytes_sum", "engine_id, remote_engine, mode"),
                      "{{engine_id}} ← {{remote_engine}} {{mode}}"),)),
        Panel("Transfers per second by mode and outcome", "Transfers that ended, per remote "
              "engine, by mode and outcome.", "ops",
              (Target(_rate("kvrdma_transfers_total", "engine_id, remote_engine, mode, outcome"),
                      "{{engine_id}} ← {{remote_engine}} {{mode}} {{outcome}}"),)),
        Panel("Requests per second by outcome",
              "Requests whose KV load finished (consumer side), by outcome.", "reqps",
              (Target(_rate("kvrdma_requests_total", "engine_id, outcome"),
                      "{{engine_id}} {{outcome}}"),)),
        Panel("Transfers in flight", "Transfers posted (pull) or expected (push) and not yet "
              "finished.", "short",
              (Target(f"sum by (engine_id, tp_rank, mode) (kvrdma_transfers_in_flight{{{SEL}}})",
                      "{{engine_id}} rank {{tp_rank}} {{mode}}"),)),
    )),
    ("Latency", (
        Panel("Transfer duration", "Post to completion of successful transfers.", "s",
              _quantiles("kvrdma_transfer_duration_seconds", split="mode")),
        Panel("Post (submit) duration", "Preparing and posting successful transfers.", "s",
              _quantiles("kvrdma_transfer_post_duration_seconds", split="mode")),
        Panel("p99 transfer duration by remote engine", "Which peer is slow.", "s",
              (Target("histogram_quantile(0.99, "
                      + _rate("kvrdma_transfer_duration_seconds_bucket", "remote_engine, mode, le")
                      + ")", "{{remote_engine}} {{mode}}"),)),
    )),
    ("Transfer sizes", (
        Panel("Bytes per transfer", "Size of successful transfers.", "bytes",
              _quantiles("kvrdma_transfer_bytes", split="mode")),
        Panel("Descriptors per transfer", "NIXL descriptors in successful transfers.", "short",
              _quantiles("kvrdma_transfer_descriptors", split="mode")),
    )),
    ("Failures and invalid blocks", (
        Panel("Failed transfers per second", "Transfers that did not succeed, per rank and "
              "remote engine, by mode and outcome.", "ops",
              (Target(_rate("kvrdma_transfers_total",
                            "engine_id, tp_rank, remote_engine, mode, outcome",
                            'outcome!="success"'),
                      "{{engine_id}} rank {{tp_rank}} ← {{remote_engine}} {{mode}} "
                      "{{outcome}}"),)),
        Panel("Transfer failure ratio", "Share of transfers that did not succeed, per mode.",
              "percentunit",
              (Target(_rate("kvrdma_transfers_total", "engine_id, remote_engine, mode",
                            'outcome!="success"') + " / "
                      + _rate("kvrdma_transfers_total", "engine_id, remote_engine, mode"),
                      "{{engine_id}} ← {{remote_engine}} {{mode}}"),)),
        Panel("Invalid blocks per second", "Local blocks reported invalid after a failed load; "
              "corrupt: those that failed the integrity check (integrity mode).",
              "short", (Target(_rate("kvrdma_invalid_blocks_total",
                                     "engine_id, tp_rank, remote_engine"),
                               "{{engine_id}} rank {{tp_rank}} ← {{remote_engine}}"),
                        Target(_rate("kvrdma_corrupt_blocks_total",
                                     "engine_id, tp_rank, remote_engine"),
                               "corrupt {{engine_id}} rank {{tp_rank}} ← {{remote_engine}}"))),
        Panel("Failed notifications per second", "Notifications not sent or rejected, per "
              "rank and remote engine, by reason.", "short",
              (Target(_rate("kvrdma_failed_notifications_total",
                            "engine_id, tp_rank, remote_engine, reason"),
                      "{{engine_id}} rank {{tp_rank}} peer {{remote_engine}} {{reason}}"),)),
        Panel("Expired leases per second",
              "Requests whose blocks were freed before every decoder had them (producer).",
              "short", (Target(_rate("kvrdma_expired_leases_total", "engine_id, tp_rank"),
                               "{{engine_id}} rank {{tp_rank}}"),)),
        Panel("Freed blocks per second", "Producer blocks released, per rank, by reason.",
              "short", (Target(_rate("kvrdma_freed_blocks_total", "engine_id, tp_rank, reason"),
                               "{{engine_id}} rank {{tp_rank}} {{reason}}"),)),
        Panel("Reading agents retired", "Reads abandoned at their deadline with data in "
              "flight: the reading NIXL agent was replaced so that data can never land.", "short",
              (Target(f"sum by (engine_id, tp_rank) "
                      f"(increase(kvrdma_agent_retirements_total{{{SEL}}}[$__rate_interval]))",
                      "{{engine_id}} rank {{tp_rank}}"),)),
    )),
    ("Handshakes", (
        Panel("Handshakes per second", "Metadata handshakes by remote engine and outcome.", "ops",
              (Target(_rate("kvrdma_handshakes_total", "engine_id, remote_engine, outcome"),
                      "{{engine_id}} → {{remote_engine}} {{outcome}}"),)),
        Panel("Handshake duration", "Successful metadata handshakes.", "s",
              _quantiles("kvrdma_handshake_duration_seconds", (0.5, 0.99))),
    )),
    ("Registration", (
        Panel("Registered KV bytes", "KV cache registered with NIXL.", "bytes",
              (Target(f"sum by (engine_id, tp_rank) (kvrdma_registered_bytes{{{SEL}}})",
                      "{{engine_id}} rank {{tp_rank}}"),)),
        Panel("Registered regions", "Memory regions registered with NIXL.", "short",
              (Target(f"sum by (engine_id, tp_rank) (kvrdma_registered_regions{{{SEL}}})",
                      "{{engine_id}} rank {{tp_rank}}"),)),
        Panel("Transports", "What UCX can use per rank: tcp where rdma was meant is a fallback.",
              "short",
              (Target("count by (engine_id, role, tp_rank, transport, ucx_tls, ucx_net_devices) "
                      f"(kvrdma_transport_info{{{SEL}}})", ""),),
              kind="table"),
        Panel("Versions", "kvrdma and handshake protocol versions running.", "short",
              (Target("count by (version, protocol_version) (kvrdma_build_info)", ""),),
              kind="table"),
    )),
    ("Peers", (
        Panel("Connected remote engines", "Remote engines with a completed handshake.", "short",
              (Target("sum by (engine_id, role, tp_rank) "
                      f"(kvrdma_connected_remote_engines{{{SEL}}})",
                      "{{engine_id}} {{role}} rank {{tp_rank}}"),)),
        Panel("Worker metrics endpoints up",
              "Sidecar: 1 if a worker's /metrics answered the last aggregation.", "short",
              (Target("kvrdma_worker_endpoint_up", "{{instance}} → {{endpoint}}"),)),
    )),
    ("Sidecar agent", (
        Panel("Handshake requests answered per second",
              "Requests the sidecar's handshake server answered, by outcome.", "reqps",
              (Target(f"sum by (outcome) (rate(kvrdma_handshake_requests_total[{RATE}]))",
                      "{{outcome}}"),)),
        Panel("Metadata publications per second",
              "Worker metadata published to the sidecar, by outcome.", "ops",
              (Target(f"sum by (outcome) (rate(kvrdma_agent_publishes_total[{RATE}]))",
                      "{{outcome}}"),)),
        Panel("Handshake connections dropped per second",
              "TCP connections the sidecar's handshake server shut down, by socket and reason: "
              "unfinished_message (a peer sent too many bytes without ending a message), idle "
              "(idle the longest past the socket's connection bound).", "ops",
              (Target("sum by (instance, socket, reason) "
                      f"(rate(kvrdma_handshake_connections_dropped_total[{RATE}]))",
                      "{{instance}} {{socket}} {{reason}}"),)),
        Panel("Published TP ranks", "Ranks whose metadata the sidecar serves.", "short",
              (Target("sum by (instance, engine_id, dp_index) (kvrdma_agent_published_ranks)",
                      "{{engine_id}} dp {{dp_index}}"),)),
        Panel("Sidecar ready", "1 when every expected rank has published.", "short",
              (Target("kvrdma_agent_ready", "{{instance}}"),)),
    )),
    ("Stage-to-stage", STAGE_PANELS),
)  # fmt: skip


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {},
        "options": [],
        "sort": 1,
        "hide": 0,
        "regex": "",
    }


def _panel(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    table = panel.kind == "table"
    targets = [
        {
            "refId": chr(ord("A") + i),
            "datasource": DATASOURCE,
            "expr": t.expr,
            "legendFormat": t.legend,
            **({"format": "table", "instant": True} if table else {"range": True}),
        }
        for i, t in enumerate(panel.targets)
    ]
    options: dict[str, Any] = (
        {"showHeader": True}
        if table
        else {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    )
    return {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": options,
        "targets": targets,
    }


def build_dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for title, row in ROWS:
        panels.append({"id": len(panels) + 1, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})  # fmt: skip
        y += 1
        for i, panel in enumerate(row):
            panels.append(_panel(panel, len(panels) + 1, 12 * (i % 2), y + 8 * (i // 2)))
        y += 8 * ((len(row) + 1) // 2)
    datasource_var = {"name": "datasource", "label": "Data source", "type": "datasource",
                      "query": "prometheus", "current": {}, "options": [], "hide": 0,
                      "refresh": 1, "regex": ""}  # fmt: skip
    return {
        "uid": UID,
        "title": TITLE,
        "description": "KV-cache transfer over NIXL: throughput, latency, failures, peers.",
        "tags": ["kvrdma", "nixl", "kv-cache", "disaggregated-serving"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": [datasource_var, *(_variable(*v) for v in VARIABLES)]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build_dashboard(), indent=2, ensure_ascii=False) + "\n"


def panel_expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query target of every panel."""
    return [
        (p["title"], t["expr"])
        for p in dashboard["panels"]
        if p["type"] != "row"
        for t in p["targets"]
    ]


def variable_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(variable name, `label_values(...)` query) for every query variable."""
    return [
        (v["name"], v["definition"])
        for v in dashboard["templating"]["list"]
        if v["type"] == "query"
    ]
