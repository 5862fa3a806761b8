"""A small synthetic visit log in which sessions keep one intent topic, the training settings
the policy tests share, and windows of its visits as stored states."""

import numpy as np

from personalization.state import UserState
from personalization.train import TrainConfig
from personalization.visits import VisitLog


def synthetic_visits(n_users=150, sessions=4, topics=6, per_topic=10, D=16, k=5, seed=0):
    """(VisitLog, classifier rows, query topic, session intent) of a small intent world."""
    rng = np.random.default_rng(seed)
    L = topics * per_topic
    centre = rng.standard_normal((topics, D)).astype(np.float32) * 2
    q_topic = np.repeat(np.arange(topics), per_topic)
    rows_w = centre[q_topic] + 0.3 * rng.standard_normal((L, D)).astype(np.float32)
    n_pages = 240
    p_topic = rng.integers(0, topics, n_pages)
    Z = (np.maximum(centre[p_topic] + rng.standard_normal((n_pages, D)), 0)).astype(np.float16)
    IDS = np.stack([t * per_topic + rng.choice(per_topic, k, replace=False) for t in p_topic])
    IDS[:, -1] = rng.integers(0, L, n_pages)  # one off-topic query per page
    SC = -np.sort(-rng.random((n_pages, k)).astype(np.float32), axis=1)
    user, ts, sess, page, intent = [], [], [], [], []
    s_id = 0
    for u in range(n_users):
        t = 1.7e9 + rng.random() * 3600
        for _ in range(sessions):
            it = rng.integers(0, topics)
            intent.append(it)
            for _ in range(2 + rng.poisson(4)):
                on = rng.random() < 0.65
                pool = np.flatnonzero(p_topic == it) if on else np.arange(n_pages)
                user.append(u)
                ts.append(t)
                sess.append(s_id)
                page.append(rng.choice(pool))
                t += 5 + rng.exponential(40)
            s_id += 1
            t += 3 * 3600 + rng.random() * 86400
    user, ts, sess, page = map(np.array, (user, ts, sess, page))
    intent = np.array(intent)
    n = len(ts)
    # epsilon-greedy logging: the page's top query, else a random query of the last 3 pages
    shown = IDS[page, 0].copy()
    prop = np.full(n, 0.7)
    explore = rng.random(n) < 0.3
    back = np.maximum(np.arange(n) - rng.integers(0, 3, n), 0)
    back = np.where(sess[back] == sess, back, np.arange(n))
    shown[explore] = IDS[page[back[explore]], rng.integers(0, k, explore.sum())]
    prop = np.where(explore, 0.3 / (3 * k), 0.7 + 0.3 / (3 * k))
    p_click = np.where(q_topic[shown] == intent[sess], 0.45, 0.04)
    clicked = rng.random(n) < p_click
    v = VisitLog(
        user=user,
        user_ids=[f"u{i}" for i in range(n_users)],
        ts=ts,
        session=sess,
        session_ids=[f"s{i}" for i in range(s_id)],
        event_ids=[f"e{i}" for i in range(n)],
        page=page,
        Z=Z,
        IDS=IDS,
        SC=SC,
        shown=shown,
        clicked=clicked,
        propensity=prop,
        search_indptr=np.zeros(n + 1, np.int64),
        search_ids=np.zeros(0, np.int64),
        pop_q=shown[clicked],
        pop_ts=ts[clicked],
        n_labels=L,
        engine_version="synthetic",
    )
    return v, rows_w, q_topic, intent


CFG = TrainConfig(
    K=4,
    topk=5,
    hidden=16,
    query_dim=8,
    mlp_hidden=16,
    epochs=4,
    batch_size=128,
    lr=1e-2,
    threads=1,
    val_frac=0.25,
    objective="losses",
)


def state(i, z, ids, scores, ts=1.7e9):
    return UserState(f"e{i}", ts + 30 * i, 1, 2, z, ids, scores)


def window_states(v, row, n):
    """The n states ending at visit `row` of the synthetic log, as UserState records."""
    rows = list(range(row - n + 1, row + 1))
    return [
        state(r, v.Z[v.page[r]], v.IDS[v.page[r]], v.SC[v.page[r]], v.ts[r] - 30 * r) for r in rows
    ]


def policy_weights(pred) -> dict[str, np.ndarray]:
    """A GRU policy over the predictor's label ids (untrained weights: what it scores does not
    matter here, only which ids it reads)."""
    from personalization.features import sim_table_from_rows
    from personalization.gru import GruPolicyNet

    rows = pred.classifier_rows(np.arange(pred.num_labels))
    cfg = TrainConfig(hidden=8, query_dim=4, mlp_hidden=8)
    w = GruPolicyNet(cfg.gru_config(), pred.dim, rows, np.zeros(len(rows), np.float32))
    weights = w.export_weights()
    weights["sim_table"] = sim_table_from_rows(rows, 8)
    weights["sim_norm"] = np.array([0.0, 1.0], np.float32)
    return weights
