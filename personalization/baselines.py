"""The strong baselines of `astec personalize evaluate`, built only from the training period of
the logs (the sessions before the evaluation's split):

  session_knn       V-SKNN over the window's candidates (personalization.session_knn), its k,
                    recency weighting and click weight chosen on the training period's latest
                    sessions (the validation carve-out), by logged inverse-propensity CTR
  fitted_no_intent  a ridge logistic regression of the logged clicks on the hand features of
                    the shown query, the intent filter's features left out: the policy's fitted
                    start without the intent filter
  intent_rule       the fixed hand rule intent_mass + 0.05 score_current

Each gives a ranking key over the batch's candidates; the evaluation applies the same cold-start
rule to every one (a visit without history gets the current page's top query). `knn_val` is the
session-kNN fitted without the validation carve-out: a key judged on those sessions must not
have read their clicks (personalization.evaluate.explore_scales).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from personalization import session_knn as sknn
from personalization.features import N_FEATURES, N_INTENT, N_KERNEL, EventBatch, F, cluster_lookup
from personalization.visits import VisitLog

NAMES = ("session_knn", "fitted_no_intent", "intent_rule")


@dataclass
class Baselines:
    knn: sknn.SessionKNN
    fitted: np.ndarray  # [N_FEATURES] weights (intent columns 0)
    fitted_bias: float
    intent: np.ndarray  # [N_FEATURES] weights of the hand rule
    knn_val: sknn.SessionKNN | None = None  # the chosen configuration on the fit sessions only
    report: dict = field(default_factory=dict)

    def keys(
        self,
        b: EventBatch,
        v: VisitLog,
        rows: np.ndarray,
        K: int,
        ttl_s: float,
        validation: bool = False,
    ) -> dict:
        """Ranking keys [B, C] (higher = better) of NAMES (validation: session-kNN's from
        knn_val, for rows of the validation carve-out)."""
        tie = 1e-6 * b.feats[..., F["mean_score_window"]]
        knn = self.knn_val if validation and self.knn_val is not None else self.knn
        return {
            "session_knn": sknn.scores(knn, v, rows, b.cand_ids, K, ttl_s) + tie,
            "fitted_no_intent": b.feats @ self.fitted + self.fitted_bias,
            "intent_rule": b.feats @ self.intent,
        }


def _batches(policy, v: VisitLog, rows: np.ndarray, K: int, ttl_s: float, log_pop, size=2048):
    from personalization.train import make_batch

    w = policy.weights
    for a in range(0, len(rows), size):
        r = rows[a : a + size]
        yield (
            r,
            make_batch(v, r, K, ttl_s, log_pop, w["sim_table"], w["sim_norm"], cluster_lookup(w)),
        )


def _greedy(key: np.ndarray, b: EventBatch) -> np.ndarray:
    """Chosen label per visit: the key's best candidate, the top-1 rule on cold start."""
    cold = b.state_mask.sum(1) <= 1
    key = np.where(cold[:, None], b.feats[..., F["score_current"]], key)
    col = np.argmax(np.where(b.cand_mask, key, -np.inf), 1)
    return np.where(b.cand_mask.any(1), b.cand_ids[np.arange(len(col)), col], -1)


VAL_FRAC = 0.2  # the validation carve-out: the latest share of the training sessions


def carve_out(v: VisitLog, train_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fit rows, validation rows): the training visits split at the start time below which
    1 - VAL_FRAC of them start."""
    from personalization.train import session_start_ts

    start = session_start_ts(v)[train_rows]
    cut = np.quantile(start, 1.0 - VAL_FRAC) if len(start) else 0.0
    return train_rows[start < cut], train_rows[start >= cut]


def fit_session_knn(
    policy, v: VisitLog, train_rows: np.ndarray, K: int, ttl_s: float, log_pop
) -> tuple[sknn.SessionKNN, sknn.SessionKNN, dict]:
    """V-SKNN with the configuration that earns the most logged IPS CTR on the validation
    carve-out (carve_out), refitted on all the training sessions; and that configuration on
    the fit sessions alone."""
    fit_rows, val_rows = carve_out(v, train_rows)
    batches = list(_batches(policy, v, val_rows, K, ttl_s, log_pop))
    grid: dict[tuple, float] = {}
    best: tuple | None = None  # the first configuration with the highest CTR, as max()
    model_val: sknn.SessionKNN | None = None
    for k in sknn.GRID_K:
        for decay in sknn.GRID_DECAY:
            for cw in sknn.GRID_CLICK:
                model = sknn.build(v, fit_rows, k, decay, cw)
                chosen = [
                    _greedy(
                        sknn.scores(model, v, r, b.cand_ids, K, ttl_s)
                        + 1e-6 * b.feats[..., F["mean_score_window"]],
                        b,
                    )
                    for r, b in batches
                ]
                ch = np.concatenate(chosen) if chosen else np.zeros(0, np.int64)
                grid[(k, decay, cw)] = sknn.ips_ctr(v, val_rows, ch)
                if best is None or grid[(k, decay, cw)] > grid[best]:
                    best, model_val = (k, decay, cw), model
    assert best is not None and model_val is not None  # the grid is never empty
    model = sknn.build(v, train_rows, *best)
    rep = {
        "chosen": model.config(),
        "validation_visits": len(val_rows),
        "validation_ips_ctr": {
            f"k={c[0]} {c[1]} click={c[2]:g}": round(x, 5) for c, x in grid.items()
        },
    }
    return model, model_val, rep


def fit_no_intent(
    policy, v: VisitLog, train_rows: np.ndarray, K: int, ttl_s: float, log_pop, n=60_000, seed=0
) -> tuple[np.ndarray, float]:
    """Ridge logistic regression of the logged clicks on the shown query's hand features
    without the intent filter's (the kernel's last N_INTENT columns) and without what the user
    was shown before (shown_recent): the policy's start before either."""
    from personalization.train import shown_features
    from personalization.value import fit_logistic

    sim = (policy.weights["sim_table"], policy.weights["sim_norm"], cluster_lookup(policy.weights))
    X, ya = shown_features(v, train_rows, K, ttl_s, log_pop, sim, n, seed)
    Xa = X[:, : N_KERNEL - N_INTENT]
    w = np.zeros(N_FEATURES, np.float32)
    if len(ya) == 0 or ya.min() == ya.max():
        return w, 0.0
    th = fit_logistic(Xa, ya, l2=1e-3)
    w[: N_KERNEL - N_INTENT] = th[:-1]
    return w, float(th[-1])


def fit_baselines(
    policy, v: VisitLog, train_rows: np.ndarray, K: int, ttl_s: float, log_pop
) -> Baselines:
    """Every strong baseline from the training visits `train_rows` (never the evaluated ones)."""
    from personalization.train import intent_rank_weights

    knn, knn_val, rep = fit_session_knn(policy, v, train_rows, K, ttl_s, log_pop)
    w, bias = fit_no_intent(policy, v, train_rows, K, ttl_s, log_pop)
    return Baselines(knn, w, bias, intent_rank_weights(), knn_val, {"session_knn": rep})
