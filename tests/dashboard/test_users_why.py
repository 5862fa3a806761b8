"""The Users page says why each ad was served: the visit its query came from ("this page", or
"2 visits ago: <title>", titles from the click log) and the policy's margin over the page's own
top query, for the ad logged then and for the current policy's choice."""

import numpy as np

from dashboard import users
from personalization.explain import describe_source
from personalization.state import UserState


def _states(n=8, L=20, D=8):
    rng = np.random.default_rng(4)
    return [
        UserState(
            f"e{i}",
            1.7e9 + 60 * i,
            1,
            2,
            rng.random(D),
            rng.choice(L, 4, replace=False),
            np.sort(rng.random(4))[::-1],
        )
        for i in range(n)
    ]


def _policy(tmp_path, L=20, D=8):
    import torch

    from personalization.features import F, sim_table_from_rows
    from personalization.gru import GruPolicyNet
    from personalization.policy import GruPolicy
    from personalization.train import TrainConfig, publish

    torch.manual_seed(0)
    cfg = TrainConfig(K=4, topk=4, hidden=4, query_dim=2, mlp_hidden=4)
    rows = np.random.default_rng(0).normal(size=(L, D)).astype(np.float32)
    w = GruPolicyNet(cfg.gru_config(), D, rows, np.zeros(L, np.float32)).export_weights()
    w["sim_table"], w["sim_norm"] = sim_table_from_rows(rows, 4), np.array([0, 1], np.float32)
    w["mlp.w2"] = np.random.default_rng(1).normal(size=w["mlp.w2"].shape).astype(np.float32)
    w["lin.w"][F["in_current"]] = -3.0  # earlier visits' queries win where the page has others
    return GruPolicy.load(publish(tmp_path / "gru", w, cfg, {})[1], backend="numpy")


def test_visit_rows_say_where_each_query_came_from_and_its_margin(tmp_path):
    states = _states()
    names = [f"q{i}" for i in range(20)]
    logged = {
        "e0": {"event_id": "e0", "title": "Page zero", "query": "q1"},
        "e1": {"event_id": "e1", "title": "Page one", "query": "q2"},  # logged without why
        "e3": {
            "event_id": "e3",
            "title": "Page three",
            "query": "q5",
            "source_visits_ago": 3,
            "source_event_id": "e0",
            "margin": 0.125,
        },
        "e4": {
            "event_id": "e4",
            "title": "Page four",
            "query": "q6",
            "source_visits_ago": 0,
            "source_event_id": "e4",
            "margin": 0.0,
        },
    }
    rows = users.visit_rows(users.visits(states, names, None, logged=logged))
    by_event = {r["event"]: r for r in rows}
    assert by_event["e3"]["shown from"] == "3 visits ago: Page zero"
    assert by_event["e3"]["shown margin"] == 0.125
    assert by_event["e4"]["shown from"] == "this page" and by_event["e4"]["shown margin"] == 0.0
    assert by_event["e1"]["shown from"] == "" and by_event["e1"]["shown margin"] is None
    # the top1 rule: always the page's own top query
    assert {r["chosen from"] for r in rows} == {"this page"}
    assert {r["chosen margin"] for r in rows} == {0.0}

    pol = _policy(tmp_path)
    vs = users.visits(states, names, pol, logged=logged)
    titles = {e: r["title"] for e, r in logged.items()}
    for i, v in enumerate(vs):
        q = names.index(v.chosen)
        # the latest of the visits the policy read (itself and up to K - 1 before) holding q
        window = states[max(0, i - pol.K + 1) : i + 1]
        ago = next(a for a, s in enumerate(reversed(window)) if q in s.query_ids)
        src = window[len(window) - 1 - ago].event_id
        assert v.chosen_from == describe_source(ago, titles.get(src)), (i, v.chosen_from)
        assert v.chosen_margin is not None and v.chosen_margin >= -1e-6
    assert any(v.chosen_from != "this page" for v in vs)
