"""Session k-nearest neighbours (V-SKNN, Ludewig and Jannach): the strongest simple baseline of
session-based recommendation, over the candidates the policy ranks.

A past session is the set of its pages' top-m predicted queries (its items), with the queries
clicked in it as its outcome. A visit's window (its last K pages, the current one newest) is a
vector of its pages' items weighted by recency; its k most similar past sessions (cosine of the
item vectors) vote for each candidate with their similarity: presence of the candidate among
their items plus `click_weight` times its clicks there. So a candidate scores high when the
sessions that looked like this one contained it, and clicked it.

k, the recency weighting and the click weight are chosen on the validation carve-out of the
training logs (the latest sessions of the training period) by the inverse-propensity CTR of the
greedy choice, which needs only the logs; the holdout is never read for this. Everything is
scipy.sparse / numpy over a batch of visits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from personalization.visits import VisitLog

GRID_K = (20, 100, 400)
GRID_DECAY = ("linear", "none")
GRID_CLICK = (0.0, 10.0)
ITEMS_PER_PAGE = 3


@dataclass
class SessionKNN:
    S: sp.csr_matrix  # [n_sessions, L] item presence of the past sessions (0/1)
    M: sp.csr_matrix  # [n_sessions, L] their votes: presence + click_weight x clicks
    norm: np.ndarray  # [n_sessions] sqrt(items per session)
    k: int
    decay: str
    click_weight: float
    m: int = ITEMS_PER_PAGE

    def config(self) -> dict:
        return {"k": self.k, "decay": self.decay, "click_weight": self.click_weight, "m": self.m}


def _session_matrices(v: VisitLog, rows: np.ndarray, m: int) -> tuple[sp.csr_matrix, ...]:
    """(presence [n, L], clicks [n, L]) of the sessions of `rows`."""
    rows = np.asarray(rows, np.int64)
    _, sess = np.unique(v.session[rows], return_inverse=True)
    n = int(sess.max(initial=-1)) + 1
    L = v.n_labels
    items = v.IDS[v.page[rows], :m]
    r = np.repeat(sess, items.shape[1])
    c = items.ravel()
    ok = c >= 0
    S = sp.csr_matrix((np.ones(int(ok.sum())), (r[ok], c[ok])), shape=(n, L))
    S.data[:] = 1.0
    clk = v.clicked[rows] & (v.shown[rows] >= 0)
    C = sp.csr_matrix((np.ones(int(clk.sum())), (sess[clk], v.shown[rows][clk])), shape=(n, L))
    return S, C


def build(
    v: VisitLog, rows: np.ndarray, k: int, decay: str, click_weight: float, m: int = ITEMS_PER_PAGE
) -> SessionKNN:
    """The neighbour sessions of the training visits `rows`."""
    S, C = _session_matrices(v, rows, m)
    M = (S + click_weight * C).tocsr()
    norm = np.sqrt(np.maximum(np.asarray(S.sum(1)).ravel(), 1.0))
    return SessionKNN(S, M, norm, k, decay, click_weight, m)


def _window_vectors(knn: SessionKNN, v: VisitLog, rows: np.ndarray, K: int, ttl_s: float):
    idx, mask = v.window(rows, K, ttl_s)
    B = len(rows)
    # linear: the current page weighs 1, the oldest of K 1/K
    w = (np.arange(K, dtype=np.float64) + 1.0) / K if knn.decay == "linear" else np.ones(K)
    items = v.IDS[v.page[idx], : knn.m]  # [B, K, m]
    wt = np.broadcast_to((w[None, :] * mask)[..., None], items.shape)
    r = np.broadcast_to(np.arange(B)[:, None, None], items.shape)
    ok = (items >= 0) & (wt > 0)
    W = sp.csr_matrix((wt[ok], (r[ok], items[ok])), shape=(B, v.n_labels))
    return W


def scores(
    knn: SessionKNN, v: VisitLog, rows: np.ndarray, cand_ids: np.ndarray, K: int, ttl_s: float
) -> np.ndarray:
    """float64 [B, C] each candidate's vote from the window's k nearest past sessions."""
    rows = np.asarray(rows, np.int64)
    B, C = cand_ids.shape
    W = _window_vectors(knn, v, rows, K, ttl_s)
    out = np.zeros((B, C))
    n = knn.S.shape[0]
    if n == 0:
        return out
    k = min(knn.k, n)
    L = v.n_labels
    for a in range(0, B, 512):  # [512, n_sessions] dense similarities at a time
        sim = np.asarray((W[a : a + 512] @ knn.S.T).todense()) / knn.norm[None, :]
        b = len(sim)
        top = (
            np.argpartition(-sim, k - 1, axis=1)[:, :k] if k < n else np.tile(np.arange(n), (b, 1))
        )
        val = np.take_along_axis(sim, top, 1)
        Wk = sp.csr_matrix((val.ravel(), top.ravel(), np.arange(0, b * k + 1, k)), shape=(b, n))
        R = (Wk @ knn.M).tocsr()
        R.sum_duplicates()
        R.sort_indices()
        keys = np.repeat(np.arange(b, dtype=np.int64), np.diff(R.indptr)) * L + R.indices
        cid = cand_ids[a : a + b]
        q = np.arange(b, dtype=np.int64)[:, None] * L + np.maximum(cid, 0)
        pos = np.minimum(np.searchsorted(keys, q), max(len(keys) - 1, 0))
        hit = (keys[pos] == q) & (cid >= 0) if len(keys) else np.zeros(q.shape, bool)
        out[a : a + b] = np.where(hit, R.data[pos] if len(keys) else 0.0, 0.0)
    return out


def ips_ctr(v: VisitLog, rows: np.ndarray, chosen: np.ndarray) -> float:
    """Inverse-propensity CTR of choices `chosen` on the logged visits `rows` (logs only)."""
    shown, clicked, prop = v.shown[rows], v.clicked[rows], v.propensity[rows]
    ok = shown >= 0
    if not ok.any():
        return 0.0
    hit = (chosen == shown) & clicked & ok
    return float((hit / np.maximum(prop, 1e-6)).sum() / ok.sum())
