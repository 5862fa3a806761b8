"""Evaluation scores the policy on what it would have shown: at each held-out visit its
shown_recent reads its own earlier greedy choices (replayed per user, in order), not the
logger's, and a policy that learnt to avoid repeats does so on the replay."""

import dataclasses

import numpy as np
import pytest

from personalization.evaluate import evaluate_policies, replay_shown
from personalization.features import F
from personalization.policy import GruPolicy
from personalization.train import publish, split_rows, train_policy
from testkit.policy_data import CFG, synthetic_visits


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    v, rows_w, _, _ = synthetic_visits(n_users=40)
    cfg = dataclasses.replace(CFG, epochs=1)
    w, _ = train_policy(v, rows_w, cfg, progress=False)
    w = dict(w)
    w["lin.w"] = w["lin.w"].copy()
    w["lin.w"][F["shown_recent"]] = -50.0  # a query shown lately never wins again
    _, path = publish(tmp_path_factory.mktemp("gru"), w, cfg, {})
    _, rows, _ = split_rows(v, 0.5)
    return v, GruPolicy.load(path), rows


def test_the_replay_feeds_the_policy_its_own_earlier_choices(setup):
    v, pol, rows = setup
    K, ttl = pol.K, pol.ttl_s
    lp = pol.weights["log_pop"]
    hist = replay_shown(pol, v, rows, lp, K, ttl)
    res = evaluate_policies(pol, v, rows, lp, K, ttl, None, progress=False)
    chosen = res.chosen["gru"]
    idx, mask = v.window(rows, K, ttl)
    pos = {int(r): j for j, r in enumerate(rows)}
    checked = 0
    for j in range(len(rows)):
        assert hist[j, -1] == -1  # the current visit's ad is what is being chosen
        for t in range(K - 1):
            p = pos.get(int(idx[j, t]), -1) if mask[j, t] else -1
            assert hist[j, t] == (chosen[p] if p >= 0 else -1)
            checked += p >= 0
    assert checked > 200
    # the logger's history is not what the policy read
    logged = np.where(mask[:, :-1], v.shown[idx[:, :-1]], -1)
    assert (hist[:, :-1] != logged).any()
    # with a repeat penalty the policy moves on: after its first visit with history, no
    # user sees the previous visit's choice again (a cold start follows the page's top query)
    cold = mask.sum(1) <= 1
    prev_ok = (hist[:, -2] >= 0) & ~cold
    repeats = (chosen == hist[:, -2]) & prev_ok
    assert prev_ok.sum() > 100 and not repeats.any()
