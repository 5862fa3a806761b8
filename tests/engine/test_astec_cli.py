"""`astec train` / `astec predict` on a tiny TSV: model dir, prediction file, --text, clear
errors."""

import json

from click.testing import CliRunner

from engine.formats import read_predictions, write_label_names, write_text_tsv
from engine.synthetic import label_names, zipf_dataset
from infra.cli import cli

FAST = {
    "network": {"embedding_dim": 16},
    "surrogate": {"epochs": 2},
    "shortlist": {"negatives": 20, "knn_neighbours": 5, "centroid_neighbours": 10},
    "extreme": {"epochs": 2},
    "rerank": {"epochs": 1},
    "search": {"candidates": 20},
    "training": {"batch_size": 64},
}


def test_train_then_predict(tmp_path):
    texts, Y = zipf_dataset(400, 30, labels_per_point=2, words_per_point=3, vocab_size=120, seed=2)
    write_text_tsv(tmp_path / "train.tsv", texts[:300], Y[:300])
    write_text_tsv(tmp_path / "test.tsv", texts[300:], Y[300:])
    write_label_names(tmp_path / "labels.txt", label_names(30))
    (tmp_path / "cfg.json").write_text(json.dumps(FAST))
    r = CliRunner().invoke(
        cli,
        [
            "train",
            "--train",
            str(tmp_path / "train.tsv"),
            "--labels",
            str(tmp_path / "labels.txt"),
            "--out",
            str(tmp_path / "m"),
            "--config",
            str(tmp_path / "cfg.json"),
            "--seed",
            "3",
            "--quiet",
        ],
    )
    assert r.exit_code == 0, r.output
    for f in (
        "manifest.json",
        "config.json",
        "train_log.json",
        "labels.json",
        "vectorizer/tfidf.json",
        "learner_0/model.safetensors",
        "learner_0/learner.json",
    ):
        assert (tmp_path / "m" / f).is_file(), f
    assert json.loads((tmp_path / "m" / "config.json").read_text())["seed"] == 3
    r = CliRunner().invoke(
        cli,
        [
            "predict",
            "--model",
            str(tmp_path / "m"),
            "--input",
            str(tmp_path / "test.tsv"),
            "--out",
            str(tmp_path / "pred.txt"),
            "--top-k",
            "4",
        ],
    )
    assert r.exit_code == 0, r.output
    P = read_predictions(tmp_path / "pred.txt", 30)
    assert P.shape == (100, 30) and (P.getnnz(axis=1) == 4).all()
    r = CliRunner().invoke(
        cli, ["predict", "--model", str(tmp_path / "m"), "--text", texts[0], "--top-k", "2"]
    )
    assert r.exit_code == 0 and r.output.count("label") == 2, r.output


def test_errors_are_clear(tmp_path):
    (tmp_path / "bad.tsv").write_text("a title\t1,2\nno tab here\n")
    r = CliRunner().invoke(
        cli, ["train", "--train", str(tmp_path / "bad.tsv"), "--out", str(tmp_path / "m")]
    )
    assert r.exit_code != 0 and "bad.tsv:2" in r.output
    (tmp_path / "m2").mkdir()
    r = CliRunner().invoke(cli, ["predict", "--model", str(tmp_path / "m2"), "--text", "x"])
    assert r.exit_code != 0 and "manifest.json" in r.output


def test_train_from_click_logs(tmp_path):
    """`astec train --clicks` turns search clicks into title -> queries data and trains on it."""
    import numpy as np

    from engine.clicklog import ClickLogWriter

    rng = np.random.default_rng(0)
    topics = [
        ("python", "snake"),
        ("kernel", "linux"),
        ("editor", "text"),
        ("audio", "sound"),
        ("game", "chess"),
        ("font", "serif"),
    ]
    logs = tmp_path / "logs"
    with ClickLogWriter(logs, "search_clicks") as w:
        for page in range(120):
            a, b = topics[page % len(topics)]
            title = f"{a} {b} tool number {page}"
            for q in (f"{a} {b}", f"best {a}", f"{b} download"):
                for _ in range(int(rng.integers(2, 4))):
                    w.write(
                        {
                            "query": q,
                            "url": f"https://example.org/p{page}",
                            "title": title,
                            "ts": 1767600000 + page,
                        }
                    )
    part = next((logs / "search_clicks").rglob("*.jsonl"))
    with open(part, "a") as f:
        f.write('{"query": "torn line", "url"\n')
    (tmp_path / "cfg.json").write_text(json.dumps(FAST))
    r = CliRunner().invoke(
        cli,
        [
            "train",
            "--clicks",
            str(logs),
            "--out",
            str(tmp_path / "m"),
            "--config",
            str(tmp_path / "cfg.json"),
            "--quiet",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "1 corrupt lines skipped" in r.output
    assert (tmp_path / "m" / "data" / "train.tsv").is_file()
    names = json.loads((tmp_path / "m" / "labels.json").read_text())
    assert "python snake" in names and len(names) == 18
    r = CliRunner().invoke(
        cli,
        [
            "predict",
            "--model",
            str(tmp_path / "m"),
            "--text",
            "kernel linux tool number 7",
            "--top-k",
            "3",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "linux" in r.output or "kernel" in r.output


def test_train_needs_exactly_one_source(tmp_path):
    r = CliRunner().invoke(cli, ["train", "--out", str(tmp_path / "m")])
    assert r.exit_code != 0 and "exactly one of --train" in r.output
