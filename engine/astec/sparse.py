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


def topk_rows_outside(M: sp.csr_matrix, mask: sp.csr_matrix, k: int, threads: int = 1):
    """topk_rows of M without its entries at mask's positions (and without stored zeros), in
    one compiled pass: hard negatives are a shortlist's best labels that are not positives,
    and the sparse algebra that removed the positives first ran on one core."""
    M = sp.csr_matrix(M, dtype=np.float32)
    M.sum_duplicates()
    mask = sp.csr_matrix(mask)
    mask.sum_duplicates()
    n = M.shape[0]
    if mask.shape[0] != n:
        raise ValueError(f"topk_rows_outside: {n} rows but a mask of {mask.shape[0]}")
    indptr = M.indptr.astype(np.int64)
    indices = M.indices.astype(np.int64)
    mptr = mask.indptr.astype(np.int64)
    midx = mask.indices.astype(np.int64)
    mdat = mask.data
    counts = np.zeros(n, np.int64)
    keep = np.empty(M.nnz, np.int64)
    row_parts(
        n,
        threads,
        lambda a, b: _topk_outside_positions(
            indptr, indices, M.data, mptr, midx, mdat != 0, k, counts, keep, a, b
        ),
    )
    out_ptr, (pos,) = _pack_rows(indptr, counts, [keep], [np.int64], threads)
    return sp.csr_matrix((M.data[pos], M.indices[pos], out_ptr), shape=M.shape)


@njit(cache=True, nogil=True, boundscheck=False)
def _topk_outside_positions(indptr, indices, data, mptr, midx, mset, k, counts, keep, a, b):
    """Row r's top k entries outside the mask, in column order, at keep[indptr[r]:...]; both
    matrices' columns ascending (a merge walk finds the masked ones)."""
    for r in range(a, b):
        s, e = indptr[r], indptr[r + 1]
        q, qe = mptr[r], mptr[r + 1]
        m = 0
        for p in range(s, e):
            c = indices[p]
            while q < qe and midx[q] < c:
                q += 1
            if (q < qe and midx[q] == c and mset[q]) or data[p] == 0:
                continue
            keep[s + m] = p
            m += 1
        if m > k:
            cand = keep[s : s + m].copy()
            order = np.argsort(-data[cand], kind="mergesort")[:k]  # ties to the lower column
            keep[s : s + k] = np.sort(cand[order])
            m = k
        counts[r] = m


@njit(cache=True, nogil=True, boundscheck=False)
def _pack_slots(bound, counts, out_ptr, src, dst, a, b):
    """Rows a..b: row r's counts[r] entries from src[bound[r]:] to dst[out_ptr[r]:]."""
    for r in range(a, b):
        s, o = bound[r], out_ptr[r]
        for t in range(counts[r]):
            dst[o + t] = src[s + t]


def _pack_rows(bound, counts, sources, dtypes, threads: int):
    """(indptr, arrays) of rows written into slots (row r's counts[r] entries from bound[r] of
    each source array) packed back to back, as a csr's arrays of the given dtypes: the
    compiled passes that fill rows of unknown length write them into slots first."""
    n = counts.size
    out_ptr = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=out_ptr[1:])
    outs = [np.empty(int(out_ptr[-1]), dt) for dt in dtypes]

    def run(a: int, b: int) -> None:
        for src, dst in zip(sources, outs, strict=True):
            _pack_slots(bound, counts, out_ptr, src, dst, a, b)

    row_parts(n, threads, run)
    return out_ptr, outs


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
def _label_score_rows(
    pids, pw, inv, Yptr, Yidx, Ydat, cids, csims, owner, prior, prior_score, wk, wc, L,
    bound, counts, out_idx, out_val, a, b,
):  # fmt: skip
    """Rows a..b of label_scores, row r written from bound[r]: its labels ascending with their
    scores, zeros dropped; counts[r] = how many."""
    acc = np.zeros(L, np.float32)  # the neighbours' summed weights per label
    best = np.zeros(L, np.float32)  # the best centre's similarity (clipped at 0) per label
    pri = np.zeros(L, np.float32)  # the prior's tiny scores
    seen = np.zeros(L, np.bool_)
    for t in range(prior.size):
        pri[prior[t]] = prior_score[t]
    kp, kc = pids.shape[1], cids.shape[1]
    for r in range(a, b):
        o = bound[r]
        ns = 0
        for j in range(kp):
            i = pids[r, j]
            w = pw[r, j]
            for q in range(Yptr[i], Yptr[i + 1]):
                lab = Yidx[q]
                if not seen[lab]:
                    seen[lab] = True
                    out_idx[o + ns] = lab
                    ns += 1
                acc[lab] += w * Ydat[q]
        for j in range(kc):
            i = cids[r, j]
            if i < 0:
                continue
            lab = owner[i]
            if not seen[lab]:
                seen[lab] = True
                out_idx[o + ns] = lab
                ns += 1
            v = max(csims[r, j], np.float32(0.0))
            if v > best[lab]:
                best[lab] = v
        for t in range(prior.size):
            lab = prior[t]
            if not seen[lab]:
                seen[lab] = True
                out_idx[o + ns] = lab
                ns += 1
        labs = np.sort(out_idx[o : o + ns])
        m = 0
        for t in range(ns):
            lab = labs[t]
            # the sums' order of the sparse algebra this replaced: (knn + centres) + prior
            v = ((acc[lab] * inv[r]) * wk + wc * best[lab]) + pri[lab]
            acc[lab] = 0.0
            best[lab] = 0.0
            seen[lab] = False
            if v != 0:
                out_idx[o + m] = lab
                out_val[o + m] = v
                m += 1
        counts[r] = m


def label_scores(
    point_ids: np.ndarray,
    point_w: np.ndarray,
    point_labels: sp.csr_matrix,
    centre_ids: np.ndarray,
    centre_sims: np.ndarray,
    owner: np.ndarray,
    prior: np.ndarray,
    prior_score: np.ndarray,
    centroid_weight: float,
    L: int,
    threads: int = 1,
) -> sp.csr_matrix:
    """csr [n, L] of shortlist scores, columns ascending, zeros dropped:
        (1 - w) * sum_j c_j y_jl / sum_j c_j + w * max(0, best centre of l) + prior_l
    over each row's neighbour points (point_ids [n, kp], weights c = point_w) and label centres
    (centre_ids [n, kc], -1 = none, owned by `owner`), prior labels always in. One compiled pass
    per row range: the sparse algebra it replaces (S @ Y, scalings, three csr sums) ran on one
    core and built [n, ~700] temporaries for every training point; the values are the same
    floats (the same products and sums in the same order)."""
    pids = np.ascontiguousarray(point_ids, dtype=np.int64)
    pw = np.ascontiguousarray(point_w, dtype=np.float32)
    cids = np.ascontiguousarray(centre_ids, dtype=np.int64)
    csims = np.ascontiguousarray(centre_sims, dtype=np.float32)
    n = pids.shape[0]
    if not (pw.shape == pids.shape and csims.shape == cids.shape and cids.shape[0] == n):
        raise ValueError(
            f"label_scores: point hits {pids.shape} / {pw.shape}, centre hits {cids.shape} / "
            f"{csims.shape}: one row per text in each"
        )
    Y = sp.csr_matrix(point_labels)
    Yptr = Y.indptr.astype(np.int64)
    Yidx = Y.indices.astype(np.int64)
    Ydat = np.ascontiguousarray(Y.data, dtype=np.float32)
    kp = pids.shape[1]
    if kp:  # the denominators as scipy's row sums computed them (np.add.reduceat)
        denom = np.add.reduceat(pw.ravel(), np.arange(0, n * kp, kp)) if n else np.zeros(0)
        denom = np.asarray(denom, np.float32)
        denom[denom == 0] = 1.0
        inv = (1.0 / denom).astype(np.float32)
        sizes = np.diff(Yptr)[pids].sum(axis=1)
    else:
        inv = np.ones(n, np.float32)
        sizes = np.zeros(n, np.int64)
    prior = np.ascontiguousarray(prior, dtype=np.int64)
    bound = np.zeros(n + 1, np.int64)
    np.cumsum(sizes + cids.shape[1] + prior.size, out=bound[1:])
    idx = np.empty(int(bound[-1]), np.int64)
    val = np.empty(int(bound[-1]), np.float32)
    counts = np.zeros(n, np.int64)
    args = (
        pids, pw, inv, Yptr, Yidx, Ydat, cids, csims,
        np.ascontiguousarray(owner, dtype=np.int64), prior,
        np.ascontiguousarray(prior_score, dtype=np.float32),
        np.float32(1.0 - centroid_weight), np.float32(centroid_weight), int(L),
        bound, counts, idx, val,
    )  # fmt: skip
    row_parts(n, threads, lambda a, b: _label_score_rows(*args, a, b))
    out_ptr, (to_idx, to_val) = _pack_rows(
        bound, counts, [idx, val], [np.int32, np.float32], threads
    )
    return sp.csr_matrix((to_val, to_idx, out_ptr), shape=(n, L))


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
