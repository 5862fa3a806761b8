"""The features' constants follow the logs they are fitted on: traffic whose sessions persist
more, drift less or whose views come further apart gives keep rates and a block gap that move
the same way; a trained policy stores what was fitted and serving reads exactly that back."""

import json

import numpy as np
import pytest

from personalization.artifact import MANIFEST, PolicyFileError
from personalization.features import DEFAULT_FIT, FIT_KEY, FeatureFit, cluster_lookup
from personalization.fit_filter import fit_block_gap, fit_intent_filter
from personalization.policy import GruPolicy
from personalization.train import make_batch, publish, split_rows, train_policy
from simulator.traffic import LogSettings
from simulator.world import generate_world
from testkit.policy_data import CFG, synthetic_visits
from testkit.traffic_visits import traffic_visits

# Two traffic settings far apart: sessions that continue the last one's intent and hardly drift,
# views 3 s + Exp(40 s) apart; against fresh intents at each session, frequent drift and views
# 8 times further apart.
STEADY = (LogSettings(days=5, seed=1, persist=0.9, drift=0.02, epsilon=0.5), 1.0)
FICKLE = (LogSettings(days=5, seed=1, persist=0.0, drift=0.4, epsilon=0.5), 8.0)


@pytest.fixture(scope="module")
def world():
    return generate_world(n_queries=1000, n_pages=1500, n_users=150, seed=5)


def _fit(world, settings, scale):
    v = traffic_visits(world, settings, scale)
    tr, va, _ = split_rows(v, 0.25)
    w, report = fit_intent_filter(v, tr, va, 8, 30 * 86400.0, world.n_queries, 16, seed=0)
    return v, FeatureFit.from_array(w[FIT_KEY]), report


@pytest.fixture(scope="module")
def fits(world):
    return {name: _fit(world, *s) for name, s in (("steady", STEADY), ("fickle", FICKLE))}


def test_fitted_keep_rate_follows_drift(fits):
    """Interests that drift within sessions leave less of the belief to keep between views.
    (The rate across blocks is not compared: with most users holding one dominant interest a
    session repeats the last one's intent at about 0.9 with persist 0.9 and still about 0.7 with
    persist 0, and the fitted rates differ by less than their noise.)"""
    steady, fickle = fits["steady"][1], fits["fickle"][1]
    assert steady.keep > fickle.keep, (steady, fickle)
    for f in (steady, fickle):  # a page's evidence counts: the factor is not fitted away
        assert f.kappa_scale > 0.5 and 0 <= f.keep_block <= 1 and 0 <= f.keep <= 1


def test_fitted_block_gap_follows_the_gaps_and_separates_sessions(fits):
    gaps = {}
    for name, (v, fit, _) in fits.items():
        same_user = v.user[1:] == v.user[:-1]
        gap = np.diff(v.ts)[same_user]
        new_session = (v.session[1:] != v.session[:-1])[same_user]
        # the fitted gap cuts where the sessions change, which the fit never saw (sessions
        # start at random times, so some begin minutes after the last one ended)
        assert (gap[~new_session] < fit.block_gap_s).mean() > 0.9, name
        assert (gap[new_session] >= fit.block_gap_s).mean() > 0.6, name
        gaps[name] = fit.block_gap_s
    assert gaps["fickle"] > 2 * gaps["steady"], gaps


def test_block_gap_needs_gaps():
    v, _, _, _ = synthetic_visits(n_users=3, sessions=1, seed=0)
    assert fit_block_gap(v, np.arange(3)) is None


def test_a_policy_serves_exactly_the_constants_it_was_fitted_with(tmp_path):
    v, rows_w, _, _ = synthetic_visits(n_users=60, seed=4)
    w, report = train_policy(v, rows_w, CFG, progress=False)
    fitted = FeatureFit.from_array(w[FIT_KEY])
    assert fitted != DEFAULT_FIT
    _, path = publish(tmp_path / "gru", w, CFG, {"train": report})
    manifest = json.loads((path / MANIFEST).read_text())
    assert FeatureFit.from_json(manifest["feature_fit"]) == fitted
    pol = GruPolicy.load(path)
    served_clusters = cluster_lookup(pol.weights)
    assert served_clusters is not None and served_clusters.fit == fitted
    rows = np.arange(20, 220)
    trained = make_batch(v, rows, CFG.K, CFG.ttl_s, w["log_pop"], None, None, cluster_lookup(w))
    served = make_batch(v, rows, CFG.K, CFG.ttl_s, w["log_pop"], None, None, served_clusters)
    np.testing.assert_array_equal(trained.feats, served.feats)
    # a policy written before the constants were fitted loads with the values it was trained with
    del manifest["feature_fit"]
    (path / MANIFEST).write_text(json.dumps(manifest))
    old = cluster_lookup(GruPolicy.load(path).weights)
    assert old is not None and old.fit == DEFAULT_FIT
    manifest["feature_fit"] = {**fitted.to_json(), "keep": 1.5}
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(PolicyFileError, match=r"feature_fit\.keep"):
        GruPolicy.load(path)
