"""The intent features: the batched filter equals its definition written as a plain loop over
one window (with and without a successor kernel), padding never leaks into them, and
co-occurrence clusters recover planted groups."""

import numpy as np
import pytest
import scipy.sparse as sp

from personalization.features import (
    INTENT_KAPPA,
    INTENT_KEEP,
    INTENT_KEEP_BLOCK,
    KAPPA_FLOOR,
    F,
    build_batch,
    cluster_kappa,
    cluster_lookup,
    pad_states,
)
from personalization.query_clusters import query_clusters


def _loop_intent(cl, kappa, ids, sc, mask, starts, cand, T=None):
    """Definition: belief over clusters, uniform at first; per state (oldest first) keep
    INTENT_KEEP of it (INTENT_KEEP_BLOCK at a block start), the rest moved through the
    successor kernel T [n, n] (uniform: T None) unless it is the first, then multiply by
    1 + kappa(c) * the state's score share per cluster c; mass of the cand's cluster."""
    n = int(cl.max()) + 1
    T = np.full((n, n), 1.0 / n) if T is None else T
    belief = np.full(n, 1.0 / n)
    first = True
    share = np.zeros(n)
    for t in range(ids.shape[0]):
        if not mask[t]:
            continue
        share = np.zeros(n)
        for q, s in zip(ids[t], sc[t], strict=True):
            if q >= 0 and cl[q] >= 0:
                share[cl[q]] += s
        share = share / max(share.sum(), 1e-9)
        if not first:
            keep = INTENT_KEEP_BLOCK if starts[t] else INTENT_KEEP
            belief = keep * belief + (1 - keep) * (belief @ T)
        belief = belief * (1 + kappa * share)
        belief /= belief.sum()
        first = False
    c = cl[cand]
    return (belief[c], share[c]) if c >= 0 else (0.0, 0.0)


@pytest.mark.parametrize(
    ("kappa", "kernel"),
    [(None, False), ([5.0, 40.0, 20.0, 1.0], False), ([5.0, 40.0, 20.0, 1.0], True)],
)
def test_intent_features_match_their_definition(kappa, kernel):
    """With a policy's per-cluster factors and, for a policy without them, INTENT_KAPPA; with
    a fitted successor kernel (two explicit successors per cluster, the rest uniform) and
    without (uniform)."""
    rng = np.random.default_rng(0)
    L, K, k, D = 30, 5, 4, 3
    cl = rng.integers(0, 4, L).astype(np.float32)
    cl[7] = -1  # a query never clustered
    w = {"query_cluster": cl}
    if kappa is not None:
        w["cluster_kappa"] = np.array(kappa, np.float32)
    T = None
    if kernel:
        w["cluster_succ"] = np.array([[1, 2], [0, 0], [3, 1], [2, 0]], np.float32)
        w["cluster_succ_p"] = np.array(
            [[0.6, 0.3], [0.5, 0.2], [0.9, 0.05], [0.0, 0.1]], np.float32
        )
        p = w["cluster_succ_p"].astype(np.float64)
        T = np.repeat((1 - p.sum(1))[:, None] / 4, 4, 1)
        for j in range(4):
            for r in range(2):
                T[j, int(w["cluster_succ"][j, r])] += p[j, r]
        np.testing.assert_allclose(T.sum(1), 1.0)
    clusters = cluster_lookup(w)
    assert clusters is not None
    if kernel:
        assert clusters.kernel is not None
        np.testing.assert_allclose(clusters.kernel.dense(), T)
    lookup = clusters.lookup
    assert lookup.shape == (L + 1,) and lookup[-1] == -1
    want_kappa = np.full(4, INTENT_KAPPA) if kappa is None else np.array(kappa)
    np.testing.assert_allclose(clusters.kappa, want_kappa)
    seqs = []
    for n in (5, 3, 1):
        ids = rng.choice(L, (n, k), replace=False)
        ids[0, -1] = -1
        ids[-1, 0] = 7
        ts = 1.7e9 + np.array([0, 4000, 4040, 4080, 4120][:n], float)  # a block starts at 1
        seqs.append((rng.random((n, D)).astype(np.float32), ids, rng.random((n, k)), ts))
    z, ids, sc, mask, ts = pad_states(seqs, K)
    b = build_batch(z, ids, sc, mask, np.zeros(L, np.float32), ts, clusters=clusters)
    cols = [F["intent_mass"], F["page_cluster_share"]]
    for r in range(len(seqs)):
        gaps = np.r_[np.inf, np.diff(ts[r])]
        starts = mask[r] & (gaps >= 1800)
        for c in np.flatnonzero(b.cand_mask[r]):
            want = _loop_intent(
                lookup[:-1], want_kappa, ids[r], sc[r], mask[r], starts, b.cand_ids[r, c], T
            )
            assert b.feats[r, c, cols] == pytest.approx(want, abs=1e-5)
        assert not b.feats[r, ~b.cand_mask[r]].any()
    assert (b.feats[b.cand_ids == 7][:, cols] == 0).all()
    # without clusters the columns stay 0, the other features unchanged
    b0 = build_batch(z, ids, sc, mask, np.zeros(L, np.float32), ts)
    assert not b0.feats[..., cols].any()
    other = [i for i in range(b.feats.shape[-1]) if i not in cols]
    np.testing.assert_array_equal(b0.feats[..., other], b.feats[..., other])


def test_cluster_kappa_is_inverse_to_a_clusters_share_of_the_views():
    """Three clusters; views put 60% / 30% / 10% of their evidence in them (each view's scores
    normalised, so a view counts once whatever its scores): the factors are INTENT_KAPPA x
    (1/3) / share, the smallest share floored at KAPPA_FLOOR / 3; a view with no clustered query
    does not count; factors whose cluster counts disagree with the clusters are refused."""
    lookup = np.array([0, 0, 1, 2, -1, -1], np.int64)  # query 4 unclustered; last = padding
    views = [([0, 1], [2.0, 1.0])] * 6 + [([2, -1], [0.5, 0.0])] * 3 + [([3, 4], [1, 3])]
    views += [([4, -1], [1.0, 0.0])] * 5  # no clustered query: no evidence
    ids = np.array([v[0] for v in views])
    sc = np.array([v[1] for v in views], float)
    got = cluster_kappa(ids, sc, lookup)
    share = np.array([0.6, 0.3, max(0.1, KAPPA_FLOOR / 3)])
    np.testing.assert_allclose(got, INTENT_KAPPA / 3 / share, rtol=1e-6)
    assert got.dtype == np.float32 and got[0] < got[1]
    w = {"query_cluster": lookup[:-1].astype(np.float32), "cluster_kappa": got[:2]}
    with pytest.raises(ValueError, match="3 clusters"):
        cluster_lookup(w)


def test_query_clusters_recover_planted_groups():
    """Pages predict queries of one group (plus one stray query of another group now and
    then): the clusters are the groups, and a query never predicted gets -1."""
    rng = np.random.default_rng(3)
    G, per, L, k = 6, 10, 61, 5  # query 60 is never predicted
    group = np.repeat(np.arange(G), per)
    ids, sc = [], []
    for _ in range(600):
        g = int(rng.integers(G))
        q = rng.choice(np.flatnonzero(group == g), k, replace=False)
        if rng.random() < 0.2:
            q[-1] = rng.choice(np.flatnonzero(group != g))
        ids.append(q)
        sc.append(np.sort(rng.random(k))[::-1])
    cl = query_clusters(np.array(ids), np.array(sc), L, n_clusters=G, seed=0)
    assert cl.dtype == np.float32 and cl[60] == -1
    # each group lands in one cluster and no two groups share one
    first = [int(cl[g * per]) for g in range(G)]
    assert len(set(first)) == G
    for g in range(G):
        assert (cl[g * per : (g + 1) * per] == first[g]).all()
    again = query_clusters(np.array(ids), np.array(sc), L, n_clusters=G, seed=0)
    np.testing.assert_array_equal(cl, again)
    with pytest.raises(ValueError, match="n_clusters"):
        query_clusters(np.array(ids), np.array(sc), L, n_clusters=0)


def test_query_clusters_join_what_sessions_view_together():
    """Four interests, each served by two kinds of page whose titles predict disjoint queries:
    the titles alone cannot tell which kinds belong together, the sessions (each views pages
    of one interest's two kinds) can, and with them each interest is one cluster."""
    rng = np.random.default_rng(5)
    I, per, k = 4, 8, 4
    kinds = 2 * I
    L = kinds * per
    ids, sc, page_kind = [], [], []
    for p in range(400):
        g = p % kinds
        ids.append(rng.choice(np.arange(g * per, (g + 1) * per), k, replace=False))
        sc.append(np.sort(rng.random(k))[::-1] + 0.1)
        page_kind.append(g)
    page_kind = np.array(page_kind)
    rows, cols = [], []
    for s in range(600):  # a session: 4 views of pages of its interest's two kinds
        i = s % I
        pages = rng.choice(np.flatnonzero(page_kind // 2 == i), 4, replace=False)
        rows += [s] * 4
        cols += pages.tolist()
    groups = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(600, 400))
    ids, sc = np.array(ids), np.array(sc)
    interest = np.arange(L) // (2 * per)

    def recovered(cl):
        return len(set(cl.tolist())) == I and all(
            len(set(cl[interest == i].tolist())) == 1 for i in range(I)
        )

    assert recovered(query_clusters(ids, sc, L, n_clusters=I, seed=0, groups=groups))
    assert not recovered(query_clusters(ids, sc, L, n_clusters=I, seed=0))
    with pytest.raises(ValueError, match="page columns"):
        query_clusters(ids, sc, L, n_clusters=I, groups=groups[:, :10])


@pytest.mark.parametrize(
    ("succ", "succ_p", "match"),
    [
        ([[1.0], [4.0]], [[0.5], [0.5]], "outside"),
        ([[1.0], [0.0]], [[0.5], [1.5]], "probabilities"),
        ([[1.0], [0.5]], [[0.5], [0.5]], "cluster ids"),
        ([[1.0, 0.0]], [[0.5, 0.5]], "shapes"),
        ([[1.0], [0.0]], None, "together"),
    ],
)
def test_a_broken_successor_kernel_is_refused(succ, succ_p, match):
    """A policy's successor kernel that cannot be a distribution over its clusters is refused
    with what is wrong, not served."""
    w = {"query_cluster": np.array([0, 1, 1, 0], np.float32), "cluster_succ": np.array(succ)}
    if succ_p is not None:
        w["cluster_succ_p"] = np.array(succ_p, np.float32)
    with pytest.raises(ValueError, match=match):
        cluster_lookup(w)
