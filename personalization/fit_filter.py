"""Fitting the features' constants to a policy's own training logs (features.FeatureFit).

Nothing here reads how the traffic was generated: each constant is what the logs support.

- The block gap (what separates two "sessions" of one user): the valley of the gaps between a
  user's consecutive visits in the training period (personalization.gap_valley: a
  two-component Gaussian mixture on the log gaps, cut where the components cross).
- The intent filter's keep rates within and across blocks and its odds factor (kappa's scale,
  floor and power): by how well the filter's belief from a window's earlier pages predicts
  the interest of its last page, against a uniform belief, on the validation windows. The
  filter is a model of how a reader's interest carries over from page to page, and the page
  sequence is what shows it; the likelihood of the clicks is nearly flat in the keep rates.
- The intent filter's successor kernel (where an interest goes when it is not kept; uniform
  unless fitted): EM on the training page sequence, smoothed towards uniform; the smoothing,
  and whether any kernel at all, chosen by the validation click likelihood below (the most
  page-predictive kernels also model the pages read off the interest).
- The query clusters' count: by the log-likelihood, on the validation visits, of the logged
  clicks on the shown query under a logistic model of the filter's belief in the shown
  query's cluster and its score on the current page (the logistic's three coefficients fitted
  on the training visits), over a geometric grid of counts refined once around the best, the
  filter fitted as above for each count.
- Both criteria run the compiled filter the features use (feature_kernels), so one setting
  costs milliseconds; the continuous constants by Nelder-Mead from a neutral start.
- recency_score's decay: the same likelihood with the recency-weighted score of the shown
  query in place of the filter's belief, by a bounded scalar search.
- shown_recent's decay per earlier visit: the same likelihood with the shown query's
  shown_recent (how often it was shown at the window's earlier visits), by a bounded scalar
  search.
- The intent ranking's weight of the current page's score beside the filter's belief
  (train.intent_rank_weights): the same likelihood with the ranking's key of the shown query
  as the one feature, by a bounded scalar search on its log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from personalization.features import (
    DEFAULT_FIT,
    FIT_KEY,
    FeatureFit,
    Successors,
    cluster_share,
    kappa_of_share,
    query_lookup,
    recency_weights,
    shown_recent,
    successor_arrays,
)
from personalization.gap_valley import gap_valley
from personalization.visits import VisitLog

log = logging.getLogger(__name__)

MIN_CLICKS = 5  # fewer clicks on either side: nothing to fit the likelihood on
MAX_EVALS = 150  # filter settings tried for the chosen cluster count
GRID_EVALS = 50  # ... and for each count of the grid (on GRID_ROWS visits a side)
GRID_ROWS = 4000
MAX_ROWS = 10000  # visits a side the final fit reads
# k-means restarts per count of the grid (the chosen count gets query_clusters' default): a
# compute knob (a tighter optimum of the same objective, at proportional cost), not fitted
GRID_RESTARTS = 4


@dataclass
class Windows:
    """The windows of some visits and the click on their shown query (the fitting data)."""

    ids: np.ndarray  # int64 [B, K, k]
    scores: np.ndarray  # float32 [B, K, k]
    mask: np.ndarray  # bool [B, K]
    ts: np.ndarray  # float64 [B, K]
    shown: np.ndarray  # int64 [B] the shown query
    clicked: np.ndarray  # float64 [B] 1.0 where it was clicked
    score_shown: np.ndarray  # float64 [B, K] the shown query's score in each state (0: absent)
    shown_before: np.ndarray  # int64 [B, K] the query shown at each window visit (-1: none)


def windows(v: VisitLog, rows: np.ndarray, K: int, ttl_s: float, shown: bool = True) -> Windows:
    """Windows of `rows` (only those whose visit logged a shown query, with `shown`)."""
    rows = np.asarray(rows, np.int64)
    if shown:
        rows = rows[v.shown[rows] >= 0]
    _, ids, sc, mask = v.states(rows, K, ttl_s)
    idx, _ = v.window(rows, K, ttl_s)
    q = v.shown[rows]
    hit = (ids == q[:, None, None]) & (q[:, None, None] >= 0)
    return Windows(
        ids=np.ascontiguousarray(ids, np.int64),
        scores=np.ascontiguousarray(sc, np.float32),
        mask=np.ascontiguousarray(mask, np.bool_),
        ts=np.ascontiguousarray(v.ts[idx], np.float64),
        shown=q,
        clicked=v.clicked[rows].astype(np.float64),
        score_shown=(sc * hit).sum(-1).astype(np.float64),
        shown_before=np.where(mask, v.shown[idx], -1),
    )


def subsample(w: Windows, n: int, seed: int) -> Windows:
    """At most n of the windows, drawn without replacement (deterministic in seed)."""
    if len(w.shown) <= n:
        return w
    r = np.sort(np.random.default_rng(seed).choice(len(w.shown), n, replace=False))
    return Windows(*(getattr(w, f)[r] for f in Windows.__dataclass_fields__))


def fit_block_gap(v: VisitLog, rows: np.ndarray) -> float | None:
    """Seconds: the valley (gap_valley) of the gaps between the users' consecutive visits
    among `rows` (None: too few gaps or no second mode)."""
    rows = np.sort(np.asarray(rows, np.int64))
    prev = rows - 1
    ok = (prev >= 0) & (v.user[np.maximum(prev, 0)] == v.user[rows])
    return gap_valley(v.ts[rows[ok]] - v.ts[prev[ok]])


def _logistic(X: np.ndarray, y: np.ndarray, ridge: float = 1e-3, iters: int = 25) -> np.ndarray:
    """Coefficients of a ridge logistic regression of y on X (Newton's method)."""
    beta = np.zeros(X.shape[1])
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-np.clip(X @ beta, -30, 30)))
        g = X.T @ (y - p) - ridge * beta
        H = (X * (p * (1 - p))[:, None]).T @ X + ridge * np.eye(X.shape[1])
        step = np.linalg.solve(H, g)
        beta += step
        if np.abs(step).max() < 1e-8:
            break
    return beta


def _loglik(X: np.ndarray, y: np.ndarray, beta: np.ndarray) -> float:
    """Mean Bernoulli log-likelihood of y under the logistic model beta."""
    from personalization.value import bernoulli_loglik

    return bernoulli_loglik(np.clip(X @ beta, -30, 30), y)


def click_loglik(feat_tr: np.ndarray, feat_va: np.ndarray, tr: Windows, va: Windows) -> float:
    """Validation mean log-likelihood of the clicks under a logistic model of [1, feat, the
    shown query's score on the current page], fitted on the training visits."""

    def design(f, w):
        return np.column_stack([np.ones(len(f)), f, w.score_shown[:, -1]])

    beta = _logistic(design(feat_tr, tr), tr.clicked)
    return _loglik(design(feat_va, va), va.clicked, beta)


def fit_recency(tr: Windows, va: Windows) -> float | None:
    """recency_gamma maximising the validation likelihood of the clicks given the shown
    query's recency-weighted score (None: too few clicks)."""
    from scipy.optimize import minimize_scalar

    if min(tr.clicked.sum(), va.clicked.sum()) < MIN_CLICKS:
        return None
    K = tr.mask.shape[1]

    def rec(w: Windows, g: float) -> np.ndarray:
        wt = recency_weights(K, g)[None, :] * w.mask
        return (wt * w.score_shown).sum(1) / np.maximum(wt.sum(1), 1e-9)

    res = minimize_scalar(
        lambda g: -click_loglik(rec(tr, g), rec(va, g), tr, va),
        bounds=(0.01, 0.99),
        method="bounded",
        options={"xatol": 1e-3},
    )
    return float(res.x)


def fit_shown_decay(tr: Windows, va: Windows) -> float | None:
    """shown_decay maximising the validation likelihood of the clicks given the shown query's
    shown_recent (None: too few clicks, or no query shown twice in a window)."""
    from scipy.optimize import minimize_scalar

    if min(tr.clicked.sum(), va.clicked.sum()) < MIN_CLICKS:
        return None

    def rec(w: Windows, g: float) -> np.ndarray:
        return shown_recent(w.shown[:, None], w.shown_before, w.mask, g)[:, 0].astype(np.float64)

    if not rec(tr, 1.0).any():
        return None
    res = minimize_scalar(
        lambda g: -click_loglik(rec(tr, g), rec(va, g), tr, va),
        bounds=(0.0, 1.0),
        method="bounded",
        options={"xatol": 1e-3},
    )
    return float(res.x)


def _sig(x: float) -> float:
    return float(1.0 / (1.0 + np.exp(-np.clip(x, -30.0, 30.0))))


def _kappa_fit(theta: np.ndarray, fit: FeatureFit) -> FeatureFit:
    """fit with kappa_* from unconstrained parameters (log scale, log floor, power)."""
    return replace(
        fit,
        kappa_scale=float(np.exp(np.clip(theta[0], -10, 10))),
        kappa_floor=float(np.exp(np.clip(theta[1], -10, 5))),
        kappa_power=float(np.clip(theta[2], 0.0, 3.0)),
    )


# The optimisers' starts (not fitted values): a filter that keeps most of its belief, a page
# that counts as much as a few earlier ones, evidence proportional to 1 / share; and the first
# simplex's steps around them (a wide look).
_KEEP0, _KEEP_STEP = np.array([2.0, 0.0]), np.array([1.5, 1.5])
_KAPPA0, _KAPPA_STEP = np.array([np.log(5.0), 0.0, 1.0]), np.array([1.5, 1.0, 0.5])


def _nelder_mead(f, x0: np.ndarray, step: np.ndarray, max_evals: int):
    from scipy.optimize import minimize

    simplex = np.vstack([x0, x0 + np.diag(step)])
    opts = {"maxfev": max_evals, "xatol": 0.02, "fatol": 1e-7, "initial_simplex": simplex}
    return minimize(f, x0, method="Nelder-Mead", options=opts)


def _filter_fit(theta: np.ndarray, fit: FeatureFit) -> FeatureFit:
    """fit with keep, keep_block and kappa_* from unconstrained parameters (logit keeps, log
    scale, log floor, power)."""
    return replace(_kappa_fit(theta[2:], fit), keep=_sig(theta[0]), keep_block=_sig(theta[1]))


def page_score(
    share: np.ndarray,
    lookup: np.ndarray,
    w: Windows,
    fit: FeatureFit,
    kernel: Successors | None = None,
) -> float:
    """Mean log ratio by which the filter's belief from each window's earlier pages predicts
    the interest of its last page better than a uniform belief
    (feature_kernels.page_prediction)."""
    from personalization.feature_kernels import page_prediction

    kappa = kappa_of_share(share, fit).astype(np.float64)
    s, n = page_prediction(
        *(w.ids, w.scores, w.mask, w.ts, fit.block_gap_s, lookup, kappa),
        *(fit.keep, fit.keep_block, *successor_arrays(kernel)),
    )
    return s / max(n, 1)


# Successors kept explicit per cluster (the rest of a row spread uniformly): a compute knob of
# the served filter (each step costs n x SUCCESSORS), not fitted
SUCCESSORS = 16
# EM steps per kernel, the smoothing strengths tried (a row's pseudo-count towards the uniform
# kernel) and the evidence scales of the E-step's page odds (em_successors): search ranges,
# the pair is chosen on the validation clicks
SUCCESSOR_EM_STEPS = 8
SUCCESSOR_PRIORS = (1.0, 10.0, 100.0)
SUCCESSOR_SCALES = (10.0, 30.0, 100.0, 300.0)
# the E-step's odds divide by a cluster's share of the views, floored at this fraction of the
# uniform share: a numerical guard for clusters almost never viewed
SUCCESSOR_SHARE_FLOOR = 0.01


def project_successors(T: np.ndarray, r: int = SUCCESSORS) -> Successors:
    """The sparse kernel (Successors, stored precision) nearest the dense row-stochastic T:
    each row's r largest entries kept exactly, the others replaced by their mean."""
    n = T.shape[0]
    r = min(r, n)
    idx = np.argsort(-T, axis=1, kind="stable")[:, :r]
    top = np.take_along_axis(T, idx, 1)
    rho = n * np.maximum(1.0 - top.sum(1), 0.0) / (n - r) if r < n else np.zeros(n)
    p = np.maximum(top - rho[:, None] / n, 0.0)
    p /= np.maximum(p.sum(1, keepdims=True) + rho[:, None], 1.0)  # rows sum to <= 1
    return Successors.from_weights(idx.astype(np.float32), p.astype(np.float32), n)


def em_successors(
    share: np.ndarray,
    lookup: np.ndarray,
    pages: Windows,
    fit: FeatureFit,
    prior: float,
    scale: float,
) -> Successors:
    """The successor kernel after SUCCESSOR_EM_STEPS EM steps on the last two pages of the
    windows `pages` (feature_kernels.successor_counts), from the uniform kernel, each row
    smoothed towards uniform by `prior` pseudo-counts. The E-step weighs a page's evidence for
    cluster c by the odds 1 + scale e(c) / (n share(c)): a page of a cluster everyone reads
    says less about where this reader went than one of a niche. (With the served filter's
    own odds, fitted to predict pages, a page read off the interest in a busy cluster counts
    as a move there, and the kernel learns those instead of the reader's moves.)"""
    from personalization.feature_kernels import successor_counts

    e_fit = replace(fit, kappa_scale=scale, kappa_power=1.0, kappa_floor=SUCCESSOR_SHARE_FLOOR)
    kappa = kappa_of_share(share, e_fit).astype(np.float64)
    n = len(share)
    kern: Successors | None = None
    for _ in range(SUCCESSOR_EM_STEPS):
        T = np.full((n, n), 1.0 / n) if kern is None else kern.dense()
        counts = successor_counts(
            *(pages.ids, pages.scores, pages.mask, pages.ts, fit.block_gap_s, lookup),
            *(kappa, fit.keep, fit.keep_block, *successor_arrays(kern), T),
        )
        kern = project_successors((counts + prior / n) / (counts.sum(1, keepdims=True) + prior))
    assert kern is not None
    return kern


def fit_successors(
    share: np.ndarray,
    lookup: np.ndarray,
    pages: Windows,
    tr: Windows,
    va: Windows,
    fit: FeatureFit,
) -> tuple[Successors | None, dict]:
    """The successor kernel of the intent filter: where an interest goes when it is not kept.
    EM on the training page windows `pages` (em_successors) for each pseudo-count and evidence
    scale of SUCCESSOR_PRIORS x SUCCESSOR_SCALES; the pair, and whether any kernel at all,
    chosen by the validation click log-likelihood of the filter's belief in the shown query's
    cluster (filter_click_loglik on the shown windows tr / va; None: the uniform kernel did
    as well). Not by how well it predicts the next page: the most page-predictive kernels
    also model the pages read off the interest, and pick the clicked query's cluster less
    often."""
    base = filter_click_loglik(share, lookup, tr, va, fit)
    report: dict = {"uniform": base}
    best, best_ll = None, base
    if len(share) < 2:
        return None, report
    for scale in SUCCESSOR_SCALES:
        for prior in SUCCESSOR_PRIORS:
            kern = em_successors(share, lookup, pages, fit, prior, scale)
            ll = filter_click_loglik(share, lookup, tr, va, fit, kern)
            report[f"scale {scale:g}, prior {prior:g}"] = ll
            if ll > best_ll:
                best, best_ll = kern, ll
    return best, report


def fit_filter_constants(
    share: np.ndarray,
    lookup: np.ndarray,
    va: Windows,
    fit: FeatureFit,
    max_evals: int = MAX_EVALS,
) -> FeatureFit:
    """fit with keep, keep_block and kappa_* maximising how well the filter's belief from a
    window's earlier pages predicts the interest of its last page on the validation windows
    (page_score), for clusters `lookup` whose shares of the evidence are `share`: the filter
    is a model of how a reader's interest carries over from page to page, and the page
    sequence is what shows it (the likelihood of the clicks is nearly flat in the keep rates
    and, fitted jointly, drives them to 1 with kappa to its bounds)."""
    res = _nelder_mead(
        lambda th: -page_score(share, lookup, va, _filter_fit(th, fit)),
        np.r_[_KEEP0, _KAPPA0],
        np.r_[_KEEP_STEP, _KAPPA_STEP],
        max_evals,
    )
    return _filter_fit(res.x, fit)


def filter_mass(
    share: np.ndarray,
    lookup: np.ndarray,
    w: Windows,
    fit: FeatureFit,
    kernel: Successors | None = None,
) -> np.ndarray:
    """float64 [B] the filter's belief under `fit` in the shown query's cluster at each window."""
    from personalization.feature_kernels import intent_mass

    kappa = kappa_of_share(share, fit).astype(np.float64)
    m, _ = intent_mass(
        *(w.ids, w.scores, w.mask, w.ts, fit.block_gap_s, lookup, kappa),
        *(fit.keep, fit.keep_block, *successor_arrays(kernel), lookup[w.shown]),
    )
    return m


def filter_click_loglik(
    share: np.ndarray,
    lookup: np.ndarray,
    tr: Windows,
    va: Windows,
    fit: FeatureFit,
    kernel: Successors | None = None,
) -> float:
    """Validation click log-likelihood (click_loglik) of the filter's belief in the shown
    query's cluster under `fit` (and the successor kernel)."""
    return click_loglik(
        filter_mass(share, lookup, tr, fit, kernel),
        filter_mass(share, lookup, va, fit, kernel),
        tr,
        va,
    )


def intent_rank_loglik(
    weight: float, mass_tr: np.ndarray, mass_va: np.ndarray, tr: Windows, va: Windows
) -> float:
    """Validation mean log-likelihood of the clicks under a logistic model (fitted on the
    training visits) of the intent ranking's key intent_mass + weight x score_current of the
    shown query."""

    def design(m: np.ndarray, w: Windows) -> np.ndarray:
        return np.column_stack([np.ones(len(m)), m + weight * w.score_shown[:, -1]])

    beta = _logistic(design(mass_tr, tr), tr.clicked)
    return _loglik(design(mass_va, va), va.clicked, beta)


def fit_intent_score_weight(
    mass_tr: np.ndarray, mass_va: np.ndarray, tr: Windows, va: Windows
) -> float:
    """intent_score_weight maximising intent_rank_loglik (bounded search on its log over
    [1e-3, 10]): the ranking's mix of the filter's belief and the page's score is what best
    predicts the clicks."""
    from scipy.optimize import minimize_scalar

    res = minimize_scalar(
        lambda x: -intent_rank_loglik(float(np.exp(x)), mass_tr, mass_va, tr, va),
        bounds=(np.log(1e-3), np.log(10.0)),
        method="bounded",
    )
    return float(np.exp(res.x))


def cluster_grid(n_queries: int) -> list[int]:
    """Geometric grid of cluster counts (factor 2) from 8 to a twentieth of the queries predicted
    (<= 256)."""
    top = int(np.clip(n_queries // 20, 8, 256))
    n = max(int(np.log2(top / 8)), 0) + 1
    return sorted({round(float(x)) for x in np.geomspace(8, top, n)})


def fit_intent_filter(
    v: VisitLog,
    train_rows: np.ndarray,
    val_rows: np.ndarray,
    K: int,
    ttl_s: float,
    n_labels: int,
    n_clusters: int = 0,
    seed: int = 0,
) -> tuple[dict[str, np.ndarray], dict]:
    """The policy's intent-filter weights fitted on its logs: `query_cluster` [L]
    (query_clusters on the pages of the training and validation visits and their sessions;
    n_clusters 0 = the count chosen by validation likelihood, > 0 that count, < 0 no clusters),
    `cluster_kappa` [n] and the FeatureFit (under FIT_KEY), and a report of what was tried."""
    import scipy.sparse as sp

    from personalization.query_clusters import query_clusters

    fit = DEFAULT_FIT
    report: dict = {}
    gap = fit_block_gap(v, train_rows)
    if gap is not None:
        fit = replace(fit, block_gap_s=gap)
    report["block_gap_s"] = gap
    tr = subsample(windows(v, train_rows, K, ttl_s), MAX_ROWS, seed)
    va = subsample(windows(v, val_rows, K, ttl_s), MAX_ROWS, seed + 1)
    tr_g, va_g = subsample(tr, GRID_ROWS, seed), subsample(va, GRID_ROWS, seed + 1)
    gamma = fit_recency(tr, va)
    if gamma is not None:
        fit = replace(fit, recency_gamma=gamma)
    decay = fit_shown_decay(tr, va)
    if decay is not None:
        fit = replace(fit, shown_decay=decay)
    report["shown_decay"] = decay
    rows = np.concatenate([train_rows, val_rows])
    pages, col = np.unique(v.page[rows], return_inverse=True)
    sess, grp = np.unique(v.session[rows], return_inverse=True)
    groups = sp.csr_matrix((np.ones(len(rows)), (grp, col)), shape=(len(sess), len(pages)))
    viewed = v.page[rows]

    def clusters(k: int, restarts: int = 16) -> np.ndarray:
        return query_clusters(
            v.IDS[pages], v.SC[pages], n_labels, k, seed, restarts=restarts, groups=groups
        )

    enough = min(tr.clicked.sum(), va.clicked.sum()) >= MIN_CLICKS
    seen = int(np.unique(v.IDS[pages][v.IDS[pages] >= 0]).size)
    grid = cluster_grid(seen)
    if n_clusters < 0:
        qc = np.full(n_labels, -1.0, np.float32)
    elif n_clusters > 0 or not enough:  # no clicks to choose by: the grid's middle
        qc = clusters(n_clusters or grid[len(grid) // 2])
    else:
        tried: dict[int, float] = {}

        def attempt(k: int) -> None:
            if k in tried or k < 2:
                return
            qc_k = clusters(k, GRID_RESTARTS)
            lookup = query_lookup(qc_k)
            share = cluster_share(v.IDS[viewed], v.SC[viewed], lookup)
            f = fit_filter_constants(share, lookup, va_g, fit, GRID_EVALS)
            ll = filter_click_loglik(share, lookup, tr_g, va_g, f)
            tried[k] = ll
            log.info("clusters %d: validation click log-likelihood %.5f", k, ll)

        for k in grid:
            attempt(k)
        best = max(tried, key=lambda k: tried[k])
        for k in (round(best / np.sqrt(2)), round(best * np.sqrt(2))):  # one refinement
            if grid[0] <= k <= grid[-1]:
                attempt(int(k))
        qc = clusters(max(tried, key=lambda k: tried[k]))
        report["clusters_tried"] = {str(k): round(t, 6) for k, t in sorted(tried.items())}
    lookup = query_lookup(qc)
    share = cluster_share(v.IDS[viewed], v.SC[viewed], lookup)
    kernel = None
    if n_clusters >= 0:  # the page sequence needs no clicks
        pages_tr = subsample(windows(v, train_rows, K, ttl_s, shown=False), MAX_ROWS, seed)
        pages_va = subsample(windows(v, val_rows, K, ttl_s, shown=False), MAX_ROWS, seed + 1)
        fit = fit_filter_constants(share, lookup, pages_va, fit)
        if enough:
            kernel, report["successors_val_click_loglik"] = fit_successors(
                share, lookup, pages_tr, tr, va, fit
            )
        report["successors"] = 0 if kernel is None else int(kernel.succ.shape[1])
        report["val_page_score"] = page_score(share, lookup, pages_va, fit, kernel)
        if enough:
            m_tr = filter_mass(share, lookup, tr, fit, kernel)
            m_va = filter_mass(share, lookup, va, fit, kernel)
            report["val_click_loglik"] = click_loglik(m_tr, m_va, tr, va)
            isw = fit_intent_score_weight(m_tr, m_va, tr, va)
            report["intent_score_weight_val_click_loglik"] = {
                "fitted": intent_rank_loglik(isw, m_tr, m_va, tr, va),
                "unfitted": intent_rank_loglik(fit.intent_score_weight, m_tr, m_va, tr, va),
            }
            fit = replace(fit, intent_score_weight=isw)
    kappa = kappa_of_share(share, fit)
    report["clusters"] = int(lookup.max()) + 1
    report["feature_fit"] = fit.to_json()
    log.info("fitted feature constants: %s", report)
    weights = {"query_cluster": qc, "cluster_kappa": kappa, FIT_KEY: fit.to_array()}
    return weights | ({} if kernel is None else kernel.weights()), report
