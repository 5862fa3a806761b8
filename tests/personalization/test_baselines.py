"""The strong baselines: session-kNN votes as its definition says, finds the session's intent
where the page's top query does not, and is configured on the training period's validation
carve-out only; the fitted baseline leaves the intent filter out."""

from types import SimpleNamespace

import numpy as np
import pytest

from personalization import session_knn as sknn
from personalization.baselines import fit_baselines
from personalization.features import N_INTENT, N_KERNEL, F
from personalization.train import make_batch, session_start_ts
from testkit.policy_data import synthetic_visits

K, TTL = 4, 30 * 86400.0


@pytest.fixture(scope="module")
def data():
    v, _, q_topic, intent = synthetic_visits(n_users=200, sessions=5, seed=3)
    start = session_start_ts(v)
    cut = np.quantile(start, 0.75)
    return v, q_topic, intent, np.flatnonzero(start < cut), np.flatnonzero(start >= cut)


def test_scores_are_the_votes_of_the_k_most_similar_sessions(data):
    v, _, _, train, test = data
    knn = sknn.build(v, train, k=7, decay="linear", click_weight=3.0)
    rows = test[:40]
    cand = v.IDS[v.page[rows]]  # the current page's queries as candidates
    got = sknn.scores(knn, v, rows, cand, K, TTL)
    S, M = knn.S.toarray(), knn.M.toarray()
    idx, mask = v.window(rows, K, TTL)
    checked = 0
    for i in range(len(rows)):  # the definition, one visit at a time
        w = np.zeros(v.n_labels)
        for j in range(K):
            if mask[i, j]:
                for q in v.IDS[v.page[idx[i, j]], :3]:
                    w[q] += (j + 1) / K
        sim = S @ w / knn.norm
        order = np.argsort(-sim, kind="stable")
        if np.isclose(sim[order[6]], sim[order[7]]):
            continue  # a tie at the k-th neighbour: either session is a right answer
        top = order[:7]
        want = sim[top] @ M[top][:, cand[i]]
        assert np.allclose(got[i], want), i
        checked += 1
    assert checked >= 20


def test_session_knn_finds_the_sessions_intent_better_than_the_pages_top_query(data):
    v, q_topic, intent, train, test = data
    knn = sknn.build(v, train, k=50, decay="linear", click_weight=10.0)
    b = make_batch(v, test, K, TTL, np.zeros(v.n_labels, np.float32))
    warm = b.state_mask.sum(1) > 1
    key = (
        sknn.scores(knn, v, test, b.cand_ids, K, TTL) + 1e-6 * b.feats[..., F["mean_score_window"]]
    )
    pick = b.cand_ids[np.arange(len(test)), np.argmax(np.where(b.cand_mask, key, -np.inf), 1)]
    top1 = v.IDS[v.page[test], 0]
    want = intent[v.session[test]]
    hit_knn = (q_topic[pick] == want)[warm].mean()
    hit_top1 = (q_topic[top1] == want)[warm].mean()
    assert hit_knn > hit_top1 + 0.05


def test_baselines_are_fitted_on_the_training_period_only(data):
    v, _, _, train, test = data
    policy = SimpleNamespace(weights={"sim_table": None, "sim_norm": None})
    clicked = v.clicked.copy()
    base = fit_baselines(policy, v, train, K, TTL, np.zeros(v.n_labels, np.float32))
    rep = base.report["session_knn"]
    assert len(rep["validation_ips_ctr"]) == len(sknn.GRID_K) * len(sknn.GRID_DECAY) * len(
        sknn.GRID_CLICK
    )
    assert rep["validation_visits"] < len(train)
    assert base.knn.S.shape[0] == len(np.unique(v.session[train]))
    # no evaluated visit's clicks reach any baseline: scramble them and nothing changes
    v.clicked[test] = ~v.clicked[test]
    try:
        again = fit_baselines(policy, v, train, K, TTL, np.zeros(v.n_labels, np.float32))
    finally:
        v.clicked[:] = clicked
    assert again.knn.config() == base.knn.config()
    assert np.array_equal(again.fitted, base.fitted)
    # the intent filter's features and what the user was shown before left out
    assert np.all(base.fitted[N_KERNEL - N_INTENT :] == 0)
    assert np.any(base.fitted[: N_KERNEL - N_INTENT] != 0)


class TopicJudge:
    """A click model over the synthetic log's topics (the evaluation's judge interface): 0.3
    for a query of the visit's intent topic, 0.02 otherwise."""

    def __init__(self, v, q_topic, intent, fatigue=(0, 1.0)):
        self.q_topic, self.fatigue = q_topic, fatigue
        self.visit_intent = intent[v.session]

    def p_click(self, rows, q, intent=None):
        q = np.asarray(q)
        it = self.visit_intent[rows] if intent is None else np.asarray(intent)
        it = it if q.ndim == 1 else it[:, None] if it.ndim == 1 else it.argmax(1)[:, None]
        return np.where(q >= 0, np.where(self.q_topic[np.maximum(q, 0)] == it, 0.3, 0.02), 0.0)

    def window_posterior(self, v, rows, K, ttl_s, clicks=False, profile=False):
        return np.full((len(rows), int(self.q_topic.max()) + 1), 1.0)


def _policy():
    return SimpleNamespace(
        K=K,
        ttl_s=TTL,
        weights={"sim_table": None, "sim_norm": np.array([0.0, 1.0], np.float32)},
        logits=lambda b: 3.0 * b.feats[..., F["score_current"]],
    )


def _evaluate(data, exploration, fatigue=(0, 1.0), base=None, scales=None):
    from personalization.evaluate import Truth, evaluate_policies

    v, q_topic, intent, train, test = data
    policy = _policy()
    log_pop = np.zeros(v.n_labels, np.float32)
    base = base or fit_baselines(policy, v, train, K, TTL, log_pop)
    truth = Truth({f"s{i}": int(x) for i, x in enumerate(intent)}, q_topic)
    judge = TopicJudge(v, q_topic, intent, fatigue)
    return evaluate_policies(
        policy, v, test, log_pop, K, TTL, truth, progress=False, judge=judge,
        baselines=base, exploration=exploration, scales=scales,
    )  # fmt: skip


def test_a_baselines_exploration_does_not_depend_on_its_keys_unit(data):
    """Served, a baseline explores by its key put on the click log-odds scale: votes counted
    in hundreds serve the same CTR."""
    import dataclasses

    from personalization.evaluate import explore_scales

    v, _, _, train, _ = data
    log_pop = np.zeros(v.n_labels, np.float32)
    base = fit_baselines(_policy(), v, train, K, TTL, log_pop)
    small = dataclasses.replace(
        base,
        knn=dataclasses.replace(base.knn, M=base.knn.M * 0.01),
        knn_val=dataclasses.replace(base.knn_val, M=base.knn_val.M * 0.01),
    )
    sc, sc_small = (explore_scales(_policy(), v, train, log_pop, b) for b in (base, small))
    assert sc["session_knn"] > 0
    assert sc_small["session_knn"] == pytest.approx(sc["session_knn"] * 100.0, rel=1e-3)
    # a key that rises with the click odds explores towards its best candidates
    assert sc["fitted_no_intent"] == pytest.approx(1.0, abs=0.3)  # already log-odds
    served = [
        _evaluate(data, (1.0, 1.0), base=b, scales=s).metrics["session_knn"]["served_ctr"]
        for b, s in ((base, sc), (small, sc_small))
    ]
    assert served[0] == pytest.approx(served[1], rel=1e-6)
    # without the scale the unit decides: votes / 100 explore almost uniformly
    raw = [
        _evaluate(data, (1.0, 1.0), base=b).metrics["session_knn"]["served_ctr"]
        for b in (base, small)
    ]
    assert abs(raw[0] - raw[1]) > 1e-3


def test_served_ctr_is_the_greedy_one_without_exploration_and_pays_for_exploring(data):
    greedy = _evaluate(data, (0.0, 1.0))
    for name in ("gru", "top1", "session_knn", "fitted_no_intent", "intent_rule"):
        m = greedy.metrics[name]
        assert m["served_ctr"] == pytest.approx(m["actual_ctr"]), name
    explored = _evaluate(data, (1.0, 1e12))  # all exploration, uniform over the candidates
    uniform = explored.metrics["top1"]["served_ctr"]
    for name in ("gru", "session_knn", "intent_rule"):
        assert explored.metrics[name]["served_ctr"] == pytest.approx(uniform, rel=1e-6), name
    # the session-kNN's greedy choice beats choosing at random among the same candidates
    assert greedy.metrics["session_knn"]["actual_ctr"] > uniform


def test_fatigue_tires_each_policy_by_its_own_repeats(data):
    fresh = _evaluate(data, (0.0, 1.0))
    tired = _evaluate(data, (0.0, 1.0), fatigue=(3, 0.5))
    for name in ("top1", "session_knn"):
        a, b = fresh.per_visit[name]["actual_ctr"], tired.per_visit[name]["actual_ctr"]
        ratio = b / np.where(a > 0, a, 1.0)
        assert np.all(np.isclose(ratio, 1.0) | np.isclose(ratio, 0.5)), name
        assert np.isclose(ratio, 0.5).any(), name
