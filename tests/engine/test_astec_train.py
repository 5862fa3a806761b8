"""Astec end to end on tiny data: it learns, saves/loads bit-identically, and survives the inputs
users bring (tiny label sets, labels without points, empty or unknown texts, duplicates)."""

import json

import numpy as np
import pytest
import scipy.sparse as sp

from engine.astec import Astec, AstecConfig
from engine.astec.config import EnsembleParams
from engine.astec.io import ModelDirError
from engine.astec.sparse_ranker import label_pairs
from engine.ranking_metrics import evaluate
from engine.synthetic import zipf_dataset

FAST = {
    "network": {"embedding_dim": 32},
    "surrogate": {"epochs": 4, "lr": 0.02},
    "shortlist": {
        "negatives": 50,
        "knn_neighbours": 10,
        "centroid_neighbours": 20,
        "head_min_points": 30,
    },
    "extreme": {"epochs": 4, "lr": 0.01, "finetune_lr": 0.005},
    "rerank": {"epochs": 2},
    "search": {"candidates": 50},
    "training": {"batch_size": 64, "threads": 1},
}
OFF = {"enabled": False}


def fast(**sections: dict) -> AstecConfig:
    """FAST with some sections' fields set: fast(rerank=OFF)."""
    return AstecConfig.from_dict(
        {**FAST, **{s: {**FAST.get(s, {}), **v} for s, v in sections.items()}}
    )


@pytest.fixture(scope="module")
def data():
    texts, Y = zipf_dataset(
        1500,
        60,
        labels_per_point=2,
        words_per_point=4,
        words_per_label=2,
        vocab_size=400,
        noise=0.1,
        seed=1,
    )
    return texts[:1200], Y[:1200], texts[1200:], Y[1200:]


@pytest.fixture(scope="module")
def model(data):
    tr, Ytr, _, _ = data
    return Astec.train(
        tr, Ytr, fast(), label_names=[f"lab{i}" for i in range(Ytr.shape[1])], progress=False
    )


def test_learns_keyword_labels(model, data):
    _, _, te, Yte = data
    ids, scores = model.predict(te, k=5)
    assert ids.shape == (300, 5) and ids.dtype == np.int64 and scores.dtype == np.float32
    assert np.all(np.diff(scores, axis=1) <= 1e-7), "scores must be best first"
    m = evaluate(Yte, (ids, scores), ks=(1, 3))
    assert m["P@1"] > 70.0, m


def test_train_log_has_modules_and_choices(model):
    lg = model.train_log["learners"][0]["modules"]
    for mod in ("I", "II", "IV", "reranker"):
        assert lg[mod]["seconds"] >= 0 and lg[mod]["peak_rss_mb"] > 0
    assert 0.0 <= lg["IV"]["alpha"] <= 1.0 and 0.0 <= lg["reranker"]["beta"] <= 1.0
    assert "P@1" in lg["IV"]["valid"]
    assert 0.0 <= lg["sparse"]["gamma"] <= 1.0 and lg["sparse"]["weights"] > 0
    assert [r["gamma"] for r in lg["sparse"]["gamma_selection"]] == list(
        model.config.combination.gamma_grid
    )


def test_sparse_ranker_off_is_the_papers_astec(data):
    """sparse_ranker=false trains no ranker: predictions are the alpha/beta combination only,
    and the saved model carries no ranker files."""
    tr, Ytr, te, _ = data
    m = Astec.train(tr[:600], Ytr[:600], fast(sparse=OFF, rerank=OFF), progress=False)
    assert m.learners[0].sparse is None and m.ranker_vectorizer is None
    assert "sparse" not in m.train_log["learners"][0]["modules"]
    assert m.ranker_features(te[:3]) is None
    ids, _ = m.predict(te[:20], k=3)
    assert ids.shape == (20, 3)


def test_spectral_norm_bounded(model):
    for enc in (model.learners[0].encoder, model.learners[0].reranker):
        R = enc.baked_residual()
        assert np.linalg.norm(R, 2) <= model.config.network.spectral_lambda * 1.02


def test_features_shape(model, data):
    z = model.features(data[2][:7])
    assert z.shape == (7, 32) and z.dtype == np.float32 and np.isfinite(z).all()


def test_save_load_identical(model, data, tmp_path):
    te = data[2][:100]
    model.save(tmp_path / "m")
    loaded = Astec.load(tmp_path / "m")
    a, sa = model.predict(te, k=5)
    b, sb = loaded.predict(te, k=5)
    assert np.array_equal(a, b) and np.allclose(sa, sb)
    assert json.loads((tmp_path / "m" / "train_log.json").read_text())["num_points"] == 1200
    assert (tmp_path / "m" / "learner_0" / "sparse_ranker.npz").exists()
    assert loaded.learners[0].gamma == model.learners[0].gamma
    assert (loaded.learners[0].sparse.W != model.learners[0].sparse.W).nnz == 0


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_load_refuses_corrupt_dir(model, tmp_path, damage):
    root = model.save(tmp_path / "m")
    target = root / "learner_0" / "model.safetensors"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-100])
    elif damage == "flip":
        raw = bytearray(target.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        target.write_bytes(bytes(raw))
    elif damage == "delete":
        target.unlink()
    else:
        (root / "manifest.json").unlink()
    with pytest.raises(ModelDirError) as e:
        Astec.load(root)
    assert (
        ("manifest.json" in str(e.value))
        if damage == "manifest"
        else ("model.safetensors" in str(e.value))
    )


def test_empty_and_unknown_texts_get_frequent_labels(model, data):
    Ytr = data[1]
    ids, scores = model.predict(["", "zzzz qqqq", "   "], k=3)
    top = np.argsort(-np.asarray(Ytr.sum(axis=0)).ravel(), kind="stable")[:10]
    assert np.isfinite(scores).all()
    assert set(ids[0]).issubset(set(top)) and np.array_equal(ids[0], ids[1])


def test_tiny_label_sets_and_labels_without_points():
    texts = ["red apple", "green apple", "red car", "blue car", "apple pie", "fast car"] * 4
    Y = sp.csr_matrix(
        np.array(
            [[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 1, 0], [1, 0, 0], [0, 1, 0]] * 4, dtype=np.float32
        )
    )  # label 2 has no training point
    m = Astec.train(texts, Y, fast(), progress=False)
    ids, _scores = m.predict(["apple", "car", ""], k=5)
    assert ids.shape == (3, 5)
    assert ids[0, 0] == 0 and ids[1, 0] == 1
    assert (ids[:, 3:] == -1).all(), "only 3 labels exist, the rest is padding"
    one = Astec.train(
        ["a", "b", "a b"], sp.csr_matrix(np.ones((3, 1), np.float32)), fast(), progress=False
    )
    assert one.predict(["a"], k=2)[0].tolist() == [[0, -1]]


def test_duplicate_texts_and_ensemble(tmp_path):
    texts, Y = zipf_dataset(300, 20, labels_per_point=1, words_per_point=3, vocab_size=100, seed=3)
    texts = texts + texts[:100]
    Y = sp.vstack([Y, Y[:100]]).tocsr()
    m = Astec.train(texts, Y, fast(rerank=OFF), learners=2, progress=False)
    assert len(m.learners) == 2
    # mean or max, chosen on the validation split (both tried and logged)
    sel = m.train_log["ensemble"]["ensemble_selection"]
    assert [r["ensemble"] for r in sel] == ["mean", "max"]
    assert (
        m.ensemble
        == m.train_log["ensemble"]["ensemble"]
        == max(sel, key=lambda r: r["objective"])["ensemble"]
    )
    m.save(tmp_path / "e")
    loaded = Astec.load(tmp_path / "e")
    assert len(loaded.learners) == 2 and loaded.ensemble == m.ensemble
    man = json.loads((tmp_path / "e" / "manifest.json").read_text())
    (tmp_path / "e" / "manifest.json").write_text(json.dumps({**man, "ensemble": "median"}))
    with pytest.raises(ModelDirError, match=r"manifest.json.*ensemble.*median"):
        Astec.load(tmp_path / "e")
    (tmp_path / "e" / "manifest.json").write_text(
        json.dumps({k: v for k, v in man.items() if k != "ensemble"})
    )
    assert Astec.load(tmp_path / "e").ensemble == "mean"  # saved before the choice existed
    (tmp_path / "e" / "manifest.json").write_text(json.dumps(man))
    a = m.predict(texts[:20], k=3)
    b = loaded.predict(texts[:20], k=3)
    assert np.array_equal(a[0], b[0])


def test_feature_matrix_input():
    texts, Y = zipf_dataset(400, 15, labels_per_point=1, words_per_point=3, vocab_size=80, seed=4)
    from engine.text import TfidfVectorizer

    X = TfidfVectorizer().fit_transform(texts)
    m = Astec.train(X, Y, fast(rerank=OFF), progress=False)
    ids, _ = m.predict(X[:50], k=1)
    assert (np.asarray(Y[:50][np.arange(50), ids[:, 0]]).ravel() > 0).mean() > 0.6
    with pytest.raises(ValueError, match="feature vectors"):
        m.predict(["some text"])


def test_train_reads_labels_as_0_1_and_leaves_the_callers_matrix_alone():
    """Any stored nonzero of Y is a label and a stored 0 is none; Astec.train writes nothing
    into the caller's Y (values such as click counts stay)."""
    texts, Y = zipf_dataset(300, 12, labels_per_point=2, words_per_point=3, vocab_size=60, seed=5)
    Y = sp.csr_matrix(Y, dtype=np.float32)
    Y.data[:] = np.linspace(0.5, 3.0, Y.nnz, dtype=np.float32)
    Y.data[:5] = 0.0
    before = Y.copy()
    m = Astec.train(texts, Y, fast(rerank=OFF, sparse=OFF), progress=False)
    assert np.array_equal(Y.data, before.data) and np.array_equal(Y.indices, before.indices)
    labels = m.learners[0].index.point_labels
    assert labels.nnz == Y.nnz - 5 and set(labels.data.tolist()) == {1.0}


def test_config_json_round_trip_and_errors(tmp_path):
    c = fast(ensembles={"learners": 3})
    c.save(tmp_path / "c.json")
    assert AstecConfig.load(tmp_path / "c.json") == c
    (tmp_path / "bad.json").write_text('{"embeding_dim": 3}')
    with pytest.raises(ValueError, match="embeding_dim"):
        AstecConfig.load(tmp_path / "bad.json")
    (tmp_path / "bad2.json").write_text('{"embedding_dim": "x"}')
    with pytest.raises(ValueError, match="embedding_dim"):
        AstecConfig.load(tmp_path / "bad2.json")
    assert (
        AstecConfig().resolve(3).surrogate.num_clusters <= 3
        and AstecConfig().resolve(3).shortlist.negatives <= 3
    )
    # a model saved while classifier_init existed still loads; a non-default value is refused
    assert AstecConfig.from_dict({**c.to_dict(), "classifier_init": "xavier"}) == c
    with pytest.raises(ValueError, match="classifier_init"):
        AstecConfig.from_dict({**c.to_dict(), "classifier_init": "centroid"})


def test_svd_embedding_init_trains(data):
    tr, Ytr, te, Yte = data
    m = Astec.train(tr, Ytr, fast(network={"embedding_init": "svd"}, rerank=OFF), progress=False)
    ids, sc = m.predict(te, k=1)
    assert evaluate(Yte, (ids, sc), ks=(1,))["P@1"] > 70.0
    with pytest.raises(ValueError, match="embedding_init"):
        fast(network={"embedding_init": "fasttext"})


def test_ensemble_scores_mean_and_max_over_the_union():
    """A label only one learner shortlists counts 0 in the others: the mean divides it by the
    number of learners, the max keeps it."""
    from engine.astec.predict import ensemble_scores

    a = sp.csr_matrix(np.array([[0.8, 0.0, 0.2]], np.float32))
    b = sp.csr_matrix(np.array([[0.4, 0.6, 0.0]], np.float32))
    np.testing.assert_allclose(
        ensemble_scores([a, b], "mean").toarray(), [[0.6, 0.3, 0.1]], rtol=1e-6
    )
    np.testing.assert_allclose(
        ensemble_scores([a, b], "max").toarray(), [[0.8, 0.6, 0.2]], rtol=1e-6
    )
    assert ensemble_scores([a], "mean").toarray().tolist() == a.toarray().tolist()
    with pytest.raises(ValueError, match="ensemble"):
        ensemble_scores([a, b], "median")
    with pytest.raises(ValueError, match="ensemble"):
        EnsembleParams(join="median")


def test_training_shortlists_by_chunks_are_the_same(tmp_path, monkeypatch):
    """Module II's negatives, the re-ranker's mispredictions and the sparse ranker's shortlists
    are computed by chunks of rows (memory); any chunk size gives the same result."""
    import scipy.sparse as sp

    from engine.astec import model as astec_model
    from engine.astec.network import dense_bag
    from testkit.engine_models import corpus, train_small

    texts, labels, names = corpus()
    model = train_small(tmp_path / "model")
    rows = np.repeat(np.arange(len(labels)), [len(x) for x in labels])
    Y = sp.csr_matrix(
        (np.ones(rows.size, np.float32), (rows, np.concatenate(labels))),
        shape=(len(texts), len(names)),
    )
    X, Xr = model.transform(texts), model.ranker_features(texts)
    lr, cfg = model.learners[0], model.config
    V = dense_bag(lr.encoder, X)  # searched in the final index (its ids: fit points first)

    def same(a, b):
        return a.shape == b.shape and a.nnz > 0 and (a != b).nnz == 0

    def three():
        both = astec_model._after_iv_shortlists(lr, X, Y, cfg, rerank=True, sparse=True)
        hard, cand = both.hard, both.candidates
        # one label-centre search serves both: each alone gives the same shortlists
        assert same(hard, astec_model._after_iv_shortlists(lr, X, Y, cfg, True, False).hard)
        alone = astec_model._after_iv_shortlists(lr, X, Y, cfg, False, True)
        assert same(cand, alone.candidates)
        np.testing.assert_array_equal(both.kth_centre, alone.kth_centre)
        # the same candidates as the ranker's own shortlist of those rows
        assert same(cand, astec_model._ranker_shortlists(lr, X, np.arange(X.shape[0]), cfg))
        W = astec_model._fit_ranker(Xr[:480], label_pairs(Y[:480], cand[:480]), cfg, 0).W
        depth = astec_model._after_iv_depth(cfg, True, True)
        m2, hits = astec_model._module2_negatives(lr.index, V, Y, cfg, 0, keep=depth)
        assert same(m2, astec_model._module2_negatives(lr.index, V, Y, cfg, 0)[0])
        # Module II's searches, kept while E stays fixed, give the shortlists after Module IV
        # that searching again gives
        again = astec_model._after_iv_shortlists(lr, X, Y, cfg, True, True, kept=hits)
        assert same(hard, again.hard) and same(cand, again.candidates)
        np.testing.assert_array_equal(both.kth_centre, again.kth_centre)
        return m2, hard, W

    whole = three()
    monkeypatch.setattr(astec_model, "_ROW_CHUNK", 37)
    chunked = three()
    for w, c in zip(whole, chunked, strict=True):
        assert same(w, c)
    m2, rr = whole[:2]
    assert m2.multiply(Y).nnz == 0 and rr.multiply(Y).nnz == 0  # never a positive
    assert np.diff(rr.indptr).max() <= cfg.rerank.negatives


def test_refit_keeps_the_first_fits_candidates_and_adds_labels_first_seen_in_validation(tmp_path):
    """The sparse ranker's refit on all points reuses the fit points' candidates from the first
    pass (no second shortlist of every point), adds each label the fit points never had where
    its centre is as near as the point's `sparse.negatives`-th centre was, and shortlists the
    validation points from the final indexes."""
    from dataclasses import replace

    import scipy.sparse as sp

    from engine.astec import model as astec_model
    from engine.astec.network import dense_bag
    from engine.astec.sparse import normalize_rows
    from testkit.engine_models import corpus, train_small

    texts, labels, names = corpus()
    model = train_small(tmp_path / "model")
    n = 480
    rows = np.repeat(np.arange(n), [len(x) for x in labels[:n]])
    Y = sp.csr_matrix(
        (np.ones(rows.size, np.float32), (rows, np.concatenate(labels[:n]))),
        shape=(n, len(names)),
    )
    X = model.transform(texts[:n])
    lr, cfg = model.learners[0], model.config.copy()
    cfg.shortlist.centroid_neighbours, cfg.sparse.negatives = 10, 20  # a bar below every centre
    valid = np.arange(3, n, 6)  # holds labels the fit points never have
    fit = np.setdiff1d(np.arange(n), valid)
    first_learner = replace(
        lr, index=astec_model._build_index(lr.encoder, X[fit], Y[fit], cfg, 0), search=None
    )
    first = astec_model._after_iv_shortlists(first_learner, X[fit], Y[fit], cfg, False, True)
    Cf, kth = first.candidates.copy(), first.kth_centre
    final_index = astec_model._final_index(
        lr.encoder, X, Y, fit, valid, cfg, 0, first_learner.index
    )
    final = replace(lr, index=final_index, search=None)
    C, order = astec_model._refit_candidates(final, X, Y, fit, valid, first, cfg)

    np.testing.assert_array_equal(order, np.concatenate([fit, valid]))
    assert C.shape == (n, len(names)) and first.candidates is None  # taken over, not copied
    top = C[: len(fit)]
    assert Cf.multiply(top).nnz == Cf.nnz  # every first-pass candidate kept
    added = sp.csr_matrix(top - top.multiply(Cf != 0))
    added.eliminate_zeros()
    new_labels = np.flatnonzero((np.diff(sp.csc_matrix(Y[fit]).indptr) == 0) & (Y.sum(0).A1 > 0))
    assert new_labels.size > 0 and added.nnz > 0
    assert np.isin(added.indices, new_labels).all()
    # each added label's nearest centre clears the point's bar; a new label it did not add fails it
    index = final.index
    mine = np.isin(index.centre_owner, new_labels)
    V = normalize_rows(dense_bag(lr.encoder, X[fit]))
    S = V @ normalize_rows(index.centres.vectors_of(np.flatnonzero(mine))).T
    best = np.full((len(fit), len(names)), -np.inf, np.float32)
    np.maximum.at(best, (slice(None), index.centre_owner[mine]), S)
    cleared = best >= kth[:, None]
    r, c = added.nonzero()
    assert cleared[r, c].all()
    assert cleared.sum() == added.nnz
    # the validation points: fresh shortlists from the final indexes, themselves excluded
    fresh = astec_model._ranker_shortlists(
        final, X, valid, cfg, ids=len(fit) + np.arange(len(valid))
    )
    assert (C[len(fit) :] != fresh).nnz == 0 and fresh.nnz > 0


def test_a_head_of_sampled_from_meta_labels_is_sampled_and_still_learns(model, data):
    """surrogate.sampled_from <= the meta-labels: Module I scores a sample per batch (the log
    says how wide) and the model still learns; by default (0) the full head."""
    tr, Ytr, te, Yte = data
    cfg = fast(
        surrogate={
            "num_clusters": 32,
            "sampled_from": 32,
            "sampled_negatives": 4,
            "sampled_block": 2,
        },
        training={"batch_size": 8},
        rerank=OFF,
        sparse=OFF,
    )
    m = Astec.train(tr, Ytr, cfg, progress=False)
    epochs = m.train_log["learners"][0]["modules"]["I"]["epochs"]
    assert all(0 < e["scored_meta_labels"] < 32 for e in epochs), epochs
    assert evaluate(Yte, m.predict(te, k=5), ks=(1,))["P@1"] > 70.0
    full = model.train_log["learners"][0]["modules"]["I"]["epochs"]
    assert not any("scored_meta_labels" in e for e in full)
