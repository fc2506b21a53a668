"""Handshake latency (p50/p99, via handshake_latency.py) and notification round trip.

Handshake: `HandshakeClient.fetch` round trips (fresh socket, validation) against a
`HandshakeServer` in another process, for the large model's metadata (1 rank, 128 regions:
64 layers × K/V, a 6 KiB NIXL blob) and for handshake_latency.py's defaults.

Notification round trip: `NixlBackend.send_notif` → the target's loop sees it in
`get_notifs` and sends it back → this process busy-polls `get_notifs` until it arrives. Per
variant also the latency of one 16 KiB READ with and without an attached notification (a
READ carrying one is DONE only after the target's agent progressed). Variants: kvrdma's
default agents (no progress thread) with the target's loop busy, every 1 ms or every 20 ms;
NIXL's progress thread as nixl's wrapper builds it (pthrDelay 0) and with pthrDelay 100 µs.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks import handshake_latency
from benchmarks._common import Context, percentile, summarize, target

NAME = "latency"
TUNED_DELAY = 100  # µs


def parameters(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "handshakes": 200,
            "rtts": 200,
            "rtts_slow": 30,
            "rtts_20ms": 0,
            "handshake_configs": 1,
        }
    return {
        "handshakes": 1000,
        "rtts": 2000,
        "rtts_slow": 300,
        "rtts_20ms": 40,
        "handshake_configs": 2,
    }


def _handshakes(p: dict[str, Any]) -> list[dict[str, Any]]:
    configs = [
        {"ranks": 1, "regions": 128, "metadata_bytes": 6144, "what": "large model, 1 rank"},
        {"ranks": 2, "regions": 64, "metadata_bytes": 8192, "what": "handshake_latency defaults"},
    ][: p["handshake_configs"]]
    out = []
    for c in configs:
        ns = argparse.Namespace(
            n=p["handshakes"],
            warmup=20,
            ranks=c["ranks"],
            regions=c["regions"],
            metadata_bytes=c["metadata_bytes"],
            same_process=False,
        )
        res = handshake_latency.run(ns)
        out.append({"config": c["what"], **res})
    return out


def _variant(ctx: Context, n: int, wait: float, thread: bool, delay: int | None) -> dict[str, Any]:
    """Notification RTT, and one 16 KiB READ with and without a notification, for agents
    built one way (both sides alike) with the target's loop running every `wait` s."""
    import numpy as np

    from benchmarks._common import agent_name, nixl_progress_delay
    from kvrdma.backend import BackendConfig, MemType, XferState
    from kvrdma.nixl_backend import NixlBackend

    peer = ctx.peer
    key = f"echo-{wait}-{thread}-{delay}"
    blk, nblk = 16 << 10, 64
    got = peer.call(
        "make_backend",
        key=key,
        progress_thread=thread,
        pthr_delay_us=delay,
        buffer_bytes=blk * nblk,
    )
    with nixl_progress_delay(delay):
        local = NixlBackend(BackendConfig(name=agent_name("rtt"), progress_thread=thread))
    buf = np.zeros(blk * nblk, dtype=np.uint8)
    addr = buf.ctypes.data
    reg = local.register(np.array([(addr, buf.nbytes, 0)], dtype=np.uint64), MemType.DRAM)
    old = peer.call("set_wait", wait=wait)
    try:
        name = local.add_remote(got["metadata"])
        peer.call("add_remote", key=key, metadata=local.metadata())
        peer.call("echo", key=key, on=True)
        rows = np.array([(addr, blk, 0, blk, nblk)], dtype=np.uint64)
        ll = local.prep_local(rows, MemType.DRAM)
        rl = local.prep_remote(
            name, np.array([(got["addr"], blk, 0, blk, nblk)], np.uint64), MemType.DRAM
        )

        def rtt(i: int) -> float | None:
            msg = b"ping-%d" % i
            t0 = time.perf_counter()
            local.send_notif(name, msg)
            while time.perf_counter() - t0 < 2.0:
                if msg in local.get_notifs().get(name, ()):
                    return time.perf_counter() - t0
            return None

        def read(i: int, notif: bytes) -> float | None:
            t0 = time.perf_counter()
            x = local.post("READ", ll, np.array([i % nblk]), rl, np.array([(7 * i) % nblk]), notif)
            while (r := local.poll(x)).state is XferState.PROC:
                if time.perf_counter() - t0 > 2.0:
                    x.release()
                    return None
            return time.perf_counter() - t0 if r.state is XferState.DONE else None

        out: dict[str, Any] = {}
        for what, fn in (
            ("rtt", rtt),
            ("read_with_notification", lambda i: read(i, b"done-%d" % i)),
            ("read_without_notification", lambda i: read(i, b"")),
        ):
            for i in range(10):  # warm-up (the first ones include wire-up)
                fn(i)
            samples = [fn(i) for i in range(n)]
            ok = [x for x in samples if x is not None]
            out[what] = {
                "samples": len(ok),
                "lost": len(samples) - len(ok),
                "p50_us": round(percentile(ok, 50) * 1e6, 2) if ok else None,
                "p99_us": round(percentile(ok, 99) * 1e6, 2) if ok else None,
                "us": summarize(ok, scale=1e6, digits=2),
            }
        ll.release()
        rl.release()
    finally:
        peer.call("set_wait", wait=old)
        peer.call("close", key=key)
        reg.release()
        local.close()
    return out


def run(ctx: Context) -> dict[str, Any]:
    p = parameters(ctx.quick)
    hs = _handshakes(p)
    variants = [
        ("kvrdma default (no progress thread), target busy loop", 0.0, False, None, p["rtts"]),
        ("kvrdma default, target loop every 1 ms", 0.001, False, None, p["rtts_slow"]),
        ("kvrdma default, target loop every 20 ms", 0.02, False, None, p["rtts_20ms"]),
        (
            "NIXL progress thread (pthrDelay 0, as nixl's wrapper builds it), target 1 ms",
            0.001,
            True,
            0,
            p["rtts_slow"],
        ),
        (
            f"NIXL progress thread, pthrDelay {TUNED_DELAY} µs, target 1 ms",
            0.001,
            True,
            TUNED_DELAY,
            p["rtts_slow"],
        ),
        (
            f"NIXL progress thread, pthrDelay {TUNED_DELAY} µs, target 20 ms",
            0.02,
            True,
            TUNED_DELAY,
            p["rtts_20ms"],
        ),
    ]
    rtts = []
    for what, wait, thread, delay, n in variants:
        if n <= 0:
            continue
        rtts.append(
            {
                "variant": what,
                "target_wait_s": wait,
                "progress_thread": thread,
                "pthr_delay_us": delay,
                **_variant(ctx, n, wait, thread, delay),
            }
        )
    return {
        "parameters": p,
        "results": [{"kind": "handshake", **h} for h in hs]
        + [{"kind": "notification_rtt", **r} for r in rtts],
        "targets": [
            target("handshake p99 (large model, 1 rank)", hs[0]["p99_ms"], "<=", 5.0, "ms"),
            target(
                "notification round trip p50 (kvrdma default, target busy loop)",
                rtts[0]["rtt"]["p50_us"],
                "<=",
                100.0,
                "us",
            ),
        ],
        "notes": [
            "the echo is sent by the target's Python loop: the RTT is bounded by its cadence "
            "(a busy loop costs a core, see idle_cpu)",
            "a READ that carries a notification is DONE only once the target's agent "
            "progressed: without a progress thread that is the target's loop cadence; with "
            "a NIXL progress thread (pthrDelay > 0) it is not",
            "pthrDelay is set through nixl's bindings for those rows (the Python wrapper "
            "hard-codes 0); kvrdma's BackendConfig cannot ask for it today",
        ],
    }


def draw(plt: Any, doc: dict[str, Any]) -> None:
    _fig, (a1, a2) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [1, 2.2]})
    hs = [r for r in doc["results"] if r["kind"] == "handshake"]
    for i, q in enumerate(("p50_ms", "p90_ms", "p99_ms")):
        a1.bar([j + i * 0.25 for j in range(len(hs))], [r[q] for r in hs], 0.25, label=q)
    a1.set_xticks([j + 0.25 for j in range(len(hs))], [r["config"] for r in hs], fontsize=7)
    a1.axhline(5.0, color="r", ls="--", label="target p99 5 ms")
    a1.set_ylabel("ms")
    a1.set_title("Handshake latency")
    a1.legend(fontsize=7)
    rt = [r for r in doc["results"] if r["kind"] == "notification_rtt"]
    kinds = ("rtt", "read_with_notification", "read_without_notification")
    for i, k in enumerate(kinds):
        a2.bar(
            [j + i * 0.27 for j in range(len(rt))],
            [r[k]["p50_us"] or 0 for r in rt],
            0.27,
            label=f"{k} p50",
        )
    short = []
    for r in rt:
        t = "no thread" if not r["progress_thread"] else f"thread, delay {r['pthr_delay_us']} µs"
        short.append(f"{t}\ntarget {r['target_wait_s'] * 1e3:g} ms")
    a2.set_xticks([j + 0.27 for j in range(len(rt))], short, fontsize=7)
    a2.axhline(100.0, color="r", ls="--", label="target RTT p50 100 µs")
    a2.set_yscale("log")
    a2.set_ylabel("µs (p50)")
    a2.set_title("Notification round trip and 16 KiB READ latency")
    a2.legend(fontsize=7)
