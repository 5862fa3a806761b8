"""Vectorised sparse helpers shared by shortlisting, training and prediction."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import scipy.sparse as sp
from numba import njit


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


def topk_rows(M: sp.csr_matrix, k: int, threads: int = 1) -> sp.csr_matrix:
    """Keep the k largest entries of every row (ties broken by column id), columns in order.

    A compiled per-row selection: the 3-key lexsort over every entry it replaces was a fifth
    of a training run's time (training shortlists hold hundreds of entries per point)."""
    M = sp.csr_matrix(M)
    M.sum_duplicates()  # canonical: ascending columns, so a stable sort breaks ties by column
    counts = np.diff(M.indptr)
    if counts.size == 0 or counts.max(initial=0) <= k:
        return M
    indptr = M.indptr.astype(np.int64)
    data = np.ascontiguousarray(M.data)
    out_ptr = np.concatenate([[0], np.cumsum(np.minimum(counts, k))]).astype(np.int64)
    keep = np.empty(int(out_ptr[-1]), np.int64)
    row_parts(
        M.shape[0], threads, lambda a, b: _topk_positions(indptr, data, out_ptr, keep, k, a, b)
    )
    return sp.csr_matrix((M.data[keep], M.indices[keep], out_ptr), shape=M.shape)


def row_parts(n: int, threads: int, run, min_rows: int = 1024) -> None:
    """run(a, b) over `threads` contiguous row ranges of at least `min_rows` rows (the kernels
    release the GIL; rows are independent, so the result does not depend on the split). The
    ranges depend only on (n, threads, min_rows)."""
    parts = max(1, min(int(threads), n // min_rows or 1))
    cuts = np.linspace(0, n, parts + 1).astype(np.int64)
    if parts == 1:
        run(0, n)
        return
    with ThreadPoolExecutor(parts) as ex:
        list(ex.map(lambda i: run(int(cuts[i]), int(cuts[i + 1])), range(parts)))


@njit(cache=True, nogil=True, boundscheck=False)
def _topk_positions(indptr, data, out_ptr, keep, k, a, b):
    """keep[out_ptr[r]:out_ptr[r+1]] = entry positions of row r's top k, in column order."""
    for r in range(a, b):
        s, e = indptr[r], indptr[r + 1]
        o = out_ptr[r]
        if e - s <= k:
            for p in range(s, e):
                keep[o + p - s] = p
            continue
        order = np.argsort(-data[s:e], kind="mergesort")[:k]  # stable: ties to the lower column
        keep[o : o + k] = np.sort(order) + s


@njit(cache=True, nogil=True, boundscheck=False)
def _max_by_owner(ids, sims, owner, L, counts, out_idx, out_val, a, b):
    """Rows a..b of from_owned, row r written at r * k: its owners ascending, each with its
    max similarity (clipped at 0); counts[r] = how many."""
    k = ids.shape[1]
    best = np.full(L, -np.inf, np.float32)
    seen = np.empty(k, np.int64)
    for r in range(a, b):
        ns = 0
        for j in range(k):
            i = ids[r, j]
            if i < 0:
                continue
            lab = owner[i]
            v = max(sims[r, j], np.float32(0.0))
            if best[lab] == -np.inf:
                seen[ns] = lab
                ns += 1
            if v > best[lab]:
                best[lab] = v
        labs = np.sort(seen[:ns])
        o = r * k
        for t in range(ns):
            out_idx[o + t] = labs[t]
            out_val[o + t] = best[labs[t]]
            best[labs[t]] = -np.inf
        counts[r] = ns


def from_owned(ids: np.ndarray, sims: np.ndarray, owner: np.ndarray, L: int, threads: int = 1):
    """csr [n, L]: for each row, the max of max(sim, 0) over its neighbours (ids [n, k], -1 =
    none) per owning label: the label-centre index's scores, by a compiled pass (a lexsort of
    every (row, label) pair cost as much as the index search itself)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    sims = np.ascontiguousarray(sims, dtype=np.float32)
    owner = np.ascontiguousarray(owner, dtype=np.int64)
    n, k = ids.shape
    idx = np.empty(n * k, np.int64)
    val = np.empty(n * k, np.float32)
    counts = np.zeros(n, np.int64)
    row_parts(n, threads, lambda a, b: _max_by_owner(ids, sims, owner, L, counts, idx, val, a, b))
    out_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    # row r's entries sit at r * k ... r * k + counts[r]: gather them contiguously
    keep = np.repeat(np.arange(n, dtype=np.int64) * k - out_ptr[:-1], counts) + np.arange(
        int(out_ptr[-1])
    )
    return sp.csr_matrix(
        (val[keep], idx[keep].astype(np.int32), out_ptr), shape=(n, L), dtype=np.float32
    )


def topk_dense_from_csr(M: sp.csr_matrix, k: int):
    """Top-k (ids int64 [n,k], scores float32 [n,k]) per row, best first (ties: lower column);
    missing slots are -1 / 0."""
    M = sp.csr_matrix(M)
    n = M.shape[0]
    ids = np.full((n, k), -1, dtype=np.int64)
    scores = np.zeros((n, k), dtype=np.float32)
    if M.nnz == 0 or k == 0:
        return ids, scores
    if not M.has_sorted_indices:  # a stable sort by score then breaks ties by column
        M = M.sorted_indices()
    _topk_dense(
        M.indptr.astype(np.int64),
        M.indices.astype(np.int64),
        np.ascontiguousarray(M.data, dtype=np.float32),
        ids,
        scores,
    )
    return ids, scores


@njit(cache=True, nogil=True, boundscheck=False)
def _topk_dense(indptr, indices, data, ids, scores):
    """Rows' top k, best first, ties to the earlier entry (the lower column: rows are sorted).
    Small k (the weight grids and predictions ask for 5-10 of ~300): one pass keeping a sorted
    buffer, an entry entering only when it beats the k-th so far; large k: a stable sort."""
    k = ids.shape[1]
    for r in range(indptr.size - 1):
        s, e = indptr[r], indptr[r + 1]
        if k > 32 or e - s <= k:
            order = np.argsort(-data[s:e], kind="mergesort")[:k]
            for j in range(order.size):
                ids[r, j] = indices[s + order[j]]
                scores[r, j] = data[s + order[j]]
            continue
        m = 0
        for p in range(s, e):
            v = data[p]
            if m == k and v <= scores[r, k - 1]:
                continue
            j = min(m, k - 1)  # the slot it takes, moving later ones down (ties stay first)
            while j > 0 and scores[r, j - 1] < v:
                if j < k:
                    scores[r, j] = scores[r, j - 1]
                    ids[r, j] = ids[r, j - 1]
                j -= 1
            scores[r, j] = v
            ids[r, j] = indices[p]
            m = min(m + 1, k)


def remove_entries(M: sp.csr_matrix, mask: sp.csr_matrix) -> sp.csr_matrix:
    """Entries of M whose position is not set in mask (e.g. a shortlist minus the positives)."""
    M = sp.csr_matrix(M, dtype=np.float32)
    hit = (M != 0).multiply(mask != 0)
    out = M - M.multiply(hit)
    out.eliminate_zeros()
    return sp.csr_matrix(out)
