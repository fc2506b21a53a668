"""Write (or, with --check, verify) the generated files under metrics/.

    python metrics/generate.py          # rewrite grafana/kvrdma.json and METRICS.md
    python metrics/generate.py --check  # exit 1 if either is out of date

The dashboard comes from `metrics/dashboard.py`, the metric reference from `metrics_markdown()`
below (over `kvrdma.telemetry.METRIC_DOCS`); tests/unit/test_dashboard.py runs the same check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(HERE.parent))

from kvrdma import telemetry as t  # noqa: E402
from metrics.dashboard import render  # noqa: E402

DASHBOARD_JSON = HERE / "grafana" / "kvrdma.json"
METRICS_MD = HERE / "METRICS.md"


def _fmt_bound(b: float, unit: str) -> str:
    if unit == "bytes":
        for factor, suffix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if b >= factor:
                return f"{b / factor:g} {suffix}"
    if unit == "seconds":
        for scale, suffix in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
            if b >= scale:
                return f"{round(b / scale, 6):g} {suffix}"
    return f"{b:.0f}"


def metrics_markdown() -> str:
    """The metric reference (`metrics/METRICS.md`, the README table), from kvrdma.telemetry."""
    lines = [
        "# kvrdma metrics",
        "",
        "Generated from `kvrdma/telemetry.py` by `python metrics/generate.py`; do not edit.",
        "",
        "| metric | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    for d in t.METRIC_DOCS:
        labels = ", ".join(f"`{lbl}`" for lbl in d.labels)
        lines.append(f"| `{d.name}` | {d.type} | {labels} | {d.help} |")
    lines += ["", "Histogram buckets (upper bounds; `+Inf` is implied):", ""]
    for d in t.METRIC_DOCS:
        if d.buckets:
            unit = "bytes" if d.name.endswith("_bytes") else d.name.rsplit("_", 1)[-1]
            bounds = ", ".join(_fmt_bound(b, unit) for b in d.buckets)
            lines.append(f"- `{d.name}`: {bounds}")
    lines += [
        "",
        "Label values (anything else raises `ValueError`):",
        "",
        f"- `role`: {', '.join(t.ROLES)}",
        f"- `outcome` of `{t.TRANSFERS.name}`: {', '.join(t.TRANSFER_OUTCOMES)}",
        f"- `mode` of the `{t.TRANSFERS.name}`, `kvrdma_transfer_*` and "
        f"`{t.IN_FLIGHT.name}` series: {', '.join(t.TRANSFER_MODES)}",
        f"- `reason` of `{t.FAILED_NOTIFICATIONS.name}`: "
        + ", ".join(t.NOTIFICATION_FAILURE_REASONS),
        f"- `reason` of `{t.FREED_BLOCKS.name}`: {', '.join(t.FREED_BLOCK_REASONS)}",
        f"- `outcome` of `{t.HANDSHAKES.name}`: {', '.join(t.HANDSHAKE_OUTCOMES)}",
        f"- `outcome` of `{t.REQUESTS.name}`: {', '.join(t.REQUEST_OUTCOMES)}",
        f"- `outcome` of `{t.AGENT_REQUESTS.name}`: {', '.join(t.AGENT_REQUEST_OUTCOMES)}",
        f"- `outcome` of `{t.AGENT_PUBLISHES.name}`: {', '.join(t.AGENT_PUBLISH_OUTCOMES)}",
        f"- `socket` of `{t.AGENT_DROPPED_CONNECTIONS.name}`: {', '.join(t.AGENT_SOCKETS)}",
        f"- `reason` of `{t.AGENT_DROPPED_CONNECTIONS.name}`: "
        + ", ".join(t.CONNECTION_DROP_REASONS),
        f"- `outcome` of `{t.STAGE_TRANSFERS.name}`: {', '.join(t.STAGE_OUTCOMES)}",
        f"- `direction` of the `kvrdma_stage_*` series: {', '.join(t.STAGE_DIRECTIONS)}",
        "",
        "Histograms record successful transfers and handshakes only (as vLLM does);",
        "failures are counted by the `_total` counters.",
        "",
        "## vLLM NixlConnector parity",
        "",
        "| vLLM series | kvrdma equivalent |",
        "|---|---|",
    ]
    lines += [f"| `{v}` | `{k}` |" for v, k in t.VLLM_PARITY.items()]
    return "\n".join(lines) + "\n"


def generated() -> dict[Path, str]:
    return {DASHBOARD_JSON: render(), METRICS_MD: metrics_markdown()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    stale = [p for p, text in generated().items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            sys.stderr.write(f"{p.relative_to(HERE.parent)} is out of date\n")
        return 1 if stale else 0
    for p, text in generated().items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
