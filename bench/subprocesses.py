"""Benchmark workers in their own interpreters, which end with the command that started them.

A benchmark runs each method or size in a fresh process so that its peak RSS is its own. When
the command is stopped by a signal it cannot catch (`kill`, a CI timeout), its worker would go
on training for up to an hour on the cores the next job needs: on Linux the worker asks the
kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def run_worker(cmd: list[str], **popen_kwargs) -> tuple[int, resource.struct_rusage]:
    """Run cmd to completion; (its wait status, its resource usage: peak RSS in ru_maxrss)."""
    proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent, **popen_kwargs)  # noqa: PLW1509
    try:
        _, status, ru = os.wait4(proc.pid, 0)
    except BaseException:  # Ctrl-C or an error here: the worker does not outlive the command
        proc.kill()
        proc.wait()
        raise
    return status, ru
