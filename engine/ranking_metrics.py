"""Extreme multi-label metrics: P@k, nDCG@k, PSP@k, PSnDCG@k.

Definitions follow the Extreme Classification Repository as implemented by pyxclib
(`xclib/evaluation/xc_metrics.py`), so figures are comparable with published tables:

* every test point counts in the mean, including points with no true labels (they score 0);
* P@k divides by k even when fewer than k labels were predicted;
* nDCG@k divides each point's DCG@k by its ideal DCG over min(k, |true labels|);
* PSP@k = sum over points of (sum of 1/p_l over hits in the top k) / k, divided by the same sum
  for the best achievable ranking (true labels ordered by 1/p_l) -- a ratio of dataset sums;
* PSnDCG@k = mean of (propensity-weighted DCG / unweighted ideal DCG), divided by the same for
  the best achievable ranking.

Everything is vectorised over CSR arrays (one sort of all non-zeros, no per-point loop).
Predictions may be a CSR score matrix (every stored entry is a prediction, top-k by score with
ties broken by the lower label id) or top-k arrays `(ids [n, k], scores [n, k] or None)` where
id -1 marks padding; with `scores=None` the ids are taken as already ranked best first.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp

__all__ = [
    "METRIC_NAMES",
    "PROPENSITY_A",
    "PROPENSITY_B",
    "evaluate",
    "hit_matrix",
    "inv_propensity",
    "ndcg",
    "precision",
    "psndcg",
    "psprecision",
    "topk",
]

METRIC_NAMES = ("P", "nDCG", "PSP", "PSnDCG")
# the propensity model's A, B when a data set has none of its own (the XC repository's choice
# for data sets other than Amazon's 0.6, 2.6 and Wikipedia's 0.5, 0.4)
PROPENSITY_A, PROPENSITY_B = 0.55, 1.5


def inv_propensity(
    labels,
    n_train: int | None = None,
    A: float = PROPENSITY_A,
    B: float = PROPENSITY_B,
    num_labels: int | None = None,
) -> np.ndarray:
    """Inverse propensities 1/p_l = 1 + C (N_l + B)^-A, C = (ln N - 1)(B + 1)^A (Jain et al. 2016).

    `labels` is the training label matrix (n_train x L; N_l = points with label l) or a vector of
    per-label counts N_l (then `n_train` is required). `num_labels` pads with N_l = 0 for labels
    that never occur in training (they get the largest weight). Returns float64 [L].
    """
    if sp.issparse(labels):
        Y = sp.csr_matrix(labels)
        counts = np.bincount(Y.indices[Y.data != 0], minlength=Y.shape[1]).astype(np.float64)
        if n_train is None:
            n_train = Y.shape[0]
    else:
        counts = np.asarray(labels, dtype=np.float64).ravel()
        if n_train is None:
            raise ValueError("inv_propensity: n_train is required when passing label counts")
        if np.any(counts < 0):
            raise ValueError("inv_propensity: label counts must be >= 0")
    if n_train < 2:
        raise ValueError(f"inv_propensity: need at least 2 training points, got {n_train}")
    if num_labels is not None:
        if num_labels < counts.shape[0]:
            raise ValueError(
                f"inv_propensity: num_labels={num_labels} is smaller than the "
                f"{counts.shape[0]} labels counted"
            )
        counts = np.concatenate([counts, np.zeros(num_labels - counts.shape[0])])
    C = (np.log(n_train) - 1.0) * (B + 1.0) ** A
    return 1.0 + C * np.power(counts + B, -A)


def _as_binary_csr(Y) -> sp.csr_matrix:
    Y = sp.csr_matrix(Y, copy=True)
    Y.eliminate_zeros()
    Y.data[:] = 1.0
    Y.sum_duplicates()
    Y.sort_indices()
    return Y


def _rank_rows(
    rows: np.ndarray, primary: np.ndarray, cols: np.ndarray, n: int, k: int, pad_value=0.0
):
    """Top-k per row of entries (row, value, col): value desc, ties by lower col; -1 pads ids."""
    order = np.lexsort((cols, -primary, rows))
    rows_s = rows[order]
    starts = np.searchsorted(rows_s, np.arange(n))
    rank = np.arange(rows_s.shape[0]) - starts[rows_s]
    keep = rank < k
    ids = np.full((n, k), -1, dtype=np.int64)
    vals = np.full((n, k), pad_value, dtype=np.float64)
    ids[rows_s[keep], rank[keep]] = cols[order][keep]
    vals[rows_s[keep], rank[keep]] = primary[order][keep]
    return ids, vals


def topk(pred, k: int, num_labels: int | None = None) -> np.ndarray:
    """Top-k label ids [n, k] (int64, -1 = no prediction) from a CSR score matrix or arrays.

    `pred` is a sparse score matrix, an `(ids, scores)` tuple (scores may be None when the ids
    are already ranked), or a 2-D int array of ranked ids. Ids >= num_labels raise ValueError.
    """
    if sp.issparse(pred):
        P = sp.csr_matrix(pred)
        n = P.shape[0]
        rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(P.indptr))
        ids, _ = _rank_rows(
            rows, P.data.astype(np.float64), P.indices.astype(np.int64), n, k, pad_value=-np.inf
        )
        if num_labels is not None and ids.max(initial=-1) >= num_labels:
            raise ValueError(
                f"prediction label id {int(ids.max())} is >= the number of labels {num_labels}"
            )
        return ids
    if isinstance(pred, tuple):
        ids, scores = pred
    else:
        ids, scores = pred, None
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"prediction ids must be a 2-D [n, k] array, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"prediction ids must be integers, got dtype {ids.dtype}")
    ids = ids.astype(np.int64)
    if num_labels is not None and ids.size and ids.max() >= num_labels:
        raise ValueError(
            f"prediction label id {int(ids.max())} is >= the number of labels {num_labels}"
        )
    if ids.size and ids.min() < -1:
        raise ValueError(f"prediction label id {int(ids.min())} is negative (-1 is padding)")
    n, kk = ids.shape
    if scores is not None:
        scores = np.asarray(scores, dtype=np.float64)
        if scores.shape != ids.shape:
            raise ValueError(f"prediction scores shape {scores.shape} != ids shape {ids.shape}")
        valid = ids >= 0
        rows = np.repeat(np.arange(n, dtype=np.int64), kk).reshape(n, kk)[valid]
        ids, _ = _rank_rows(rows, scores[valid], ids[valid], n, k, pad_value=-np.inf)
        return ids
    if kk >= k:
        return ids[:, :k].copy()
    return np.hstack([ids, np.full((n, k - kk), -1, dtype=np.int64)])


def hit_matrix(Y_true, ids: np.ndarray) -> np.ndarray:
    """Bool [n, k]: whether ids[i, j] is a true label of point i (padding -1 is never a hit)."""
    Y = _as_binary_csr(Y_true)
    n, L = Y.shape
    if ids.shape[0] != n:
        raise ValueError(f"{ids.shape[0]} prediction rows but {n} test points")
    rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(Y.indptr))
    true_keys = rows * (L + 1) + Y.indices.astype(np.int64)  # sorted: rows, then sorted indices
    pred_keys = np.arange(n, dtype=np.int64)[:, None] * (L + 1) + ids
    if true_keys.shape[0] == 0:
        return np.zeros(ids.shape, dtype=bool)
    pos = np.minimum(np.searchsorted(true_keys, pred_keys), true_keys.shape[0] - 1)
    return (true_keys[pos] == pred_keys) & (ids >= 0)


def _discounts(k: int) -> np.ndarray:
    return 1.0 / np.log2(np.arange(k) + 2.0)


def _ideal_dcg(Y: sp.csr_matrix, k: int) -> np.ndarray:
    """Per-point ideal DCG@1..k [n, k] over min(j, |true|); points without labels get 1 (their
    numerator is 0)."""
    npos = np.diff(Y.indptr)
    cum = np.cumsum(_discounts(k))
    j = np.minimum(np.arange(1, k + 1)[None, :], npos[:, None])
    out = np.where(j > 0, cum[np.maximum(j, 1) - 1], 1.0)
    return out


def _best_ps_weights(Y: sp.csr_matrix, inv_prop: np.ndarray, k: int) -> np.ndarray:
    """[n, k] inverse propensities of each point's true labels, highest first (0-padded)."""
    n = Y.shape[0]
    rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(Y.indptr))
    cols = Y.indices.astype(np.int64)
    _, vals = _rank_rows(rows, inv_prop[cols], cols, n, k, pad_value=0.0)
    return vals


def _prepare(Y_true, pred, k: int):
    Y = _as_binary_csr(Y_true)
    ids = topk(pred, k, num_labels=Y.shape[1])
    if ids.shape[0] != Y.shape[0]:
        raise ValueError(f"{ids.shape[0]} prediction rows but {Y.shape[0]} test points")
    if Y.shape[0] == 0:
        raise ValueError("no test points to evaluate")
    return Y, ids, hit_matrix(Y, ids)


def _check_inv_prop(inv_prop, L: int) -> np.ndarray:
    inv_prop = np.asarray(inv_prop, dtype=np.float64).ravel()
    if inv_prop.shape[0] < L:
        raise ValueError(
            f"inv_prop has {inv_prop.shape[0]} entries but the test set has {L} "
            "labels (pass num_labels to inv_propensity)"
        )
    return inv_prop


def _prec_curve(weights: np.ndarray) -> np.ndarray:
    k = weights.shape[1]
    return (np.cumsum(weights, axis=1) / np.arange(1, k + 1)).mean(axis=0)


def _dcg_curve(weights: np.ndarray, idcg: np.ndarray) -> np.ndarray:
    k = weights.shape[1]
    return (np.cumsum(weights * _discounts(k), axis=1) / idcg).mean(axis=0)


def _safe_ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b > 0)


def precision(Y_true, pred, k: int = 5) -> np.ndarray:
    """P@1..k as fractions [k]."""
    _, _, hits = _prepare(Y_true, pred, k)
    return _prec_curve(hits.astype(np.float64))


def ndcg(Y_true, pred, k: int = 5) -> np.ndarray:
    """nDCG@1..k as fractions [k]."""
    Y, _, hits = _prepare(Y_true, pred, k)
    return _dcg_curve(hits.astype(np.float64), _ideal_dcg(Y, k))


def psprecision(Y_true, pred, inv_prop, k: int = 5) -> np.ndarray:
    """PSP@1..k as fractions [k], normalised by the best achievable PSP@k."""
    Y, ids, hits = _prepare(Y_true, pred, k)
    ip = _check_inv_prop(inv_prop, Y.shape[1])
    w = np.where(hits, ip[np.maximum(ids, 0)], 0.0)
    return _safe_ratio(_prec_curve(w), _prec_curve(_best_ps_weights(Y, ip, k)))


def psndcg(Y_true, pred, inv_prop, k: int = 5) -> np.ndarray:
    """PSnDCG@1..k as fractions [k], normalised by the best achievable PSnDCG@k."""
    Y, ids, hits = _prepare(Y_true, pred, k)
    ip = _check_inv_prop(inv_prop, Y.shape[1])
    w = np.where(hits, ip[np.maximum(ids, 0)], 0.0)
    idcg = _ideal_dcg(Y, k)
    return _safe_ratio(_dcg_curve(w, idcg), _dcg_curve(_best_ps_weights(Y, ip, k), idcg))


def evaluate(Y_true, pred, inv_prop=None, ks: Sequence[int] = (1, 3, 5)) -> dict[str, float]:
    """All metrics as percentages: {"P@1": .., "nDCG@1": .., "PSP@1": .., "PSnDCG@1": .., ...}.

    PSP/PSnDCG keys appear only when `inv_prop` (from `inv_propensity`) is given.
    """
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must be positive integers, got {ks}")
    K = ks[-1]
    Y, ids, hits = _prepare(Y_true, pred, K)
    h = hits.astype(np.float64)
    idcg = _ideal_dcg(Y, K)
    curves = {"P": _prec_curve(h), "nDCG": _dcg_curve(h, idcg)}
    if inv_prop is not None:
        ip = _check_inv_prop(inv_prop, Y.shape[1])
        w = np.where(hits, ip[np.maximum(ids, 0)], 0.0)
        best = _best_ps_weights(Y, ip, K)
        curves["PSP"] = _safe_ratio(_prec_curve(w), _prec_curve(best))
        curves["PSnDCG"] = _safe_ratio(_dcg_curve(w, idcg), _dcg_curve(best, idcg))
    return {
        f"{name}@{k}": float(100.0 * curve[k - 1]) for name, curve in curves.items() for k in ks
    }
