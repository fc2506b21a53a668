"""One rank of a stage as a process, driven by JSON lines on stdin (used by test_stages_transfer).

It prints `{"port": P}` once its endpoint listens, reads `{"peers": {rank: port}}`, connects,
then obeys commands: `{"send": [request ids]}` / `{"receive": [ids], "deadline": s}`,
`{"fill": byte}` / `{"check": byte}` on its free landing slots, `{"slots": true}` (free, and
held for READs given up), `{"metrics": true}` (its stage series) and
`{"forge": offer fields}` (an offer no honest sender makes), `{"close": byte}` (the endpoint
closed, its slab then filled) / `{"check_slab": byte}`, printing one JSON result line per
command.
Every request's full KV is a function of its id, so each rank can check what it received.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import zlib

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from kvrdma.errors import KvrdmaError
from kvrdma.stages import StageMapping, StageMetrics, StagePayload, StageReceiver, StageSender
from kvrdma.stages.endpoint import Offer, StageEndpoint, encode

HEADS, LAYERS, BLOCKS, TOKENS, DIM = 8, 3, 4, 16, 32
CACHE_BLOCKS, REQUEST_BLOCKS = 12, [7, 8, 9, 10]
LANDING_BLOCKS = [3, 0, 11, 5]  # where a receiving rank's own cache takes them


def full_kv(request_id: str, layer: int) -> torch.Tensor:
    """The whole `[2, blocks, tokens, heads, dim]` KV of one layer of a request."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{request_id}/{layer}".encode()))
    return torch.randn(2, BLOCKS, TOKENS, HEADS, DIM, generator=g).to(torch.bfloat16)


def paged_cache(request_id: str, layer: int, mine: slice) -> torch.Tensor:
    """A `[2, blocks, tokens, heads, dim]` paged cache of one layer holding the request's KV
    (this rank's heads) in its blocks `REQUEST_BLOCKS`, other requests' values elsewhere."""
    cache = torch.randn(2, CACHE_BLOCKS, TOKENS, HEADS, DIM)[:, :, :, mine].to(torch.bfloat16)
    cache[:, REQUEST_BLOCKS] = full_kv(request_id, layer)[:, :, :, mine]
    return cache


def heads(rank: int, size: int) -> slice:
    n = HEADS // size
    return slice(rank * n, (rank + 1) * n)


def check(rid: str, got: StagePayload, mine: slice) -> list[str]:
    bad = []
    for layer in range(LAYERS):
        want = full_kv(rid, layer)[:, :, :, mine]
        k, v = got.layers[layer]
        if not (torch.equal(k, want[0]) and torch.equal(v, want[1])):
            bad.append(f"{rid}/{layer}")
    if got.request_id != rid or got.block_ids != REQUEST_BLOCKS or got.metadata != {"r": rid}:
        bad.append(f"{rid}/meta")
    return bad


def reply(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def stage_samples(registry: CollectorRegistry, direction: str) -> dict[str, float]:
    """This rank's `kvrdma_stage_*` samples: transfers by outcome, bytes, successes timed,
    shards offered, landing slots held (one stage pair per process, so a name suffices)."""
    out: dict[str, float] = {}
    for fam in registry.collect():
        for s in fam.samples:
            if s.labels.get("direction", direction) != direction:
                continue
            if s.name == "kvrdma_stage_transfers_total":
                out[s.labels["outcome"]] = s.value
            elif s.name == "kvrdma_stage_transfer_bytes_sum":
                out["bytes"] = s.value
            elif s.name == "kvrdma_stage_offered_shards":
                out["offered"] = s.value
            elif s.name == "kvrdma_stage_held_landing_slots":
                out["held"] = s.value
            elif s.name == "kvrdma_stage_transfer_duration_seconds_count":
                out["timed"] = s.value
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["send", "receive"], required=True)
    p.add_argument("--senders", type=int, required=True)
    p.add_argument("--receivers", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--lease", type=float, default=60.0)
    p.add_argument("--port", type=int, default=0)  # a restarted rank serves where it did
    p.add_argument("--retries", type=int, default=3)  # StageSender's default
    args = p.parse_args()
    registry = CollectorRegistry()
    metrics = StageMetrics(registry=registry)
    mapping = StageMapping(args.senders, args.receivers)
    sending = args.role == "send"
    size = args.senders if sending else args.receivers
    ep = StageEndpoint(
        pipeline="test",
        stage="thinker" if sending else "talker",
        rank=args.rank,
        size=size,
        port=args.port,
        slot_bytes=1 << 16,
        num_slots=64,
    )
    reply(port=ep.port)
    peers = {int(r): ("127.0.0.1", port) for r, port in json.loads(input())["peers"].items()}
    stop = threading.Event()
    lock = threading.Lock()  # the agent is driven from one thread at a time
    if sending:
        side: StageSender | StageReceiver = StageSender(
            ep, mapping, stage_index=0, lease=args.lease, retries=args.retries, metrics=metrics
        )
        side.connect("talker", peers)
    else:
        side = StageReceiver(ep, mapping, from_stage_index=0, metrics=metrics)
        side.connect("thinker", peers)

    def pump() -> None:  # a stage keeps stepping its agent: its peers' transfers need it
        while not stop.is_set():
            with lock:
                side.step()
            time.sleep(0.0005)

    threading.Thread(target=pump, daemon=True).start()
    reply(connected=True)
    filled: list[int] = []  # the slots the last "fill" wrote
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if "send" in cmd:
                for rid in cmd["send"]:
                    mine = heads(args.rank, size)
                    layers = [full_kv(rid, layer)[:, :, :, mine] for layer in range(LAYERS)]
                    with lock:
                        side.send(  # type: ignore[union-attr]
                            rid, layers, block_ids=REQUEST_BLOCKS, metadata={"r": rid}
                        )
                reply(sent=cmd["send"])
            elif "send_blocks" in cmd:  # straight from a paged cache, reused once sent
                for rid in cmd["send_blocks"]:
                    mine = heads(args.rank, size)
                    caches = [paged_cache(rid, layer, mine) for layer in range(LAYERS)]
                    with lock:
                        side.send_blocks(  # type: ignore[union-attr]
                            rid, caches, REQUEST_BLOCKS, metadata={"r": rid}
                        )
                    for cache in caches:
                        cache.fill_(-1.0)  # the blocks go to other requests at once
                reply(sent=cmd["send_blocks"])
            elif "receive" in cmd:
                bad = []
                names = cmd.get("companions", [])
                for rid in cmd["receive"]:
                    with lock:
                        got, extra = side.receive_with_companions(  # type: ignore[union-attr]
                            rid, names, timeout=cmd.get("deadline", 30.0)
                        )
                    for name, payload in [("", got), *extra.items()]:
                        full_id = f"{rid}#{name}" if name else rid
                        bad += check(full_id, payload, heads(args.rank, size))
                reply(received=cmd["receive"], bad=bad)
            elif "receive_blocks" in cmd:  # into blocks of this rank's own paged caches
                bad, mine = [], heads(args.rank, size)
                for rid in cmd["receive_blocks"]:
                    caches = [torch.randn(2, CACHE_BLOCKS, TOKENS, HEADS, DIM)[:, :, :, mine]
                              .to(torch.bfloat16) for _ in range(LAYERS)]  # fmt: skip
                    before = [c.clone() for c in caches]
                    with lock:
                        got = side.receive_blocks(  # type: ignore[union-attr]
                            rid, caches, LANDING_BLOCKS, timeout=cmd.get("deadline", 30.0)
                        )
                    for layer, (cache, old) in enumerate(zip(caches, before, strict=True)):
                        old[:, LANDING_BLOCKS] = full_kv(rid, layer)[:, :, :, mine]
                        if not torch.equal(cache, old):  # its blocks, and nothing else
                            bad.append(f"{rid}/{layer}")
                    if got.block_ids != REQUEST_BLOCKS or got.metadata != {"r": rid}:
                        bad.append(f"{rid}/meta")
                reply(received=cmd["receive_blocks"], bad=bad)
            elif "fill" in cmd:  # the landing slots free now: what the next receive may use
                with lock:
                    filled = [int(i) for i in np.flatnonzero(ep.slots.free)]
                    for i in filled:
                        ep.slab[i * ep.slot_bytes : (i + 1) * ep.slot_bytes].fill_(cmd["fill"])
                reply(filled=len(filled))
            elif "check" in cmd:
                with lock:
                    views = [ep.slab[i * ep.slot_bytes : (i + 1) * ep.slot_bytes] for i in filled]
                    reply(intact=all(bool((v == cmd["check"]).all()) for v in views))
            elif "slots" in cmd:
                with lock:
                    held = side.held_slots if isinstance(side, StageReceiver) else 0
                    reply(free=int(ep.slots.free.sum()), held=held)
            elif "metrics" in cmd:
                with lock:
                    reply(metrics=stage_samples(registry, args.role))
            elif "close" in cmd:  # the endpoint closed, then its whole slab filled
                stop.set()
                with lock:
                    ep.close()
                    ep.slab.fill_(cmd["close"])
                reply(closed=True)
            elif "check_slab" in cmd:
                with lock:
                    reply(intact=bool((ep.slab == cmd["check_slab"]).all()))
            elif "forge" in cmd:
                with lock:
                    for peer in ep.peers.values():
                        ep.backend.send_notif(peer.agent, encode(Offer(**cmd["forge"])))
                reply(forged=True)
        except KvrdmaError as exc:
            reply(error=str(exc), kind=type(exc).__name__)
    stop.set()
    ep.close()


if __name__ == "__main__":
    main()
