"""The Bayes filter over a visit's latent intent from its window's true page sub-topics: the
reference rows (`bayes_window`, `bayes_clicks`, `bayes_profile`, `oracle`, `oracle_no_user`)
see what a policy sees (`bayes_clicks` also the window's ad outcomes, `bayes_profile` the user's
earlier history), with the simulator's own generative model.

The simulator (simulator/traffic.py) draws a session's intent as the user's previous session's
final intent with probability `persist`, else afresh from the user's interests; at each later
view of the session the intent is redrawn with probability `drift`; a view is on-intent with
probability a (a page of the intent's sub-topic s, by popularity) else a popular page from
anywhere, so a page of sub-topic s multiplies the odds of s by 1 + a / (1 - a) / pop(s). The
filter runs that hidden Markov chain forward over the window's K pages (oldest first), with
"afresh" meaning the given prior (the user's true interests) or a uniform one. Logs written
before intents persisted record neither setting; persist = drift = 0 is then exactly the
earlier rule (the current session's pages, one intent).
"""

from __future__ import annotations

import numpy as np


def intent_posterior(
    v,
    rows: np.ndarray,
    K: int,
    ttl_s: float,
    page_sub: np.ndarray,
    log_lr: np.ndarray,
    persist: float = 0.0,
    drift: float = 0.0,
    prior: np.ndarray | None = None,
    slot_lik=None,
) -> np.ndarray:
    """[B,S] P(intent at visit rows[b] | its window's pages). page_sub: sub-topic of each
    VisitLog page (-1 unknown); log_lr [S]: log odds factor of a page of s; prior [B,S] (rows
    sum to 1) or None for uniform; slot_lik(j, idx[:, j], mask[:, j]) -> [B,S] or None: a
    further likelihood of what was observed at window slot j besides its page (an ad's click
    outcome), applied after the page's."""
    rows = np.asarray(rows, np.int64)
    idx, mask = v.window(rows, K, ttl_s)
    B, S = len(rows), len(log_lr)
    base = np.full((B, S), 1.0 / S) if prior is None else np.asarray(prior, np.float64)
    _, sess_code = np.unique(np.asarray(v.session_ids, dtype=object), return_inverse=True)
    sess = np.asarray(sess_code, np.int64)[v.session[idx]]
    sub = page_sub[v.page[idx]]
    lr = np.exp(log_lr)
    alpha = base.copy()
    started = np.zeros(B, bool)
    prev = np.full(B, -1, np.int64)
    R = np.arange(B)
    for j in range(idx.shape[1]):
        m = mask[:, j]
        step = m & started
        keep = np.where(sess[:, j] != prev, persist, 1.0 - drift)[:, None]
        alpha = np.where(step[:, None], keep * alpha + (1.0 - keep) * base, alpha)
        e = m & (sub[:, j] >= 0)
        s = np.maximum(sub[:, j], 0)
        alpha[R[e], s[e]] *= lr[s[e]]
        extra = slot_lik(j, idx[:, j], m) if slot_lik is not None else None
        if extra is not None:
            alpha *= extra
        alpha /= alpha.sum(1, keepdims=True)
        started |= m
        prev = np.where(m, sess[:, j], prev)
    return alpha


def chain_settings(sim: dict) -> tuple[float, float]:
    """(persist, drift) from a simulation.json: 0 for logs written before intents persisted."""
    st = sim.get("settings", {})
    return float(st.get("persist", 0.0)), float(st.get("drift", 0.0))
