"""The outcome of a `kvrdma demo` run: per-request results summed into a table and JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvrdma.cli.demo.faults import RequestResult


@dataclass
class Summary:
    layout: str
    p_tp: int
    d_tp: int
    requests: int = 0
    ok: int = 0
    failed: int = 0
    wrong_elements: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    invalid_blocks: int = 0
    setup_seconds: float = 0.0
    endpoints: list[str] = field(default_factory=list)
    handshake_ms: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    results: list[RequestResult] = field(default_factory=list)
    devices: dict[str, str] = field(default_factory=dict)
    mode: str = "pull"  # or "push" / "push, layer-wise"
    quarantined: int = 0  # push: failed requests' blocks a D rank held out of use ...
    released: int = 0  # ... and let go once no producer could write them

    def table(self) -> str:
        lat = np.array(self.latencies or [0.0]) * 1e3
        gbs = self.bytes / self.seconds / 1e9 if self.seconds else 0.0
        rate = float(np.median(self.rates or [0.0])) / 1e9
        # what one request's time covers: the READs, or (push) from D expecting it to landed
        span = "expected -> landed" if self.mode.startswith("push") else "READ posted -> done"
        rows = [
            ("layout", f"{self.layout}  (P tp {self.p_tp} -> D tp {self.d_tp})"),
            ("mode", self.mode),
            ("caches", f"P on {self.devices.get('P', 'cpu')}, D on {self.devices.get('D', 'cpu')}"),
            ("requests", f"{self.requests} ({self.ok} verified, {self.failed} failed)"),
            ("blocks moved", f"{self.blocks}"),
            ("bytes moved", f"{self.bytes / 2**20:.1f} MiB"),
            ("throughput", f"{gbs:.2f} GB/s over {self.seconds:.2f} s (with verification)"),
            ("per-request rate", f"{rate:.2f} GB/s median ({span})"),
            ("latency p50", f"{np.percentile(lat, 50):.2f} ms per request"),
            ("latency p99", f"{np.percentile(lat, 99):.2f} ms per request"),
            ("wrong elements", f"{self.wrong_elements}"),
            ("invalid blocks", f"{self.invalid_blocks}"),
            *(
                [("quarantined", f"{self.quarantined} (released {self.released})")]
                if self.mode.startswith("push")
                else []
            ),
            ("setup", f"{self.setup_seconds:.2f} s (handshake {', '.join(self.handshake_ms)} ms)"),
        ]
        width = max(len(k) for k, _ in rows)
        line = "+" + "-" * (width + 2) + "+" + "-" * 48 + "+"
        out = [line] + [f"| {k:<{width}} | {v:<46} |" for k, v in rows] + [line]
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        lat = np.array(self.latencies or [0.0])
        return {
            "layout": self.layout,
            "mode": self.mode,
            "p_tp": self.p_tp,
            "d_tp": self.d_tp,
            "devices": self.devices,
            "requests": self.requests,
            "verified": self.ok,
            "failed": self.failed,
            "wrong_elements": self.wrong_elements,
            "blocks": self.blocks,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "gb_per_s": self.bytes / self.seconds / 1e9 if self.seconds else 0.0,
            "per_request_gb_per_s_p50": float(np.median(self.rates or [0.0])) / 1e9,
            "latency_p50_ms": float(np.percentile(lat, 50) * 1e3),
            "latency_p99_ms": float(np.percentile(lat, 99) * 1e3),
            "invalid_blocks": self.invalid_blocks,
            "quarantined": self.quarantined,
            "released": self.released,
            "errors": self.errors,
        }
