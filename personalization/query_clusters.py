"""Query clusters from what the engine predicts together: the vocabulary of the intent filter.

Two queries the engine predicts for the same pages serve the same interest. Each page's top-k
predictions (score-weighted, normalised per page) give a sparse page x query matrix A; the rows
of the co-occurrence matrix A^T A, L2-normalised, are clustered by spherical k-means (k-means++
start, deterministic in the seed). On the simulator's worlds these clusters recover the latent
sub-topics far better than the Astec classifier rows do (purity 0.76 against 0.19 for k-means
of the 32-d `sim_table` vectors with 32 clusters on world 22), and the filter over them
(features.build_batch's intent filter) carries most of what the window's true page sub-topics tell.
Sparse throughout: A has k entries per page, A^T A about k^2 per page.

Sessions add what titles cannot: pages a user views in one session mostly serve the session's
interest (the simulator's 0.7 on-intent rate; a reader's browsing in real logs), so with the
sessions' pages given (`groups`, sessions x pages) each query's row also holds its
co-occurrence over the sessions' predicted queries (M^T M, M = groups @ A row-normalised), unit
rows of the two concatenated with equal weight, which makes the clusters purer
(docs/decisions.md).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp


def query_clusters(
    ids: np.ndarray,
    scores: np.ndarray,
    n_labels: int,
    n_clusters: int,
    seed: int = 0,
    restarts: int = 16,
    groups: sp.spmatrix | None = None,
) -> np.ndarray:
    """float32 [n_labels] cluster of every query id (-1: never predicted on these pages) from the
    pages' predictions ids [P,k] (-1 = none) and scores [P,k] into n_clusters >= 1 clusters
    (personalization.fit_filter chooses the count);
    the best (highest summed cosine to the centres) of `restarts` k-means runs; groups: optional
    sparse [G,P] views of the pages by session (see the module docstring)."""
    if n_clusters < 1:
        raise ValueError(f"n_clusters must be >= 1, got {n_clusters}")
    ids = np.asarray(ids, np.int64)
    scores = np.asarray(scores, np.float64)
    ok = (ids >= 0) & (ids < n_labels) & (scores > 0)
    P = ids.shape[0]
    rows = np.broadcast_to(np.arange(P)[:, None], ids.shape)[ok]
    A = _rows_sum_to_one(sp.csr_matrix((scores[ok], (rows, ids[ok])), shape=(P, n_labels)))
    X, seen = _unit_rows(A.T @ A)
    if groups is not None:
        if groups.shape[1] != P:
            raise ValueError(f"groups has {groups.shape[1]} page columns, predictions {P} pages")
        M = _rows_sum_to_one(sp.csr_matrix(groups, dtype=np.float64) @ A)
        X, _ = _unit_rows(sp.hstack([X, _unit_rows(M.T @ M)[0]]))
    out = np.full(n_labels, -1.0, np.float32)
    if len(seen) == 0:
        return out
    X = X[seen]  # unit rows [n, ...] of the queries predicted on some page
    k = min(n_clusters, X.shape[0])
    rng = np.random.default_rng(seed)
    best_fit, assign = -np.inf, np.zeros(X.shape[0], np.int64)
    # `restarts` is a compute knob, not a model constant: more runs only find a tighter optimum
    # of the same objective (never a different model), at proportional cost, so it is set, not
    # fitted (k-means is start-sensitive: keep the tightest of a few)
    for _ in range(restarts):
        fit, a = _spherical_kmeans(X, k, rng)
        if fit > best_fit:
            best_fit, assign = fit, a
    out[seen] = assign
    return out


def _rows_sum_to_one(M) -> sp.csr_matrix:
    """M with each non-empty row divided by its sum (a page's or a session's scores as shares)."""
    return (sp.diags(1.0 / np.maximum(np.asarray(M.sum(1)).ravel(), 1e-12)) @ M).tocsr()


def _unit_rows(C) -> tuple[sp.csr_matrix, np.ndarray]:
    """(C with L2-normalised rows, ids of its non-zero rows)."""
    C = sp.csr_matrix(C)
    norm = np.sqrt(np.asarray(C.multiply(C).sum(1)).ravel())
    return (sp.diags(1.0 / np.maximum(norm, 1e-300)) @ C).tocsr(), np.flatnonzero(norm > 0)


def _spherical_kmeans(X, k: int, rng: np.random.Generator) -> tuple[float, np.ndarray]:
    """(summed cosine of every row to its centre, assignment [n]) of spherical k-means on the
    unit rows of sparse X from a k-means++ start."""
    n = X.shape[0]
    first = int(rng.integers(n))
    cent = [first]
    best = np.asarray((X @ X[first].T).todense()).ravel()
    for _ in range(k - 1):  # k-means++: far from every chosen centre, by squared distance
        d = np.clip(1.0 - best, 0.0, None) + 1e-12
        c = int(rng.choice(n, p=d / d.sum()))
        cent.append(c)
        best = np.maximum(best, np.asarray((X @ X[c].T).todense()).ravel())
    M = X[cent].toarray()  # [k, L] dense centres
    assign = np.full(n, -1)
    for _ in range(50):
        sim = np.asarray(X @ M.T)
        new = sim.argmax(1)
        if (new == assign).all():
            break
        assign = new
        ind = sp.csr_matrix((np.ones(n), (assign, np.arange(n))), shape=(k, n))
        M = np.asarray((ind @ X).todense())
        M /= np.maximum(np.linalg.norm(M, axis=1, keepdims=True), 1e-12)
    sim = np.asarray(X @ M.T)
    return float(sim[np.arange(n), assign].sum()), assign
