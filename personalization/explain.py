"""Why an ad query was served: the visit it came from and the policy's margin over the page's
own top query.

A personalized choice and a wrong one look the same on a page unless the viewer sees where the
query came from ("this page", or "2 visits ago: <that page's title>") and by how much the policy
preferred it to what the page alone suggests. The stream logs both with each ad query
(`source_visits_ago`, `source_event_id`, `margin`; docs/formats.md); the demo and the
dashboard's Users page print them.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, boundscheck=False)
def sources(ids: np.ndarray, mask: np.ndarray, query: np.ndarray) -> np.ndarray:
    """int64 [B] visits ago (0 = the current page, the last slot) of the latest window state
    whose top-k holds `query` [B]; -1 where none does. ids [B,K,k] and mask [B,K] are the
    right-aligned windows (features.pad_states). Compiled: it runs once per served event."""
    B, K = ids.shape[0], ids.shape[1]
    out = np.full(B, -1, np.int64)
    for b in range(B):
        if query[b] < 0:
            continue
        for ago in range(K):
            t = K - 1 - ago
            if mask[b, t] and (ids[b, t] == query[b]).any():
                out[b] = ago
                break
    return out


@njit(cache=True, nogil=True, boundscheck=False)
def page_top(ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """int64 [B] the best-scored valid id of each row of ids / scores [B,k] (-1 if none; the
    first of equal scores)."""
    B, k = ids.shape
    out = np.full(B, -1, np.int64)
    for b in range(B):
        best = -np.inf
        for j in range(k):
            if ids[b, j] >= 0 and (out[b] < 0 or scores[b, j] > best):
                out[b] = ids[b, j]
                best = scores[b, j]
    return out


def margins(cand: np.ndarray, probs: np.ndarray, col: np.ndarray, top: np.ndarray):
    """float32 [B] the policy's probability of the served candidate (column `col` of cand
    [B,C] / probs [B,C]) minus that of the page's top query `top` [B]; NaN where the top query
    is not a candidate or nothing was served. 0 when the policy serves the page's top query."""
    R = np.arange(len(cand))
    it = cand == top[:, None]
    ok = it.any(1) & (cand[R, col] >= 0) & (top >= 0)
    m = probs[R, col] - probs[R, it.argmax(1)]
    return np.where(ok, m, np.nan).astype(np.float32)


def describe_source(ago: int | None, title: str | None) -> str:
    """ "this page", "2 visits ago: <title>" (the title when known), or "" when unknown."""
    if ago is None or ago < 0:
        return ""
    if ago == 0:
        return "this page"
    head = "1 visit ago" if ago == 1 else f"{ago} visits ago"
    return f"{head}: {title}" if title else f"{head} (title not logged)"
