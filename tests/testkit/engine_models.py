"""A small real Astec model on tests/data/stream and the parity check the predictor tests share."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.predictor import Predictor
from testkit.paths import STREAM_DATA

DATA = Path(STREAM_DATA)


def corpus():
    texts, labels = [], []
    for line in (DATA / "train.tsv").read_text(encoding="utf-8").splitlines():
        t, ids = line.split("\t")
        texts.append(t)
        labels.append([int(x) for x in ids.split(",")])
    names = (DATA / "labels.txt").read_text(encoding="utf-8").split("\n")[:-1]
    return texts, labels, names


def train_small(out: Path, **sections: dict):
    """A small Astec on the first 480 texts, saved to `out`; sections: config fields to set,
    by section (`shortlist={"exact_max_points": 0}`)."""
    import scipy.sparse as sp

    from engine.astec import Astec, AstecConfig

    texts, labels, names = corpus()
    rows = np.repeat(np.arange(len(labels)), [len(x) for x in labels])
    Y = sp.csr_matrix(
        (np.ones(rows.size, np.float32), (rows, np.concatenate(labels))),
        shape=(len(texts), len(names)),
    )
    small = {
        "network": {"embedding_dim": 32},
        "surrogate": {"epochs": 2},
        "extreme": {"epochs": 2},
        "rerank": {"epochs": 1},
        "training": {"threads": 1},
    }
    cfg = AstecConfig.from_dict(
        {**small, **{s: {**small.get(s, {}), **v} for s, v in sections.items()}}
    )
    model = Astec.train(texts[:480], Y[:480], cfg, label_names=names, progress=False)
    model.save(out)
    return model


def parity(ids_a, sc_a, ids_b, sc_b):
    same5 = np.mean([set(a[:5]) == set(b[:5]) for a, b in zip(ids_a, ids_b, strict=True)])
    close = np.mean([np.allclose(a, b, atol=1e-4) for a, b in zip(sc_a, sc_b, strict=True)])
    return same5, close


def model_like(model, predictor_dir: Path):
    """The torch model searching as much as the predictor does (the export's serving profile
    searches fewer neighbours than the model's own defaults)."""
    from bench.engine_predict import match_search

    match_search(model, predictor_dir)
    return model


def assert_model_parity(model, p: Predictor, test: list[str]):
    """The predictor's batch and single-text paths give the model's top-5 and scores; returns
    the model's (ids, scores)."""
    ids_t, sc_t = model.predict(test, k=10)
    ids_p, sc_p = p.predict(test, k=10)
    same5, close = parity(ids_t, sc_t, ids_p, sc_p)
    assert same5 >= 0.99 and close >= 0.99, (same5, close)
    one = [p.predict_one(t, 10) for t in test]
    same5, close = parity(ids_p, sc_p, [o[0] for o in one], [o[1] for o in one])
    assert same5 >= 0.99 and close >= 0.99, (same5, close)
    return ids_t, sc_t
