"""Same seed, same model: a small Astec (every module on: surrogate, shortlist, extreme
classifier with fine-tuned E, re-ranker, sparse ranker, label-name match, a 2-learner ensemble,
HNSW indexes) trained on tests/data/stream predicts exactly what the committed fixture holds.

The fixture was written by the training code before its modules were split into one function
each; training is bit-reproducible run to run on one thread, so any change to the training
code that changes a single score shows here. To write the fixture again (only after a change
meant to change the model, on a CPU of the kind CI runs on):

    python tests/engine/test_training_parity.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "engine" / "training_parity.npz"
STREAM = Path(__file__).resolve().parents[1] / "data" / "stream"
TRAIN, K = 480, 10


def _corpus() -> tuple[list[str], sp.csr_matrix, list[str]]:
    texts, labels = [], []
    for line in (STREAM / "train.tsv").read_text(encoding="utf-8").splitlines():
        t, ids = line.split("\t")
        texts.append(t)
        labels.append([int(x) for x in ids.split(",")])
    names = (STREAM / "labels.txt").read_text(encoding="utf-8").split("\n")[:-1]
    rows = np.repeat(np.arange(len(labels)), [len(x) for x in labels])
    Y = sp.csr_matrix(
        (np.ones(rows.size, np.float32), (rows, np.concatenate(labels))),
        shape=(len(texts), len(names)),
    )
    return texts, Y, names


def _train_and_predict() -> tuple[np.ndarray, np.ndarray, dict]:
    from engine.astec import Astec, AstecConfig

    texts, Y, names = _corpus()
    cfg = AstecConfig.from_dict(
        {
            "network": {"embedding_dim": 32},
            "surrogate": {"epochs": 3, "patience": 1},
            "shortlist": {"exact_max_points": 0, "knn_neighbours": 20},
            "extreme": {"epochs": 2},
            "rerank": {"epochs": 1},
            "sparse": {"negatives": 100},
            "ensembles": {"learners": 2},
            "search": {"graph_m": 8},
            "training": {"threads": 1, "precision": "float32"},
            "seed": 3,
        }
    )
    model = Astec.train(texts[:TRAIN], Y[:TRAIN], cfg, label_names=names, progress=False)
    ids, scores = model.predict(texts[TRAIN:], k=K)
    lg = model.train_log
    choices = {
        "alpha": [lr.alpha for lr in model.learners],
        "beta": [lr.beta for lr in model.learners],
        "gamma": [lr.gamma for lr in model.learners],
        "ensemble": model.ensemble,
        "label_text_weight": model.label_text_weight,
        "valid_points": lg["valid_points"],
    }
    return ids, scores, choices


@pytest.mark.slow
def test_training_gives_the_fixtures_predictions():
    want = np.load(FIXTURE, allow_pickle=False)
    ids, scores, choices = _train_and_predict()
    assert ids.shape == want["ids"].shape
    assert (ids == want["ids"]).all(), f"{int((ids != want['ids']).sum())} ids differ"
    diff = float(np.abs(scores - want["scores"]).max())
    assert diff == 0.0, f"max score difference {diff}"
    for k in ("alpha", "beta", "gamma"):
        assert choices[k] == want[k].tolist(), k
    assert choices["ensemble"] == str(want["ensemble"])
    assert choices["label_text_weight"] == float(want["label_text_weight"])


def _write_fixture() -> None:
    ids, scores, choices = _train_and_predict()
    np.savez_compressed(
        FIXTURE,
        ids=ids,
        scores=scores,
        alpha=np.asarray(choices["alpha"]),
        beta=np.asarray(choices["beta"]),
        gamma=np.asarray(choices["gamma"]),
        ensemble=np.asarray(choices["ensemble"]),
        label_text_weight=np.asarray(choices["label_text_weight"]),
    )
    print(f"wrote {FIXTURE}: {ids.shape[0]} texts, top {K}; {choices}")


if __name__ == "__main__":
    _write_fixture()
