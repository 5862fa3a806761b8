"""`astec bench scale` at a tiny size: every module's time and peak memory reach the JSON and a
well-formed table (one column per header cell), the sparse ranker included; progress bars when
asked for (an hour-long size must not run silently), none in captured output by default."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testkit.paths import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


ROOT = REPO


def _scale(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    cfg = tmp_path / "cfg.json"
    cfg.write_text(
        json.dumps(
            {
                "surrogate": {"epochs": 1},
                "extreme": {"epochs": 1},
                "rerank": {"epochs": 1},
                "network": {"embedding_dim": 32},
                "training": {"threads": 1},
            }
        )
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "infra.cli",
            "bench",
            "scale",
            "--sizes",
            "300",
            "--config",
            str(cfg),
            "--json-out",
            str(tmp_path / "scale.json"),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_bench_scale_reports_every_module(tmp_path):
    res = _scale(tmp_path)
    out, table = tmp_path / "scale.json", res.stdout
    (row,) = json.loads(out.read_text())
    assert row["L"] == 300 and row["N"] == 600
    for m in ("I", "II", "IV", "reranker", "sparse"):
        assert row["modules"][m]["seconds"] > 0 and row["modules"][m]["peak_rss_mb"] > 0
    assert 0 < row["P@1"] <= 100 and row["peak_rss_mb"] > 0
    lines = [ln for ln in table.splitlines() if ln.startswith("|")]
    assert len(lines) == 3
    widths = {ln.count("|") for ln in lines}
    assert len(widths) == 1, lines
    assert "sparse s" in lines[0] and lines[2].startswith("| 300 | 600 |")
    # stderr is not a terminal here: no progress bars unless asked for
    assert "Module IV" not in res.stderr


def test_bench_scale_progress_shows_each_module(tmp_path):
    res = _scale(tmp_path, "--progress")
    for stage in ("Module I", "Module II", "Module IV", "Re-ranker", "Sparse ranker: refit"):
        assert stage in res.stderr, res.stderr[-2000:]
    assert "Module" not in res.stdout  # the table alone on stdout
