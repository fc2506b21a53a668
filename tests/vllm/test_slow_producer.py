"""D's handshake with a producer runs off its step path: while the producer's process is
stopped (its side channel accepts connections but answers nothing), D's `start_load_kv`
returns at once and D keeps serving its other requests. The waiting request's read starts
once the producer answers, byte for byte; if it never does, the request fails cleanly
(every block invalid, policy "fail") when the handshake's deadline passes."""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Iterator

import pytest
from _harness import EngineProc, EngineSpec, free_port, requires_vllm, started, write_model_dir
from _harness import prompt as harness_prompt

from kvrdma.defaults import HANDSHAKE_TIMEOUT_SECONDS

pytestmark = [pytest.mark.timeout(300), requires_vllm]

# a start_load_kv that waited for the stopped producer would take the whole deadline
PROMPT_CALL = HANDSHAKE_TIMEOUT_SECONDS / 2


prompt = functools.partial(harness_prompt, step=41, offset=5)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProc, EngineProc]]:
    model_dir = str(write_model_dir(tmp_path_factory.mktemp("model")))
    tag = uuid.uuid4().hex[:6]
    p_specs = {"p": EngineSpec(model_dir, "kv_producer", f"P-{tag}", free_port())}
    d_specs = {
        key: EngineSpec(model_dir, "kv_consumer", f"D-{key}-{tag}", free_port())
        for key in ("resumed", "stopped")
    }
    with started(p_specs, d_specs) as engines:
        yield engines


def _prefill(p: EngineProc, rid: str) -> tuple[dict, bytes]:
    p.add("p", rid, prompt(rid), 1, {"do_remote_decode": True, "do_remote_prefill": False})
    _, _, reason, params_json, _, snap, _ = p.wait("finished", rid)
    assert reason == "length"
    return json.loads(params_json), snap


def test_read_starts_once_a_stopped_producer_answers(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    p, d = engines
    params, p_bytes = _prefill(p, "req-resumed")
    with p.stopped():
        d.add("resumed", "dreq-resumed", prompt("req-resumed"), 2, params)
        d.add("resumed", "local", prompt("local"), 4, None)
        # D decodes its local request while the handshake waits for the producer
        assert d.wait("finished", "local", timeout=PROMPT_CALL)[2] == "length"
        assert d.probe("resumed", "load_seconds") < PROMPT_CALL
    _, _, ids, d_bytes, invalid, failed = d.wait("recv_done", "dreq-resumed", timeout=30)
    assert (invalid, failed) == ([], [])
    assert len(ids) == 5 and d_bytes == p_bytes
    assert d.wait("finished", "dreq-resumed")[2] == "length"
    p.wait("sent", "req-resumed")


def test_handshake_with_a_producer_that_stays_stopped_fails_the_request(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    p, d = engines
    params, _ = _prefill(p, "req-stopped")
    with p.stopped():
        t0 = time.monotonic()
        d.add("stopped", "dreq-stopped", prompt("req-stopped"), 2, params)
        _, _, _, _, invalid, _ = d.wait("recv_done", "dreq-stopped", timeout=60)
        waited = time.monotonic() - t0
        assert len(invalid) == 5  # every block of the load, under the default policy "fail"
        assert d.wait("finished", "dreq-stopped")[2] == "error"
        assert waited >= HANDSHAKE_TIMEOUT_SECONDS * 0.9  # it waited for the whole deadline
        assert d.probe("stopped", "load_seconds") < PROMPT_CALL  # ... but never on the step path
        reduced, _, kvrdma_samples = d.stats("stopped")
        assert reduced["num_failed_transfers"] == 1 and reduced["num_invalid_blocks"] == 5
        assert kvrdma_samples["kvrdma_handshakes_total"] == 1
        # no heartbeat will hold the producer's blocks for a read that will never run
        assert d.probe("stopped", "heartbeating") == []
