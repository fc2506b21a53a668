"""Faults `kvrdma demo --fault …` injects, and the check that the reports match them.

- kill-producer: SIGKILL P rank 0 mid-run. Every request dispatched once the process is gone
  must be reported with exactly its blocks invalid; nothing hangs. (Between the signal and the
  process's end its memory can still be read, and a READ then rightly verifies.)
- stall-producer: SIGSTOP P rank 0 mid-run (UCX over TCP: over shared memory a stopped
  process's memory stays readable, so reads would rightly succeed). Later requests must be
  reported invalid by the READ deadline (≤ 2× deadline after posting).
- restart-producer: SIGKILL P rank 0 and start a new one (same engine, new NIXL agent). D sees
  the peer vanish, re-handshakes, swaps the agent; requests after the restart must verify.
- drop-notifications: D reads without notifying. Reads verify; P frees every request's blocks
  when its lease expires, and counts it. The lease is short so the run ends soon, and the
  READ deadline is cut below it (a READ must end before the lease frees its blocks).
- corrupt-handshake: the first second of handshake replies is corrupted on the wire. D's
  handshake fails cleanly (nothing corrupt reaches NIXL), requests meanwhile are reported
  invalid, then D retries and later requests verify.
- partition (with --hosts): the prefill host is cut off mid-run and joins again 1.5x
  the READ deadline later. Reads cut off are reported invalid within 2x the deadline; once
  the link is back D's side channel and reads recover, and later requests verify.

With `--mode push` the same faults (but drop-notifications, a pull fault) hit pushes, the
deadline being the push's; the blocks of a failed push must stay quarantined while a stopped
producer could still write them, and be released once no producer can.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrdma.testing import stop_process, tcp_only

FAULTS = (
    "kill-producer",
    "stall-producer",
    "restart-producer",
    "drop-notifications",
    "corrupt-handshake",
    "partition",
)
_HEAL_AFTER = 1.5  # a partition lasts this many READ deadlines: past the deadline, not forever


@dataclass
class RequestResult:
    rid: str
    index: int
    d_blocks: list[int]
    dispatched_at: float
    finished_at: float = 0.0
    ok: bool = False
    wrong: int = 0
    invalid: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class CorruptingProxy:
    """A ZMQ proxy in front of the handshake server that flips bytes in its replies until
    `until` (monotonic seconds)."""

    def __init__(self, backend_port: int, until: float) -> None:
        import zmq

        self.until = until
        self.corrupted = 0
        self.first_at: float | None = None
        self._backend = f"tcp://127.0.0.1:{backend_port}"
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.linger = 0
        self.port = self._front.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvrdma-corrupt-proxy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            if not self._front.poll(50):
                continue
            client, *request = self._front.recv_multipart()
            back = self._ctx.socket(zmq.DEALER)
            back.linger = 0
            try:
                back.connect(self._backend)
                back.send_multipart(request)
                if not back.poll(2000):
                    continue
                replies = back.recv_multipart()
            finally:
                back.close()
            if len(replies) != 1:  # the answer to a client's side-channel probe: pass it on
                self._front.send_multipart([client, *replies])
                continue
            reply = bytearray(replies[0])
            if time.monotonic() < self.until:
                if not self.corrupted:
                    self.first_at = time.monotonic()
                for i in range(len(reply) // 3, len(reply), max(1, len(reply) // 7)):
                    reply[i] ^= 0x5A
                self.corrupted += 1
            self._front.send_multipart([client, bytes(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3)
        self._front.close()
        self._ctx.term()


class FaultPlan:
    """Injects one fault at request `at` and judges the outcome."""

    def __init__(self, kind: str, *, at: int, read_deadline: float) -> None:
        if kind not in FAULTS:
            raise ValueError(f"--fault must be one of {', '.join(FAULTS)}, got {kind!r}")
        self.kind = kind
        self.at = at
        self.notes: list[str] = []
        lease = self.lease_seconds_for(read_deadline)
        if kind == "drop-notifications" and read_deadline >= lease:
            read_deadline = lease / 2
            self.notes.append(f"read deadline {read_deadline:g}s, within the {lease:g}s lease")
        self.read_deadline = read_deadline
        self.injected_at: float | None = None
        self.gone_at: float | None = None  # kill-producer: when the killed process had ended
        self.recovered_at: float | None = None
        self.proxy: CorruptingProxy | None = None
        self.producer_stats: dict[int, tuple[int, int, int]] = {}
        # partition: cuts the prefill host off (False) or joins it again (True); set by the run
        self.set_link: Callable[[bool], None] | None = None
        self._heal_timer: threading.Timer | None = None

    # ---- setup -------------------------------------------------------------------------
    def child_env(self) -> dict[str, str]:
        return {"UCX_TLS": tcp_only()} if self.kind == "stall-producer" else {}

    def lease_seconds(self) -> float:
        return self.lease_seconds_for(self.read_deadline)

    def lease_seconds_for(self, read_deadline: float) -> float:
        return 4.0 if self.kind == "drop-notifications" else max(30.0, read_deadline * 3)

    def handshake_port(self, server_port: int) -> int:
        if self.kind != "corrupt-handshake":
            return server_port
        self.injected_at = time.monotonic()
        # corrupt until a little after the decode ranks' first handshakes (they start later)
        self.proxy = CorruptingProxy(server_port, until=float("inf"))
        return self.proxy.port

    @property
    def waits_for_producers(self) -> bool:
        return self.kind == "drop-notifications"

    # ---- injection ---------------------------------------------------------------------
    def due(self, index: int) -> bool:
        """The next request is the one the fault comes before."""
        return index == self.at and self.injected_at is None

    def before_dispatch(
        self, index: int, procs: list[tuple[Any, Any, str, int]], respawn: Callable[[], None]
    ) -> None:
        if index != self.at or self.injected_at is not None:
            return
        if self.kind in ("drop-notifications", "corrupt-handshake"):
            return
        if self.kind == "partition":
            self._partition()
            return
        victim = next(p for p, _, role, rank in procs if role == "P" and rank == 0)
        self.injected_at = time.monotonic()
        if self.kind == "stall-producer":
            stop_process(victim.pid)
            self.notes.append(f"SIGSTOP producer rank 0 (pid {victim.pid})")
        else:
            os.kill(victim.pid, signal.SIGKILL)
            self.notes.append(f"SIGKILL producer rank 0 (pid {victim.pid})")
            self._watch_end(victim.pid)
            if self.kind == "restart-producer":
                victim.join(timeout=5)
                respawn()
                self.notes.append("started a new producer rank 0 (same engine id, new agent)")

    def _watch_end(self, pid: int) -> None:
        """Stamp `gone_at` once the killed process `pid` has ended, without reaping it (its
        parent still joins it) and without holding up the requests meanwhile."""

        def watch() -> None:
            with contextlib.suppress(ChildProcessError):  # reaped already, or not our child
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            self.gone_at = time.monotonic()

        threading.Thread(target=watch, name="kvrdma-demo-victim", daemon=True).start()

    def _partition(self) -> None:
        if self.set_link is None:
            raise ValueError("--fault partition needs the hosts' links (--hosts N)")
        self.injected_at = time.monotonic()
        self.set_link(False)
        heal_after = _HEAL_AFTER * self.read_deadline
        self.notes.append(f"prefill host cut off; joined again {heal_after:g}s later")
        self._heal_timer = threading.Timer(heal_after, self._heal)
        self._heal_timer.daemon = True
        self._heal_timer.start()

    def _heal(self) -> None:
        if self.recovered_at is None and self.set_link is not None:
            self.set_link(True)
            self.recovered_at = time.monotonic()

    def on_ready(self, role: str, rank: int) -> None:
        if self.kind == "restart-producer" and role == "P" and self.injected_at is not None:
            self.recovered_at = time.monotonic()

    def on_dispatch(self, index: int) -> None:
        """Corrupt handshakes until request `at` is dispatched, then let them through."""
        if self.proxy is not None and index == self.at and self.proxy.until == float("inf"):
            self.proxy.until = time.monotonic() + 0.2
            self.notes.append(f"handshake replies corrupted until request {index}")

    def release(self, procs: list[tuple[Any, Any, str, int]]) -> None:
        """Undo what must not outlive the run (a stopped process, the proxy, a cut link)."""
        if self._heal_timer is not None:
            self._heal_timer.cancel()
            self._heal()
        if self.kind == "stall-producer":
            for p, _, role, rank in procs:
                if role == "P" and rank == 0 and p.is_alive():
                    os.kill(p.pid, signal.SIGCONT)
        if self.proxy is not None:
            self.notes.append(f"corrupted {self.proxy.corrupted} handshake replies")
            if self.proxy.first_at is not None:
                self.injected_at = self.proxy.first_at
            self.proxy.close()
            self.proxy = None

    def is_dead(self, role: str, rank: int) -> bool:
        """Ranks the parent must not wait for."""
        return (
            role == "P"
            and rank == 0
            and self.injected_at is not None
            and self.kind in ("kill-producer", "stall-producer")
        )

    @property
    def pausing(self) -> bool:
        """Hold new requests while a restarted producer comes up."""
        return (
            self.kind == "restart-producer"
            and self.injected_at is not None
            and self.recovered_at is None
        )

    # ---- verdict -----------------------------------------------------------------------
    def detection_seconds(self, results: list[RequestResult]) -> float | None:
        """Seconds from the injection to the first failure reported (None: none was)."""
        t0 = self.injected_at
        ends = [r.finished_at for r in results if not r.ok and t0 is not None]
        return None if t0 is None or not ends else round(min(ends) - t0, 4)

    def judge(
        self,
        results: list[RequestResult],
        p_tp: int,
        concurrency: int = 8,
        push: tuple[int, int] | None = None,
    ) -> tuple[bool, list[str]]:
        """Whether what the run reported matches the injected fault, and the lines saying so;
        `push`: the run's (quarantines, releases) when it pushed."""
        lines = [f"fault: {self.kind}"] + [f"  {n}" for n in self.notes]
        failed = [r for r in results if not r.ok]
        ok = self._judge_failures(results, failed, lines)
        if self.kind in ("kill-producer", "stall-producer"):
            ok = self._judge_lost_producer(results, lines) and ok
        elif self.kind in ("restart-producer", "partition"):
            ok = self._judge_restart(results, concurrency, lines) and ok
            if self.kind == "partition":
                ok = self._judge_partition(results, lines) and ok
        elif self.kind == "drop-notifications":
            ok = self._judge_dropped_notifications(results, failed, p_tp, lines) and ok
        elif self.kind == "corrupt-handshake":
            late = [r for r in results if r.ok]
            if not failed or not late:
                ok = False
                lines.append(
                    f"  FAIL: expected early failures and later success, got "
                    f"{len(failed)} failed / {len(late)} verified"
                )
        if push is not None:
            ok = self._judge_quarantine(*push, lines) and ok
        lines.append(f"  verdict: {'reports match the injected fault' if ok else 'MISMATCH'}")
        return ok, lines

    def _judge_quarantine(self, quarantined: int, released: int, lines: list[str]) -> bool:
        """Push: a stopped producer could still write, so the blocks of the pushes it failed
        stay out of use (none released while it is stopped); any other fault leaves no
        producer that could, so every quarantine ends."""
        lines.append(f"  push: {quarantined} quarantine(s), {released} released during the run")
        stalled = self.kind == "stall-producer"
        ok = quarantined > 0 and released == 0 if stalled else released == quarantined
        if not ok:
            want = "some, none released" if stalled else "every one released"
            lines.append(f"  FAIL: expected quarantines: {want}")
        return ok

    def _judge_failures(
        self, results: list[RequestResult], failed: list[RequestResult], lines: list[str]
    ) -> bool:
        """Any fault: no wrong element, and every failed request reports exactly its blocks."""
        wrong = sum(r.wrong for r in results)
        t0 = self.injected_at
        ok = wrong == 0 and len(results) > 0
        if wrong:
            lines.append(f"  FAIL: {wrong} wrong elements (silent corruption)")
        for r in failed:
            if r.wrong == 0 and sorted(r.invalid) != sorted(r.d_blocks):
                ok = False
                lines.append(
                    f"  FAIL: {r.rid} reported invalid {sorted(r.invalid)[:8]} but owned "
                    f"{sorted(r.d_blocks)[:8]}"
                )
        if t0 is not None and failed:
            first = min(failed, key=lambda r: r.finished_at)
            lines.append(
                f"  detected: first failure reported {first.finished_at - t0:.3f}s after injection"
            )
        for r in failed[:12]:
            blocks = sorted(r.invalid)
            shown = ", ".join(map(str, blocks[:10])) + (", …" if len(blocks) > 10 else "")
            lines.append(
                f"  {r.rid}: invalid blocks [{shown}] ({r.errors[0][:90] if r.errors else ''})"
            )
        if len(failed) > 12:
            lines.append(f"  … and {len(failed) - 12} more failed requests")
        return ok

    def _judge_lost_producer(self, results: list[RequestResult], lines: list[str]) -> bool:
        """A killed or stopped producer: requests after the fault fail, within 2x the
        deadline; a killed producer's memory stays readable until its process has ended, so
        only those dispatched once it had ended must fail."""
        t0 = self.injected_at
        after = [r for r in results if t0 is not None and r.dispatched_at > t0]
        must_fail = after
        if self.kind == "kill-producer" and t0 is not None:
            gone = self.gone_at
            if gone is None:
                lines.append("  FAIL: the killed producer had not ended by the verdict")
                return False
            must_fail = [r for r in after if r.dispatched_at > gone]
            lines.append(
                f"  producer gone {gone - t0:.4f}s after SIGKILL; of the "
                f"{len(after) - len(must_fail)} request(s) dispatched in between "
                f"{sum(r.ok for r in after if r not in must_fail)} verified (its memory was "
                "still readable)"
            )
        ok = True
        late_ok = [r.rid for r in must_fail if r.ok]
        if late_ok or all(r.ok for r in after):
            ok = False
            lines.append(f"  FAIL: requests after the fault verified: {late_ok[:5]}")
        slow = [r for r in after if r.finished_at - r.dispatched_at > 2 * self.read_deadline + 1]
        if slow:
            ok = False
            lines.append(f"  FAIL: {len(slow)} failures reported later than 2x the deadline")
        return ok

    def _judge_partition(self, results: list[RequestResult], lines: list[str]) -> bool:
        """A partition: some reads were cut, each reported within 2x the deadline."""
        t0, healed = self.injected_at, self.recovered_at
        cut = [
            r
            for r in results
            if not r.ok and t0 is not None and healed is not None and r.finished_at >= t0
        ]
        slow = [r.rid for r in cut if r.finished_at - r.dispatched_at > 2 * self.read_deadline]
        if healed is not None and t0 is not None:
            lines.append(f"  cut off for {healed - t0:.3f}s; {len(cut)} request(s) cut")
        if not cut or slow:
            lines.append(f"  FAIL: expected cut reads, each within 2x the deadline; late: {slow}")
            return False
        return True

    def _judge_restart(
        self, results: list[RequestResult], concurrency: int, lines: list[str]
    ) -> bool:
        """A restarted producer: after a few failures on the old agent, everything verifies."""
        rec = self.recovered_at
        post = sorted(
            (r for r in results if rec is not None and r.dispatched_at >= rec),
            key=lambda r: r.index,
        )
        # reads posted before D noticed the old agent is gone fail fast (peer lost), then
        # D re-handshakes and swaps in the new agent: everything after must verify
        lead = 0
        while lead < len(post) and not post[lead].ok and lead < concurrency:
            lead += 1
        bad = [r.rid for r in post[lead:] if not r.ok]
        if rec is None or len(post) - lead < 3 or bad:
            lines.append(
                f"  FAIL: after the restart {len(post)} requests, {lead} failed before the "
                f"re-handshake, later failures {bad[:5]}"
            )
            return False
        lines.append(
            f"  recovered: {lead} request(s) hit the old agent, then re-handshake; "
            f"{len(post) - lead} later requests all verified"
        )
        return True

    def _judge_dropped_notifications(
        self,
        results: list[RequestResult],
        failed: list[RequestResult],
        p_tp: int,
        lines: list[str],
    ) -> bool:
        """Reads without notifications: all verify, and every producer hold ends by its lease."""
        expired = sum(s[1] for s in self.producer_stats.values())
        want = len(results) * p_tp
        stats = sorted(self.producer_stats.items())
        per_rank = ", ".join(f"rank {r}: {s[1]}" for r, s in stats)
        lines.append(
            f"  producers freed {expired}/{want} request holds by lease expiry ({per_rank})"
        )
        if failed or expired != want:
            lines.append("  FAIL: expected every read verified and every hold expired")
            return False
        return True
