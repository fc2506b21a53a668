"""The README's "Using it from a serving engine" block, executed as written.

The block is the decode side: it connects to the engine "prefill" at 127.0.0.1:5600 and reads
that engine's blocks 7 and 9 into its blocks 0 and 1. Here the prefill side is real: the
shipped `kvrdma agent` on that port, and a producer worker process (same cache shapes, each
block filled with its own block id) that publishes its metadata to the agent, holds the
request's blocks and steps until it is stopped.
"""

from __future__ import annotations

import os
import re
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("nixl")
pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
PORT = 5600  # the port the README's block connects to

PRODUCER = """
import sys, time, torch
from kvrdma import Worker, load_kv_transfer_config
from kvrdma.handshake.publisher import KeepPublished

config = load_kv_transfer_config(
    '{"kv_connector":"NixlConnector","kv_role":"kv_producer","engine_id":"prefill"}'
)
worker = Worker.create(config, tp_rank=0, tp_size=1, total_num_kv_heads=8)
ids = torch.arange(64, dtype=torch.bfloat16).view(1, 64, 1, 1, 1)
kv_caches = {
    f"layers.{i}": ids.expand(2, 64, 16, 8, 128).contiguous() for i in range(4)
}
worker.register_kv_caches(kv_caches, cache_layout="split_kv", block_size=16)
kept = KeepPublished(lambda: worker.metadata, sys.argv[1], timeout=60.0)  # a publish lasts 30 s
worker.hold("req-1", [7, 9])
print("ready", flush=True)
end = time.monotonic() + 150
while time.monotonic() < end and "req-1" not in worker.get_finished().finished_sending:
    time.sleep(0.001)
print("sent", flush=True)
while time.monotonic() < end:  # keep serving until stopped
    worker.get_finished()
    time.sleep(0.01)
"""

CHECK = """
import sys, torch
ns = {"__name__": "__main__"}
exec(compile(open(sys.argv[1]).read(), "README.md", "exec"), ns)
for name, t in ns["kv_caches"].items():
    assert bool((t[:, 0] == 7).all() and (t[:, 1] == 9).all()), name
    assert not t[:, 2:].any(), name
print("verified")
"""


def readme_engine_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Using it from a serving engine") :]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "no python block under 'Using it from a serving engine'"
    return m.group(1)


_PENDING: dict[int, bytes] = {}  # per process: output read, not yet split into lines


def _expect(proc: subprocess.Popen[str], word: str, timeout: float) -> None:
    """Read the process's output (NIXL logs there too) until a line `word`. Lines are split
    here: select() does not see a line that a buffered readline already holds."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    end = time.monotonic() + timeout
    while True:
        pending = _PENDING.get(proc.pid, b"")
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            _PENDING[proc.pid] = pending
            if line.decode(errors="replace").strip() == word:
                return
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            pytest.fail(f"the producer did not say {word!r} within {timeout:g} s")
        chunk = os.read(fd, 65536)
        if not chunk:
            pytest.fail(f"the producer exited ({proc.wait(5)}) before saying {word!r}")
        _PENDING[proc.pid] = pending + chunk


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def prefill(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """The shipped agent on 127.0.0.1:5600 and a producer publishing to it."""
    assert _port_free(PORT), f"port {PORT} (the README's handshake port) is in use"
    publish = f"ipc://{tmp_path}/publish.sock"
    config = '{"kv_connector":"NixlConnector","kv_role":"kv_producer","engine_id":"prefill"}'
    agent = subprocess.Popen(
        [sys.executable, "-m", "kvrdma", "agent", "--config", config, "--host", "127.0.0.1",
         "--port", str(PORT), "--http-port", "0", "--publish", publish],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    producer = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, publish],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        _expect(producer, "ready", 120)
        yield producer
    finally:
        for p in (producer, agent):
            p.terminate()
        for p in (producer, agent):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        assert producer.stdout is not None
        producer.stdout.close()


def test_readme_engine_example_runs_as_written(
    prefill: subprocess.Popen[str], tmp_path: Path
) -> None:
    code = readme_engine_example()
    assert "handshake_client" not in code
    script = tmp_path / "example.py"
    script.write_text(code)
    run = subprocess.run(
        [sys.executable, "-c", CHECK, str(script)],
        cwd=ROOT, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert "req-1 read" in lines and lines[-1] == "verified", run.stdout
    _expect(prefill, "sent", 30)  # the read told the producer "done"
