"""Serving reads the window training read: Redis hands the policy a user's states in arrival
order, keeps stale ones alive and, after an engine switch, holds states of other label ids; the
policy must score each visit exactly as training scored it (VisitLog.window: timestamp order,
states beyond the TTL masked, nothing after the visit)."""

import dataclasses

import numpy as np
import pytest

from personalization.features import F, cluster_lookup
from personalization.policy import GruPolicy
from personalization.scoring import candidate_logits, softmax_masked
from personalization.state import UserState, serving_window, space_tag
from personalization.train import make_batch, publish, train_policy
from testkit.policy_data import CFG, synthetic_visits

TTL = 2 * 3600.0  # shorter than the hours between sessions: earlier sessions are stale
SPACE = space_tag("ab" * 32)
STATE_K = 16  # what Redis keeps per user (the stream's default state_k)


@pytest.fixture(scope="module")
def world():
    return synthetic_visits(n_users=60)


@pytest.fixture(scope="module")
def served(world, tmp_path_factory):
    """A policy trained with a 2-hour TTL, its recurrent term given weight (training may keep
    its start, where that term is zero, and then the order of the states would matter less)."""
    v, rows_w, _, _ = world
    cfg = dataclasses.replace(CFG, ttl_s=TTL, epochs=1)
    w, _ = train_policy(v, rows_w, cfg, progress=False)
    w = dict(w)
    w["mlp.w2"] = np.random.default_rng(1).normal(size=w["mlp.w2"].shape).astype(np.float32)
    # and earlier visits' queries a chance against the current page's (sources of both kinds)
    w["lin.w"] = w["lin.w"].copy()
    w["lin.w"][F["in_current"]] -= 2.0
    w["lin.w"][F["shown_recent"]] -= 1.0  # what was shown at earlier visits counts
    _, path = publish(tmp_path_factory.mktemp("gru"), w, cfg, {})
    return GruPolicy.load(path), w, cfg


def visit_state(v, r, space=SPACE):
    """The stored state of visit r, with the ad shown there (the stream marks it)."""
    p = v.page[r]
    return UserState(
        v.event_ids[r], float(v.ts[r]), 1, 2, v.Z[p], v.IDS[p], v.SC[p], space, int(v.shown[r])
    )


def redis_history(v, r, rng):
    """What Redis holds when visit r arrives: the user's last STATE_K - 1 earlier visits plus
    one of the user's later visits that arrived first (out of order) and a fresh state from
    another engine's label space, all shuffled (arrival order is not timestamp order)."""
    u = v.user[r]
    first = r
    while first > 0 and v.user[first - 1] == u and r - first < STATE_K - 2:
        first -= 1
    hist = [visit_state(v, i) for i in range(first, r)]
    if r + 1 < v.n and v.user[r + 1] == u:
        hist.append(visit_state(v, r + 1))
    other = visit_state(v, r, space=SPACE + 1)
    other.event_id, other.ts = "other-engine", float(v.ts[r]) - 1.0
    hist.append(other)
    return [hist[i] for i in rng.permutation(len(hist))]


def test_serving_scores_every_visit_as_training_did(world, served):
    v = world[0]
    pol, w, cfg = served
    assert pol.ttl_s == TTL  # the published config carries the TTL it was trained with
    rng = np.random.default_rng(0)
    rows = np.flatnonzero(np.r_[False, v.user[1:] == v.user[:-1]])  # visits with history
    rows = np.sort(rng.choice(rows, 300, replace=False))
    hists = [redis_history(v, r, rng) for r in rows]
    ranked = pol.rank_batch(hists, [visit_state(v, r) for r in rows])

    _, mask = v.window(rows, cfg.K, cfg.ttl_s)
    sim = (w["sim_table"], w["sim_norm"], cluster_lookup(w))
    b = make_batch(v, rows, cfg.K, cfg.ttl_s, w["log_pop"], *sim)
    p_train = softmax_masked(candidate_logits(w, b))
    naive_differs = 0
    for j, r in enumerate(rows):
        if mask[j].sum() == 1:  # every earlier state stale: the cold-start rule, as evaluated
            assert ranked[j] is None, r
            continue
        ids, probs = ranked[j]
        m = b.cand_mask[j]
        want = dict(zip(b.cand_ids[j][m].tolist(), p_train[j][m].tolist(), strict=True))
        got = dict(zip(ids.tolist(), probs.tolist(), strict=True))
        assert got.keys() == want.keys(), r
        assert np.allclose([got[q] for q in want], list(want.values()), atol=1e-5), r
        # the last K - 1 states in arrival order are not that window
        naive = [s.event_id for s in hists[j][-(cfg.K - 1) :]]
        lo = max(r - cfg.K + 1, 0)
        naive_differs += naive != [v.event_ids[i] for i in range(lo, r) if v.user[i] == v.user[r]]
    assert (mask.sum(1) == 1).sum() > 20  # stale earlier sessions were cut
    assert (b.feats[..., F["shown_recent"]] > 0).sum() > 100  # earlier ads were in play
    assert naive_differs > 100  # arrival order, later and foreign states were all in play


def test_window_orders_by_time_and_drops_later_stale_and_foreign_states():
    z, ids, sc = np.zeros(4), [1, 2], [0.5, 0.4]
    cur = UserState("now", 1000.0, 1, 2, z, ids, sc, SPACE)
    h = [
        UserState("b", 900.0, 1, 2, z, ids, sc, SPACE),
        UserState("later", 1001.0, 1, 2, z, ids, sc, SPACE),  # arrived first, happened after
        UserState("a", 800.0, 1, 2, z, ids, sc, SPACE),
        UserState("stale", 1000.0 - 61.0, 1, 2, z, ids, sc, SPACE),
        UserState("foreign", 950.0, 1, 2, z, ids, sc, SPACE + 1),
        UserState("v1-record", 990.0, 1, 2, z, ids, sc, 0),  # untagged: kept
        "not a state",
    ]
    names = [s.event_id for s in serving_window(h, cur, K=8, ttl_s=300.0)]
    assert names == ["a", "b", "stale", "v1-record", "now"]
    assert [s.event_id for s in serving_window(h, cur, K=3, ttl_s=60.0)] == [
        "v1-record",
        "now",
    ]
    assert serving_window(h, cur, K=1, ttl_s=300.0) == [cur]


def test_state_records_carry_their_label_space_and_old_records_still_read():
    s = UserState.from_visit("e1", 5.0, "u", "t", np.ones(3), [4, 5], [0.5, 0.25], SPACE)
    back = UserState.decode(s.encode())
    assert back.space == SPACE and back.query_ids.tolist() == [4, 5]
    assert UserState.from_json(back.to_json()).space == SPACE
    # records of earlier versions, as Redis may still hold: version 2 (no shown field) read
    # with nothing shown, version 1 (no space either) with space 0
    s.shown = 7
    raw = s.encode()
    assert UserState.decode(raw).shown == 7 and UserState.from_json(s.to_json()).shown == 7
    v2 = raw[:2] + b"\x02" + raw[3:35] + raw[39:]
    old = UserState.decode(v2)
    assert old.space == SPACE and old.shown == -1 and old.event_id == "e1"
    assert np.array_equal(old.scores, s.scores)
    v1 = raw[:2] + b"\x01" + raw[3:27] + raw[39:]
    old = UserState.decode(v1)
    assert old.space == 0 and old.shown == -1 and old.event_id == "e1" and old.ts == 5.0
    assert np.array_equal(old.scores, s.scores)


def test_each_served_query_names_the_visit_it_came_from_and_its_margin(world, served):
    from personalization.explain import describe_source

    v = world[0]
    pol = served[0]
    rows = np.flatnonzero(np.r_[False, v.user[1:] == v.user[:-1]])[:400]
    hists = [[visit_state(v, i) for i in range(max(r - 20, 0), r) if v.user[i] == v.user[r]]
             for r in rows]  # fmt: skip
    cur = [visit_state(v, r) for r in rows]
    sv = pol.serve_batch(hists, cur, epsilon=0.0, rng=np.random.default_rng(0))
    assert sv.source_ago is not None and sv.source_event is not None and sv.margin is not None
    for j in range(len(rows)):
        q, ago = int(sv.query[j]), int(sv.source_ago[j])
        window = serving_window(hists[j], cur[j], pol.K, pol.ttl_s)
        src = window[len(window) - 1 - ago]
        # the latest visit of the window whose predicted queries hold the served one
        assert src.event_id == sv.source_event[j] and q in src.query_ids
        assert all(q not in s.query_ids for s in window[len(window) - ago :])
        top = int(cur[j].query_ids[np.argmax(cur[j].scores)])
        p = dict(zip(sv.cand_ids[j].tolist(), sv.cand_scores[j].tolist(), strict=True))
        assert sv.margin[j] == pytest.approx(p[q] - p[top], abs=1e-6) and sv.margin[j] >= -1e-6
        f = sv.fields(j)
        assert f["source_visits_ago"] == ago and f["source_event_id"] == src.event_id
    assert (sv.source_ago > 0).sum() > 20 and (sv.source_ago == 0).sum() > 20
    assert (sv.margin > 0).any()  # chosen over the page's own top query
    assert describe_source(0, "t") == "this page"
    assert describe_source(2, "Page X") == "2 visits ago: Page X"
    assert describe_source(1, None) == "1 visit ago (title not logged)"
    assert describe_source(-1, "t") == ""
