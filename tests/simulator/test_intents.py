"""Interests that persist across a user's sessions and drift within them, and the
Bayes filter the reference rows use to read them from a window's pages."""

from types import SimpleNamespace

import numpy as np
import pytest

from personalization.intent_filter import intent_posterior
from personalization.visits import VisitLog
from simulator.traffic import LogSettings, simulate_sessions
from simulator.world import generate_world


@pytest.fixture(scope="module")
def world():
    return generate_world(n_queries=2000, n_pages=3000, n_users=300, seed=3)


def _consecutive_same(ss) -> float:
    """Share of a user's sessions whose first intent equals the previous session's last."""
    order = np.lexsort((ss.start, ss.user))
    ends = np.r_[np.flatnonzero(np.diff(ss.v_session)), len(ss.v_session) - 1]
    last = ss.v_intent[ends][order]
    same_user = ss.user[order][1:] == ss.user[order][:-1]
    return float((ss.intent[order][1:] == last[:-1])[same_user].mean())


def test_intents_persist_across_sessions(world):
    s = LogSettings(days=6, drift=0.0)
    fresh = simulate_sessions(
        world, np.random.default_rng(1), 0.0, LogSettings(days=6, persist=0.0, drift=0.0)
    )
    kept = simulate_sessions(world, np.random.default_rng(1), 0.0, s)
    a, b = _consecutive_same(fresh), _consecutive_same(kept)
    # a fresh draw repeats the last intent with P = sum of squared interest weights (most users
    # have one dominant interest); persist 0.7 raises it to 0.7 + 0.3 * that
    assert a < 0.8 and abs(b - (s.persist + (1 - s.persist) * a)) < 0.03, (a, b)
    assert (kept.v_intent == kept.intent[kept.v_session]).all()  # drift 0: one intent


def test_intents_drift_within_sessions(world):
    ss = simulate_sessions(world, np.random.default_rng(2), 0.0, LogSettings(days=6, drift=0.2))
    moved = ss.v_intent != ss.intent[ss.v_session]
    assert not moved[ss.v_pos == 0].any()
    late = moved[ss.v_pos >= 5].mean()
    assert 0.2 < late < 0.8 and late > 2 * moved[ss.v_pos == 1].mean()
    # the page follows the view's intent, not the session's first one
    sub = world.page_subtopic[ss.v_page]
    assert (sub == ss.v_intent)[moved].mean() > 0.5
    assert (sub == ss.intent[ss.v_session])[moved].mean() < 0.35


def test_last_intent_carries_over(world):
    rng = np.random.default_rng(3)
    first = simulate_sessions(world, rng, 0.0, LogSettings(days=2))
    ss = simulate_sessions(
        world, rng, 2 * 86400.0, LogSettings(days=2, persist=1.0, drift=0.0), first.last_intent
    )
    order = np.lexsort((ss.start, ss.user))
    head = order[np.r_[True, ss.user[order][1:] != ss.user[order][:-1]]]
    had = first.last_intent[ss.user[head]] >= 0
    assert had.sum() > 50
    assert (ss.intent[head][had] == first.last_intent[ss.user[head]][had]).all()


def _visits(ss, world):
    """The minimal VisitLog view intent_posterior reads: views sorted by (user, ts)."""
    order = np.lexsort((ss.v_ts, ss.user[ss.v_session]))
    sess = ss.v_session[order]
    code = np.cumsum(np.r_[True, sess[1:] != sess[:-1]]) - 1
    ids = [f"s{k}" for k in sess[np.r_[True, sess[1:] != sess[:-1]]].tolist()]
    v = SimpleNamespace(
        user=ss.user[sess], ts=ss.v_ts[order], session=code, session_ids=ids, page=ss.v_page[order]
    )
    v.window = VisitLog.window.__get__(v)
    return v, ss.v_intent[order]


def _log_lr(world, a=0.7):
    pop = np.bincount(world.page_subtopic, weights=world.page_pop, minlength=world.n_subtopics)
    return np.log1p(a / (1 - a) / pop)


def test_filter_reads_the_chain_better_than_the_session_alone(world):
    s = LogSettings(days=4)
    ss = simulate_sessions(world, np.random.default_rng(4), 0.0, s)
    v, truth = _visits(ss, world)
    rows = np.arange(len(truth))
    args = (v, rows, 8, 30 * 86400.0, world.page_subtopic.astype(np.int64), _log_lr(world))
    session_only = intent_posterior(*args)  # persist = drift = 0: the earlier rule
    chain = intent_posterior(*args, s.persist, s.drift)
    np.testing.assert_allclose(chain.sum(1), 1.0)
    hit_s = (session_only.argmax(1) == truth).mean()
    hit_c = (chain.argmax(1) == truth).mean()
    assert hit_c > hit_s + 0.02, (hit_c, hit_s)
    # a first view in a session: the session-only rule sees one page, the chain sees earlier ones
    first = ss.v_pos[np.lexsort((ss.v_ts, ss.user[ss.v_session]))] == 0
    assert (chain.argmax(1) == truth)[first].mean() > (session_only.argmax(1) == truth)[
        first
    ].mean() + 0.05
