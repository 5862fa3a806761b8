"""Where a browsing log's gaps between a user's consecutive visits split in two.

Gaps inside a sitting and gaps between sittings form two modes in any browsing log: a
two-component Gaussian mixture on the log gaps, cut where the two components' weighted
densities cross (the least ambiguous cut). The intent filter's block gap
(personalization.fit_filter) and the sessions of logs without session ids
(personalization.visits) both cut there.
"""

from __future__ import annotations

import numpy as np

MIN_GAPS = 20  # fewer gaps than this: nothing to fit a valley on


def gap_valley(gaps: np.ndarray) -> float | None:
    """Seconds where the two components of a Gaussian mixture on log1p(gaps) cross (None: fewer
    than MIN_GAPS gaps or no second mode)."""
    x = np.log1p(np.maximum(np.asarray(gaps, np.float64), 0.0))
    if len(x) < MIN_GAPS or np.ptp(x) <= 0:
        return None
    lo, hi = np.quantile(x, [0.25, 0.75])
    mu = np.array([lo, hi])
    sd = np.full(2, max(x.std(), 1e-3))
    w = np.array([0.5, 0.5])
    for _ in range(200):  # EM
        dens = w / sd * np.exp(-0.5 * ((x[:, None] - mu) / sd) ** 2)
        r = dens / np.maximum(dens.sum(1, keepdims=True), 1e-300)
        n = r.sum(0)
        if (n < 1e-6).any():
            return None
        w_new = n / len(x)
        mu_new = (r * x[:, None]).sum(0) / n
        sd_new = np.sqrt((r * (x[:, None] - mu_new) ** 2).sum(0) / n) + 1e-3
        done = np.abs(mu_new - mu).max() < 1e-6
        w, mu, sd = w_new, mu_new, sd_new
        if done:
            break
    a, b = np.argsort(mu)
    grid = np.linspace(mu[a], mu[b], 2001)  # the crossing between the two means

    def logd(i):
        return np.log(w[i] / sd[i]) - 0.5 * ((grid - mu[i]) / sd[i]) ** 2

    above = logd(b) >= logd(a)
    if not above.any() or above.all():
        return None
    return float(np.expm1(grid[int(np.argmax(above))]))
