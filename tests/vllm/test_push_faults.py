"""Push mode through vLLM's scheduler when the producer stalls or dies after prefill. A
stopped producer could still write: the decoder gives the request up at
`push_registration_timeout` but reports it (every block invalid) only once the producer has
stopped writing, so vLLM never recomputes into blocks a late WRITE could land in. A killed
producer is found gone at once. With `kv_load_failure_policy: recompute` D then recomputes
the prompt. A push D aborts keeps its blocks until the producer has stopped writing.
(The tests run in file order: the last one kills the producer.)"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Iterator

import pytest
from _children import counted_since
from _harness import EngineProc, EngineSpec, free_port, requires_vllm, started, write_model_dir
from _harness import prompt as harness_prompt

pytestmark = [pytest.mark.timeout(300), requires_vllm]

PUSH_TIMEOUT = 2.0


prompt = functools.partial(harness_prompt, step=41, offset=11)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProc, EngineProc]]:
    model_dir = str(write_model_dir(tmp_path_factory.mktemp("model")))
    tag = uuid.uuid4().hex[:6]
    push = {"transfer_mode": "push"}
    p_specs = {"p": EngineSpec(model_dir, "kv_producer", f"Pp-{tag}", free_port(), extra=push)}
    d_specs = {
        "d": EngineSpec(
            model_dir,
            "kv_consumer",
            f"Dp-{tag}",
            free_port(),
            policy="recompute",
            extra={"push_registration_timeout": PUSH_TIMEOUT},
        )
    }
    with started(p_specs, d_specs) as engines:
        yield engines


def _prefill(p: EngineProc, rid: str) -> dict:
    p.add("p", rid, prompt(rid), 1, {"do_remote_decode": True, "do_remote_prefill": False})
    params = json.loads(p.wait("finished", rid)[3])
    assert params["transfer_mode"] == "push"
    return params


def _warm(p: EngineProc, d: EngineProc) -> None:
    """A first request pushed and finished: D has handshaken with P."""
    rid = f"warm-{uuid.uuid4().hex[:6]}"
    d.add("d", rid, prompt(f"p{rid}"), 2, _prefill(p, f"p{rid}"))
    assert d.wait("recv_done", rid)[4:] == ([], [])
    assert d.wait("finished", rid)[2] == "length"


def _recomputed(d: EngineProc, rid: str) -> None:
    _, _, ids, _, invalid, failed = d.wait("recv_done", rid)
    assert ids and invalid == sorted(ids) and failed == []  # every block invalid
    _, _, reason, _, _, _, computed = d.wait("finished", rid)
    assert reason == "length" and computed == 150  # the whole prompt, recomputed on D


def test_an_aborted_push_frees_its_blocks_only_once_no_producer_can_write_them(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    p, d = engines
    _warm(p, d)
    params = _prefill(p, "pa")
    with p.stopped():
        d.add("d", "da", prompt("pa"), 2, params)
        end = time.monotonic() + 10.0  # D expects it from the stopped producer
        while d.free_blocks("d") == d.free_at_start["d"]:
            assert time.monotonic() < end, "D never allocated the request's blocks"
            time.sleep(0.1)
        steps, half = d.probe("d", "steps"), time.monotonic() + 0.5
        # and the steps after (half a second, three at least): the expectation is out
        while d.probe("d", "steps") < steps + 3 or time.monotonic() < half:
            assert time.monotonic() < end, "D did not step on while the producer was stopped"
            time.sleep(0.05)
        d.abort("d", "da")
        time.sleep(PUSH_TIMEOUT)  # the stopped producer could still write: blocks held
        assert d.free_blocks("d") < d.free_at_start["d"]
    end = time.monotonic() + 10.0  # it hears the abort, stops: D's blocks are freed
    while d.free_blocks("d") != d.free_at_start["d"]:
        assert time.monotonic() < end, "D's blocks were not freed after the producer stopped"
        time.sleep(0.1)


def test_a_push_whose_expect_raises_fails_alone_and_once(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """An unexpected error while D tells P to push (NIXL's bindings failing in a way kvrdma
    does not know) fails that load only, at its registration timeout: reported once, every
    block invalid, D recomputes it and goes on loading."""
    p, d = engines
    _warm(p, d)
    params = _prefill(p, "pe")
    requests = d.probe("d", "requests")
    d.break_post("d", "RuntimeError", push=True)
    d.add("d", "de", prompt("pe"), 2, params)
    _recomputed(d, "de")
    with pytest.raises(TimeoutError):
        d.wait("recv_done", "de", timeout=1.0)  # reported once
    assert counted_since(requests, d.probe("d", "requests")) == {"invalid_blocks": 1}
    _warm(p, d)


def test_a_push_that_failed_before_d_aborted_it_stays_counted_failed_once(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    """The push fails at its timeout while the producer is stopped (its report is held back),
    then D aborts the request: once the producer stops writing D frees its blocks, and the
    stats count one failed transfer, no successful one; vLLM gets no invalid blocks for a
    request it no longer has."""
    p, d = engines
    _warm(p, d)
    params = _prefill(p, "pf")
    reduced, _, _ = d.stats("d")
    requests = d.probe("d", "requests")
    with p.stopped():
        d.add("d", "df", prompt("pf"), 2, params)
        end = time.monotonic() + PUSH_TIMEOUT + 10.0
        while not any("push of request 'df' failed" in w for w in d.probe("d", "warnings")):
            assert time.monotonic() < end, "D did not give the push up at its timeout"
            time.sleep(0.1)  # given up, its report held back
        d.abort("d", "df")
    _, _, ids, _, invalid, failed = d.wait("recv_done", "df", timeout=10.0)
    assert (ids, invalid, failed) == ([], [], [])  # vLLM frees the blocks, nothing else
    with pytest.raises(TimeoutError):
        d.wait("recv_done", "df", timeout=1.0)  # reported once
    after, _, _ = d.stats("d")
    grew = {
        k: after[k] - reduced.get(k, 0)
        for k in ("num_successful_transfers", "num_failed_transfers")
    }
    assert grew == {"num_successful_transfers": 0, "num_failed_transfers": 1}
    assert counted_since(requests, d.probe("d", "requests")) == {"invalid_blocks": 1}
    assert d.free_blocks("d") == d.free_at_start["d"]


def test_a_stalled_producer_holds_the_report_back_and_a_killed_one_fails_it_at_once(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    p, d = engines
    _warm(p, d)

    params = _prefill(p, "ps")
    with p.stopped():
        d.add("d", "ds", prompt("ps"), 2, params)
        with pytest.raises(TimeoutError):  # past the timeout, and still not reported
            d.wait("recv_done", "ds", timeout=PUSH_TIMEOUT + 2.0)
    _recomputed(d, "ds")  # the resumed producer was told to abort, and stopped writing

    params = _prefill(p, "pk")
    p.kill()
    t0 = time.monotonic()
    d.add("d", "dk", prompt("pk"), 2, params)
    _recomputed(d, "dk")
    assert time.monotonic() - t0 < PUSH_TIMEOUT + 5.0
