"""Two `kv_both` engines reading from each other while the test waits on only one of them.

An engine's events (a load's `recv_done` carries a snapshot of the blocks) go to the test
through a pipe. If the test reads one engine's events only, the other engine's events fill
its pipe, and an engine that blocked in sending one stops stepping: its producer agent is
no longer progressed and a peer's first READ from it cannot connect. Real engines never wait
for a reader of their events, so the harness must not either: A finishes its own load
first, then B reads from A while the test reads only B's events.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import pytest
from _harness import EngineProc, EngineSpec, free_port, requires_vllm, started, write_model_dir
from _harness import prompt as harness_prompt

pytestmark = [pytest.mark.timeout(180), requires_vllm]

UNREAD_S = 3.0  # how long A's events stay unread: enough for its load to end and report


def prompt(rid: str) -> list[int]:
    return harness_prompt(rid, step=113, offset=23)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProc, EngineProc]]:
    model_dir = str(write_model_dir(tmp_path_factory.mktemp("model")))
    tag = uuid.uuid4().hex[:6]
    a_specs = {"a": EngineSpec(model_dir, "kv_both", f"A-{tag}", free_port())}
    b_specs = {"b": EngineSpec(model_dir, "kv_both", f"B-{tag}", free_port())}
    with started(a_specs, b_specs) as e:
        yield e


def _prefill(e: EngineProc, key: str, rid: str) -> tuple[dict, bytes]:
    e.add(key, rid, prompt(rid), 1, {"do_remote_decode": True, "do_remote_prefill": False})
    ev = e.wait("finished", rid)
    return json.loads(ev[3]), ev[5]


def test_a_peer_reads_an_engine_whose_events_wait_unread(
    engines: tuple[EngineProc, EngineProc],
) -> None:
    a, b = engines
    from_a, a_snap = _prefill(a, "a", "ab")
    from_b, b_snap = _prefill(b, "b", "ba")
    a.add("a", "dba", prompt("ba"), 2, from_b)  # A loads from B; its events are not read yet
    time.sleep(UNREAD_S)
    b.add("b", "dab", prompt("ab"), 2, from_a)
    _, _, _, got, invalid, failed = b.wait("recv_done", "dab", timeout=30)
    assert (invalid, failed) == ([], []), b.probe("b", "warnings")
    assert got == a_snap
    _, _, _, got, invalid, failed = a.wait("recv_done", "dba", timeout=30)
    assert (invalid, failed) == ([], []) and got == b_snap
