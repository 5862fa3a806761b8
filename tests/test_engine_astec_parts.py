"""Astec building blocks: balanced clustering, sparse top-k, shortlists exclude positives."""
import numpy as np
import scipy.sparse as sp

from engine.astec.clustering import balanced_clusters, meta_labels
from engine.astec.shortlist import recall_at, training_shortlist
from engine.astec.sparse import topk_dense_from_csr, topk_rows


def test_balanced_clusters_sizes_differ_by_at_most_one_level():
    rng = np.random.default_rng(0)
    C = sp.csr_matrix(rng.random((1000, 50)).astype(np.float32))
    a = balanced_clusters(C, 64, seed=0, progress=False)
    sizes = np.bincount(a, minlength=64)
    assert sizes.min() >= 15 and sizes.max() <= 16 and a.max() == 63
    assert balanced_clusters(C[:3], 64, progress=False).max() <= 2   # L < clusters: no crash


def test_clusters_group_similar_labels():
    base = np.eye(4, dtype=np.float32)
    C = sp.csr_matrix(np.repeat(base, 8, axis=0) + 0.01)   # 4 groups of 8 identical labels
    a = balanced_clusters(C, 4, seed=1, progress=False)
    for g in range(4):
        assert len(set(a[g * 8:(g + 1) * 8])) == 1


def test_meta_labels():
    Y = sp.csr_matrix(np.array([[1, 1, 0], [0, 0, 1]], np.float32))
    M = meta_labels(Y, np.array([0, 0, 1]), 2).toarray()
    assert M.tolist() == [[1, 0], [0, 1]]


def test_topk_rows_and_dense():
    M = sp.csr_matrix(np.array([[0.1, 0.5, 0.3, 0], [0, 0, 0, 0], [0.2, 0, 0, 0.9]], np.float32))
    T = topk_rows(M, 2).toarray()
    assert T.tolist() == np.array([[0, 0.5, 0.3, 0], [0, 0, 0, 0], [0.2, 0, 0, 0.9]], np.float32).tolist()
    ids, sc = topk_dense_from_csr(M, 3)
    assert ids.tolist() == [[1, 2, 0], [-1, -1, -1], [3, 0, -1]]


def test_training_shortlist_excludes_positives():
    S = sp.csr_matrix(np.array([[0.9, 0.8, 0.7, 0.1, 0.0, 0.0]], np.float32))
    Y = sp.csr_matrix(np.array([[1, 0, 0, 0, 0, 0]], np.float32))
    N = training_shortlist(S, Y, 2, 0, seed=0).toarray()
    assert N.tolist() == [[0, 1, 1, 0, 0, 0]]
    N = training_shortlist(S, Y, 2, 3, seed=0).toarray()
    assert N[0, 0] == 0 and N.sum() >= 2


def test_recall_at_leaves_scores_untouched():
    # every row has fewer entries than `size`: recall must not overwrite the caller's scores with 1s
    S = sp.csr_matrix(np.array([[0.9, 0.2, 0.0], [0.0, 0.4, 0.7]], np.float32))
    Y = sp.csr_matrix(np.array([[1, 0, 0], [1, 0, 1]], np.float32))
    before = S.toarray().copy()
    assert abs(recall_at(S, Y, 5) - 100.0 * 2 / 3) < 1e-4
    assert np.array_equal(S.toarray(), before)
    assert abs(recall_at(S, Y, 1) - 100.0 * 2 / 3) < 1e-4
