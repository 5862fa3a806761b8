"""Astec building blocks: balanced clustering, sparse top-k, shortlists exclude positives."""

import numpy as np
import pytest
import scipy.sparse as sp

from engine.astec.clustering import balanced_clusters, meta_labels
from engine.astec.shortlist import add_random_negatives, hard_negatives, recall_at
from engine.astec.sparse import label_scores, normalize_rows, topk_dense_from_csr, topk_rows


def hnsw_config():
    """Indexes built as HNSW graphs at any size, serving graphs of degree 16, one thread."""
    from engine.astec.config import AstecConfig

    return AstecConfig.from_dict(
        {
            "shortlist": {"exact_max_points": 0},
            "search": {"graph_m": 16},
            "training": {"threads": 1},
        }
    )


def test_balanced_clusters_sizes_differ_by_at_most_one_level():
    rng = np.random.default_rng(0)
    C = sp.csr_matrix(rng.random((1000, 50)).astype(np.float32))
    a = balanced_clusters(C, 64, seed=0, progress=False)
    sizes = np.bincount(a, minlength=64)
    assert sizes.min() >= 15 and sizes.max() <= 16 and a.max() == 63
    assert balanced_clusters(C[:3], 64, progress=False).max() <= 2  # L < clusters: no crash


def test_clusters_group_similar_labels():
    base = np.eye(4, dtype=np.float32)
    C = sp.csr_matrix(np.repeat(base, 8, axis=0) + 0.01)  # 4 groups of 8 identical labels
    a = balanced_clusters(C, 4, seed=1, progress=False)
    for g in range(4):
        assert len(set(a[g * 8 : (g + 1) * 8])) == 1


def test_meta_labels():
    Y = sp.csr_matrix(np.array([[1, 1, 0], [0, 0, 1]], np.float32))
    M = meta_labels(Y, np.array([0, 0, 1]), 2).toarray()
    assert M.tolist() == [[1, 0], [0, 1]]


def test_topk_rows_and_dense():
    M = sp.csr_matrix(np.array([[0.1, 0.5, 0.3, 0], [0, 0, 0, 0], [0.2, 0, 0, 0.9]], np.float32))
    T = topk_rows(M, 2).toarray()
    assert (
        T.tolist()
        == np.array([[0, 0.5, 0.3, 0], [0, 0, 0, 0], [0.2, 0, 0, 0.9]], np.float32).tolist()
    )
    ids, _sc = topk_dense_from_csr(M, 3)
    assert ids.tolist() == [[1, 2, 0], [-1, -1, -1], [3, 0, -1]]


def test_training_shortlist_excludes_positives():
    S = sp.csr_matrix(np.array([[0.9, 0.8, 0.7, 0.1, 0.0, 0.0]], np.float32))
    Y = sp.csr_matrix(np.array([[1, 0, 0, 0, 0, 0]], np.float32))
    H = hard_negatives(S, Y, 2)
    assert H.toarray().tolist() == [[0, 1, 1, 0, 0, 0]]
    N = add_random_negatives(H, Y, 3, seed=0).toarray()
    assert N[0, 0] == 0 and N.sum() >= 2 and set(np.unique(N)) <= {0, 1}


def test_recall_at_leaves_scores_untouched():
    # every row has fewer entries than `size`: recall must not overwrite the caller's scores with 1s
    S = sp.csr_matrix(np.array([[0.9, 0.2, 0.0], [0.0, 0.4, 0.7]], np.float32))
    Y = sp.csr_matrix(np.array([[1, 0, 0], [1, 0, 1]], np.float32))
    before = S.toarray().copy()
    assert abs(recall_at(S, Y, 5) - 100.0 * 2 / 3) < 1e-4
    assert np.array_equal(S.toarray(), before)
    assert abs(recall_at(S, Y, 1) - 100.0 * 2 / 3) < 1e-4


def test_sparse_ranker_learns_word_cues_from_shortlisted_negatives():
    """Each label's linear model separates its positives from the points that shortlisted it;
    weights under the threshold are dropped; a label nobody shortlisted scores -1 (a sure
    negative, not 0, which would outscore the labels it learnt to reject)."""
    from engine.astec.sparse_ranker import SparseRanker, ranker_features

    rng = np.random.default_rng(0)
    n, F, L = 400, 30, 4
    words = rng.integers(0, F, size=(n, 3))
    X = sp.csr_matrix(
        (np.ones(words.size, np.float32), (np.repeat(np.arange(n), 3), words.ravel())), shape=(n, F)
    )
    # label l is present exactly when word l occurs; label 3 has no point and no negatives
    Y = sp.csr_matrix(
        np.stack([(words == l).any(1) for l in range(3)] + [np.zeros(n, bool)], 1).astype(
            np.float32
        )
    )
    neg = sp.csr_matrix(np.tile([1, 1, 1, 0], (n, 1)).astype(np.float32))
    Xr = ranker_features(X)
    assert Xr.shape == (n, F + 1) and np.allclose(Xr[:, F].toarray(), 1.0)
    r = SparseRanker.fit(Xr, Y, neg, cost=1.0, threshold=0.1)
    C = sp.csr_matrix(np.ones((n, L), np.float32))
    u = r.scores(Xr, C).reshape(n, L)
    Yd = Y.toarray() > 0
    for lab in range(3):
        assert u[Yd[:, lab], lab].min() > u[~Yd[:, lab], lab].max(), lab
    assert np.all(u[:, 3] == -1.0) and r.W[3].nnz == 1  # never seen: bias -1 only
    assert np.all(np.abs(r.W.data[r.W.indices != F]) >= 0.1)
    with pytest.raises(ValueError, match="columns"):
        r.scores(Xr[:, :F], C)
    with pytest.raises(ValueError, match="feature rows"):
        SparseRanker.fit(Xr[:-1], Y, neg)


def _topk_reference(M: sp.csr_matrix, k: int) -> np.ndarray:
    """Row by row in Python: the k largest entries, ties to the lower column."""
    out = np.zeros(M.shape, np.float32)
    D = M.toarray()
    for r in range(M.shape[0]):
        cols = M.indices[M.indptr[r] : M.indptr[r + 1]]
        best = sorted(cols, key=lambda c: (-D[r, c], c))[:k]
        out[r, best] = D[r, best]
    return out


def test_topk_rows_matches_a_row_by_row_reference_with_ties_and_threads():
    # values on a coarse grid: many ties, which must go to the lower column
    M = sp.random(3000, 400, density=0.05, random_state=4, format="csr", dtype=np.float32)
    M.data = np.round(M.data * 4).astype(np.float32) / 4 + 0.25
    for k in (1, 7, 30):
        ref = _topk_reference(M, k)
        for threads in (1, 2, 3):
            T = topk_rows(M, k, threads)
            assert T.has_sorted_indices
            assert np.array_equal(T.toarray(), ref)


def _scores_by_sparse_algebra(pids, pw, Y, cids, csims, owner, prior, prior_score, w, L):
    """The shortlist scores written as scipy algebra (how ShortlistIndex.scores computed them)."""
    n, k = pids.shape
    S = sp.csr_matrix((pw.ravel(), pids.ravel(), np.arange(0, n * k + 1, k)), shape=(n, Y.shape[0]))
    denom = np.asarray(S.sum(axis=1)).ravel()
    denom[denom == 0] = 1.0
    K = (1.0 - w) * sp.csr_matrix(sp.diags((1.0 / denom).astype(np.float32)) @ (S @ Y))
    best = np.full((n, L), -np.inf, np.float32)
    for r in range(n):
        for j in range(cids.shape[1]):
            if cids[r, j] >= 0:
                lab = owner[cids[r, j]]
                best[r, lab] = max(best[r, lab], csims[r, j], 0.0)
    rr, cc = np.nonzero(best > -np.inf)
    M = w * sp.csr_matrix((best[rr, cc], (rr, cc)), shape=(n, L), dtype=np.float32)
    m = prior.size
    P = sp.csr_matrix(
        (np.tile(prior_score, n), np.tile(prior, n), np.arange(n + 1) * m), shape=(n, L)
    )
    out = sp.csr_matrix(K + M + P, dtype=np.float32)
    out.eliminate_zeros()
    out.sort_indices()
    return out


def test_label_scores_equal_the_sparse_algebra_bit_for_bit():
    # the shortlist's scores: neighbours' label shares + best centre per label + prior, the same
    # floats as the sparse-matrix formula, whatever the row split
    rng = np.random.default_rng(5)
    n, kp, kc, N, count, L = 1500, 9, 12, 400, 300, 90
    Y = sp.random(N, L, density=0.03, format="csr", random_state=1, dtype=np.float32)
    Y.data[:] = 1.0
    pids = rng.integers(0, N, (n, kp))
    pw = np.clip(rng.normal(0.3, 0.4, (n, kp)), 0, None).astype(np.float32)
    pw[::11] = 0.0  # rows whose neighbours all weigh 0
    cids = rng.integers(0, count, (n, kc))
    cids[::7, -1] = -1  # a search that found fewer centres
    csims = rng.normal(0, 0.5, (n, kc)).astype(np.float32)
    owner = rng.integers(0, L, count)
    prior = np.array([3, 40, 7])
    prior_score = np.array([3e-6, 2e-6, 1e-6], np.float32)
    for w in (0.5, 0.3, 0.0, 1.0):
        ref = _scores_by_sparse_algebra(pids, pw, Y, cids, csims, owner, prior, prior_score, w, L)
        for threads in (1, 2):
            M = label_scores(pids, pw, Y, cids, csims, owner, prior, prior_score, w, L, threads)
            assert M.has_sorted_indices and M.shape == (n, L)
            assert np.array_equal(M.indptr, ref.indptr)
            assert np.array_equal(M.indices, ref.indices)
            assert np.array_equal(M.data, ref.data)
    # no neighbours or no centres searched: the other part alone
    none = np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float32)
    M = label_scores(*none, Y, cids, csims, owner, prior[:0], prior_score[:0], 0.5, L, 2)
    ref = _scores_by_sparse_algebra(
        np.zeros((n, 1), np.int64), np.zeros((n, 1), np.float32), Y, cids, csims, owner,
        prior[:0], prior_score[:0], 0.5, L,
    )  # fmt: skip
    assert np.array_equal(M.toarray(), ref.toarray())
    M = label_scores(pids, pw, Y, *none, owner, prior, prior_score, 0.5, L, 2)
    assert np.array_equal(M.toarray(), _scores_by_sparse_algebra(
        pids, pw, Y, np.full((n, 1), -1), np.zeros((n, 1), np.float32), owner, prior,
        prior_score, 0.5, L,
    ).toarray())  # fmt: skip


def test_hard_negatives_are_the_best_non_positives_whatever_the_threads():
    n, L = 3000, 200
    S = sp.random(n, L, density=0.2, format="csr", random_state=2, dtype=np.float32)
    S.data = np.round(S.data * 20).astype(np.float32)  # ties (broken by the lower column) and 0s
    Y = sp.random(n, L, density=0.05, format="csr", random_state=3, dtype=np.float32)
    Y.data[:] = 1.0
    for size in (5, 30, 60):
        ref = np.zeros((n, L), np.float32)
        for r in range(n):
            row = S[r].toarray().ravel()
            row[Y[r].toarray().ravel() != 0] = 0
            cols = np.flatnonzero(row)
            top = cols[np.argsort(-row[cols], kind="stable")[:size]]
            ref[r, top] = 1.0
        for threads in (1, 2):
            H = hard_negatives(S, Y, size, threads)
            assert H.has_sorted_indices
            assert np.array_equal(H.toarray(), ref)
            assert (H.multiply(Y)).nnz == 0


def test_exact_search_orders_by_similarity_then_lower_id_with_duplicates():
    # duplicated vectors (training texts that repeat) tie exactly: the lower id must come first,
    # as in the exported predictor, whether the tie is inside the top k or at its boundary (up
    # to 32 tied past k: the search's margin)
    from engine.astec.ann import AnnIndex

    rng = np.random.default_rng(6)
    base = rng.standard_normal((60, 16)).astype(np.float32)
    V = base[rng.integers(0, 60, 400)]  # ~7 copies of each vector, ids shuffled
    Q = base[:30] + 0.3 * rng.standard_normal((30, 16))
    index = AnnIndex.build(V, exact_max=10_000)
    Vn = V / np.linalg.norm(V, axis=1, keepdims=True)
    Qn = Q / np.maximum(np.linalg.norm(Q, axis=1, keepdims=True), 1e-12)
    for k in (1, 5, 9, 40):
        ids, sims = index.query(Q.astype(np.float32), k, block=7)
        for r in range(Q.shape[0]):
            s = index.vectors @ Qn[r].astype(np.float32)
            ref = sorted(range(len(V)), key=lambda c: (-s[c], c))[:k]
            assert ids[r].tolist() == ref, (k, r)
            assert np.allclose(sims[r], Vn[ref] @ Qn[r], atol=1e-5)


def test_exact_top_k_is_exact_when_its_sampled_threshold_misleads_and_across_blocks(monkeypatch):
    # the kernel keeps the columns above a threshold taken from a strided sample of the row;
    # a row whose largest values sit exactly on the sampled columns leaves fewer than k above
    # it, and the answer must still be the row's true top k (ties: lower column first)
    import engine.astec.ann as ann

    rng = np.random.default_rng(11)
    m, k = 5000, 50
    S = rng.random((6, m)).astype(np.float32)
    S[:3, :: max(1, m // 1024)] += 10.0  # the sampled columns hold the row's largest values
    S[3:, 100:400] = 0.5  # and long runs of ties
    S[3:, 4000:] = 0.5
    ids = np.empty((6, k), np.int64)
    vals = np.empty((6, k), np.float32)
    ann._top_rows(S, k, ids, vals, 0, 6)
    for r in range(6):
        ref = sorted(range(m), key=lambda c: (-S[r, c], c))[:k]
        assert ids[r].tolist() == ref
        assert np.array_equal(vals[r], S[r, ref])
    # many blocks, rows split over threads: the same answer as one block (the matmul of
    # another shape may round the similarities differently in the last bit)
    V = rng.standard_normal((500, 8)).astype(np.float32)
    Q = rng.standard_normal((70, 8)).astype(np.float32)
    index = ann.AnnIndex.build(V, exact_max=10_000)
    whole = index.query(Q, 30, num_threads=2)
    monkeypatch.setattr(ann, "_BLOCK_FLOATS_F32", 0)  # this float32 index's cap
    blocked = index.query(Q, 30, num_threads=2, block=8)
    assert np.array_equal(whole[0], blocked[0])
    assert np.allclose(whole[1], blocked[1], atol=1e-6)


def test_bfloat16_top_k_by_counting_is_the_float_top_k():
    # the bfloat16 search orders its candidates by counting their 16-bit keys: the answer must
    # be the float top k (value, then lower column) with bfloat16's many ties, negative values,
    # -0 equal to +0, rows whose sampled bar misleads, and k near the row's length
    import torch

    import engine.astec.ann as ann

    rng = np.random.default_rng(12)
    m = 3000
    S = rng.normal(0, 0.3, (9, m)).astype(np.float32)
    S[:3, :: max(1, m // 1024)] += 5.0  # the sampled columns hold the row's largest values
    S[3, 200:900] = 0.5  # long runs of ties
    S[4] = -np.abs(S[4])  # only negatives
    S[5, ::2] = 0.0
    S[5, 1::2] = -0.0
    H16 = torch.from_numpy(S).to(torch.bfloat16)
    F = H16.float().numpy()  # the values the bits stand for
    H = H16.view(torch.int16).numpy()
    for k in (1, 40, 700, m):
        ids = np.empty((9, k), np.int64)
        vals = np.empty((9, k), np.float32)
        ref_ids, ref_vals = ids.copy(), vals.copy()
        ann._top_rows_bf16(H, k, ids, vals, 0, 9)
        ann._top_rows(F, k, ref_ids, ref_vals, 0, 9)
        assert np.array_equal(ids, ref_ids), k
        assert np.array_equal(vals, ref_vals), k
    assert ids[5, :3].tolist() == [0, 1, 2]  # -0 and +0 tie: lower column first


def test_bfloat16_search_finds_nearly_the_float32_neighbours_and_serving_stays_float32(
    monkeypatch,
):
    # training-time bulk searches may multiply in bfloat16 (2x faster where the CPU does it
    # natively): similarities within bfloat16's rounding, the same neighbours but for
    # near-ties at the k-th boundary; the indexes prediction searches never do
    import engine.astec.ann as ann
    from engine.astec import AstecConfig
    from engine.astec.config import ConfigError
    from engine.astec.model import _build_index

    rng = np.random.default_rng(3)
    V = rng.standard_normal((3000, 64)).astype(np.float32)
    Q = rng.standard_normal((200, 64)).astype(np.float32)
    exact = ann.AnnIndex.build(V, exact_max=10_000)
    low = ann.AnnIndex.build(V, exact_max=10_000, precision="bfloat16")
    assert (exact.precision, low.precision) == ("float32", "bfloat16")
    for k in (10, 300):
        ids, sims = exact.query(Q, k, num_threads=2)
        lid, lsims = low.query(Q, k, num_threads=2, block=64)
        assert np.abs(np.sort(lsims, axis=1) - np.sort(sims, axis=1)).max() < 0.02
        same = np.mean([np.intersect1d(a, b).size / k for a, b in zip(ids, lid, strict=True)])
        assert same > 0.95, (k, same)
        assert np.all(np.diff(lsims, axis=1) <= 0)  # best first
    # "auto" follows the CPU; a bad value is refused with its field's name
    import engine.astec.config as config

    monkeypatch.setattr(config, "native_bf16", lambda: False)
    assert config.resolve_precision("auto") == "float32"
    monkeypatch.setattr(config, "native_bf16", lambda: True)
    assert config.resolve_precision("auto") == "bfloat16"
    with pytest.raises(ConfigError, match=r"training\.precision"):
        AstecConfig.from_dict({"training": {"precision": "half"}})
    # training indexes take the setting, serving indexes stay float32 (the exported predictor's)
    Y = sp.csr_matrix(
        (np.ones(3000, np.float32), (np.arange(3000), rng.integers(0, 50, 3000))), shape=(3000, 50)
    )
    cfg = AstecConfig()  # 3,000 points: both indexes exact
    cfg.training.precision = "bfloat16"
    X = sp.csr_matrix(V)
    train_index = _build_index(None, X, Y, cfg, 0, V)
    serve_index = _build_index(None, X, Y, cfg, 0, V, serving=True)
    assert train_index.centres.precision == "bfloat16"
    assert serve_index.centres.precision == serve_index.points.precision == "float32"
    assert serve_index.centres.as_exact().precision == "float32"


def test_serving_index_shares_the_training_graph_only_when_it_is_the_same_graph():
    # the search's choice runs on serving graphs over the fit points: when the training graph
    # has the serving degree (and efC) it is that graph, searched at the serving ef
    from engine.astec.model import _build_index

    rng = np.random.default_rng(7)
    V = rng.standard_normal((300, 8)).astype(np.float32)
    Y = sp.csr_matrix((np.ones(300, np.float32), (np.arange(300), np.arange(300) % 20)))
    for m, shared in ((16, True), (24, False)):
        cfg = hnsw_config()
        cfg.shortlist.hnsw_x = (m, 50, 60)
        train = _build_index(None, None, Y, cfg, 0, V)
        serve = _build_index(None, None, Y, cfg, 0, V, serving=True, same_points=train)
        assert train.points.kind == serve.points.kind == "hnsw"
        assert (serve.points.hnsw is train.points.hnsw) == shared, m
        assert serve.points.hnsw.M == 16 and serve.points.ef_search == 1
        assert train.points.ef_search == 60
        ids, _ = serve.points.query(V[:20], 5, 1)
        assert (ids[:, 0] == np.arange(20)).all()  # each point finds itself


def test_final_index_grows_the_fit_graph_by_the_validation_points():
    # the serving indexes over every training point, fit points first: a fit graph of the serving
    # degree takes the validation points as ids len(fit)... instead of a build over all points
    import torch

    from engine.astec.model import _build_index, _final_index
    from engine.astec.network import Encoder, dense_bag

    n, vocab = 400, 50
    X = sp.random(n, vocab, density=0.3, format="csr", random_state=8, dtype=np.float32)
    Y = sp.csr_matrix((np.ones(n, np.float32), (np.arange(n), np.arange(n) % 20)))
    torch.manual_seed(0)
    enc = Encoder(vocab, 16)
    valid = np.arange(5, n, 10)
    fit = np.setdiff1d(np.arange(n), valid)
    order = np.concatenate([fit, valid])
    for m, grown in ((16, True), (24, False)):
        cfg = hnsw_config()
        cfg.shortlist.hnsw_x = (m, 50, 60)
        fit_index = _build_index(enc, X[fit], Y[fit], cfg, 0)
        graph = fit_index.points.hnsw
        final = _final_index(enc, X, Y, fit, valid, cfg, 0, fit_index)
        assert final.points.count == n and (final.points.hnsw is graph) == grown, m
        assert final.points.hnsw.M == 16 and final.points.ef_search == 1
        assert (final.point_labels != Y[order]).nnz == 0
        ids, _ = final.points.query(dense_bag(enc, X[order]), 10, 1)
        assert (ids[:, 0] == np.arange(n)).mean() >= 0.98  # each point finds itself
        if grown:  # the fit index gave its graph away
            with pytest.raises(ValueError, match="no hnswlib graph"):
                fit_index.points.query(dense_bag(enc, X[:3]), 1, 1)


def test_final_index_keeps_the_fit_centre_graph_over_the_updated_centres():
    # the final label-centre graph is the search choice's graph over the fit points' centres
    # with each one-centre label's centre moved to its mean over every point, a head label's
    # k-means centres kept, and the labels seen only in the validation split inserted
    import torch

    from engine.astec.ann import AnnIndex
    from engine.astec.model import _build_index, _final_index
    from engine.astec.network import Encoder, dense_bag
    from engine.astec.shortlist import label_centres

    n, vocab = 600, 60
    X = sp.random(n, vocab, density=0.3, format="csr", random_state=9, dtype=np.float32)
    labels = np.arange(n) % 50
    labels[:80] = 0  # a head label
    valid = np.arange(3, n, 7)
    labels[valid[:5]] = 50 + np.arange(5)  # five labels only in the validation split
    Y = sp.csr_matrix((np.ones(n, np.float32), (np.arange(n), labels)), shape=(n, 55))
    fit = np.setdiff1d(np.arange(n), valid)
    order = np.concatenate([fit, valid])
    torch.manual_seed(0)
    enc = Encoder(vocab, 16)
    cfg = hnsw_config()
    cfg.shortlist.head_min_points, cfg.shortlist.head_centres = 60, 3
    fit_index = _build_index(enc, X[fit], Y[fit], cfg, 0)
    Vf = dense_bag(enc, X[fit])
    fit_centres = label_centres(Vf, Y[fit], 3, 60, 0)
    serving = _build_index(enc, X[fit], Y[fit], cfg, 0, Vf, serving=True, centres_owner=fit_centres)
    assert serving.centres.kind == "hnsw"
    final = _final_index(enc, X, Y, fit, valid, cfg, 0, fit_index, (serving, fit_centres[0]))
    owner = final.centre_owner
    assert final.centres.kind == "hnsw" and final.centres.count == owner.size
    assert final.centres.hnsw is not serving.centres.hnsw
    assert owner.tolist() == [*fit_centres[1].tolist(), 50, 51, 52, 53, 54]
    got = final.centres.vectors_of(np.arange(owner.size))
    V = dense_bag(enc, X[order])
    V /= np.linalg.norm(V, axis=1, keepdims=True)
    Yo = Y[order]
    for j in np.unique(owner, return_index=True)[1]:  # each label's first centre: its mean
        mean = V[Yo[:, owner[j]].nonzero()[0]].sum(0)
        assert np.allclose(got[j], mean / np.linalg.norm(mean), atol=1e-5), j
    head = np.flatnonzero(owner == 0)[1:]  # the head label's k-means centres
    assert head.size == 3 and np.allclose(got[head], fit_centres[0][head], atol=1e-6)

    def recall(graph, vectors):  # of 10-NN searches against the exact ones
        ids, _ = graph.query(vectors, 10, 1)
        want, _ = AnnIndex.build(vectors, exact_max=10**6).query(vectors, 10, 1)
        return np.mean([np.intersect1d(a, b).size / 10 for a, b in zip(ids, want, strict=True)])

    assert recall(final.centres, got) >= 0.95
    assert recall(serving.centres, fit_centres[0]) >= 0.95  # the fit graph is left as it was


def test_graph_with_new_vectors_keeps_its_links_and_finds_the_new_neighbours():
    # after Module IV the fit points' graph keeps Module II's links over the fine-tuned v: the
    # stored vectors are the new ones (what prediction's graph, grown from it, exports), the
    # searches rank by them, and the graph it came from is left as it was
    from engine.astec.ann import AnnIndex

    rng = np.random.default_rng(3)
    V = rng.standard_normal((2000, 24)).astype(np.float32)
    moved = V + 0.3 * rng.standard_normal(V.shape).astype(np.float32)  # v moved by ~0.3 |v|
    old = AnnIndex.build(V, 0, 16, 100, 50, 1, 0)
    new = old.with_vectors(moved, 1)
    exact_new = AnnIndex.build(moved, 10**9)
    ids = np.arange(2000)
    assert np.array_equal(new.vectors_of(ids), exact_new.vectors_of(ids))
    assert np.array_equal(old.vectors_of(ids), AnnIndex.build(V, 10**9).vectors_of(ids))
    assert new.hnsw is not old.hnsw and new.hnsw.M == 16 and new.count == 2000
    got, sims = new.query(moved[:300], 10, 1)
    want, _ = exact_new.query(moved[:300], 10, 1)
    assert (got[:, 0] == np.arange(300)).all()  # each point finds itself (new vector)
    recall = np.mean([len(set(got[i]) & set(want[i])) / 10 for i in range(300)])
    assert recall >= 0.95, recall
    np.testing.assert_allclose(sims[:, 0], 1.0, atol=1e-5)
    with pytest.raises(ValueError, match="vectors for a graph"):
        old.with_vectors(moved[:10], 1)
    # nodes in another order than the points' ids: each id still gets its own new vector
    import hnswlib

    perm = rng.permutation(2000)
    graph = hnswlib.Index(space="ip", dim=24)
    graph.init_index(max_elements=2000, M=16, ef_construction=100, random_seed=0)
    graph.add_items(normalize_rows(V[perm]), perm, num_threads=1)
    shuffled = AnnIndex("hnsw", 24, 2000, hnsw=graph, ef_search=50).with_vectors(moved, 1)
    assert np.array_equal(shuffled.vectors_of(ids), exact_new.vectors_of(ids))
    got, _ = shuffled.query(moved[:300], 1, 1)
    assert (got[:, 0] == np.arange(300)).all()
    # an exact index: the same exact search over the new vectors, the old one untouched
    small = AnnIndex.build(V[:100], 10**9)
    moved_small = small.with_vectors(moved[:100], 1)
    assert moved_small.kind == "exact" and moved_small.precision == small.precision
    assert np.array_equal(moved_small.vectors_of(ids[:100]), exact_new.vectors_of(ids[:100]))
    assert np.array_equal(
        small.vectors_of(ids[:100]), AnnIndex.build(V, 10**9).vectors_of(ids[:100])
    )


def test_graph_of_another_state_layout_is_built_anew_over_the_new_vectors(monkeypatch):
    # a hnswlib whose pickled state is not the layout with_vectors writes into (another
    # ser_version) gets a fresh graph with the old one's degree and construction ef over the new
    # vectors, never records written at guessed offsets
    import hnswlib

    from engine.astec.ann import AnnIndex

    rng = np.random.default_rng(4)
    V = rng.standard_normal((1500, 24)).astype(np.float32)
    moved = V + 0.3 * rng.standard_normal(V.shape).astype(np.float32)
    old = AnnIndex.build(V, 0, 12, 80, 50, 1, 0)
    real = hnswlib.Index.__getstate__

    def other_layout(self):
        (state,) = real(self)
        return ({**state, "ser_version": 2},)

    monkeypatch.setattr(hnswlib.Index, "__getstate__", other_layout)
    built = []
    monkeypatch.setattr(
        AnnIndex, "build", staticmethod(lambda *a, _b=AnnIndex.build: built.append(a) or _b(*a))
    )
    new = old.with_vectors(moved, 1)
    assert len(built) == 1 and built[0][2:4] == (12, 80)  # M, ef_construction
    ids = np.arange(1500)
    want = AnnIndex.build(moved, 10**9).vectors_of(ids)
    np.testing.assert_allclose(new.vectors_of(ids), want, atol=1e-6)  # normalised twice
    got, _ = new.query(moved[:200], 1, 1)
    assert (got[:, 0] == np.arange(200)).all()


def test_small_nodes_split_on_their_gram_matrix_as_on_their_rows(monkeypatch):
    # the Gram-matrix split is the same 2-means (same steps, same random draws): on rows
    # without ties it gives the same clusters as the row-wise split
    import engine.astec.clustering as cl

    rng = np.random.default_rng(8)
    C = sp.random(700, 2000, density=0.01, random_state=8, format="csr", dtype=np.float32)
    C = normalize_rows(sp.csr_matrix(sp.hstack([C, rng.random((700, 5), dtype=np.float32)])))
    for dense in (False, True):
        M = C.toarray() if dense else C
        gram = balanced_clusters(M, 64, seed=3, progress=False)
        monkeypatch.setattr(cl, "_GRAM_MAX", 0)
        rows = balanced_clusters(M, 64, seed=3, progress=False)
        monkeypatch.undo()
        assert np.array_equal(gram, rows)
        assert np.bincount(gram, minlength=64).max() <= 11
