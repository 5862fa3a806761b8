"""Vectorised sparse helpers shared by shortlisting, training and prediction."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp


def normalize_rows(M):
    """L2-normalise rows of a dense array or csr matrix; all-zero rows stay zero."""
    if sp.issparse(M):
        M = sp.csr_matrix(M, dtype=np.float32, copy=True)
        norms = np.sqrt(np.asarray(M.multiply(M).sum(axis=1)).ravel())
        norms[norms == 0] = 1.0
        return sp.diags((1.0 / norms).astype(np.float32)) @ M
    norms = np.linalg.norm(M, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return (M / norms).astype(np.float32)


def from_pairs(rows, cols, vals, shape, reduce: str = "max") -> sp.csr_matrix:
    """Build a csr matrix from (row, col, val) triples; duplicates are reduced by max or sum."""
    rows = np.asarray(rows, dtype=np.int64).ravel()
    cols = np.asarray(cols, dtype=np.int64).ravel()
    vals = np.asarray(vals, dtype=np.float32).ravel()
    ok = cols >= 0
    rows, cols, vals = rows[ok], cols[ok], vals[ok]
    if reduce == "sum":
        M = sp.csr_matrix((vals, (rows, cols)), shape=shape, dtype=np.float32)
        M.sum_duplicates()
        return M
    order = np.lexsort((-vals, cols, rows))
    rows, cols, vals = rows[order], cols[order], vals[order]
    first = np.ones(len(rows), dtype=bool)
    first[1:] = (rows[1:] != rows[:-1]) | (cols[1:] != cols[:-1])
    return sp.csr_matrix((vals[first], (rows[first], cols[first])), shape=shape, dtype=np.float32)


def topk_rows(M: sp.csr_matrix, k: int) -> sp.csr_matrix:
    """Keep the k largest entries of every row (ties broken by column id)."""
    M = sp.csr_matrix(M)
    M.sum_duplicates()
    n = M.shape[0]
    counts = np.diff(M.indptr)
    if counts.size == 0 or counts.max(initial=0) <= k:
        return M
    rows = np.repeat(np.arange(n), counts)
    order = np.lexsort((M.indices, -M.data, rows))
    rank = np.arange(order.size) - M.indptr[rows[order]]
    keep = np.sort(order[rank < k])
    return sp.csr_matrix(
        (M.data[keep], M.indices[keep], np.concatenate([[0], np.cumsum(np.minimum(counts, k))])),
        shape=M.shape,
    )


def topk_dense_from_csr(M: sp.csr_matrix, k: int):
    """Top-k (ids int64 [n,k], scores float32 [n,k]) per row, best first; missing slots are
    -1 / 0."""
    M = sp.csr_matrix(M)
    n = M.shape[0]
    ids = np.full((n, k), -1, dtype=np.int64)
    scores = np.zeros((n, k), dtype=np.float32)
    if M.nnz == 0 or k == 0:
        return ids, scores
    counts = np.diff(M.indptr)
    rows = np.repeat(np.arange(n), counts)
    order = np.lexsort((M.indices, -M.data, rows))
    rank = np.arange(order.size) - M.indptr[rows[order]]
    sel = order[rank < k]
    r = rows[sel]
    pos = rank[rank < k]
    ids[r, pos] = M.indices[sel]
    scores[r, pos] = M.data[sel]
    return ids, scores


def remove_entries(M: sp.csr_matrix, mask: sp.csr_matrix) -> sp.csr_matrix:
    """Entries of M whose position is not set in mask (e.g. a shortlist minus the positives)."""
    M = sp.csr_matrix(M, dtype=np.float32)
    hit = (M != 0).multiply(mask != 0)
    out = M - M.multiply(hit)
    out.eliminate_zeros()
    return sp.csr_matrix(out)
