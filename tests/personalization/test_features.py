"""The candidate features: the compiled batch computation equals each feature's definition
written as a plain loop over one window, padding never leaks into them, and the query vectors
come out unit-length."""

import numpy as np
import pytest

from personalization.features import (
    FEATURE_NAMES,
    RECENCY_GAMMA,
    Clusters,
    F,
    build_batch,
    gru_input_dim,
    pad_states,
    query_lookup,
    sim_table_from_rows,
)


def _loop_scores(ids, sc, mask, in_block, log_pop, cand):
    """Definition of the score features of one candidate of one window (K states, current
    last): its score where a state's top-k holds it (else 0), averaged with each weighting."""
    K = ids.shape[0]
    s = np.array([sc[t][list(ids[t]).index(cand)] if cand in ids[t] else 0.0 for t in range(K)])
    p = np.array([1.0 if cand in ids[t] else 0.0 for t in range(K)])
    real = np.flatnonzero(mask)
    rec = np.array([RECENCY_GAMMA ** (K - 1 - t) for t in real])
    blk = np.flatnonzero(in_block)
    cur = list(ids[K - 1])
    return {
        "score_current": s[K - 1],
        "in_current": p[K - 1],
        "score_previous": s[K - 2] if K > 1 and mask[K - 2] else 0.0,
        "mean_score_window": s[real].mean(),
        "frac_states": p[real].mean(),
        "recency_score": (rec * s[real]).sum() / rec.sum(),
        "mean_score_block": s[blk].mean(),
        "frac_block": p[blk].mean(),
        "inv_rank_current": 1.0 / (1 + cur.index(cand)) if cand in cur else 0.0,
        "log_popularity": log_pop[cand],
        "window_fill": len(real) / K,
    }


def test_score_features_match_their_definition():
    rng = np.random.default_rng(2)
    L, K, k, D = 25, 6, 4, 3
    log_pop = rng.random(L).astype(np.float32)
    seqs = []
    for n in (6, 4, 1):  # full window, partial window, current page only
        ids = np.stack([rng.choice(L, k, replace=False) for _ in range(n)])
        ids[0, -1] = -1  # a state with fewer queries
        ts = 1.7e9 + np.array([0, 40, 4000, 4040, 4080, 4120][:n], float)  # a block starts at 2
        seqs.append((rng.random((n, D)).astype(np.float32), ids, rng.random((n, k)), ts))
    z, ids, sc, mask, ts = pad_states(seqs, K)
    b = build_batch(z, ids, sc, mask, log_pop, ts)
    names = FEATURE_NAMES[: F["window_fill"] + 1]
    for r, seq in enumerate(seqs):
        n = len(seq[0])
        want_cands = np.unique(seq[1][seq[1] >= 0])
        np.testing.assert_array_equal(b.cand_ids[r, b.cand_mask[r]], want_cands)
        starts = np.r_[True, np.diff(seq[3]) >= 1800]
        in_block = np.zeros(K, bool)
        in_block[K - n + np.flatnonzero(starts).max() :] = True  # since the last block start
        for c in np.flatnonzero(b.cand_mask[r]):
            want = _loop_scores(ids[r], sc[r], mask[r], in_block, log_pop, b.cand_ids[r, c])
            got = {name: b.feats[r, c, F[name]] for name in names}
            assert got == pytest.approx(want, abs=1e-5)
        assert not b.feats[r, ~b.cand_mask[r]].any()
        # the GRU's inputs: unit page features of the real states, the block-start flag, the
        # log of the minutes to the next state (0 on the current page), then the cluster
        # evidence (one zero column without clusters)
        assert b.z.shape == (len(seqs), K, gru_input_dim(D, 0))
        zr = b.z[r, K - n :]
        np.testing.assert_allclose(np.linalg.norm(zr[:, :D], axis=1), 1.0, rtol=1e-5)
        assert not b.z[r, : K - n].any()
        np.testing.assert_array_equal(zr[:, D], starts)
        gaps = np.r_[np.diff(seq[3]), 0.0]
        np.testing.assert_allclose(zr[:, D + 1], np.log1p(gaps / 60.0), rtol=1e-5)
        assert not zr[:, D + 2 :].any()


def test_the_gru_reads_each_pages_share_of_evidence_per_query_cluster():
    """With clusters, each real state's last columns of z are its predicted queries' score
    shares per cluster (the intent filter's evidence): what lets the GRU follow a user from
    one interest to the next."""
    rng = np.random.default_rng(5)
    L, K, k, D, n_cl = 30, 5, 4, 3, 4
    qc = rng.integers(-1, n_cl, L).astype(np.float32)  # some queries in no cluster
    cl = Clusters(query_lookup(qc), np.ones(n_cl))
    seqs = []
    for n in (5, 2):
        ids = np.stack([rng.choice(L, k, replace=False) for _ in range(n)])
        ts = 1.7e9 + 60.0 * np.arange(n)
        seqs.append((rng.random((n, D)).astype(np.float32), ids, rng.random((n, k)), ts))
    z, ids, sc, mask, ts = pad_states(seqs, K)
    b = build_batch(z, ids, sc, mask, np.zeros(L, np.float32), ts, clusters=cl)
    assert b.z.shape == (2, K, gru_input_dim(D, n_cl))
    for r in range(2):
        for t in np.flatnonzero(mask[r]):
            g = qc[ids[r, t]].astype(int)
            want = np.bincount(g[g >= 0], weights=sc[r, t][g >= 0], minlength=n_cl)
            want = want / max(want.sum(), 1e-9)
            np.testing.assert_allclose(b.z[r, t, D + 2 :], want, rtol=1e-5, atol=1e-6)


def _loop_sims(T, norm, ids, mask, in_block, cand):
    """Definition: cosine of the candidate's vector with each page's normalised summed vector,
    averaged over the current page / the block / the window, then standardised."""
    K = ids.shape[0]
    pages = []
    for t in range(K):
        v = sum((T[q] for q in ids[t] if q >= 0 and mask[t]), np.zeros(T.shape[1], np.float32))
        n = np.linalg.norm(v)
        pages.append(v / n if n > 1e-6 else v)
    cos = [float(T[cand] @ p) for p in pages]
    cur = cos[K - 1]
    blk = np.mean([c for c, b in zip(cos, in_block, strict=True) if b])
    win = np.mean([c for c, m in zip(cos, mask, strict=True) if m])
    return (np.array([cur, blk, win]) - norm[0]) / norm[1]


def test_sim_features_match_their_definition():
    rng = np.random.default_rng(0)
    L, K, k, D = 40, 5, 4, 6
    T = sim_table_from_rows(rng.standard_normal((L, 12)).astype(np.float32) + 1.0, dim=8)
    assert T.shape == (L + 1, 8)
    assert np.allclose(np.linalg.norm(T[:L], axis=1), 1.0, atol=1e-5) and not T[L].any()
    norm = np.array([0.3, 0.2], np.float32)
    seqs = []
    for n in (5, 3, 1):  # full window, partial window, current page only
        ids = rng.choice(L, (n, k), replace=False) if n * k <= L else None
        ids[0, -1] = -1  # a state with fewer queries
        ts = 1.7e9 + np.array([0, 4000, 4040, 4080, 4120][:n], float)  # a block starts at 1
        seqs.append(
            (
                rng.random((n, D)).astype(np.float32),
                ids,
                -np.sort(-rng.random((n, k)).astype(np.float32), 1),
                ts,
            )
        )
    z, ids, sc, mask, ts = pad_states(seqs, K)
    b = build_batch(z, ids, sc, mask, np.zeros(L, np.float32), ts, T, norm)
    cols = [F["sim_current"], F["sim_block"], F["sim_window"]]
    for r in range(len(seqs)):
        in_block = np.zeros(K, bool)
        n = len(seqs[r][0])
        gaps = np.diff(seqs[r][3])
        first_in_block = (
            K - n + (np.flatnonzero(gaps >= 1800).max() + 1 if (gaps >= 1800).any() else 0)
        )
        in_block[first_in_block:] = True
        for c in np.flatnonzero(b.cand_mask[r]):
            want = _loop_sims(T, norm, ids[r], mask[r], in_block, b.cand_ids[r, c])
            assert b.feats[r, c, cols] == pytest.approx(want, abs=1e-4)
        assert not b.feats[r, ~b.cand_mask[r]].any()


def test_sim_features_are_zero_without_a_table():
    rng = np.random.default_rng(1)
    ids = rng.choice(20, (3, 4), replace=False)
    z, I, S, m, ts = pad_states(
        [
            (
                rng.random((3, 5)).astype(np.float32),
                ids,
                np.ones((3, 4), np.float32),
                1.7e9 + 40.0 * np.arange(3),
            )
        ],
        4,
    )
    b = build_batch(z, I, S, m, np.zeros(20, np.float32), ts)
    assert not b.feats[..., [F["sim_current"], F["sim_block"], F["sim_window"]]].any()
    # a table without its cosine statistics is refused by name (it was a TypeError on None)
    T = sim_table_from_rows(rng.standard_normal((20, 12)).astype(np.float32) + 1.0, dim=8)
    with pytest.raises(ValueError, match="sim_table needs sim_norm"):
        build_batch(z, I, S, m, np.zeros(20, np.float32), ts, T)


def test_shown_recent_counts_earlier_showings_by_their_distance():
    """shown_recent: a candidate shown at the window's earlier visits scores decay^(visits back
    - 1) per showing; the current visit's slot, padding states and other queries count 0."""
    from personalization.features import DEFAULT_FIT, FeatureFit, pad_shown

    rng = np.random.default_rng(5)
    L, K, k, D = 12, 5, 3, 2
    seqs, shown = [], []
    for n in (5, 3):
        ids = np.stack([rng.choice(L, k, replace=False) for _ in range(n)])
        seqs.append((rng.random((n, D)).astype(np.float32), ids, rng.random((n, k)), np.arange(n)))
        shown.append(ids[:, 0].copy())  # each visit showed its page's first query
    shown[0][1] = shown[0][3]  # one query shown twice (3 and 1 visits back)
    z, ids, sc, mask, ts = pad_states(seqs, K)
    sh = pad_shown(shown, K)
    assert (sh[1, :2] == -1).all()
    decay = 0.4
    fit = FeatureFit(shown_decay=decay)
    cl = Clusters(query_lookup(np.zeros(L, np.float32)), np.ones(1), fit)
    b = build_batch(z, ids, sc, mask, np.zeros(L, np.float32), ts, clusters=cl, shown=sh)
    for r, s in enumerate(shown):
        n = len(s)
        for c in np.flatnonzero(b.cand_mask[r]):
            q = b.cand_ids[r, c]
            want = sum(decay ** (n - 2 - t) for t in range(n - 1) if s[t] == q)
            assert b.feats[r, c, F["shown_recent"]] == pytest.approx(want, abs=1e-6)
    assert b.feats[0, :, F["shown_recent"]].max() == pytest.approx(1.0 + decay**2, abs=1e-6)
    # nothing shown: the column is 0, and the other columns do not move
    b0 = build_batch(z, ids, sc, mask, np.zeros(L, np.float32), ts, clusters=cl)
    assert not b0.feats[..., F["shown_recent"]].any()
    other = [i for i in range(len(FEATURE_NAMES)) if i != F["shown_recent"]]
    np.testing.assert_array_equal(b0.feats[..., other], b.feats[..., other])
    # the manifest carries the decay; a fit recorded before it existed reads the default
    assert FeatureFit.from_json(fit.to_json()) == fit
    with pytest.raises(ValueError, match=r"feature_fit\.shown_decay"):
        FeatureFit.from_json({**fit.to_json(), "shown_decay": 1.5})
    older = {f: x for f, x in fit.to_json().items() if f != "shown_decay"}
    assert FeatureFit.from_json(older).shown_decay == DEFAULT_FIT.shown_decay
