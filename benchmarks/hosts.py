"""Across hosts (`kvrdma demo --hosts 2`, network namespaces; needs root): throughput over
the testbed link, under netem where the kernel has it and random loss (nftables), and how
long after a partition the first failure is reported (`--fault partition`, READ deadline
1 s)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import harness as h

DEADLINE = 1.0


def _demo(extra: list[str], requests: int) -> dict[str, Any]:
    """One demo run's JSON summary, plus its exit code."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        argv = [sys.executable, "-m", "kvrdma", "demo", "--no-progress", "--hosts", "2"]
        argv += ["--requests", str(requests), "--json", str(out), *extra]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        doc: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    return doc | {"exit_code": proc.returncode, "stderr_tail": proc.stderr[-300:]}


def run(ctx: h.Context) -> dict[str, Any]:
    from kvrdma.testing.netns import netem_missing, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise RuntimeError(f"hosts: no network namespaces here: {reason}")
    requests = 16 if ctx.quick else 64
    shapes = {"none": []} | {
        s: ["--netem", s] for s in ("delay 5ms 1ms", "loss 1%", "delay 5ms reorder 25% 50%")
    }
    shapes["loss 1% (nftables)"] = ["--loss", "1"]
    missing = netem_missing()
    rows = []
    for name, extra in shapes.items():
        if extra[:1] == ["--netem"] and missing:
            rows.append({"netem": name, "note": "skipped: no sch_netem"})
            continue
        if extra[:1] == ["--loss"] and shutil.which("nft") is None:
            rows.append({"netem": name, "note": "skipped: no nftables (`nft`)"})
            continue
        doc = _demo(extra, requests)
        rows.append({"netem": name, **{k: doc.get(k) for k in ("gb_per_s", "latency_p50_ms")}})
    cut = _demo(
        ["--fault", "partition", "--read-deadline", str(DEADLINE), "--concurrency", "4",
         "--request-interval", "0.05", "--max-tokens", "256"],
        max(requests, 40),
    )  # fmt: skip
    detected = cut.get("fault_detected_seconds")
    return {
        "parameters": {"hosts": 2, "requests": requests, "read_deadline_s": DEADLINE},
        "results": rows,
        "partition": {k: cut.get(k) for k in ("fault_verdict", "fault_detected_seconds")}
        | {"failed": cut.get("failed"), "verified": cut.get("verified")},
        "targets": [
            h.target("partition: first failure after the cut", detected, f"<= {2 * DEADLINE} s")
        ],
        "tables": [
            h.table(
                "kvrdma demo --hosts 2 (UCX over TCP between namespaces)",
                rows,
                "netem: netem; GB/s*: gb_per_s; latency p50 ms: latency_p50_ms; note: note",
            )
        ],
        "summary": [
            f"Partition: first failure reported {detected} s after the cut; verdict "
            f"{cut.get('fault_verdict')}; {cut.get('failed')} failed, {cut.get('verified')} "
            f"verified." + (f" netem: {missing}" if missing else "")
        ],
        "notes": ["detection and recovery per fault in detail: tests/integration/test_netns.py"],
    }
