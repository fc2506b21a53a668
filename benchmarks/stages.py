"""Stage-to-stage transfer (`stages` benchmark, issue 22 "Performance").

packing: `pack_into` a preallocated buffer and `unpack_tensor(copy=True)` of a request's KV
(bf16 `(K, V)` per layer) against one plain `Tensor.copy_` of the same number of bytes,
paired per repetition (target: >= 0.8x the copy's speed); also against copying the
request's tensors one by one (what packing costs beyond the copies it cannot avoid).

throughput: one request moved from a sending stage rank to a receiving one by
`StageSender.send` + `StageReceiver.receive` (pack, offer, READ, unpack) against kvrdma's
own READ path (`TransferBackend.post("READ")` + `poll`) of the same bytes between the same
two agents, paired per repetition. Both stage ranks live in this process, each with its
own NIXL agent and slab, so the READ goes over UCX between two agents as between processes.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from benchmarks import harness as h

HEADS, DIM, TOKENS = 8, 128, 16
TARGET_RATIO = 0.8


def _payload(nbytes: int, layers: int, rid: str = "bench") -> Any:
    """A request of `layers` layers of bf16 `(K, V)` totalling about `nbytes`."""
    import torch

    from kvrdma.stages import StagePayload

    per_block = 2 * layers * TOKENS * HEADS * DIM * 2
    blocks = max(1, nbytes // per_block)
    g = torch.Generator().manual_seed(0)
    kv = [
        tuple(
            torch.randn(blocks, TOKENS, HEADS, DIM, generator=g).to(torch.bfloat16)
            for _ in range(2)
        )
        for _ in range(layers)
    ]
    return StagePayload(rid, kv, list(range(blocks)), {"bench": True})


def _packing(sizes: list[int], layers: int, reps: int, seed: int) -> list[dict[str, Any]]:
    import torch

    from kvrdma.stages import pack_into, packed_size, unpack_tensor

    rows, rng = [], random.Random(seed)
    for size in sizes:
        p = _payload(size, layers)
        n = packed_size(p)
        buf, src, dst = (torch.zeros(n, dtype=torch.uint8) for _ in range(3))
        src.fill_(1)
        pack_into(p, buf)  # unpack may come first in a repetition's order
        flats = [t.reshape(-1).view(torch.uint8) for layer in p.layers for t in layer]
        fns = {
            "copy": lambda d=dst, s=src: d.copy_(s),
            "copy_each": lambda d=dst, fs=flats: _copy_each(d, fs),
            "pack": lambda p=p, b=buf: pack_into(p, b),
            "unpack": lambda b=buf: unpack_tensor(b, copy=True),
        }
        times: dict[str, list[float]] = {k: [] for k in fns}
        for i in range(reps + 2):  # the first two warm up
            for what in rng.sample(list(fns), len(fns)):  # a fresh order each repetition
                fn = fns[what]
                t0 = time.perf_counter()
                fn()
                if i >= 2:
                    times[what].append(time.perf_counter() - t0)
        got = unpack_tensor(buf, copy=True)
        exact = all(
            torch.equal(a, b) for la, lb in zip(p.layers, got.layers, strict=True)
            for a, b in zip(la, lb, strict=True)
        )  # fmt: skip
        gbps = {k: h.summarize([n / t / 1e9 for t in v], 1, 3) for k, v in times.items()}
        rows.append({
            "kind": "packing", "bytes": n, "layers": layers, "byte_exact": exact,
            "gb_per_s": gbps, "ms": {k: h.summarize(v, 1e3) for k, v in times.items()},
            "pack_vs_copy": h.paired(times["pack"], times["copy"]),
            "unpack_vs_copy": h.paired(times["unpack"], times["copy"]),
            "pack_vs_copy_each": h.paired(times["pack"], times["copy_each"]),
        })  # fmt: skip
    return rows


def _copy_each(dst: Any, flats: list[Any]) -> None:
    """The payload's tensors copied one by one, back to back: packing without its header."""
    off = 0
    for f in flats:
        dst[off : off + f.numel()].copy_(f)
        off += f.numel()


class _Pair:
    """A sending and a receiving stage rank in this process, the sender stepped by a thread."""

    def __init__(self, slot_bytes: int, num_slots: int) -> None:
        from kvrdma.stages import StageEndpoint, StageMapping, StageReceiver, StageSender

        self.tx_ep, self.rx_ep = (
            StageEndpoint(pipeline="bench", stage=name, rank=0, size=1, slot_bytes=slot_bytes,
                          num_slots=num_slots)
            for name in ("thinker", "talker")
        )  # fmt: skip
        m = StageMapping(1, 1)
        self.tx = StageSender(self.tx_ep, m, stage_index=0)
        self.rx = StageReceiver(self.rx_ep, m, from_stage_index=0)
        self.tx.connect("talker", {0: ("127.0.0.1", self.rx_ep.port)})
        self.rx.connect("thinker", {0: ("127.0.0.1", self.tx_ep.port)})
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:  # the sending stage's loop: frees what was read
        while not self.stop.is_set():
            with self.lock:
                self.tx.step()
            time.sleep(0.0002)

    def stage(self, payload: Any) -> float:
        t0 = time.perf_counter()
        with self.lock:
            self.tx.send(payload.request_id, payload.layers, block_ids=payload.block_ids)
        self.rx.receive(payload.request_id, timeout=30.0)
        return time.perf_counter() - t0

    def read(self, slots: int) -> float:
        """kvrdma's READ of `slots` slots of the sender's slab into the receiver's."""
        from kvrdma.backend import XferState

        ep, peer = self.rx_ep, self.rx.senders[0]
        ids = list(range(slots))
        t0 = time.perf_counter()
        x = ep.backend.post("READ", ep.local, ids, peer.slab, ids, b"")
        while (r := ep.backend.poll(x)).state is XferState.PROC:
            time.sleep(0)
        x.release()
        if r.state is not XferState.DONE:
            raise RuntimeError(f"READ of {slots} slots failed: {r.error}")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.rx_ep.close()
        self.tx_ep.close()


def _throughput(sizes: list[int], layers: int, reps: int) -> list[dict[str, Any]]:
    from kvrdma.stages import packed_size

    slot = 1 << 20
    pair = _Pair(slot, max(sizes) // slot + 8)
    rows = []
    try:
        for size in sizes:
            n = packed_size(_payload(size, layers))
            slots = -(-n // slot)
            t_stage, t_read = [], []
            for i in range(reps + 2):
                p = _payload(size, layers, rid=f"r{size}-{i}")
                ts, tr = pair.stage(p), pair.read(slots)
                if i >= 2:
                    t_stage.append(ts)
                    t_read.append(tr)
            rows.append({
                "kind": "throughput", "bytes": n, "layers": layers,
                "gb_per_s": {"stage": h.summarize([n / t / 1e9 for t in t_stage], 1, 3),
                             "read": h.summarize([slots * slot / t / 1e9 for t in t_read], 1, 3)},
                "ms": {"stage": h.summarize(t_stage, 1e3), "read": h.summarize(t_read, 1e3)},
                "stage_vs_read": h.paired(t_stage, t_read),
            })  # fmt: skip
    finally:
        pair.close()
    return rows


def run(ctx: h.Context) -> dict[str, Any]:
    mib = 1 << 20
    sizes = [4 * mib, 32 * mib] if ctx.quick else [4 * mib, 64 * mib, 256 * mib]
    reps = 5 if ctx.quick else 30
    layers = 4
    packing = _packing(sizes, layers, reps, ctx.seed)
    moved = _throughput(sizes, layers, reps)
    worst = {k: min(r[f"{k}_vs_copy"]["paired_median"] or 0.0 for r in packing)
             for k in ("pack", "unpack")}  # fmt: skip
    pk_spec = "bytes: bytes|size; pack GB/s*: gb_per_s.pack.median; "
    pk_spec += "unpack GB/s*: gb_per_s.unpack.median; copy GB/s*: gb_per_s.copy.median; "
    pk_spec += "pack / copy: pack_vs_copy|ratio; unpack / copy: unpack_vs_copy|ratio; "
    pk_spec += "pack / per-tensor copies: pack_vs_copy_each|ratio; byte-exact: byte_exact"
    tp_spec = "bytes: bytes|size; stage GB/s*: gb_per_s.stage.median; "
    tp_spec += "kvrdma READ GB/s*: gb_per_s.read.median; stage / READ: stage_vs_read|ratio"
    return {
        "parameters": {
            "sizes": sizes,
            "layers": layers,
            "repetitions": reps,
            "dtype": "bfloat16",
            "heads": HEADS,
            "head_dim": DIM,
        },
        "results": packing + moved,
        "targets": [
            h.target(
                "pack_into / plain tensor copy, same bytes (worst size)",
                worst["pack"],
                f">= {TARGET_RATIO} x",
            ),
            h.target(
                "unpack / plain tensor copy, same bytes (worst size)",
                worst["unpack"],
                f">= {TARGET_RATIO} x",
            ),
        ],
        "tables": [
            h.table("Packing vs a plain tensor copy", packing, pk_spec),
            h.table("Stage-to-stage vs kvrdma's READ, same bytes", moved, tp_spec),
        ],
        "notes": [
            "stage time is send (pack into the slab, offer) + receive (READ, unpack with a "
            "copy, merge); READ is the same slots moved by one kvrdma READ, nothing else",
            "both stage ranks run in the benchmark process, each with its own NIXL agent",
        ],
    }
