"""One compiled pass from a batch's candidate logits to what `GruPolicy.serve_batch` logs.

At one event per call the numpy version (policy.explore, then the ordering, the three
reorderings and explain.margins) was ~25 small array calls, ~100 us of dispatch for a few
hundred flops, a third of an exploring event's cost. The arithmetic is policy.explore's (its
numpy form stays the reference, and the closed loop's simulator uses it): the same uniforms
pick the same column; probabilities agree to float32 rounding.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, boundscheck=False)
def _softmax_row(lg, mask, scale, out):
    """out <- softmax(lg / scale) over the masked slots (0 elsewhere; all 0 if none)."""
    C = lg.shape[0]
    m = -np.inf
    for c in range(C):
        if mask[c] and lg[c] / scale > m:
            m = lg[c] / scale
    if not np.isfinite(m):
        m = 0.0
    s = 0.0
    for c in range(C):
        x = np.exp(lg[c] / scale - m) if mask[c] else 0.0
        out[c] = x
        s += x
    s = max(s, 1e-30)
    for c in range(C):
        out[c] /= s


@njit(cache=True, nogil=True, boundscheck=False)
def serve_rows(logit, mask, cand, epsilon, temperature, u, top_query):
    """For logits / mask / cand [B, C] (every row with a masked slot), the uniforms u [B] in
    [0, 1) and the page's top query per row (-1: unknown): (col [B] the served column, greedy
    [B], probs_col [B] and prop_col [B] its softmax probability and propensity, cand_o [B, C]
    the candidates by descending probability (stable; -1 padding), their probabilities and
    propensities [B, C] (0 on padding), margin [B] (the served probability minus the top
    query's; NaN where the top query is no candidate)), as policy.explore and serve_batch
    compute them."""
    B, C = logit.shape
    col = np.empty(B, np.int64)
    greedy = np.empty(B, np.bool_)
    p_col = np.empty(B, np.float32)
    q_col = np.empty(B, np.float32)
    cand_o = np.full((B, C), -1, np.int64)
    cs = np.zeros((B, C), np.float32)
    cp = np.zeros((B, C), np.float32)
    margin = np.full(B, np.nan, np.float32)
    probs = np.empty(C)
    soft = np.empty(C)
    prop = np.empty(C)
    key = np.empty(C)
    for b in range(B):
        lg = logit[b].astype(np.float64)
        mk = mask[b]
        _softmax_row(lg, mk, 1.0, probs)
        if temperature == 1.0:
            soft[:] = probs
        else:
            _softmax_row(lg, mk, max(temperature, 1e-6), soft)
        top = 0
        best = -np.inf
        for c in range(C):
            if mk[c] and lg[c] > best:
                best = lg[c]
                top = c
        tot = 0.0
        for c in range(C):
            prop[c] = epsilon * soft[c]
        prop[top] += 1.0 - epsilon
        for c in range(C):
            tot += prop[c]
        bar = u[b] * tot
        k = 0
        run = 0.0
        for c in range(C):
            run += prop[c]
            if run < bar:
                k += 1
        k = min(k, C - 1)
        if not mk[k]:
            k = top
        col[b] = k
        greedy[b] = k == top
        p_col[b] = np.float32(probs[k])
        q_col[b] = np.float32(prop[k])
        for c in range(C):
            key[c] = -probs[c] if mk[c] else 1.0
        order = np.argsort(key, kind="mergesort")
        for j in range(C):
            c = order[j]
            if mk[c] and cand[b, c] >= 0:
                cand_o[b, j] = cand[b, c]
                cs[b, j] = np.float32(probs[c])
                cp[b, j] = np.float32(prop[c])
        t = top_query[b]
        if t >= 0 and cand[b, k] >= 0:
            for c in range(C):
                if cand[b, c] == t:
                    margin[b] = np.float32(probs[k]) - np.float32(probs[c])
                    break
    return col, greedy, p_col, q_col, cand_o, cs, cp, margin
