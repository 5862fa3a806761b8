"""Search clicks -> title->queries TSV: min clicks, dedupe, split by page, corrupt lines counted."""

import json

from engine.clicklog import ClickLogWriter
from engine.clicks_dataset import build_training_set
from engine.formats import read_label_names, read_text_tsv

T0 = 1_767_571_200.0  # 2026-01-05T00:00:00Z


def _clicks(tmp_path, recs):
    ClickLogWriter(tmp_path / "logs", "search_clicks").write_many(
        [{"query": q, "url": u, "title": t, "ts": T0 + i} for i, (q, u, t) in enumerate(recs)]
    )


def _rows(path, names):
    texts, Y = read_text_tsv(path, num_labels=len(names))
    return {t: sorted(names[j] for j in Y[i].indices) for i, t in enumerate(texts)}


def test_min_clicks_dedupe_and_labels(tmp_path):
    recs = (
        [("cheap flights", "u/1", "Flights to Rome")] * 3
        + [("rome hotels", "u/1", "Flights to Rome")] * 2
        + [("misclick", "u/1", "Flights to Rome")]  # one click: noise, dropped
        + [("Cheap  Flights", "u/2", "flights to rome")] * 2  # same title at another url: merged
        + [("pasta recipe", "u/3", "Pasta\tcarbonara")] * 2  # tab in a title is normalised
    )
    _clicks(tmp_path, recs)
    stats = build_training_set(tmp_path / "logs", tmp_path / "ds", min_clicks=2, test_fraction=0.0)
    names = read_label_names(tmp_path / "ds" / "labels.txt")
    assert names == ["cheap flights", "rome hotels", "pasta recipe"]  # by total clicks
    rows = _rows(tmp_path / "ds" / "train.tsv", names)
    assert rows == {
        "flights to rome": ["cheap flights", "rome hotels"],
        "pasta carbonara": ["pasta recipe"],
    }
    assert stats["clicks"] == len(recs) and stats["pairs"] == 4 and stats["pairs_kept"] == 3
    assert json.loads((tmp_path / "ds" / "clicks_dataset.json").read_text())["labels"] == 3


def test_split_by_page_is_disjoint_and_stable(tmp_path):
    recs = [(f"query {i % 50}", f"u/{i}", f"page title {i}") for i in range(600) for _ in range(2)]
    _clicks(tmp_path, recs)
    a = build_training_set(tmp_path / "logs", tmp_path / "a", min_clicks=2, test_fraction=0.25)
    build_training_set(tmp_path / "logs", tmp_path / "b", min_clicks=2, test_fraction=0.25)
    tr = (tmp_path / "a" / "train.tsv").read_text().splitlines()
    te = (tmp_path / "a" / "test.tsv").read_text().splitlines()
    assert {ln.split("\t")[0] for ln in tr}.isdisjoint({ln.split("\t")[0] for ln in te})
    assert 0.18 < len(te) / 600 < 0.32 and a["points_train"] + a["points_test"] == 600
    assert (tmp_path / "b" / "test.tsv").read_text().splitlines() == te


def test_corrupt_lines_are_skipped_and_reported(tmp_path):
    _clicks(tmp_path, [("q", "u/1", "a page")] * 2)
    part = next((tmp_path / "logs" / "search_clicks").rglob("*.jsonl"))
    with open(part, "ab") as f:
        f.write(b'{"query": "q", "url": "u/1"}\n{broken\n')
    stats = build_training_set(tmp_path / "logs", tmp_path / "ds", min_clicks=2, test_fraction=0.0)
    assert stats["points_train"] == 1
    assert stats["read"]["corrupt"] == 2 and stats["read"]["records"] == 2
