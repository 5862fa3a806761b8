"""Benchmark workers end with the command that started them, however it is stopped."""

import os
import signal
import subprocess
import sys
import time

from testkit.paths import REPO

PARENT = """
import sys
from bench.subprocesses import run_worker
SLEEPER = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
status, ru = run_worker([sys.executable, "-c", SLEEPER])
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split(")")[-1].split()[0] != "Z"


def test_worker_dies_when_its_command_is_killed():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.send_signal(signal.SIGKILL)  # no handler, no finally: only the kernel can tell
    parent.wait(10)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_worker_status_and_peak_rss_are_reported():
    from bench.subprocesses import run_worker

    status, ru = run_worker(
        [sys.executable, "-c", "b = bytearray(50_000_000); raise SystemExit(3)"]
    )
    assert os.WEXITSTATUS(status) == 3
    assert ru.ru_maxrss * 1024 > 50_000_000
