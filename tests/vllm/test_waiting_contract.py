"""What vLLM's scheduler assumes of `finished_recving`: every rank reports once each request
it parked in WAITING_FOR_REMOTE_KVS, also one aborted there (vLLM keeps its blocks until
then), and never one it did not park (a full local prefix hit, whose load only tells the
producer to let go: the scheduler asserts on it). The producer is told in both cases."""

from __future__ import annotations

import functools
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
    requires_vllm,
    started,
    write_model_dir,
)
from _harness import prompt as harness_prompt

pytestmark = [pytest.mark.timeout(300), requires_vllm]

prompt = functools.partial(harness_prompt, step=61, offset=9)

# decoder -> its producer
DECODERS = {"tp2": "p", "hybrid": "p-hybrid", "async": "p", "push-tp2": "p-push"}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProc, EngineProc]]:
    model_dir = str(write_model_dir(tmp_path_factory.mktemp("model")))
    tag = uuid.uuid4().hex[:6]

    def spec(role: str, name: str, **kw: object) -> EngineSpec:
        return EngineSpec(model_dir, role, f"{name}-{tag}", free_port(), **kw)  # type: ignore[arg-type]

    p_specs = {
        "p": spec("kv_producer", "P"),
        "p-hybrid": spec("kv_producer", "Phy", hybrid=True),
        "p-push": spec("kv_producer", "Ppu", extra={"transfer_mode": "push"}),
    }
    d_specs = {
        "tp2": spec("kv_consumer", "Dtp2", tp_size=2),
        "hybrid": spec("kv_consumer", "Dhy", hybrid=True),
        "async": spec("kv_consumer", "Das", async_scheduling=True),
        "push-tp2": spec("kv_consumer", "Dpu", tp_size=2),
    }
    with started(p_specs, d_specs) as engines:
        yield engines


def _prefill(p: EngineProc, key: str, rid: str, tokens: list[int]) -> dict:
    p.add(key, rid, tokens, 1, {"do_remote_decode": True, "do_remote_prefill": False})
    _, _, reason, params_json, _, _, _ = p.wait("finished", rid)
    assert reason == "length"
    return json.loads(params_json)


def _all_blocks_free(d: EngineProc, dk: str) -> None:
    deadline = time.monotonic() + 10
    while d.free_blocks(dk) != d.free_at_start[dk]:
        assert time.monotonic() < deadline, "D still holds the request's blocks"
        time.sleep(0.05)


@pytest.mark.parametrize("dk", list(DECODERS))
def test_a_request_aborted_while_waiting_is_reported_once_and_frees_both_sides(
    engines: tuple[EngineProc, EngineProc], dk: str
) -> None:
    p, d = engines
    pk, rid = DECODERS[dk], f"req-abort-{dk}"
    params = _prefill(p, pk, rid, prompt(rid))
    with p.stopped():  # D's first handshake with P waits, and so does the request
        d.add(dk, f"d{rid}", prompt(rid), 3, params)
        deadline = time.monotonic() + 10
        while d.free_blocks(dk) == d.free_at_start[dk]:
            assert time.monotonic() < deadline, "D never allocated the request's blocks"
            time.sleep(0.02)
        d.abort(dk, f"d{rid}")
        time.sleep(0.5)
        assert d.free_blocks(dk) < d.free_at_start[dk]  # kept until the load is reported
    d.wait("recv_done", f"d{rid}", timeout=30)
    _all_blocks_free(d, dk)
    p.wait("sent", rid, timeout=PROMPT_FREE_SECONDS)  # told, not left to its lease
    with pytest.raises(TimeoutError):
        d.wait("recv_done", f"d{rid}", timeout=1.0)  # reported once
    params = _prefill(p, pk, f"{rid}-next", prompt(f"{rid}-next"))
    d.add(dk, f"d{rid}-next", prompt(f"{rid}-next"), 2, params)
    assert d.wait("recv_done", f"d{rid}-next")[4:] == ([], [])
    assert d.wait("finished", f"d{rid}-next")[2] == "length"


@pytest.mark.parametrize("dk", ["tp2", "push-tp2"])
def test_a_full_local_hit_tells_the_producer_and_is_never_reported(
    engines: tuple[EngineProc, EngineProc], dk: str
) -> None:
    """D's prefix cache holds every token P computed: nothing is loaded, vLLM runs the
    request at once, and P still frees its blocks promptly."""
    p, d = engines
    pk, rid = DECODERS[dk], f"req-hit-{dk}"
    tokens = prompt(rid)
    d.add(dk, f"warm-{rid}", tokens, 2, None)
    assert d.wait("finished", f"warm-{rid}")[2] == "length"
    params = _prefill(p, pk, rid, tokens[:128])  # four whole blocks, all cached on D
    d.add(dk, f"d{rid}", tokens, 2, params)
    _, _, reason, _, _, _, computed = d.wait("finished", f"d{rid}")
    assert (reason, computed) == ("length", 150 - 128)
    p.wait("sent", rid, timeout=PROMPT_FREE_SECONDS)
    with pytest.raises(TimeoutError):
        d.wait("recv_done", f"d{rid}", timeout=1.0)
    _all_blocks_free(d, dk)
