"""Shared fixtures: the real Apache Kafka broker and Redis, started once per test session.

Unless both KAFKA_BOOTSTRAP and REDIS_URL are set (then those services are used as they are,
with KAFKA_SASL_* / ASTEC_* settings from the environment), the `services` fixture starts an
Apache Kafka broker (KRaft, SASL) and redis-server on free loopback ports in a temp
directory through infra.services, and stops exactly those processes at the end, also on failure.
Tests that use the stream should take `stream_settings`: same services, but topic names and a
consumer group of their own so tests never read each other's messages.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from stream.settings import Settings, load_settings


@pytest.fixture(scope="session")
def services(tmp_path_factory) -> Settings:
    """Settings pointing at running services (started here unless the env names them)."""
    if os.environ.get("KAFKA_BOOTSTRAP") and os.environ.get("REDIS_URL"):
        yield load_settings(services_dir=str(tmp_path_factory.mktemp("no-services")))
        return
    from infra.services import start_services, stop_services

    data_dir = tmp_path_factory.mktemp("services")
    start_services(data_dir)
    try:
        yield load_settings(services_dir=str(data_dir), env={})
    finally:
        stop_services(data_dir)


@pytest.fixture
def stream_settings(services: Settings) -> Settings:
    """The session's services with fresh topics, consumer group and Redis key prefix."""
    from stream.topics import ensure_topics

    tag = uuid.uuid4().hex[:8]
    s = services.replace(
        topic_page_views=f"page-views-{tag}",
        topic_ad_queries=f"ad-queries-{tag}",
        topic_ad_clicks=f"ad-clicks-{tag}",
        topic_dead_letters=f"dead-letters-{tag}",
        consumer_group=f"astec-test-{tag}",
        redis_key_prefix=f"astec-test-{tag}",
    )
    ensure_topics(s)
    return s


# ---- a small real model for the stream tests ------------------------------------------------
STREAM_DATA = os.path.join(os.path.dirname(__file__), "data", "stream")


def read_stream_corpus():
    """(titles, label id lists, label names) of tests/data/stream (600 real Debian lines)."""
    titles, labels = [], []
    with open(os.path.join(STREAM_DATA, "train.tsv"), encoding="utf-8") as f:
        for line in f:
            text, ids = line.rstrip("\n").split("\t")
            titles.append(text)
            labels.append([int(x) for x in ids.split(",")])
    with open(os.path.join(STREAM_DATA, "labels.txt"), encoding="utf-8") as f:
        names = f.read().split("\n")[:-1]
    return titles, labels, names


class KnnPredictor:
    """TF-IDF k-nearest-neighbour label voting (the ENGINE-NOTES reference model) with LSA
    features as z: a real, fitted model with the engine predictor's interface, for in-process
    stream tests that must not wait for an Astec training run."""

    def __init__(
        self, titles, labels, names, dim: int = 32, neighbours: int = 10, version: str = "knn-test"
    ):
        import numpy as np
        import scipy.sparse as sp
        from scipy.sparse.linalg import svds

        from engine.text import TfidfVectorizer

        self.vec = TfidfVectorizer(word_ngrams=1).fit(titles)
        X = self.vec.transform(titles)
        self.X = sp.csr_matrix(X / np.maximum(1e-12, sp.linalg.norm(X, axis=1))[:, None])
        rows = np.repeat(np.arange(len(labels)), [len(ls) for ls in labels])
        self.Y = sp.csr_matrix(
            (np.ones(rows.size, np.float32), (rows, np.concatenate(labels))),
            shape=(len(labels), len(names)),
        )
        _, _, vt = svds(self.X.astype(np.float64), k=dim, random_state=0)
        self.P = vt.T.astype(np.float32)
        self.neighbours, self.label_names, self.version = neighbours, list(names), version

    def predict_with_features(self, texts, k: int = 10):
        import numpy as np
        import scipy.sparse as sp

        Q = self.vec.transform(texts)
        Q = sp.csr_matrix(Q / np.maximum(1e-12, sp.linalg.norm(Q, axis=1))[:, None])
        S = (Q @ self.X.T).toarray()
        nn = np.argpartition(-S, self.neighbours, axis=1)[:, : self.neighbours]
        W = np.zeros_like(S)
        np.put_along_axis(W, nn, np.take_along_axis(S, nn, 1), 1)
        scores = np.asarray((sp.csr_matrix(W) @ self.Y).todense()) + 1e-6 * np.arange(
            len(self.label_names)
        )[::-1] / len(self.label_names)
        ids = np.argsort(-scores, axis=1)[:, :k]
        return (
            ids.astype(np.int64),
            np.take_along_axis(scores, ids, 1).astype(np.float32),
            np.asarray(Q @ self.P, np.float32),
        )

    def predict(self, texts, k: int = 10):
        return self.predict_with_features(texts, k)[:2]


@pytest.fixture(scope="session")
def stream_corpus():
    return read_stream_corpus()


@pytest.fixture(scope="session")
def knn_predictor(stream_corpus):
    return KnnPredictor(*stream_corpus)


def astec(*args: str, timeout: float = 600) -> str:
    """Run the `astec` CLI in a subprocess (as a user would); returns stdout, raises on failure."""
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "infra.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=os.path.dirname(os.path.dirname(__file__)),
        check=False,
    )
    if res.returncode != 0:
        raise RuntimeError(
            f"astec {' '.join(args)} failed ({res.returncode}):\n{res.stderr[-3000:]}"
        )
    return res.stdout


@pytest.fixture(scope="session")
def astec_predictor(tmp_path_factory) -> str:
    """A real exported Astec predictor trained on tests/data/stream (about 10 s on 2 cores)."""
    d = tmp_path_factory.mktemp("astec")
    astec(
        "train",
        "--train",
        os.path.join(STREAM_DATA, "train.tsv"),
        "--labels",
        os.path.join(STREAM_DATA, "labels.txt"),
        "--out",
        str(d / "model"),
        "--threads",
        "1",
        "--quiet",
    )
    astec("export", "--model", str(d / "model"), "--out", str(d / "predictor"), "--threads", "1")
    return str(d / "predictor")


@pytest.fixture(scope="session")
def evaluation_json(astec_predictor, tmp_path_factory) -> Path:
    """A real `astec evaluate --json` file for the fixture model on its own training lines."""
    d = tmp_path_factory.mktemp("eval")
    model = str(Path(astec_predictor).parent / "model")
    train, labels = os.path.join(STREAM_DATA, "train.tsv"), os.path.join(STREAM_DATA, "labels.txt")
    astec("predict", "--model", model, "--input", train, "--out", str(d / "pred.txt"), "--k", "5")
    astec(
        "evaluate",
        "--test",
        train,
        "--labels",
        labels,
        "--pred",
        str(d / "pred.txt"),
        "--train",
        train,
        "--train-labels",
        labels,
        "--json",
        str(d / "eval.json"),
    )
    return d / "eval.json"


@pytest.fixture
def redis_settings(services: Settings) -> Settings:
    """The session's services with a Redis key prefix of this test's own (for tests that need
    Redis only, not the Kafka topics `stream_settings` creates)."""
    return services.replace(redis_key_prefix=f"astec-dash-{uuid.uuid4().hex[:8]}")
