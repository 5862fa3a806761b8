"""The stream tests' corpus (600 real Debian lines) and a small fitted model over it."""

import os

from testkit.paths import STREAM_DATA


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
