"""kvrdma.testing.stop_process returns only once every thread of the process has stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvrdma.testing import stop_process

BUSY = """
import threading
def spin():
    while True:
        pass
for _ in range(4):
    threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
spin()
"""


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
def test_every_thread_of_a_busy_process_is_stopped_on_return() -> None:
    child = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        stop_process(child.pid)
        states = [
            (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            for task in Path(f"/proc/{child.pid}/task").iterdir()
        ]
        assert len(states) == 5 and set(states) == {"T"}
        before = _cpu_ticks(child.pid)
        time.sleep(0.2)
        assert _cpu_ticks(child.pid) == before  # five spinning threads burn no CPU
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.communicate(timeout=10)


def test_a_process_that_is_gone_is_an_error() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=10)
    with pytest.raises(ProcessLookupError):
        stop_process(child.pid)
