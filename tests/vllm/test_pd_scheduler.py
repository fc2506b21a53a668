"""P and D engines, each vLLM's real Scheduler with KvrdmaConnector on both sides, P's in one
process and D's in another, over real NIXL: D's blocks equal P's byte for byte (the logical
`[layers, blocks, heads, tokens, content]` content, gathered over TP ranks), the request then
finishes in D's scheduler, and P frees its blocks once D is done."""

from __future__ import annotations

import functools
import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _harness import EngineProc, EngineSpec, free_port, requires_vllm, started, write_model_dir
from _harness import prompt as harness_prompt

pytestmark = [pytest.mark.timeout(300), requires_vllm]


prompt = functools.partial(harness_prompt, step=37, offset=5)


METRICS_PORT = free_port()
ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")

# row -> (P engine, D engine); an engine is (tp size, layout, mla)
ROWS: dict[str, tuple[tuple[int, str, bool], tuple[int, str, bool]]] = {
    **{f"P1-D1-{o}": ((1, o, False), (1, o, False)) for o in ORDERS},
    "P2-D2-LBHNC": ((2, "LBHNC", False), (2, "LBHNC", False)),
    "P1-D1-MLA": ((1, "LBHNC", True), (1, "LBHNC", True)),
    "P1-D2-MLA": ((1, "LBHNC", True), (2, "LBHNC", True)),
    "P2-D1-LBHNC": ((2, "LBHNC", False), (1, "LBHNC", False)),
    "P1-D2-LBHNC": ((1, "LBHNC", False), (2, "LBHNC", False)),
    "P4-D2-LBHNC": ((4, "LBHNC", False), (2, "LBHNC", False)),
    **{f"P2-D1-{o}": ((2, o, False), (1, o, False)) for o in ("LHBNC", "BLHNC", "BHLNC")},
    **{f"P1-D2-{o}": ((1, o, False), (2, o, False)) for o in ("LHBNC", "BLHNC", "BHLNC")},
    **{f"P4-D2-{o}": ((4, o, False), (2, o, False)) for o in ("LHBNC", "BLHNC", "BHLNC")},
    # token-major (NHD) pages: each P rank's heads land in their slice of D's token rows
    **{f"P2-D1-{o}": ((2, o, False), (1, o, False)) for o in ("LBNHC", "BLNHC")},
    **{f"P4-D2-{o}": ((4, o, False), (2, o, False)) for o in ("LBNHC", "BLNHC")},
    "P2-D1-MLA": ((2, "LBHNC", True), (1, "LBHNC", True)),
    "P4-D2-MLA": ((4, "LBHNC", True), (2, "LBHNC", True)),
    "P1-D1-LBHNC+mamba": ((1, "LBHNC+mamba", False), (1, "LBHNC+mamba", False)),
}
# push mode (`transfer_mode: "push"` on P): P WRITEs into the blocks D expects
PUSH_ROWS = ("P1-D1-LBHNC", "P2-D1-LBHNC", "P1-D2-MLA", "P4-D2-BHLNC", "P1-D1-LBHNC+mamba")
# head slices of a token-major (NHD) page are not contiguous, and pages holding Mamba state
# for some blocks and attention for others move only whole: the load fails, clearly
REFUSED = {
    **{f"P1-D2-{o}": ((1, o, False), (2, o, False)) for o in ("LBNHC", "BLNHC")},
    "P2-D1-LBHNC+mamba": ((2, "LBHNC+mamba", False), (1, "LBHNC+mamba", False)),
    "P1-D2-LBHNC+mamba": ((1, "LBHNC+mamba", False), (2, "LBHNC+mamba", False)),
}


def _key(e: tuple[int, str, bool]) -> str:
    tp, layout, mla = e
    return f"tp{tp}-{layout}{'-mla' if mla else ''}"


def _spec(model_dir: Path, role: str, e: tuple[int, str, bool], **kw: object) -> EngineSpec:
    tp, layout, mla = e
    tag = f"{role[3]}-{_key(e)}-{uuid.uuid4().hex[:6]}"
    order, _, mamba = layout.partition("+")
    return EngineSpec(
        str(model_dir), role, tag, free_port(), layout=order, tp_size=tp, mla=mla,
        hybrid=bool(mamba), **kw,
    )  # type: ignore[arg-type]  # fmt: skip


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProc, EngineProc]]:
    model_dir = write_model_dir(tmp_path_factory.mktemp("model"))
    p_specs = {
        _key(p): _spec(model_dir, "kv_producer", p) for p, _ in (*ROWS.values(), *REFUSED.values())
    }
    d_specs = {
        _key(d): _spec(model_dir, "kv_consumer", d) for _, d in (*ROWS.values(), *REFUSED.values())
    }
    for row in PUSH_ROWS:
        p = ROWS[row][0]
        p_specs[f"push-{_key(p)}"] = _spec(
            model_dir, "kv_producer", p, extra={"transfer_mode": "push"}
        )
    p_specs["push-async"] = _spec(
        model_dir, "kv_producer", (1, "LBHNC", False), extra={"transfer_mode": "push"},
        async_scheduling=True,
    )  # fmt: skip
    lease = {"kv_lease_duration": 2.0, "read_deadline": 1.0}
    p_specs["lease"] = _spec(model_dir, "kv_producer", (1, "LBHNC", False), extra=lease)
    # a slow decoder whose 32 usable blocks one long request fills, heartbeating every 2 s / 6
    d_specs["slow"] = _spec(
        model_dir, "kv_consumer", (1, "LBHNC", False), extra=lease, num_blocks=33, step_delay=0.05
    )
    # removes idle engines after 2 s; serves its rank's kvrdma_* series on METRICS_PORT
    d_specs["ttl"] = _spec(
        model_dir, "kv_consumer", (1, "LBHNC", False), extra={"engine_ttl": 2.0},
        env={"KVRDMA_METRICS_PORT": str(METRICS_PORT)},
    )  # fmt: skip
    with started(p_specs, d_specs) as engines:
        yield engines


def _prefill(p: EngineProc, key: str, rid: str) -> tuple[dict, bytes]:
    p.add(key, rid, prompt(rid), 1, {"do_remote_decode": True, "do_remote_prefill": False})
    _, _, reason, params_json, _, snap, _ = p.wait("finished", rid)
    assert reason == "length"
    return json.loads(params_json), snap  # the proxy hands P's dict to D through JSON


@pytest.mark.parametrize(
    ("row", "mode"), [(r, "pull") for r in ROWS] + [(r, "push") for r in PUSH_ROWS]
)
def test_blocks_equal_then_request_finishes(
    engines: tuple[EngineProc, EngineProc], row: str, mode: str
) -> None:
    p, d = engines
    pk, dk = (_key(e) for e in ROWS[row])
    pk = pk if mode == "pull" else f"push-{pk}"
    rid = f"req-{row}-{mode}"
    params, p_bytes = _prefill(p, pk, rid)
    assert params["do_remote_prefill"] is True and params["transfer_mode"] == mode
    assert params["tp_size"] == ROWS[row][0][0]
    groups = params["remote_block_ids"]  # one list per KV-cache group
    assert len(groups[0]) == 5 and len(groups) == (3 if "mamba" in pk else 1)
    held = len({b for g in groups for b in g if b})
    assert p.free_blocks(pk) == p.free_at_start[pk] - held  # held for D

    d.add(dk, f"d{rid}", prompt(rid), 3, params)
    _, _, d_ids, d_bytes, invalid, failed = d.wait("recv_done", f"d{rid}")
    assert (invalid, failed) == ([], [])
    assert len(d_ids) == 5
    assert any(p_bytes)  # the stand-in runner wrote P's KV
    assert d_bytes == p_bytes
    _, _, reason, _, tokens, _, computed = d.wait("finished", f"d{rid}")
    assert reason == "length" and tokens
    assert computed <= 1  # at most the last prompt token, as vLLM recomputes it

    p.wait("sent", rid)
    assert p.free_blocks(pk) == p.free_at_start[pk]


def _expect_before_prefill(
    p: EngineProc,
    d: EngineProc,
    pk: str,
    dk: str,
    drid: str,
    tid: str,
    tokens: list[int],
    *,
    tp: int,
) -> None:
    """What a proxy that sends D its request while P prefills does (P's endpoint, the
    transfer's own id, no remote_block_ids); returns once every P rank has D's Expect."""
    params = {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "push",
        "remote_engine_id": p.specs[pk].engine_id, "remote_host": "127.0.0.1",
        "remote_port": p.specs[pk].side_port, "remote_request_id": tid, "tp_size": tp,
    }  # fmt: skip
    d.add(dk, drid, tokens, 3, params)
    deadline = time.monotonic() + 30
    while p.probe(pk, f"push_early:{tid}") < tp:
        assert time.monotonic() < deadline, "D's Expect did not reach every P rank"
        time.sleep(0.05)


@pytest.mark.parametrize("row", [r for r in PUSH_ROWS if "mamba" not in r])
def test_a_decoder_asked_during_prefill_gets_the_push_layer_by_layer(
    engines: tuple[EngineProc, EngineProc], row: str
) -> None:
    """A proxy that sends D its request while P prefills: it names the push by a
    `transfer_id` of its own (vLLM renames P's request) and gives D no remote_block_ids;
    every P rank has D's Expect before the prefill, and writes each layer in its forward."""
    p, d = engines
    pk, dk = f"push-{_key(ROWS[row][0])}", _key(ROWS[row][1])
    tp = ROWS[row][0][0]
    rid, tid = f"req-{row}-early", f"xfer-{uuid.uuid4().hex[:8]}"
    before = p.probe(pk, "push_written")
    _expect_before_prefill(p, d, pk, dk, f"d{rid}", tid, prompt(rid), tp=tp)
    p.add(pk, rid, prompt(rid), 1, {"do_remote_decode": True, "transfer_id": tid})
    _, _, reason, p_params, _, p_bytes, _ = p.wait("finished", rid)
    assert reason == "length" and json.loads(p_params)["remote_request_id"] == tid
    _, _, d_ids, d_bytes, invalid, failed = d.wait("recv_done", f"d{rid}")
    assert (invalid, failed, len(d_ids)) == ([], [], 5)
    assert any(p_bytes) and d_bytes == p_bytes
    assert d.wait("finished", f"d{rid}")[2] == "length"
    p.wait("sent", rid)  # reported under P's request id
    assert p.free_blocks(pk) == p.free_at_start[pk]
    after = p.probe(pk, "push_written")
    assert after.get("whole", 0) == before.get("whole", 0)  # no WRITE waited for the end
    assert after.get("layer", 0) > before.get("layer", 0)


def test_an_engine_scheduling_asynchronously_pushes_whole_when_the_request_ends(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """Two batches in flight could preempt a request whose push began: no layer-wise push
    there, even for a decoder that expects the request before prefill; the bytes still land."""
    p, d = engines
    pk, dk = "push-async", _key(ROWS["P1-D1-LBHNC"][1])
    rid, tid = "req-async", f"xfer-{uuid.uuid4().hex[:8]}"
    before = p.probe(pk, "push_written")
    _expect_before_prefill(p, d, pk, dk, f"d{rid}", tid, prompt(rid), tp=1)
    p.add(pk, rid, prompt(rid), 1, {"do_remote_decode": True, "transfer_id": tid})
    p_bytes = p.wait("finished", rid)[5]
    _, _, _, d_bytes, invalid, failed = d.wait("recv_done", f"d{rid}")
    assert (invalid, failed) == ([], []) and any(p_bytes) and d_bytes == p_bytes
    p.wait("sent", rid)
    after = p.probe(pk, "push_written")
    assert after.get("layer", 0) == before.get("layer", 0)
    assert after.get("whole", 0) == before.get("whole", 0) + 1


def test_a_decoder_with_a_prefix_hit_asked_during_prefill_gets_the_last_blocks(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """The same prompt again, sent to D during P's prefill: D has its first 4 blocks cached
    and expects only the last; P writes its own last block into it."""
    p, d = engines
    row = "P2-D1-LBHNC"
    pk, dk = f"push-{_key(ROWS[row][0])}", _key(ROWS[row][1])
    tokens = prompt("req-hit")
    loaded = []
    for n in range(2):  # the first fills D's prefix cache
        rid, tid = f"req-hit-{n}", f"xfer-{uuid.uuid4().hex[:8]}"
        _expect_before_prefill(p, d, pk, dk, f"d{rid}", tid, tokens, tp=2)
        p.add(pk, rid, tokens, 1, {"do_remote_decode": True, "transfer_id": tid})
        p_bytes = p.wait("finished", rid)[5]
        _, _, d_ids, d_bytes, invalid, failed = d.wait("recv_done", f"d{rid}")
        assert (invalid, failed, len(d_ids)) == ([], [], 5)
        assert any(p_bytes) and d_bytes == p_bytes
        assert d.wait("finished", f"d{rid}")[6] <= 1  # computed: at most the last token
        p.wait("sent", rid)
        loaded.append(d.probe(dk, "blocks_loaded"))
    assert loaded[1] - loaded[0] == 1  # the hit left D one block to load


def test_a_decoder_request_aborted_before_prefill_tells_the_producer(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """D aborts a request it expects pushed before P has it: P hears so and answers that
    nothing will come, and D frees its blocks at once (not at the expect deadline)."""
    p, d = engines
    pk, dk = (f"push-{_key(ROWS['P1-D1-LBHNC'][0])}", _key(ROWS["P1-D1-LBHNC"][1]))
    rid, tid = "req-early-abort", f"xfer-{uuid.uuid4().hex[:8]}"
    _expect_before_prefill(p, d, pk, dk, f"d{rid}", tid, prompt(rid), tp=1)
    d.abort(dk, f"d{rid}")
    deadline = time.monotonic() + 10
    while d.free_blocks(dk) != d.free_at_start[dk]:
        assert time.monotonic() < deadline, "D still holds the aborted request's blocks"
        time.sleep(0.05)


def test_a_bad_transfer_id_is_named_and_the_push_goes_by_the_request_id(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    p, d = engines
    pk, dk = (f"push-{_key(ROWS['P1-D1-LBHNC'][0])}", _key(ROWS["P1-D1-LBHNC"][1]))
    rid = "req-bad-transfer-id"
    p.add(pk, rid, prompt(rid), 1, {"do_remote_decode": True, "transfer_id": 7})
    _, _, reason, params_json, _, p_bytes, _ = p.wait("finished", rid)
    params = json.loads(params_json)
    assert reason == "length" and params["remote_request_id"] == rid
    said = [w for w in p.probe(pk, "warnings") if rid in w]
    assert said and "transfer_id must be a non-empty string" in said[0], said
    d.add(dk, f"d{rid}", prompt(rid), 3, params)
    _, _, _, d_bytes, invalid, failed = d.wait("recv_done", f"d{rid}")
    assert (invalid, failed) == ([], []) and d_bytes == p_bytes
    p.wait("sent", rid)


def test_a_request_id_another_push_goes_by_is_pushed_under_a_key_of_its_own(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """A proxy's `transfer_id` may be another request's id: the later request is pushed
    under a key no push uses (P's params tell D), and both reach D intact."""
    p, d = engines
    pk, dk = (f"push-{_key(ROWS['P1-D1-LBHNC'][0])}", _key(ROWS["P1-D1-LBHNC"][1]))
    first, second = "req-taken-by", "req-taken"
    p.add(pk, first, prompt(first), 1, {"do_remote_decode": True, "transfer_id": second})
    p.add(pk, second, prompt(second), 1, {"do_remote_decode": True})
    done = {rid: p.wait("finished", rid) for rid in (first, second)}  # P's pipe drained
    for rid, (_, _, reason, params_json, _, p_bytes, _) in done.items():
        params = json.loads(params_json)
        assert reason == "length"
        d.add(dk, f"d{rid}", prompt(rid), 3, params)
        _, _, _, d_bytes, invalid, failed = d.wait("recv_done", f"d{rid}")
        assert (invalid, failed) == ([], []) and d_bytes == p_bytes
        p.wait("sent", rid)


@pytest.mark.parametrize("row", list(REFUSED))
def test_tp_mixes_a_layout_cannot_slice_are_refused(
    engines: tuple[EngineProc, EngineProc], row: str
) -> None:
    p, d = engines
    (p_tp, layout, _), (d_tp, _, _) = REFUSED[row]
    order, _, mamba = layout.partition("+")
    pk, dk = (_key(e) for e in REFUSED[row])
    params, _ = _prefill(p, pk, f"req-{row}")
    d.add(dk, f"dreq-{row}", prompt(f"req-{row}"), 2, params)
    _, _, _, _, invalid, failed = d.wait("recv_done", f"dreq-{row}")
    # every block of the load is invalid (one group) or the request failed (several groups,
    # whose block ids are not unique), under the default policy "fail"
    assert (len(invalid), failed) == ((0, [f"dreq-{row}"]) if mamba else (5, []))
    assert d.wait("finished", f"dreq-{row}")[2] == "error"
    # the reason names the layout and the TP sizes
    said = [w for w in d.probe(dk, "warnings") if f"dreq-{row}" in w]
    assert said and f"kv_cache_order {order}" in said[0], said
    assert f"P tp {p_tp} -> D tp {d_tp}" in said[0], said


def test_lease_expiry_frees_producer_blocks(engines: tuple[EngineProc, EngineProc]) -> None:
    p, _ = engines
    _prefill(p, "lease", "req-lease")
    assert p.free_blocks("lease") == p.free_at_start["lease"] - 5
    p.wait("sent", "req-lease", timeout=20)  # no reader came: the 2 s lease ran out
    assert p.free_blocks("lease") == p.free_at_start["lease"]


def test_a_decoder_never_reads_blocks_whose_lease_ended(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """P's params carry its lease end; D gets them only after that lease ran out and P
    reused the blocks for the next prefill: D posts no READ, every block of the load is
    invalid and the request errors (policy "fail") instead of decoding another's KV."""
    p, d = engines
    params, _ = _prefill(p, "lease", "req-stale")
    assert isinstance(params["remote_blocks_expiry_time"], float), params
    p.wait("sent", "req-stale", timeout=20)  # the 2 s lease ran out
    _prefill(p, "lease", "req-next")  # the freed blocks now hold another request's KV
    dk = _key((1, "LBHNC", False))
    d.add(dk, "dreq-stale", prompt("req-stale"), 2, params)
    _, _, _, _, invalid, _ = d.wait("recv_done", "dreq-stale")
    assert len(invalid) == 5
    assert d.wait("finished", "dreq-stale")[2] == "error"
    p.wait("sent", "req-next", timeout=20)


def test_stats_reach_vllm_logging_prometheus_and_kvrdma_series(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """After the rows above: D's successful reads are counted by vLLM's stats hooks and by
    kvrdma's own series (the LBNHC D1 consumer read one request each from P1 and P2)."""
    _, d = engines
    key = _key((1, "LBNHC", False))
    reduced, vllm_samples, kvrdma_samples = d.stats(key)
    assert reduced["num_successful_transfers"] == 2 and reduced["num_blocks"] == 10
    assert reduced["num_failed_transfers"] == 0
    assert vllm_samples["vllm:kvrdma_transfers_succeeded_total"] == 2
    assert vllm_samples["vllm:kvrdma_blocks_read_total"] == 10
    assert kvrdma_samples["kvrdma_transfers_total"] == 2
    assert kvrdma_samples["kvrdma_handshakes_total"] == 2


def test_heartbeats_keep_the_lease_while_the_decoder_is_busy(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """D queues the request behind a long local one for longer than P's 2 s lease: D's
    heartbeats renew the lease, so P still holds the blocks when D finally reads them."""
    p, d = engines
    # 29 blocks, growing to all 32 usable ones: the 5-block request waits until it ends,
    # 120 steps of at least 50 ms, twice as long as the 3 s checked below
    long_prompt = [(i * 11) % 900 + 3 for i in range(900)]
    d.add("slow", "local-long", long_prompt, 120, None)
    params, p_bytes = _prefill(p, "lease", "req-hb")
    d.add("slow", "dreq-hb", prompt("req-hb"), 2, params)
    time.sleep(3.0)  # past the lease: without heartbeats P would have freed the blocks
    assert p.free_blocks("lease") == p.free_at_start["lease"] - 5
    _, _, _, d_bytes, invalid, _ = d.wait("recv_done", "dreq-hb", timeout=60)
    assert invalid == [] and d_bytes == p_bytes
    assert d.wait("finished", "local-long", timeout=60)[2] == "length"
    p.wait("sent", "req-hb")
    assert p.free_blocks("lease") == p.free_at_start["lease"]


def test_an_engine_unused_for_engine_ttl_is_removed_when_another_comes(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """D's engine_ttl is 2 s: an engine last read 3 s before another engine's handshake is
    removed then (vLLM's rule); a later request from it is handshaken again and read."""
    p, d = engines

    def load(pk: str, rid: str) -> str:
        params, p_bytes = _prefill(p, pk, rid)
        d.add("ttl", f"d{rid}", prompt(rid), 2, params)
        _, _, _, d_bytes, invalid, failed = d.wait("recv_done", f"d{rid}")
        assert (invalid, failed) == ([], []) and d_bytes == p_bytes
        assert d.wait("finished", f"d{rid}")[2] == "length"
        return str(params["remote_engine_id"])

    first = load(_key((1, "LBHNC", False)), "req-ttl-1")
    assert d.probe("ttl", "engines") == [first]
    time.sleep(3.0)
    second = load("lease", "req-ttl-2")
    assert d.probe("ttl", "engines") == [second]
    assert load(_key((1, "LBHNC", False)), "req-ttl-3") == first
    assert first in d.probe("ttl", "engines")


def test_a_rank_serves_its_metrics_on_loopback_only(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """With KVRDMA_METRICS_PORT set, rank 0 serves its kvrdma_* series at 127.0.0.1 (where the
    pod's agent scrapes it) and on no other address unless KVRDMA_METRICS_HOST says so."""
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as r:
        assert b"kvrdma_handshakes_total" in r.read()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.2:{METRICS_PORT}/metrics", timeout=10)
