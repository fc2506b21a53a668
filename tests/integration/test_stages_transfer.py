"""Stage-to-stage transfers between real processes over NIXL: every TP mix byte-exact,
a missing or dead sender reported as a clear failure, nothing landing after a give-up."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvrdma.testing import stop_process

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]


class Rank:
    def __init__(
        self,
        role: str,
        senders: int,
        receivers: int,
        rank: int,
        env: dict[str, str],
        args: Sequence[str] = (),
    ):
        self.role, self.rank = role, rank
        # stderr to a file: a rank blocked on a full pipe nobody reads would look hung
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.stage_rank", "--role", role,
             "--senders", str(senders), "--receivers", str(receivers), "--rank", str(rank),
             *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            cwd=REPO, env=env,
        )  # fmt: skip
        self._pending = b""  # read from stdout, not yet split into lines
        self.port = self.read(120)["port"]  # torch, NIXL and a standby agent: slow when loaded

    def read(self, timeout: float) -> dict[str, Any]:
        """The next JSON line (NIXL logs its own lines to stdout too). Lines are split here:
        a buffered readline could hold a whole line that select() no longer reports."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                if line.startswith(b"{"):  # NIXL may append its own log text to the line
                    return dict(json.JSONDecoder().raw_decode(line.decode())[0])
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(0.0, left))
            chunk = os.read(fd, 65536) if ready else b""
            if not chunk:
                self.proc.kill()
                self.proc.communicate(timeout=10)
                err = self.err()
                pytest.fail(f"{self.role} rank {self.rank} said nothing in {timeout} s:\n{err}")
            self._pending += chunk

    def err(self) -> str:
        """What the rank wrote to stderr so far (its last 4,000 characters)."""
        self.log.seek(0)
        return self.log.read()[-4000:]

    def ask(self, timeout: float = 90, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def stop(self) -> None:
        """End of stdin ends the rank; one that does not go within 10 s is killed."""
        try:
            self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate(timeout=10)
        self.log.close()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "KVRDMA_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


@pytest.fixture
def stages(request: pytest.FixtureRequest) -> Iterator[Any]:
    started: list[Rank] = []

    def start(
        senders: int, receivers: int, *, tx_args: Sequence[str] = (), **env: str
    ) -> tuple[list[Rank], list[Rank]]:
        e = _env(**env)
        tx = [Rank("send", senders, receivers, r, e, tx_args) for r in range(senders)]
        started.extend(tx)
        rx = [Rank("receive", senders, receivers, r, e) for r in range(receivers)]
        started.extend(rx)
        tx_ports = {r.rank: r.port for r in tx}
        rx_ports = {r.rank: r.port for r in rx}
        for r in tx:
            r.ask(peers=rx_ports)
        for r in rx:
            r.ask(peers=tx_ports)
        return tx, rx

    yield start
    for r in started:
        r.stop()


@pytest.mark.parametrize(
    ("senders", "receivers", "how"),
    [
        *[(1, 2, "send"), (2, 1, "send"), (2, 4, "send"), (4, 2, "send")],
        *[(1, 2, "blocks"), (2, 1, "blocks"), (2, 4, "blocks"), (4, 2, "blocks")],
    ],
)
def test_every_receiver_gets_exactly_its_heads(
    stages: Any, senders: int, receivers: int, how: str
) -> None:
    """With `blocks`, `send_blocks` gathers the blocks (cut by heads for each receiver) out of
    each layer's paged cache, which the sender overwrites as soon as it returns, and
    `receive_blocks` writes each sender's shard into its heads of other blocks of the
    receiver's own paged cache, leaving every other block as it was."""
    tx, rx = stages(senders, receivers)
    requests = ["chat-1", "chat-2"]
    send, receive = ("send", "receive") if how == "send" else ("send_blocks", "receive_blocks")
    for r in tx:
        assert r.ask(**{send: requests}) == {"sent": requests}
    for r in rx:
        assert r.ask(**{receive: requests}) == {"received": requests, "bad": []}


def test_companion_caches_arrive_with_their_request(stages: Any) -> None:
    tx, rx = stages(2, 1)
    for r in tx:
        r.ask(send=["gen-1", "gen-1#cfg"])
    got = rx[0].ask(receive=["gen-1"], companions=["cfg"])
    assert got == {"received": ["gen-1"], "bad": []}


def test_a_missing_sender_is_named_within_the_timeout(stages: Any) -> None:
    tx, rx = stages(2, 1)
    tx[0].ask(send=["r1"])  # rank 1 never sends
    t0 = time.monotonic()
    out = rx[0].ask(receive=["r1"], deadline=1.0)
    assert time.monotonic() - t0 < 5.0
    assert out["kind"] == "TransferError"
    assert "r1_0_0_1_0" in out["error"] and "sender rank(s) 1 (no offer)" in out["error"]
    # the receiver still works, and the shard it gave up was freed on rank 0
    tx[0].ask(send=["r2"])
    tx[1].ask(send=["r2"])
    assert rx[0].ask(receive=["r2"]) == {"received": ["r2"], "bad": []}


def test_a_killed_sender_fails_the_request_not_the_receiver(stages: Any) -> None:
    tx, rx = stages(1, 1)
    tx[0].ask(send=["r1"])
    tx[0].proc.kill()
    tx[0].proc.wait(timeout=10)
    out = rx[0].ask(receive=["r1"], deadline=3.0)
    assert out["kind"] == "TransferError", out
    assert rx[0].proc.poll() is None


@contextlib.contextmanager
def _read_given_up(tx: Rank, rx: Rank) -> Iterator[None]:
    """For the block, `rx` has given up its READ of "r1" from `tx`, stopped mid-READ (over
    TCP the READ then stays in flight); `tx` resumes after it."""
    tx.ask(send=["warm"])
    assert rx.ask(receive=["warm"])["bad"] == []
    tx.ask(send=["r1"])
    stop_process(tx.proc.pid)
    try:
        out = rx.ask(receive=["r1"], deadline=1.0)
        assert out.get("kind") == "TransferError", out
        yield
    finally:
        os.kill(tx.proc.pid, signal.SIGCONT)


def test_bytes_of_a_given_up_read_never_land(stages: Any) -> None:
    """A sender stopped mid-READ over TCP: the receive fails at its deadline, its READ keeps
    its landing slots until it ends, nothing lands in the slots a receive may use, and once
    the sender resumes the slots come back and the same rank receives again."""
    tx, rx = stages(1, 1, UCX_TLS="tcp")
    with _read_given_up(tx[0], rx[0]):
        slots = rx[0].ask(slots=True)
        assert slots["held"] > 0 and slots["free"] == 64 - slots["held"], slots
        assert rx[0].ask(metrics=True)["metrics"]["held"] == slots["held"]
        assert rx[0].ask(fill=0xAB) == {"filled": slots["free"]}
    deadline = time.monotonic() + 20.0
    while (slots := rx[0].ask(slots=True))["held"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert slots == {"free": 64, "held": 0}, slots
    assert rx[0].ask(metrics=True)["metrics"]["held"] == 0.0
    assert rx[0].ask(check=0xAB) == {"intact": True}
    tx[0].ask(send=["r2"])
    assert rx[0].ask(receive=["r2"]) == {"received": ["r2"], "bad": []}
    tx[0].ask(send=["r1"])  # a request given up once may be received when asked for again
    assert rx[0].ask(receive=["r1"]) == {"received": ["r1"], "bad": []}


def test_a_read_given_up_while_waiting_for_its_senders_warm_up_is_never_posted(
    stages: Any,
) -> None:
    """The sender stops before its connection to the receiver is warm: the receiver's READ
    waits (unposted) for the warm-up, and when the receive is given up it is dropped, its
    landing slots free at once, rather than posted once the sender resumes."""
    tx, rx = stages(1, 1, UCX_TLS="tcp")
    tx[0].ask(send=["r1"])
    stop_process(tx[0].proc.pid)
    try:
        out = rx[0].ask(receive=["r1"], deadline=1.0)
        assert out.get("kind") == "TransferError" and "reading" in out["error"], out
        assert rx[0].ask(slots=True) == {"free": 64, "held": 0}
    finally:
        os.kill(tx[0].proc.pid, signal.SIGCONT)
    tx[0].ask(send=["r2"])
    assert rx[0].ask(receive=["r2"]) == {"received": ["r2"], "bad": []}


def test_bytes_of_a_given_up_read_never_land_after_close(stages: Any) -> None:
    """A receiving endpoint closed while a given-up READ from a stopped sender still runs:
    once the sender resumes, nothing lands in the slab, whose memory its owner may now
    free for other uses."""
    tx, rx = stages(1, 1, UCX_TLS="tcp")
    with _read_given_up(tx[0], rx[0]):
        assert rx[0].ask(slots=True)["held"] > 0
        assert rx[0].ask(close=0xAB) == {"closed": True}
    time.sleep(3.0)  # the sender serves the READ it was stopped in
    assert rx[0].ask(check_slab=0xAB) == {"intact": True}
    assert rx[0].proc.poll() is None


def _eventually(rank: Rank, want: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    """The rank's stage metrics once `want` holds (a sender learns of reads asynchronously)."""
    deadline = time.monotonic() + 10.0
    while True:
        got: dict[str, float] = rank.ask(metrics=True)["metrics"]
        if want(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_metrics_count_a_real_transfer_on_both_sides(stages: Any) -> None:
    tx, rx = stages(2, 1)
    for r in tx:
        r.ask(send=["m1", "m2"])
    assert rx[0].ask(receive=["m1", "m2"]) == {"received": ["m1", "m2"], "bad": []}
    got = rx[0].ask(metrics=True)["metrics"]
    assert got["success"] == 2.0 and got["timed"] == 2.0
    assert got["timeout"] == got["failed"] == 0.0
    sent_bytes = 0.0
    for r in tx:
        sent = _eventually(r, lambda m: m.get("success") == 2.0)
        assert sent["success"] == 2.0 and sent["offered"] == 0.0, sent
        sent_bytes += sent["bytes"]
    assert got["bytes"] == sent_bytes > 2 * 2 * 3 * 2 * 4 * 16 * 4 * 32  # 2 ids x 2 ranks' heads


def test_metrics_count_a_timeout_and_a_late_shard_its_receiver_refused(stages: Any) -> None:
    tx, rx = stages(2, 1)
    assert rx[0].ask(receive=["r1"], deadline=1.0)["kind"] == "TransferError"
    got = rx[0].ask(metrics=True)["metrics"]
    assert got["timeout"] == 1.0 and got["success"] == 0.0 and "bytes" not in got
    tx[0].ask(send=["r1", "r2"])  # r1 comes after its receiver gave up: refused, unread
    tx[1].ask(send=["r2"])
    assert rx[0].ask(receive=["r2"]) == {"received": ["r2"], "bad": []}
    sent = _eventually(tx[0], lambda m: m.get("given_up") == 1.0 and m.get("success") == 1.0)
    assert sent["given_up"] == 1.0 and sent["success"] == 1.0 and sent["offered"] == 0.0, sent
    for r in tx:  # a retry of r1: offers made since the give-up are received
        r.ask(send=["r1"])
    assert rx[0].ask(receive=["r1"]) == {"received": ["r1"], "bad": []}


def test_metrics_count_an_expired_lease(stages: Any) -> None:
    tx, _ = stages(1, 1, tx_args=["--lease", "3"])  # outlasts the first metrics request
    tx[0].ask(send=["nobody-reads"])
    assert tx[0].ask(metrics=True)["metrics"]["offered"] == 1.0
    sent = _eventually(tx[0], lambda m: m.get("expired") == 1.0)
    assert sent["expired"] == 1.0 and sent["offered"] == 0.0


def test_metrics_count_a_bad_offer_as_failed(stages: Any) -> None:
    tx, rx = stages(1, 1)
    tx[0].ask(forge={"key": "r1_0_0_0_0", "slot": 10_000, "slots": 1, "nbytes": 8})
    out = rx[0].ask(receive=["r1"], deadline=5.0)
    assert out["kind"] == "TransferError" and "do not fit" in out["error"], out
    got = rx[0].ask(metrics=True)["metrics"]
    assert got["failed"] == 1.0 and got["timeout"] == 0.0


def test_metrics_count_a_shard_that_finds_no_room_as_failed(stages: Any) -> None:
    tx, _ = stages(1, 1)  # nobody receives: offered shards fill the sender's slab
    out = tx[0].ask(send=[f"fill-{i}" for i in range(64)])
    assert out["kind"] == "TransferError" and "free slots" in out["error"], out
    sent = tx[0].ask(metrics=True)["metrics"]
    assert sent["failed"] == 1.0 and sent["offered"] >= 1.0 and sent["success"] == 0.0, sent


def _free_slots(rank: Rank, want: int) -> int:
    """The rank's free slab slots once they are `want` (or 10 s have passed)."""
    deadline = time.monotonic() + 10.0
    while (free := rank.ask(slots=True)["free"]) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(free)


def test_a_send_with_room_for_only_some_shards_offers_none_and_can_be_tried_again(
    stages: Any,
) -> None:
    """One sender, two receivers: a request's two shards (2 slots each) are packed before
    either is offered, so with room for one neither is offered and the same send succeeds
    once room is made."""
    tx, rx = stages(1, 2)
    tx[0].ask(send=[f"fill-{i}" for i in range(16)])  # 16 requests x 2 shards x 2 slots
    assert _free_slots(tx[0], 0) == 0
    assert rx[0].ask(receive=["fill-0"]) == {"received": ["fill-0"], "bad": []}
    assert _free_slots(tx[0], 2) == 2  # room for one shard of the next request
    out = tx[0].ask(send=["next"])
    assert out["kind"] == "TransferError" and "free slots" in out["error"], out
    assert tx[0].ask(slots=True)["free"] == 2  # its first shard is not kept
    assert rx[1].ask(receive=["fill-0"]) == {"received": ["fill-0"], "bad": []}
    assert _free_slots(tx[0], 4) == 4
    assert tx[0].ask(send=["next"]) == {"sent": ["next"]}
    for r in rx:
        assert r.ask(receive=["next"]) == {"received": ["next"], "bad": []}


def test_a_receiver_reads_again_from_a_restarted_sender(stages: Any) -> None:
    """A sender killed and started again on its port (the same stage and rank: the same agent
    name, with a new process, agent and slab): the request it held fails naming it, and the
    receiver, not restarted, receives every later request byte-exact."""
    tx, rx = stages(1, 1)
    tx[0].ask(send=["r1"])
    assert rx[0].ask(receive=["r1"]) == {"received": ["r1"], "bad": []}
    tx[0].ask(send=["r2"])
    tx[0].proc.kill()
    tx[0].proc.wait(timeout=10)
    out = rx[0].ask(receive=["r2"], deadline=3.0)
    assert out.get("kind") == "TransferError" and "sender rank" in out["error"], out
    again = Rank("send", 1, 1, 0, _env(), ["--port", str(tx[0].port)])
    try:
        assert again.ask(peers={0: rx[0].port}) == {"connected": True}
        t0 = time.monotonic()
        outcomes = []
        for rid in ["r3", "r4", "r5"]:
            assert again.ask(send=[rid]) == {"sent": [rid]}
            outcomes.append(rx[0].ask(receive=[rid], deadline=10.0))
        assert outcomes == [{"received": [rid], "bad": []} for rid in ["r3", "r4", "r5"]], outcomes
        assert time.monotonic() - t0 < 20.0
        assert rx[0].proc.poll() is None
    finally:
        again.stop()


@pytest.mark.parametrize("retries", [3, 0])
def test_a_sender_offers_again_to_a_restarted_receiver(stages: Any, retries: int) -> None:
    """A receiver killed and started again on its port: the sender, not restarted, offers
    every later request to the new process, which receives it byte-exact, and frees the
    shard it had offered to the old one (not read) without waiting for its lease. Without
    retries the first offer after the restart fails, but finds the new process for the next."""
    tx, rx = stages(1, 1, tx_args=["--retries", str(retries)])
    tx[0].ask(send=["r1"])
    assert rx[0].ask(receive=["r1"]) == {"received": ["r1"], "bad": []}
    tx[0].ask(send=["r2"])
    rx[0].proc.kill()
    rx[0].proc.wait(timeout=10)
    again = Rank("receive", 1, 1, 0, _env(), ["--port", str(rx[0].port)])
    try:
        assert again.ask(peers={0: tx[0].port}) == {"connected": True}
        if not retries:
            out = tx[0].ask(send=["lost"])
            assert out.get("kind") == "TransferError" and "after 1 attempts" in out["error"], out
        t0 = time.monotonic()
        outcomes = []
        for rid in ["r3", "r4", "r5"]:
            outcomes.append((tx[0].ask(send=[rid]), again.ask(receive=[rid], deadline=10.0)))
        want = [({"sent": [rid]}, {"received": [rid], "bad": []}) for rid in ["r3", "r4", "r5"]]
        assert outcomes == want, outcomes
        assert time.monotonic() - t0 < 20.0
        sent = _eventually(tx[0], lambda m: m.get("success") == 4.0)
        failed = 1.0 if retries else 2.0  # r2, freed; without retries "lost" too
        assert sent["success"] == 4.0 and sent["failed"] == failed and sent["offered"] == 0.0, sent
    finally:
        again.stop()
