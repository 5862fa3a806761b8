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

import numpy as np
import scipy.sparse as sp


def sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-np.clip(x, -30, 30)))).astype(np.float32)


def classifier_logits(
    Z: np.ndarray, W: np.ndarray, b: np.ndarray, C: sp.csr_matrix, chunk: int = 1 << 16
) -> np.ndarray:
    """w_l^T z_i + b_l for every stored entry (i, l) of C, in C's entry order (float32 [nnz]).

    Chunks of 65k entries keep the gathered [chunk, D] rows at ~80 MB (1M-entry chunks cost 2.4 GB).
    """
    C = sp.csr_matrix(C)
    rows = np.repeat(np.arange(C.shape[0]), np.diff(C.indptr))
    cols = C.indices
    out = np.empty(cols.size, np.float32)
    for s in range(0, cols.size, chunk):
        r, c = rows[s : s + chunk], cols[s : s + chunk]
        out[s : s + chunk] = np.einsum("ij,ij->i", W[c], Z[r]) + b[c]
    return out


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
    y = alpha * sigmoid(logits) + (1.0 - alpha) * sigmoid(C.data)
    if rerank_logits is not None:
        y = beta * y + (1.0 - beta) * sigmoid(rerank_logits)
    if sparse_scores is not None:
        y = gamma * y + (1.0 - gamma) * sigmoid(sparse_scores)
    out = sp.csr_matrix((y.astype(np.float32), C.indices, C.indptr), shape=C.shape)
    return out


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
