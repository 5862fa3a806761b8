"""The features' constants follow the logs they are fitted on: traffic whose sessions persist
more, drift less or whose views come further apart gives keep rates and a block gap that move
the same way; logs without session ids are cut into sessions where their own gaps split; the
filter's successor kernel learns where interests lead, and is kept only where the clicks prefer
it; a trained policy stores what was fitted and serving reads exactly that back."""

import json

import numpy as np
import pytest

from personalization.artifact import MANIFEST, PolicyFileError
from personalization.features import (
    DEFAULT_FIT,
    FIT_KEY,
    FeatureFit,
    cluster_lookup,
    cluster_share,
)
from personalization.fit_filter import (
    em_successors,
    fit_block_gap,
    fit_intent_filter,
    page_score,
    windows,
)
from personalization.policy import GruPolicy
from personalization.train import make_batch, publish, split_rows, train_policy
from personalization.visits import session_codes
from simulator.dynamics import transition_kernel
from simulator.scenario import load_scenario
from simulator.traffic import LogSettings, with_scenario
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


@pytest.fixture(scope="module")
def scenario_fits(world):
    """`default` (views 3 s + Exp(40 s) apart, sessions hours apart, drift 0.05) against
    `short-memory` (30-minute pauses inside 10% of sessions, 30% of sessions starting minutes
    after the last, drift 0.3), fitted as a policy's training fits them."""
    out = {}
    for name in ("default", "short-memory"):
        s = with_scenario(LogSettings(days=5, seed=1, epsilon=0.5), load_scenario(name))
        out[name] = _fit(world, s, 1.0)
    return out


def test_sessions_of_logs_without_ids_follow_their_gaps(scenario_fits):
    """Logs without session ids are cut where their own gaps split: sessions that start minutes
    after the last pull the cut down, and the cut finds the sessions that generated the views
    (which the fit never saw) at least as well as a fixed 30 minutes does."""
    gaps = {}
    for name, (v, _, _) in scenario_fits.items():
        codes, gap = session_codes(v.user, v.ts, [None] * v.n)
        assert gap is not None, name
        same_user = v.user[1:] == v.user[:-1]
        true_new = (v.session[1:] != v.session[:-1])[same_user]
        fitted_new = (codes[1:] != codes[:-1])[same_user]
        fixed_new = np.diff(v.ts)[same_user] > 30 * 60
        assert (fitted_new == true_new).mean() >= (fixed_new == true_new).mean(), name
        gaps[name] = gap
    assert gaps["default"] > 1.15 * gaps["short-memory"], gaps
    # with session ids logged, they are the sessions and no gap is fitted
    v = scenario_fits["default"][0]
    codes, gap = session_codes(v.user, v.ts, [v.session_ids[s] for s in v.session])
    assert gap is None and (np.diff(codes) != 0).sum() == (np.diff(v.session) != 0).sum()


def test_logs_without_session_ids_are_cut_where_their_gaps_split(astec_predictor, tmp_path):
    """The simulator's logs read back through the engine with their session ids and with the
    ids stripped: the sessions cut at the logs' own valley are almost exactly the logged ones
    (default traffic: sessions hours apart), and the cut is what the reader reports."""
    from engine.predictor import Predictor
    from personalization.visits import load_visits
    from simulator.traffic import simulate_logs
    from simulator.world import save_world, world_from_dataset
    from testkit.paths import STREAM_DATA

    world = world_from_dataset(STREAM_DATA, n_users=100, seed=3)
    save_world(world, tmp_path / "world")
    logs = tmp_path / "logs"
    simulate_logs(world, logs, LogSettings(days=3, seed=3), world_dir=str(tmp_path / "world"))
    pred = Predictor.load(astec_predictor)
    logged = load_visits(logs, pred, progress=False)
    assert logged.session_gap_s is None
    for part in (logs / "page_views").rglob("part-*.jsonl"):
        recs = [json.loads(line) for line in part.read_text().splitlines() if line.strip()]
        assert all(r.pop("session_id", None) is not None for r in recs)
        part.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cut = load_visits(logs, pred, progress=False)
    assert cut.session_gap_s is not None and cut.event_ids == logged.event_ids
    same_user = logged.user[1:] == logged.user[:-1]
    new_logged = (np.diff(logged.session) != 0)[same_user]
    new_cut = (np.diff(cut.session) != 0)[same_user]
    assert new_logged.sum() > 50
    assert (new_cut == new_logged).mean() > 0.98, cut.session_gap_s


def test_fitted_constants_follow_the_scenarios(scenario_fits):
    """Interests that drift within sessions keep less of the belief between views; the intent
    ranking's weight of the page's score is fitted, and the validation clicks prefer it to the
    weight the hand rule set."""
    default, short = scenario_fits["default"][1], scenario_fits["short-memory"][1]
    assert default.keep > short.keep, (default, short)
    for name, (_, fit, report) in scenario_fits.items():
        ll = report["intent_score_weight_val_click_loglik"]
        assert ll["fitted"] > ll["unfitted"], (name, ll)
        assert fit.intent_score_weight != DEFAULT_FIT.intent_score_weight, name


def _kernel_gain(world, scenario: str) -> tuple[float, float, float, dict, dict]:
    """With a policy's fitted filter on `scenario`'s traffic, a successor kernel fitted by EM
    on the training pages: how much better than the uniform kernel it predicts the validation
    pages (page_score); the share of its mass that goes to clusters of the `transitions`
    scenario's successor sub-topics (each cluster read as the sub-topic most of its queries
    belong to) and that share for a kernel that ignores where it comes from; and
    fit_intent_filter's weights and report."""
    sc = load_scenario(scenario)
    v = traffic_visits(world, with_scenario(LogSettings(days=5, seed=1, epsilon=0.5), sc), 1.0)
    tr, va, _ = split_rows(v, 0.25)
    w, report = fit_intent_filter(v, tr, va, 8, 30 * 86400.0, world.n_queries, 16, seed=0)
    cl = cluster_lookup(w)
    viewed = v.page[np.concatenate([tr, va])]
    share = cluster_share(v.IDS[viewed], v.SC[viewed], cl.lookup)
    pages_tr, pages_va = (windows(v, r, 8, 30 * 86400.0, shown=False) for r in (tr, va))
    kern = em_successors(share, cl.lookup, pages_tr, cl.fit, 10.0, 30.0)
    gain = page_score(share, cl.lookup, pages_va, cl.fit, kern) - page_score(
        share, cl.lookup, pages_va, cl.fit
    )
    successors = transition_kernel(world, load_scenario("transitions").intent.transitions)
    n = len(share)
    qsub, qcl = world.query_subtopic, cl.lookup[:-1]
    dom = np.array(
        [np.bincount(qsub[qcl == c]).argmax() if (qcl == c).any() else -1 for c in range(n)]
    )
    to_succ = np.array([np.isin(dom, successors[d]) if d >= 0 else np.zeros(n, bool) for d in dom])
    T = kern.dense()[dom >= 0]
    mass = float((T * to_succ[dom >= 0]).sum() / T.sum())
    chance = float(to_succ[dom >= 0].mean())
    return gain, mass, chance, w, report


@pytest.fixture(scope="module")
def kernel_fits(world):
    return {name: _kernel_gain(world, name) for name in ("default", "transitions")}


def test_the_successor_kernel_follows_the_traffic(kernel_fits):
    """Where interests lead to particular others (`transitions`: 80% of redraws go to one of
    two successor sub-topics), the kernel EM fits on the page sequence sends its mass to the
    successors far above chance, far more than on `default` traffic (redraws from each user's
    own interests), and predicts the next page better than the uniform kernel by far more."""
    gain, mass, chance = kernel_fits["transitions"][:3]
    gain_default, mass_default, _ = kernel_fits["default"][:3]
    assert mass > 2 * chance and mass > 2 * mass_default, (mass, chance, mass_default)
    assert gain > 0.02 and gain > 3 * gain_default, (gain, gain_default)


def test_the_successor_kernel_is_kept_only_where_the_clicks_prefer_it(kernel_fits):
    """A policy's training keeps the kernel whose validation click likelihood is best, the
    uniform one included, and stores exactly that."""
    for name, (*_, w, report) in kernel_fits.items():
        ll = report["successors_val_click_loglik"]
        best = max(ll, key=lambda k: ll[k])
        kernel = cluster_lookup(w).kernel
        assert (kernel is None) == (best == "uniform"), (name, ll)
        assert report["successors"] == (0 if kernel is None else kernel.succ.shape[1])
        if kernel is not None:
            np.testing.assert_allclose(kernel.dense().sum(1), 1.0, atol=1e-6)


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
    # one fitted before the intent ranking's weight was: that weight at what it was trained with
    manifest["feature_fit"] = {
        k: x for k, x in fitted.to_json().items() if k != "intent_score_weight"
    }
    (path / MANIFEST).write_text(json.dumps(manifest))
    older = cluster_lookup(GruPolicy.load(path).weights)
    assert older is not None and older.fit.keep == fitted.keep
    assert older.fit.intent_score_weight == DEFAULT_FIT.intent_score_weight
    manifest["feature_fit"] = {**fitted.to_json(), "intent_score_weight": -1.0}
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(PolicyFileError, match=r"feature_fit\.intent_score_weight"):
        GruPolicy.load(path)
    manifest["feature_fit"] = {**fitted.to_json(), "keep": 1.5}
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(PolicyFileError, match=r"feature_fit\.keep"):
        GruPolicy.load(path)
