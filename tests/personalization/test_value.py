"""What a policy earns in the simulator: the evaluation's click judge is the simulator's own
click model, and the doubly-robust estimate from exploring logs covers the actual CTR."""

from types import SimpleNamespace

import numpy as np
import pytest

from personalization.policy import explore
from personalization.value import crossfit_reward, load_judge, off_policy, paired_bootstrap
from simulator.clickmodel import click_probability
from simulator.traffic import LogSettings, simulate_logs, simulate_sessions
from simulator.world import generate_world, save_world


@pytest.fixture(scope="module")
def world():
    return generate_world(600, 900, 120, seed=3)


def test_judge_equals_the_simulators_click_model(world, tmp_path):
    """personalization reads the click model as data (no stream import); on every visit and
    any query its probability is the simulator's, so "actual CTR" is the simulator's truth."""
    import json

    wdir, ldir = tmp_path / "w", tmp_path / "l"
    save_world(world, wdir)
    simulate_logs(world, ldir, LogSettings(days=1, seed=1), world_dir=str(wdir))
    truth = [json.loads(x) for x in (ldir / "truth" / "intents.jsonl").read_text().splitlines()]
    # one visit per session, each on a distinct page whose title no other page has
    rng = np.random.default_rng(0)
    _, first = np.unique(world.page_title, return_index=True)
    uniq = np.zeros(world.n_pages, bool)
    uniq[first] = True
    sess = truth[:200]
    pages = rng.choice(np.flatnonzero(uniq), len(sess), replace=False)
    titles = [world.page_title[p] for p in pages]
    v = SimpleNamespace(
        titles=titles,
        session_ids=[s["session_id"] for s in sess],
        session=np.arange(len(sess)),
        page=np.arange(len(sess)),
        n=len(sess),
    )
    judge = load_judge(wdir, ldir, v, world.query_text)
    q = rng.integers(-1, world.n_queries, (len(sess), 30))
    q[:, :5] = world.top_queries(pages, 5)  # linked queries too
    intent = np.array([s["subtopic"] for s in sess])
    want = click_probability(q, intent[:, None], pages[:, None], world=world)
    got = judge.p_click(np.arange(len(sess)), q)
    np.testing.assert_allclose(got, want, atol=1e-6)  # queries.tsv rounds popularity
    assert (got > 0.1).any() and (got == 0).any()  # both intent hits and "nothing shown"


def test_judge_reads_the_intent_at_each_view(world, tmp_path):
    """Intents drift within a session: the judge takes each visit's own intent from the truth
    file (views in time order), and a session whose views are not all loaded falls back to its
    first intent."""
    import json

    wdir, ldir = tmp_path / "w", tmp_path / "l"
    save_world(world, wdir)
    simulate_logs(world, ldir, LogSettings(days=2, seed=2, drift=0.3), world_dir=str(wdir))
    truth = [json.loads(x) for x in (ldir / "truth" / "intents.jsonl").read_text().splitlines()]
    sess = [t for t in truth if len(set(t["intents"])) > 1][:100]
    assert len(sess) == 100
    n = [len(t["intents"]) for t in sess]
    n[-1] -= 1  # the last session lost a view
    ts = np.concatenate([np.arange(k, 0, -1) * 1.0 for k in n])  # reversed: sorted by ts
    v = SimpleNamespace(
        titles=list(world.page_title),
        session_ids=[t["session_id"] for t in sess],
        session=np.repeat(np.arange(len(sess)), n),
        page=np.zeros(sum(n), np.int64),
        ts=ts,
        n=sum(n),
    )
    judge = load_judge(wdir, ldir, v, world.query_text)
    want = np.concatenate(
        [t["intents"][::-1] for t in sess[:-1]] + [[sess[-1]["subtopic"]] * n[-1]]
    )
    np.testing.assert_array_equal(judge.visit_intent, want)


def test_dr_interval_covers_the_actual_ctr_from_exploring_logs(world):
    """A logger exploring over the candidates (epsilon-softmax mixture, propensities logged)
    lets DR estimate another policy's CTR: its 95% interval holds the exact expected CTR that
    replaying the policy through the click model gives; the logger's own greedy choice is a
    different policy, so the estimate is not trivial."""
    rng = np.random.default_rng(5)
    ss = simulate_sessions(world, rng, 0.0, LogSettings(days=10, seed=5))
    V = len(ss.v_page)
    # candidates: the top 3 queries of the session's last 3 pages (current first)
    cols = []
    for lag in range(3):
        ok = ss.v_pos >= lag
        cols.append(
            np.where(
                ok[:, None], world.top_queries(ss.v_page[np.maximum(np.arange(V) - lag, 0)], 3), -1
            )
        )
    cand = np.concatenate(cols, 1)
    mask = cand >= 0
    lag_of = np.repeat(np.arange(3), 3)[None, :].repeat(V, 0).astype(np.float64)
    logits = np.where(mask, -lag_of, -np.inf).astype(np.float32)  # logger prefers the page
    col, prop, _ = explore(logits, mask, 0.5, 4.0, rng)
    R = np.arange(V)
    shown, p_shown = cand[R, col], prop[R, col]
    intent = ss.v_intent
    clicked = rng.random(V) < click_probability(shown, intent, ss.v_page, world=world)
    # target: the query of the previous page's top (the session's intent is more often there)
    tcol = np.where(mask[:, 3], 3, 0)
    target = cand[R, tcol]
    actual = click_probability(target, intent, ss.v_page, world=world).mean()
    users = ss.user[ss.v_session]
    feats = np.stack([lag_of[R, col] == 0, lag_of[R, col] == 1, lag_of[R, col] == 2], 1)
    tfeats = np.stack([tcol == 0, tcol == 3, np.zeros(V, bool)], 1)
    r_shown, (r_t,) = crossfit_reward(
        feats.astype(float), clicked, np.ones(V, bool), users, [tfeats.astype(float)]
    )
    est = off_policy(
        target, shown, clicked, p_shown, mask[R, tcol], r_t, r_shown, users, n_boot=400
    )
    lo, hi = est["dr_ci95"]
    assert lo <= actual <= hi, (actual, est)
    assert hi - lo < 0.08 and est["in_support"] == 1.0 and est["ess"] > 0.1 * V
    greedy = click_probability(cand[:, 0], intent, ss.v_page, world=world).mean()
    assert abs(greedy - actual) > (hi - lo) / 4  # a different policy, a different value


def test_paired_bootstrap_sees_a_consistent_gain_and_no_gain():
    rng = np.random.default_rng(0)
    users = rng.integers(0, 300, 6000)
    base = rng.random(6000) * 0.1
    up = paired_bootstrap(base + 0.01, base, users, 300)
    assert up["diff_ci95"][0] > 0.009 and up["lift"] > 0
    same = paired_bootstrap(base + rng.normal(0, 0.01, 6000), base, users, 300)
    assert same["diff_ci95"][0] < 0 < same["diff_ci95"][1]


def test_dr_interval_holds_when_few_clicks_carry_large_weights():
    """The logger shows the policy's choice at 1% of visits (weight 100): the DR estimate then
    rests on ~5 clicks, and a sample that drew few of them has a low mean and a small spread.
    The interval must still cover the true CTR about 95% of the time (resampling the terms
    alone covered ~90% here): its click-noise variance comes from the reward model's p."""
    rng = np.random.default_rng(0)
    users = np.repeat(np.arange(200), 20)
    N, n, hits, widths = users.size, 300, 0, []
    choice = np.zeros(N, np.int64)
    for i in range(n):
        matched = rng.random(N) < 0.01
        shown = np.where(matched, 0, 1)
        clicked = np.where(matched, rng.random(N) < 0.13, rng.random(N) < 0.1)
        est = off_policy(
            choice,
            shown,
            clicked,
            np.where(matched, 0.01, 0.99),
            np.ones(N, bool),
            np.full(N, 0.1),  # a reward model off by 0.03
            np.full(N, 0.1),
            users,
            300,
            seed=i,
        )
        lo, hi = est["dr_ci95"]
        hits += lo <= 0.13 <= hi
        widths.append(hi - lo)
    assert hits / n >= 0.935
    assert np.median(widths) < 0.25  # ~5 clicks: a Poisson count allows about 0.04 .. 0.30


def _toy_judge_and_log():
    """Two users, 4 sub-topics in 2 topics, one query per sub-topic; user u0 read three pages of
    sub-topic 2 in an earlier session, then a window of a page of sub-topic 0 and one of 1."""
    from personalization.value import DEFAULT_CLICK, ClickJudge
    from personalization.visits import VisitLog

    user = np.array([0, 0, 0, 0, 0, 1, 1])
    ts = np.array([0.0, 10, 20, 1e5, 1e5 + 10, 0, 10])
    session = np.array([0, 0, 0, 1, 1, 2, 2])
    page = np.array([2, 2, 2, 0, 1, 3, 3])  # page i is of sub-topic i
    v = SimpleNamespace(
        user=user,
        ts=ts,
        session=session,
        session_ids=["s0", "s1", "s2"],
        page=page,
        shown=np.full(7, -1),
        clicked=np.zeros(7, bool),
        n=7,
    )
    v.window = lambda rows, K, ttl_s: VisitLog.window(v, rows, K, ttl_s)
    judge = ClickJudge(
        params=dict(DEFAULT_CLICK),
        q_sub=np.arange(4),
        q_top=np.array([0, 0, 1, 1]),
        q_head=np.ones(4),
        sub_topic=np.array([0, 0, 1, 1]),
        page_sub=np.arange(4),
        link_keys=np.zeros(0, np.int64),
        visit_intent=np.zeros(7, np.int64),
        log_lr=np.log(np.full(4, 3.0)),
        visit_page=page,
        persist=0.7,
        drift=0.05,
    )
    return judge, v


def test_the_profile_reference_reads_the_users_history_before_the_window_only():
    """bayes_profile's prior is the user's own earlier pages: the sub-topic u0 read before its
    window leads the prior (and not the window's own pages, which the filter reads); a user with
    no earlier history keeps the uniform prior."""
    judge, v = _toy_judge_and_log()
    prior = judge.profile_prior(v, np.array([4, 6]), K=2, ttl_s=1e9)
    np.testing.assert_allclose(prior.sum(1), 1.0)
    assert prior[0].argmax() == 2 and prior[0, 2] == pytest.approx((3 + 0.25) / 4)
    assert prior[0, 0] == prior[0, 1] == prior[0, 3]  # the window's pages are not counted
    np.testing.assert_allclose(prior[1], 0.25)  # u1: nothing before its window
    with_profile = judge.window_posterior(v, np.array([4]), 2, 1e9, profile=True)
    without = judge.window_posterior(v, np.array([4]), 2, 1e9)
    assert with_profile[0, 2] > 2 * without[0, 2]


def test_the_clicks_reference_reads_each_earlier_ad_outcome():
    """bayes_clicks: a click on an earlier visit's ad of sub-topic 0 raises the posterior of 0;
    an ad shown and not clicked lowers it a little; the current visit's own outcome (not known
    when its ad is chosen) changes nothing."""
    judge, v = _toy_judge_and_log()
    row = np.array([4])
    base = judge.window_posterior(v, row, 2, 1e9, clicks=True)[0]
    np.testing.assert_allclose(base, judge.window_posterior(v, row, 2, 1e9)[0])
    v.shown[3] = 0
    no_click = judge.window_posterior(v, row, 2, 1e9, clicks=True)[0]
    v.clicked[3] = True
    click = judge.window_posterior(v, row, 2, 1e9, clicks=True)[0]
    assert click[0] > 1.5 * base[0] and no_click[0] < base[0]
    v.shown[4], v.clicked[4] = 1, True  # the current slot
    np.testing.assert_allclose(judge.window_posterior(v, row, 2, 1e9, clicks=True)[0], click)
