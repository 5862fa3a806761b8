"""The intent features: the batched filter equals its definition written as a plain loop over
one window, padding never leaks into them, and co-occurrence clusters recover planted groups."""

import numpy as np
import pytest

from personalization.features import (
    INTENT_KAPPA,
    INTENT_KEEP,
    INTENT_KEEP_BLOCK,
    F,
    build_batch,
    cluster_lookup,
    pad_states,
)
from personalization.query_clusters import auto_clusters, query_clusters


def _loop_intent(cl, ids, sc, mask, starts, cand):
    """Definition: belief over clusters, uniform at first; per state (oldest first) mix toward
    uniform (keep INTENT_KEEP, INTENT_KEEP_BLOCK at a block start) unless it is the first, then
    multiply by 1 + kappa * the state's score share per cluster; mass of the cand's cluster."""
    n = int(cl.max()) + 1
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
            belief = keep * belief + (1 - keep) / n
        belief = belief * (1 + INTENT_KAPPA * share)
        belief /= belief.sum()
        first = False
    c = cl[cand]
    return (belief[c], share[c]) if c >= 0 else (0.0, 0.0)


def test_intent_features_match_their_definition():
    rng = np.random.default_rng(0)
    L, K, k, D = 30, 5, 4, 3
    cl = rng.integers(0, 4, L).astype(np.float32)
    cl[7] = -1  # a query never clustered
    lookup = cluster_lookup({"query_cluster": cl})
    assert lookup is not None
    assert lookup.shape == (L + 1,) and lookup[-1] == -1
    seqs = []
    for n in (5, 3, 1):
        ids = rng.choice(L, (n, k), replace=False)
        ids[0, -1] = -1
        ids[-1, 0] = 7
        ts = 1.7e9 + np.array([0, 4000, 4040, 4080, 4120][:n], float)  # a block starts at 1
        seqs.append((rng.random((n, D)).astype(np.float32), ids, rng.random((n, k)), ts))
    z, ids, sc, mask, ts = pad_states(seqs, K)
    b = build_batch(z, ids, sc, mask, np.zeros(L, np.float32), ts, clusters=lookup)
    cols = [F["intent_mass"], F["page_cluster_share"]]
    for r in range(len(seqs)):
        gaps = np.r_[np.inf, np.diff(ts[r])]
        starts = mask[r] & (gaps >= 1800)
        for c in np.flatnonzero(b.cand_mask[r]):
            want = _loop_intent(lookup[:-1], ids[r], sc[r], mask[r], starts, b.cand_ids[r, c])
            assert b.feats[r, c, cols] == pytest.approx(want, abs=1e-5)
        assert not b.feats[r, ~b.cand_mask[r]].any()
    assert (b.feats[b.cand_ids == 7][:, cols] == 0).all()
    # without clusters the columns stay 0, the other features unchanged
    b0 = build_batch(z, ids, sc, mask, np.zeros(L, np.float32), ts)
    assert not b0.feats[..., cols].any()
    other = [i for i in range(b.feats.shape[-1]) if i not in cols]
    np.testing.assert_array_equal(b0.feats[..., other], b.feats[..., other])


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
    assert auto_clusters(2000) == 36 and auto_clusters(10) == 8 and auto_clusters(10**6) == 256
