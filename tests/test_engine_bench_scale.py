"""`astec bench scale` at a tiny size: every module's time and peak memory reach the JSON and a
well-formed table (one column per header cell), the sparse ranker included."""
from __future__ import annotations

import json

import pytest

from conftest import astec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_bench_scale_reports_every_module(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"surrogate_epochs": 1, "extreme_epochs": 1, "reranker_epochs": 1,
                               "embedding_dim": 32, "num_threads": 1}))
    out = tmp_path / "scale.json"
    table = astec("bench", "scale", "--sizes", "300", "--config", str(cfg), "--json-out", str(out))
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
