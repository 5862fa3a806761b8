"""bench/gpu_check.sh, the prepared GPU check: on a machine without CUDA it refuses with a line
saying so (and what to run instead) before it trains anything; its usage is its --help."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testkit.paths import REPO

SCRIPT = os.path.join(REPO, "bench", "gpu_check.sh")


def _run(*args: str, out) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", SCRIPT, *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
        check=False,
    )


def test_gpu_check_without_cuda_says_so_and_trains_nothing(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would train for minutes")
    res = _run(out=tmp_path / "out")
    assert res.returncode == 2, res.stderr
    assert "no CUDA device" in res.stderr and "--dry-run" in res.stderr
    assert not (tmp_path / "out").exists()


def test_gpu_check_help_names_the_paper_configuration(tmp_path):
    res = _run("--help", out=tmp_path / "out")
    assert res.returncode == 0, res.stderr
    assert "20 surrogate epochs" in res.stdout and "--dry-run" in res.stdout
