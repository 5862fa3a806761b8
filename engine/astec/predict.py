"""The prediction pipeline as plain numpy functions (shortlist -> classifier scores -> alpha/beta).

    S      = base similarities s(v) of shortlisted labels        (shortlist.ShortlistIndex.scores)
    C      = top `search.candidates` labels of S                  (sparse.topk_rows)
    logit  = w_l^T z + b_l on the entries of C                    (classifier_logits)
    y_hat  = alpha * sigmoid(logit) + (1 - alpha) * sigmoid(s)    (combine)
    y_bar  = beta * y_hat + (1 - beta) * sigmoid(w~_l^T z~ + b~_l)
    y      = gamma * y_bar + (1 - gamma) * sigmoid(u_l^T x)     (sparse ranker, sparse_ranker.py)
An ensemble joins y over learners by their mean or max (ensemble_scores; a label a learner did
not shortlist counts 0 there).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from numba import njit

from .sparse import row_parts


def sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-np.clip(x, -30, 30)))).astype(np.float32)


def classifier_logits(
    Z: np.ndarray, W: np.ndarray, b: np.ndarray, C: sp.csr_matrix, threads: int = 1
) -> np.ndarray:
    """w_l^T z_i + b_l for every stored entry (i, l) of C, in C's entry order (float32 [nnz]).

    One compiled pass reads each candidate's row of W in place: the numpy gather it replaces
    copied a [nnz, D] block through memory (a training shortlist pass scores ~300 entries for
    each of ~10^5 points)."""
    C = sp.csr_matrix(C)
    out = np.empty(C.nnz, np.float32)
    if C.nnz == 0:
        return out
    Z = np.ascontiguousarray(Z, np.float32)
    W = np.ascontiguousarray(W, np.float32)
    b = np.ascontiguousarray(b, np.float32).reshape(-1)
    ptr = C.indptr.astype(np.int64)
    lab = C.indices.astype(np.int64)
    row_parts(C.shape[0], threads, lambda a, e: _entry_dots(Z, W, b, ptr, lab, out, a, e))
    return out


# reassociation lets the dot products use SIMD (the order of a float32 sum is not a contract)
@njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc", "contract", "nsz", "arcp"})
def _entry_dots(Z, W, b, ptr, lab, out, lo, hi):
    D = Z.shape[1]
    for i in range(lo, hi):
        for e in range(ptr[i], ptr[i + 1]):
            row = W[lab[e]]
            s = np.float32(0.0)
            for d in range(D):
                s += row[d] * Z[i, d]
            out[e] = s + b[lab[e]]


@dataclass
class Sigmoids:
    """The sigmoids `combine` mixes, on C's entries: computed once, mixed at every value of a
    weight grid (the validation choices of alpha, beta and gamma)."""

    base: np.ndarray  # sigmoid(w_l^T z + b_l)
    shortlist: np.ndarray  # sigmoid(s)
    rerank: np.ndarray | None = None
    sparse: np.ndarray | None = None

    @classmethod
    def of(cls, C: sp.csr_matrix, logits, rerank_logits=None, sparse_scores=None) -> Sigmoids:
        return cls(
            sigmoid(logits),
            sigmoid(C.data),
            None if rerank_logits is None else sigmoid(rerank_logits),
            None if sparse_scores is None else sigmoid(sparse_scores),
        )


def mix(
    C: sp.csr_matrix, sig: Sigmoids, alpha: float, beta: float = 1.0, gamma: float = 1.0
) -> sp.csr_matrix:
    """Final scores on C's pattern from its sigmoids (see `combine`)."""
    y = alpha * sig.base + (1.0 - alpha) * sig.shortlist
    if sig.rerank is not None:
        y = beta * y + (1.0 - beta) * sig.rerank
    if sig.sparse is not None:
        y = gamma * y + (1.0 - gamma) * sig.sparse
    return sp.csr_matrix((y.astype(np.float32), C.indices, C.indptr), shape=C.shape)


def combine(
    C: sp.csr_matrix,
    logits: np.ndarray,
    alpha: float,
    rerank_logits: np.ndarray | None = None,
    beta: float = 1.0,
    sparse_scores: np.ndarray | None = None,
    gamma: float = 1.0,
) -> sp.csr_matrix:
    """Final scores on C's pattern: the paper's alpha/beta combination (C.data holds s), then
    the sparse ranker's gamma."""
    return mix(C, Sigmoids.of(C, logits, rerank_logits, sparse_scores), alpha, beta, gamma)


def ensemble_scores(mats: list[sp.csr_matrix], how: str = "mean") -> sp.csr_matrix:
    """Learners' final scores joined over the union of their candidates; a label missing from
    a learner's candidates counts 0 there (scores are >= 0). how: "mean" or "max"."""
    if how not in ("mean", "max"):
        raise ValueError(f"ensemble must be 'mean' or 'max', got {how!r}")
    out = sp.csr_matrix(mats[0])
    for M in mats[1:]:
        out = out + M if how == "mean" else out.maximum(M)
    out = sp.csr_matrix(out)
    if how == "mean" and len(mats) > 1:
        out = out / float(len(mats))
    out.sort_indices()
    return sp.csr_matrix(out, dtype=np.float32)
