"""A decoder that refuses a load before reading anything still tells the producer at once,
so the producer frees the request's blocks well before its lease ends (in push mode too:
an expectation of none of D's blocks, so nothing is written into the refused ones); a second
load of a producer request already loaded tells it nothing more. So do params D refuses
(malformed) as long as every field P's release needs is valid on its own; else P is left
untold, and holds the blocks until its lease ends."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import pytest
from _children import counted_since
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

pytestmark = [pytest.mark.timeout(300), requires_vllm]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProc, EngineProc]]:
    model_dir = str(write_model_dir(tmp_path_factory.mktemp("model")))
    tag = uuid.uuid4().hex[:6]
    push = {"transfer_mode": "push"}
    p_specs = {
        "p": EngineSpec(model_dir, "kv_producer", f"Pr-{tag}", free_port()),
        "p-push": EngineSpec(model_dir, "kv_producer", f"Prp-{tag}", free_port(), extra=push),
    }
    d_specs = {
        key: EngineSpec(
            model_dir, "kv_consumer", f"D{key}-{tag}", free_port(), policy="fail",
            like_engine_core=True,
        )
        for key in ("d", "d-push")
    }  # fmt: skip
    with started(p_specs, d_specs) as engines:
        yield engines


def _prefill(p: EngineProc, rid: str, *, older: bool = False, mode: str = "pull") -> dict:
    p.add(_key("p", mode), rid, prompt(rid), 1, {"do_remote_decode": True})
    params = json.loads(p.wait("finished", rid)[3])
    assert params["transfer_mode"] == mode
    if older:  # as a producer without `remote_num_tokens` answers
        del params["remote_num_tokens"]
    return params


def _key(engine: str, mode: str) -> str:
    """The engine of `mode`: each producer has a decoder of its own."""
    return engine if mode == "pull" else f"{engine}-push"


def _freed_soon(p: EngineProc, rid: str, mode: str = "pull") -> None:
    try:
        p.wait("sent", rid, timeout=PROMPT_FREE_SECONDS)
    except TimeoutError:
        pytest.fail(f"P still holds {rid!r} {PROMPT_FREE_SECONDS}s after D refused its load")
    assert not p.probe(_key("p", mode), f"held:{rid}")


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("older", [False, True], ids=["remote_num_tokens", "span"])
def test_a_load_refused_for_a_shorter_prompt_frees_the_producers_blocks(
    engines: tuple[EngineProc, EngineProc], older: bool, mode: str
) -> None:
    """Refused by the scheduler (`remote_num_tokens`) or by the worker (P's blocks span
    more than D's request): D tells P, and P frees the blocks at once (a push producer
    stops waiting for D to expect it)."""
    p, d = engines
    rid, dk = f"p-short-{older}-{mode}", _key("d", mode)
    params = _prefill(p, rid, older=older, mode=mode)
    d.add(dk, f"d-{rid}", prompt(rid)[:100], 2, params)
    _, _, _, _, invalid, failed = d.wait("recv_done", f"d-{rid}")
    assert (len(invalid), failed) == (4, [])
    assert d.wait("finished", f"d-{rid}")[2] == "error"
    _freed_soon(p, rid, mode)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("reachable", [True, False], ids=["told", "unreachable"])
def test_a_refused_load_counts_one_failed_request_and_its_release_none(
    engines: tuple[EngineProc, EngineProc], reachable: bool, mode: str
) -> None:
    """The load that only tells the producer to let go is no request of its own: D counts the
    refused request once and no transfer (none was tried), and a release that cannot reach
    its producer as a failed notification, not as a second failed request."""
    p, d = engines
    rid, dk = f"p-count-{reachable}-{mode}", _key("d", mode)
    params = _prefill(p, rid, mode=mode)
    if not reachable:  # an engine D never loaded, at a port nobody serves
        params |= {"remote_engine_id": f"P-gone-{rid}", "remote_port": free_port()}
    requests, lost = d.probe(dk, "requests"), d.probe(dk, "failed_notifications")
    transfers = d.probe(dk, "transfers")
    d.add(dk, f"d-{rid}", prompt(rid)[:100], 2, params)
    d.wait("recv_done", f"d-{rid}")
    assert d.wait("finished", f"d-{rid}")[2] == "error"
    if reachable:
        _freed_soon(p, rid, mode)
    deadline = time.monotonic() + 15.0  # an unreachable engine's handshake fails meanwhile
    while time.monotonic() < deadline and not reachable:
        if counted_since(lost, d.probe(dk, "failed_notifications")):
            break
        time.sleep(0.1)
    time.sleep(0.5)  # the release's outcome, had it been counted as a request
    assert counted_since(requests, d.probe(dk, "requests")) == {"failed": 1}
    assert counted_since(transfers, d.probe(dk, "transfers")) == {}  # nothing was read
    want = {} if reachable else {"send_failed": 1}
    assert counted_since(lost, d.probe(dk, "failed_notifications")) == want


@pytest.mark.parametrize("first", ["read", "refused", "bad-params"])
def test_a_second_load_of_one_prefill_tells_the_producer_nothing(
    engines: tuple[EngineProc, EngineProc], first: str
) -> None:
    """The first load (read, or refused and told) freed P's blocks: a second one with the
    same params (valid ones after refused ones) is refused and sends P no notification,
    which P would count towards the request's next hold."""
    p, d = engines
    rid = f"p-again-{first}"
    params = _prefill(p, rid)
    given = params | MALFORMED["remote_block_ids"] if first == "bad-params" else params
    d.add("d", f"d-{rid}-1", prompt(rid)[: 100 if first == "refused" else 150], 2, given)
    d.wait("recv_done", f"d-{rid}-1")
    d.wait("finished", f"d-{rid}-1")
    _freed_soon(p, rid)
    stray = p.probe("p", "stray_notifs")
    d.add("d", f"d-{rid}-2", prompt(rid), 2, params)
    _, _, _, _, invalid, failed = d.wait("recv_done", f"d-{rid}-2")
    assert invalid and failed == []  # the blocks past D's own prefix-cache hit
    assert d.wait("finished", f"d-{rid}-2")[2] == "error"
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert p.probe("p", "stray_notifs") == stray, "D told P of a request it freed"
        time.sleep(0.05)


# fields D refuses that leave the producer's request named (engine, host, port, request id
# and transfer mode all valid)
MALFORMED = {
    "remote_block_ids": {"remote_block_ids": [["seven"]]},
    "remote_blocks_expiry_time": {"remote_blocks_expiry_time": "soon"},
}


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("field", list(MALFORMED))
def test_refused_params_that_name_the_producers_request_free_its_blocks(
    engines: tuple[EngineProc, EngineProc], field: str, mode: str
) -> None:
    """D refuses the params, yet each field P's release needs is valid: D tells P at once,
    counted as the other refusals are (one failed request, no transfer, nothing lost)."""
    p, d = engines
    rid, dk = f"p-malformed-{field}-{mode}", _key("d", mode)
    params = _prefill(p, rid, mode=mode) | MALFORMED[field]
    requests, lost = d.probe(dk, "requests"), d.probe(dk, "failed_notifications")
    transfers = d.probe(dk, "transfers")
    d.add(dk, f"d-{rid}", prompt(rid), 2, params)
    _, _, _, _, invalid, failed = d.wait("recv_done", f"d-{rid}")
    assert invalid and failed == []
    assert d.wait("finished", f"d-{rid}")[2] == "error"
    _freed_soon(p, rid, mode)
    time.sleep(0.5)  # the release's outcome, had it been counted as a request
    assert counted_since(requests, d.probe(dk, "requests")) == {"failed": 1}
    assert counted_since(transfers, d.probe(dk, "transfers")) == {}
    assert counted_since(lost, d.probe(dk, "failed_notifications")) == {}


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_refused_params_naming_an_unreachable_producer_count_a_failed_notification(
    engines: tuple[EngineProc, EngineProc], mode: str
) -> None:
    p, d = engines
    rid, dk = f"p-malformed-gone-{mode}", _key("d", mode)
    params = _prefill(p, rid, mode=mode) | MALFORMED["remote_block_ids"]
    params |= {"remote_engine_id": f"P-gone-{rid}", "remote_port": free_port()}
    requests, lost = d.probe(dk, "requests"), d.probe(dk, "failed_notifications")
    d.add(dk, f"d-{rid}", prompt(rid), 2, params)
    d.wait("recv_done", f"d-{rid}")
    assert d.wait("finished", f"d-{rid}")[2] == "error"
    deadline = time.monotonic() + 15.0  # the unreachable engine's handshake fails meanwhile
    while time.monotonic() < deadline:
        if counted_since(lost, d.probe(dk, "failed_notifications")):
            break
        time.sleep(0.1)
    assert counted_since(lost, d.probe(dk, "failed_notifications")) == {"send_failed": 1}
    assert counted_since(requests, d.probe(dk, "requests")) == {"failed": 1}


# params that cannot name the producer's request safely, and the field at fault
UNNAMED = {
    "remote_request_id": {"remote_request_id": None},
    "remote_port": {"remote_port": "5600"},
    "remote_engine_id": {"remote_engine_id": ["P"]},
    "transfer_mode": {"transfer_mode": "bogus"},
}


@pytest.mark.parametrize("field", list(UNNAMED))
def test_refused_params_that_cannot_name_the_producer_tell_it_nothing(
    engines: tuple[EngineProc, EngineProc], field: str
) -> None:
    """Nothing is sent (P holds the blocks until its lease ends), the load still fails, and
    D's log says P was not told and why."""
    p, d = engines
    rid = f"p-unnamed-{field}"
    params = _prefill(p, rid) | MALFORMED["remote_block_ids"] | UNNAMED[field]
    lost, stray = d.probe("d", "failed_notifications"), p.probe("p", "stray_notifs")
    d.add("d", f"d-{rid}", prompt(rid), 2, params)
    _, _, _, _, invalid, failed = d.wait("recv_done", f"d-{rid}")
    assert invalid and failed == []
    assert d.wait("finished", f"d-{rid}")[2] == "error"
    time.sleep(1.0)  # a release, had one been sent
    assert p.probe("p", f"held:{rid}")
    assert p.probe("p", "stray_notifs") == stray
    assert counted_since(lost, d.probe("d", "failed_notifications")) == {}
    said = [w for w in d.probe("d", "warnings") if f"'d-{rid}'" in w and "not told" in w]
    assert said and f"kv_transfer_params.{field}" in said[0], said
