"""`astec bench peers` run the way its docs show it, from the data's own folder with relative
paths: every method runs in a worker started from the repository's root, and must still find
the files (it failed with FileNotFoundError for each method before); with --rounds, each method
reports the medians of its alternated runs."""

from __future__ import annotations

import json

import pytest

from testkit.astec_cli import astec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_bench_peers_takes_paths_relative_to_the_callers_folder(tmp_path):
    words = [f"w{i}" for i in range(40)]
    lines = []
    for i in range(240):  # label = the text's first word's group: learnable by any method
        w = words[i % 40]
        lines.append(f"{w} {words[(i * 7) % 40]} item\t{i % 40 // 4}")
    data = tmp_path / "DATA"
    data.mkdir()
    (data / "train.tsv").write_text("\n".join(lines[:200]) + "\n")
    (data / "test.tsv").write_text("\n".join(lines[200:]) + "\n")
    (data / "labels.txt").write_text("\n".join(f"label{j}" for j in range(10)) + "\n")
    out = astec(
        "bench",
        "peers",
        "--train",
        "DATA/train.tsv",
        "--test",
        "DATA/test.tsv",
        "--labels",
        "DATA/labels.txt",
        "--methods",
        "parabel,bonsai",
        "--rounds",
        "2",
        "--json-out",
        "peers.json",
        timeout=280,
        cwd=tmp_path,
    )
    parabel, bonsai = json.loads((tmp_path / "peers.json").read_text())
    for row in (parabel, bonsai):
        assert "error" not in row, row
        assert row["rounds"] == 2 and len(row["train_s_rounds"]) == 2, row
        assert len(row["train_ratio_rounds"]) == 2, row  # (seconds this small round to 0.0)
        assert len(row["train_cpu_s_rounds"]) == 2 and row["train_cpu_s"] >= 0.0, row
    assert parabel["method"] == "parabel" and parabel["P@1"] > 50.0
    assert bonsai["method"] == "bonsai" and bonsai["P@1"] > 50.0
    assert "medians of 2 rounds" in out and "train s per round" in out
    assert "train CPU s" in out and "CPU / fastest peer" in out
