"""A decoder that goes idle once its last load is read: vLLM's engine core then steps it
only while the connector says it has work, yet each producer rank must still learn that the
request was read and free its blocks, well before the lease would.

P2→D1 with MLA: D reads rank 0 only and tells rank 1 by a one-byte ack READ, which ends
only while D's reading agent is progressed, that is while D steps. Whether it is still in
flight when D's request ends is a matter of timing, so the test runs several rounds."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import pytest
from _harness import (
    PROMPT_FREE_SECONDS,
    EngineProc,
    EngineSpec,
    free_port,
    prompt,
    requires_vllm,
    started,
    write_model_dir,
)

from kvrdma.vllm.owed import NotificationsOwed, OwedReport, owed_in

pytestmark = [pytest.mark.timeout(300), requires_vllm]

ROUNDS = 10


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProc, EngineProc]]:
    model_dir = str(write_model_dir(tmp_path_factory.mktemp("model")))
    tag = uuid.uuid4().hex[:6]
    p_specs = {
        "p": EngineSpec(model_dir, "kv_producer", f"Pm-{tag}", free_port(), mla=True, tp_size=2)
    }
    d_specs = {
        "d": EngineSpec(
            model_dir, "kv_consumer", f"Dm-{tag}", free_port(), mla=True,
            like_engine_core=True,
        )
    }  # fmt: skip
    with started(p_specs, d_specs) as engines:
        yield engines


def _settled_steps(d: EngineProc) -> int:
    """D's step count once it stopped stepping for three 0.2 s windows in a row (one could
    be a starved D's pause between steps); fails if it never does."""
    deadline = time.monotonic() + 10
    steps, still = d.probe("d", "steps"), 0
    while still < 3:
        time.sleep(0.2)
        now = d.probe("d", "steps")
        still = still + 1 if now == steps else 0
        assert time.monotonic() < deadline, "D never went idle"
        steps = now
    return steps


def test_an_idle_decoder_frees_every_producer_ranks_blocks(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    p, d = engines
    for i in range(ROUNDS):
        rid = f"p-idle-{i}"
        p.add("p", rid, prompt(rid), 1, {"do_remote_decode": True})
        params = json.loads(p.wait("finished", rid)[3])
        d.add("d", f"d-{rid}", prompt(rid), 1, params)
        assert d.wait("recv_done", f"d-{rid}")[4:] == ([], [])
        assert d.wait("finished", f"d-{rid}")[2] == "length"
        try:
            p.wait("sent", rid, timeout=PROMPT_FREE_SECONDS)
        except TimeoutError:
            pytest.fail(f"round {i}: P still holds {rid!r} {PROMPT_FREE_SECONDS}s after D idled")
        steps = _settled_steps(d)
        assert not p.probe("p", f"held:{rid}")
        assert d.probe("d", "steps") == steps


def test_a_worker_reports_owed_notifications_until_it_has_said_none_are() -> None:
    report = OwedReport()
    said = [report.meta(n) for n in (0, 2, 1, 0, 0)]
    assert said == [None, NotificationsOwed(2), NotificationsOwed(1), NotificationsOwed(0), None]
    assert NotificationsOwed(0).aggregate(NotificationsOwed(1)) == NotificationsOwed(1)
    assert [owed_in(m) for m in (None, NotificationsOwed(0), NotificationsOwed(3))] == [
        False,
        False,
        True,
    ]
