"""A bounded soak with random faults: every request ends exactly once, verified or reported.

Two P ranks (each serving half of the KV heads, so every read spans both) and one D rank run as
long-lived processes with real NIXL agents over UCX/TCP (`soak_harness`), each with the
default configuration (UCX copy threads: `num_threads` not set). A seeded RNG orders
a fixed mix of faults, one per batch of 16 requests (one drop_notifs batch moved after the
others and a clean batch, so that a lease is seen to expire), then two clean batches:

- kill_restart: SIGKILL a P rank just after the reads went out, then a warm spare takes its
  place with a new NIXL agent and re-publishes; D must notice and re-handshake.
- stall: SIGSTOP a P rank just after the reads went out, SIGCONT once all were reported.
  Over TCP its reads never finish on their own: only D's deadline ends them.
- drop_notifs: D reads without notifying; P may free those blocks only when the lease ends.
- bad_ids: a quarter of the batch carries out-of-range block ids (remote too high, negative,
  or local too high); `start_read` must reject them before any backend call.
- keep_alive: a quarter of the batch is held by P and heartbeated by D (`keep_alive`) and
  read only after more than a whole lease; P must still hold it then.

At the end: every request reported exactly once (verified with zero wrong elements, failed
with exactly its local blocks invalid within 2x the deadline, or rejected without a backend
call); failures explained by the fault of their batch (timeouts only under a stall, peer loss
only at a kill or in the batch after it) and none elsewhere; every producer hold freed exactly
once, by the done notification after the read or, without one, by the lease; blocks of failed
reads (rejected or failed), zeroed when the failure was reported, still zero two batches later
(a read abandoned at its deadline retires the reading agent, so its data never lands); D idle.

`KVRDMA_SOAK_SEED` replays another order. Rank logs are under the test's tmp_path.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from soak_harness import Cluster, ClusterSpec, Soak, SoakResult

pytest.importorskip("nixl")

SEED = int(os.environ.get("KVRDMA_SOAK_SEED", "4"))
SCHEDULE = {
    "none": 8,
    "kill_restart": 5,
    "stall": 5,
    "drop_notifs": 4,
    "bad_ids": 5,
    "keep_alive": 4,
}
DEADLINE = 1.0  # read deadline, seconds
LEASE = 4.0  # producer lease, seconds (heartbeats every LEASE / 6)
REPORT_SLACK = 0.5  # scheduling on a loaded 2-core machine, on top of 2x the deadline
SOAK_BUDGET = 120.0  # seconds for the batches and the final lease


def _log_tail(log_dir: Path, name: str, lines: int = 25) -> str:
    try:
        text = (log_dir / f"{name}.log").read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


@pytest.mark.timeout(200)
def test_soak_random_faults(spawn_child: Any, tmp_path: Path) -> None:
    """>= 500 requests through seeded faults; see the module docstring for what is checked."""
    spec = ClusterSpec(read_deadline=DEADLINE, lease=LEASE, log_dir=str(tmp_path))
    cluster = Cluster(spec, spawn_child)
    try:
        cluster.start()
        soak = Soak(cluster, seed=SEED, schedule=SCHEDULE)
        result = soak.run(batch_timeout=2 * DEADLINE + 10.0)
    except BaseException as exc:
        d = cluster.d or cluster.finished_d
        exc.add_note(f"seed {SEED}; D log tail:\n{_log_tail(tmp_path, d.name if d else '?')}")
        raise
    finally:
        cluster.close()
    check_soak(result)
    assert not cluster.leftovers(), f"rank processes outlived the soak: {cluster.leftovers()}"


def check_soak(res: SoakResult) -> None:
    reqs = res.requests
    ctx = f"seed {res.seed}: "
    kinds = Counter(r.outcomes[0][0].kind for r in reqs.values() if r.outcomes)
    print(
        f"soak: {len(reqs)} requests in {len(res.batches)} batches, {res.seconds:.1f}s; "
        f"{dict(kinds)}; faults {Counter(b.fault for b in res.batches)}; D {res.d_stats}"
    )
    for b in res.batches:
        outs = Counter(
            f"{o.kind}:{o.reason.split(':', 1)[0]}" if o.kind == "failed" else o.kind
            for o, _ in (reqs[rid].outcomes[0] for rid in b.rids if reqs[rid].outcomes)
        )
        print(f"  batch {b.index:2d} {b.fault:12s} rank {b.rank:2d} {b.seconds:5.2f}s {dict(outs)}")
    assert len(reqs) >= 500
    assert res.seconds <= SOAK_BUDGET, ctx + f"soak took {res.seconds:.1f}s"

    # ---- every request ends exactly once, as verified bytes or as exactly its blocks ------
    missing = [rid for rid, r in reqs.items() if not r.outcomes]
    twice = [rid for rid, r in reqs.items() if len(r.outcomes) > 1]
    assert not missing and not twice, ctx + f"never reported {missing[:8]}, twice {twice[:8]}"
    assert sum(kinds.values()) == len(reqs)
    assert res.d_stats["unexpected"] == [], ctx + f"reports for no request: {res.d_stats}"
    reasons: Counter[str] = Counter()
    # The batch after a kill may still go to the dead agent: D re-handshakes as soon as a read
    # fails, before the replacement published (test_reads_after_restart_go_to_the_new_agent).
    after_kill = {b.index + 1 for b in res.batches if b.fault == "kill_restart"}
    for r in reqs.values():
        o, arrived = r.outcomes[0]
        what = ctx + f"{r.rid} (batch {r.batch} {r.fault}, bad ids {r.bad or 'no'}): {o}"
        if r.bad:
            assert o.kind == "rejected", what
            assert o.backend_calls == 0, what + ": the backend was called before rejecting"
            assert o.reason.startswith("ConfigError") and "out of range" in o.reason, what
            assert list(o.invalid) == sorted(r.local_ids), what
            continue
        assert o.kind in ("ok", "failed"), what
        if o.kind == "ok":
            assert o.wrong == 0, what + ": silent corruption"
            continue
        assert list(o.invalid) == sorted(r.local_ids), what + ": wrong invalid block ids"
        assert o.waited <= 2 * DEADLINE + REPORT_SLACK, what + ": reported too late"
        assert arrived - r.dispatched_at <= 2 * DEADLINE + 2 * REPORT_SLACK, what
        reason = o.reason.split(":", 1)[0]
        reasons[reason] += 1
        read_in = next(b for b in res.batches if r.rid in b.rids)
        killed = read_in.fault == "kill_restart" or read_in.index in after_kill
        if reason in ("timeout", "cancelled"):  # a stopped producer leaves reads in progress,
            # and so may a killed one whose disconnect a copy thread has not seen; at a
            # deadline the reading agent is retired and reads in flight on it are cancelled
            assert read_in.fault == "stall" or killed, what
        else:  # a killed producer: in its batch, or in the next before D re-handshaked
            assert reason == "peer_lost", what
            assert read_in.fault == "kill_restart" or read_in.index in after_kill, what
    # the faults really bit: the deadline and the disconnect both ended reads
    assert reasons["timeout"] > 0 and reasons["peer_lost"] > 0, ctx + f"failures {reasons}"

    # ---- recovery: away from a kill, everything valid verifies -----------------------------
    for b in res.batches:
        if b.fault in ("kill_restart", "stall") or b.index in after_kill:
            continue
        bad = [
            (rid, reqs[rid].outcomes[0][0].reason)
            for rid in b.rids
            if not reqs[rid].bad and reqs[rid].outcomes[0][0].kind != "ok"
        ]
        assert not bad, ctx + f"batch {b.index} ({b.fault}) after recovery: failures {bad[:4]}"
    assert res.batches[-1].fault == "none" and res.batches[-1].rids

    # ---- producers: every hold freed exactly once, notified or by the lease ----------------
    for r in reqs.values():
        o = r.outcomes[0][0]
        for key in r.held_on:
            times = res.sent.get(key, {}).get(r.rid, [])
            what = ctx + f"{r.rid} (batch {r.batch} {r.fault}) on P rank/incarnation {key}"
            if key in res.restarted:
                assert len(times) <= 1, what + f": freed {len(times)} times"
                continue
            assert len(times) == 1, what + f": freed {len(times)} times"
            held_for = times[0] - r.held_at
            if o.kind == "ok" and r.notify:  # the done notification freed it, after the read
                assert times[0] >= r.dispatched_at, what + ": freed before it was read"
                assert r.kept_alive or held_for < LEASE, what + f": freed after {held_for:.2f}s"
            elif o.kind == "ok" or o.kind == "rejected":  # no notification: only the lease
                assert held_for >= LEASE - 0.05, what + f": freed after {held_for:.2f}s"
            if r.kept_alive and o.kind == "ok":  # heartbeats kept it past a whole lease
                assert r.dispatched_at - r.held_at >= LEASE, what
    for key, freed in res.sent.items():
        strays = [rid for rid in freed if key not in reqs[rid].held_on]
        assert not strays, ctx + f"P {key} freed requests it never held: {strays[:8]}"
    for rank, c in res.counters.items():
        assert c["held"] == 0 and c["malformed_notifs"] == 0, ctx + f"P rank {rank}: {c}"
    # heartbeats kept parked requests past a whole lease (checked per request above); the
    # ranks that counted them may have been restarted since, taking their counters along
    renewed = [r for r in reqs.values() if r.kept_alive and r.outcomes[0][0].kind == "ok"]
    assert renewed, ctx + "no kept-alive request was read after its lease"
    # and some requests read without a notification were freed by their lease alone (seen in
    # the events each rank sent as they happened, so also on ranks killed since)
    leased = [
        r.rid
        for r in reqs.values()
        if not r.notify
        and r.outcomes[0][0].kind == "ok"
        and any(
            t - r.held_at >= LEASE - 0.05
            for k in r.held_on
            for t in res.sent.get(k, {}).get(r.rid, [])
        )
    ]
    assert leased, ctx + f"no request was freed by its lease; counters {res.counters}"

    # ---- nothing wrote the blocks of a request after it was reported ---------------------
    # Rejected requests never reached NIXL: their blocks stay zero. Failed reads too: a READ
    # still in flight at its deadline (stalled, or a sibling part failed) retires the reading
    # agent, so its data never lands (test_faults.py's `*_never_lands_later` pin both down).
    rejected = [a for a in res.audits if a[1] == "rejected"]
    assert rejected and not [a for a in rejected if a[3]], ctx + f"audits {rejected}"
    late = [a for a in res.audits if a[1] == "failed" and a[3]]
    assert not late, ctx + f"blocks written after their failure was reported: {late}"

    # ---- the reader is idle: nothing in flight, nothing waiting -----------------------------
    d = res.d_stats
    assert d["inflight"] == d["ready"] == d["pending"] == d["waiting"] == d["keep_alive"] == 0, d
