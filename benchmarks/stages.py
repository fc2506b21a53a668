"""Stage-to-stage transfer (`stages` benchmark, issue 22 "Performance").

packing: `pack_into` a preallocated buffer and `unpack_tensor(copy=True)` of a request's bf16
`(K, V)` of every layer against one plain `Tensor.copy_` of the same bytes into memory in use
(target: >= 0.8x its speed), and against `clone()` of another tensor (a copy into fresh memory,
as unpack makes).

throughput: `StageSender.send` + `StageReceiver.receive` of one request between two stage
ranks (in this process, each with its own NIXL agent and slab) against kvrdma's own READ
(`post("READ")` + `poll`) of the same slots between the same agents, and against the sum of
its steps (pack + that READ + unpack): what it costs beyond its copies.

Each method runs once per repetition in a fresh random order; a ratio is the median of the
per-repetition ratios, which a loaded machine (slowing a whole repetition) leaves alone.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks import harness as h

HEADS, DIM, TOKENS = 8, 128, 16
TARGET_RATIO = 0.8
PAIRS = ("pack", "unpack")


def _payload(nbytes: int, layers: int) -> Any:
    """About `nbytes` of bf16 `(K, V)` in `layers` layers, each tensor its own (as `extract`)."""
    import torch

    from kvrdma.stages import StagePayload

    blocks = max(1, nbytes // (2 * layers * TOKENS * HEADS * DIM * 2))
    kv = [torch.randn(blocks, TOKENS, HEADS, DIM).to(torch.bfloat16) for _ in range(2 * layers)]
    return StagePayload("bench", list(zip(kv[::2], kv[1::2], strict=True)), [*range(blocks)], {})


def _interleaved(fns: dict[str, Callable[[], Any]], reps: int, rng: random.Random) -> Any:
    """Seconds of each of `fns` per repetition (after 2 warm-ups)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(reps + 2):
        for name in rng.sample(list(fns), len(fns)):
            t0 = time.perf_counter()
            fns[name]()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    return times


def _stats(n: int, times: dict[str, list[float]]) -> dict[str, Any]:
    return {"gb_per_s": {k: h.summarize([n / t / 1e9 for t in v], 1, 3) for k, v in times.items()},
            "ms": {k: h.summarize(v, 1e3) for k, v in times.items()}}  # fmt: skip


def _packing(cases: list[tuple[int, int]], reps: int, rng: random.Random) -> list[Any]:
    import torch

    from kvrdma.stages import pack_into, packed_size, unpack_tensor

    rows = []
    for size, layers in cases:
        p = _payload(size, layers)
        n = packed_size(p)
        # clone reads its own tensor: one copy's source read by another stays cached for it
        buf, src, dst, other = (torch.ones(n, dtype=torch.uint8) for _ in range(4))
        pack_into(p, buf)  # unpack may come first in a repetition
        t = _interleaved(
            {"copy": lambda d=dst, s=src: d.copy_(s), "clone": other.clone,
             "pack": lambda p=p, b=buf: pack_into(p, b),
             "unpack": lambda b=buf: unpack_tensor(b, copy=True)},
            reps, rng,
        )  # fmt: skip
        got = unpack_tensor(buf, copy=True).layers
        exact = all(torch.equal(a, b) for la, lb in zip(p.layers, got, strict=True)
                    for a, b in zip(la, lb, strict=True))  # fmt: skip
        rows.append({
            "kind": "packing", "bytes": n, "layers": layers, "byte_exact": exact, **_stats(n, t),
            "pack_vs_copy": h.paired(t["pack"], t["copy"]),
            "unpack_vs_copy": h.paired(t["unpack"], t["copy"]),
            "unpack_vs_clone": h.paired(t["unpack"], t["clone"]),
        })  # fmt: skip
    return rows


class _Pair:
    """A sending and a receiving stage rank, the sender stepped by a thread (its loop)."""

    def __init__(self, slot_bytes: int, num_slots: int) -> None:
        from kvrdma.stages import StageEndpoint, StageMapping, StageReceiver, StageSender

        self.tx_ep, self.rx_ep = (
            StageEndpoint(pipeline="bench", stage=name, rank=0, size=1, slot_bytes=slot_bytes,
                          num_slots=num_slots)
            for name in ("thinker", "talker")
        )  # fmt: skip
        self.tx = StageSender(self.tx_ep, StageMapping(1, 1), stage_index=0)
        self.rx = StageReceiver(self.rx_ep, StageMapping(1, 1), from_stage_index=0)
        self.tx.connect("talker", {0: ("127.0.0.1", self.rx_ep.port)})
        self.rx.connect("thinker", {0: ("127.0.0.1", self.tx_ep.port)})
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        while not self.stop.wait(0.0002):
            with self.lock:
                self.tx.step()

    def stage(self, p: Any) -> None:
        rid = f"r{time.perf_counter_ns()}"  # a fresh request each time
        with self.lock:
            self.tx.send(rid, p.layers, block_ids=p.block_ids)
        self.rx.receive(rid, timeout=30.0)

    def by_copies(self, caches: list[Any], ids: list[int], into: list[Any]) -> None:
        """Paged caches to paged caches with copies of the request made on the way: `extract`,
        `send`, `receive`, then the receiver writes each layer into its own cache's blocks."""
        from kvrdma.stages import extract

        rid = f"r{time.perf_counter_ns()}"
        with self.lock:
            self.tx.send(rid, extract(caches, ids), block_ids=ids)
        got = self.rx.receive(rid, timeout=30.0)
        for cache, (k, v) in zip(into, got.layers, strict=True):
            cache[0][ids], cache[1][ids] = k, v

    def by_blocks(self, caches: list[Any], ids: list[int], into: list[Any]) -> None:
        """The same with `send_blocks` and `receive_blocks`: no copy on the way."""
        rid = f"r{time.perf_counter_ns()}"
        with self.lock:
            self.tx.send_blocks(rid, caches, ids)
        self.rx.receive_blocks(rid, into, ids, timeout=30.0)

    def read(self, slots: int) -> None:
        """kvrdma's READ of `slots` slots of the sender's slab into the receiver's."""
        from kvrdma.nixl import XferState

        ep, peer, ids = self.rx_ep, self.rx.senders[0], list(range(slots))
        x = ep.backend.post("READ", ep.local, ids, peer.slab, ids, b"")
        while (r := ep.backend.poll(x)).state is XferState.PROC:
            time.sleep(0)
        x.release()
        if r.state is not XferState.DONE:
            raise RuntimeError(f"READ of {slots} slots failed: {r.error}")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        for ep in (self.rx_ep, self.tx_ep):
            ep.close()


def _paged(p: Any, rng: random.Random) -> tuple[list[Any], list[int]]:
    """Each layer's `[2, blocks, ...]` paged cache, twice the request's blocks, holding the
    request's KV in scattered blocks, and those blocks' ids."""
    import torch

    k = p.layers[0][0]
    ids = rng.sample(range(2 * k.shape[0]), k.shape[0])
    caches = []
    for k, v in p.layers:
        cache = torch.zeros(2, 2 * k.shape[0], *k.shape[1:], dtype=k.dtype)
        cache[0, ids], cache[1, ids] = k, v
        caches.append(cache)
    return caches, ids


def _throughput(sizes: list[int], layers: int, reps: int, rng: random.Random) -> list[Any]:
    import torch

    from kvrdma.stages import pack_into, packed_size, unpack_tensor

    slot = 1 << 20
    pair, rows = _Pair(slot, max(sizes) // slot + 8), []
    try:
        for size in sizes:
            p = _payload(size, layers)
            n = packed_size(p)
            slots, scratch = -(-n // slot), torch.empty(n, dtype=torch.uint8)
            pack_into(p, scratch)  # unpack may come first in a repetition
            caches, ids = _paged(p, rng)
            into = [torch.zeros_like(c) for c in caches]
            t = _interleaved(
                {"stage": lambda p=p: pair.stage(p), "read": lambda s=slots: pair.read(s),
                 "pack": lambda p=p, b=scratch: pack_into(p, b),
                 "unpack": lambda b=scratch: unpack_tensor(b, copy=True),
                 "by_copies": lambda c=caches, i=ids, o=into: pair.by_copies(c, i, o),
                 "by_blocks": lambda c=caches, i=ids, o=into: pair.by_blocks(c, i, o)},
                reps, rng,
            )  # fmt: skip
            parts = [sum(ts) for ts in zip(t["pack"], t["read"], t["unpack"], strict=True)]
            rows.append({
                "kind": "throughput", "bytes": n, "layers": layers, **_stats(n, t),
                "stage_vs_read": h.paired(t["stage"], t["read"]),
                "stage_vs_parts": h.paired(t["stage"], parts),
                "blocks_vs_copies": h.paired(t["by_blocks"], t["by_copies"]),
            })  # fmt: skip
    finally:
        pair.close()
    return rows


def run(ctx: h.Context) -> dict[str, Any]:
    import torch

    mib, rng = 1 << 20, random.Random(ctx.seed)
    cases = [(4 * mib, 8), (32 * mib, 32)]
    cases = cases if ctx.quick else [(4 * mib, 8), (4 * mib, 32), (32 * mib, 32), (64 * mib, 32)]
    sizes = [4 * mib, 32 * mib] if ctx.quick else [4 * mib, 16 * mib, 64 * mib]
    reps = 5 if ctx.quick else 30
    packing = _packing(cases, reps, rng)
    moved = _throughput(sizes, 32, reps, rng)
    worst = {k: min(r[f"{k}_vs_copy"]["paired_median"] or 0.0 for r in packing) for k in PAIRS}
    pk = "bytes: bytes|size; layers: layers; pack GB/s*: gb_per_s.pack.median; "
    pk += "unpack GB/s*: gb_per_s.unpack.median; copy GB/s*: gb_per_s.copy.median; "
    pk += "pack / copy: pack_vs_copy|ratio; unpack / copy: unpack_vs_copy|ratio; "
    pk += "unpack / clone: unpack_vs_clone|ratio; byte-exact: byte_exact"
    tp = "bytes: bytes|size; stage GB/s*: gb_per_s.stage.median; "
    tp += "kvrdma READ GB/s*: gb_per_s.read.median; stage / READ: stage_vs_read|ratio; "
    tp += "stage / (pack + READ + unpack): stage_vs_parts|ratio; "
    tp += "cache to cache GB/s*: gb_per_s.by_blocks.median; "
    tp += "send_blocks + receive_blocks / by copies: blocks_vs_copies|ratio"
    return {
        "parameters": {"packing": cases, "sizes": sizes, "throughput_layers": 32,
                       "repetitions": reps, "dtype": "bfloat16", "heads": HEADS,
                       "head_dim": DIM, "torch_threads": torch.get_num_threads()},
        "results": packing + moved,
        "targets": [h.target(f"{k} / plain tensor copy, same bytes (worst case)", worst[k],
                             f">= {TARGET_RATIO} x") for k in PAIRS],
        "tables": [h.table("Packing vs a plain tensor copy", packing, pk),
                   h.table("Stage-to-stage vs kvrdma's READ, same bytes", moved, tp)],
        "notes": [
            "stage = send (pack into the slab, offer) + receive (READ, unpack with a copy): two "
            "copies besides the READ, so about 1/3 of the READ's speed if they are as fast; "
            "'stage / (pack + READ + unpack)' near 1: nothing lost beyond those copies",
            "both stage ranks run in the benchmark process, each with its own NIXL agent",
            "cache to cache: the request's blocks lie scattered in each layer's paged cache "
            "(twice the request's blocks) and land in the same blocks of the receiver's caches; "
            "send_blocks + receive_blocks gather them into the slab and write them from the "
            "landing slots, 'by copies' is extract, send, receive, then a write of each layer",
        ],
    }  # fmt: skip
