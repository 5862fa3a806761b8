"""The exported CPU predictor: parity with the torch model, no torch on the predict path,
corrupt directories refused, the API the stream and GRU code rely on, and the CLI commands."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from engine.export import ExportOptions, export_model
from engine.manifest import ManifestError
from engine.predictor import Predictor
from testkit.engine_models import (
    assert_model_parity,
    corpus,
    model_like,
    parity,
    train_small,
)
from testkit.paths import REPO, STREAM_DATA


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A small real model (exact search, re-ranker) and its exported predictor."""
    d = tmp_path_factory.mktemp("pred")
    model = train_small(d / "model")
    export_model(d / "model", d / "predictor", progress=False)
    texts, _, _ = corpus()
    test = [*texts[480:], "", "zzzz qqqq unknownword", texts[0]]  # held out + edge cases
    return model, d, test


def test_parity_with_torch_model(built):
    model, d, test = built
    p = Predictor.load(d / "predictor")
    # the default model has a sparse ranker: parity covers its scores too
    assert p.ranker_vectorizer is not None and p.learners[0].sparse is not None
    assert p.learners[0].gamma == model.learners[0].gamma < 1.0
    assert_model_parity(model_like(model, d / "predictor"), p, test)
    np.testing.assert_allclose(p.features(test), model.features(test), atol=1e-5)


def test_onnx_backend_matches_numpy(built):
    _, d, test = built
    a = Predictor.load(d / "predictor", backend="numpy")
    b = Predictor.load(d / "predictor", backend="onnx")
    ia, _sa, za = a.predict_with_features(test[:40], k=5)
    ib, _sb, zb = b.predict_with_features(test[:40], k=5)
    assert (ia == ib).mean() >= 0.99
    np.testing.assert_allclose(za, zb, atol=1e-5)


def test_hnsw_model_and_ensemble_export_as_one_predictor(tmp_path):
    """A model whose indexes are HNSW is copied graph for graph (its lean serving graphs) and
    searched as much as the model chose on validation: same labels and scores as the model,
    whichever way the ensemble joins its learners (max here, then mean)."""
    model = train_small(
        tmp_path / "model",
        shortlist={"exact_max_points": 0},
        ensembles={"learners": 2, "join": "max"},
    )
    assert model.ensemble == "max"
    export_model(tmp_path / "model", tmp_path / "pred", progress=False)
    p = Predictor.load(tmp_path / "pred")
    assert len(p.learners) == 2 and p.ensemble == "max"
    assert all(lr.points.graph is not None for lr in p.learners)
    assert p.learners[0].centres.graph.m == model.config.search.graph_m
    cfg = json.loads((tmp_path / "pred" / "predictor.json").read_text())
    for lr, lc in zip(model.learners, cfg["learners"], strict=True):
        want = lr.search_sizes(model.config)
        assert (lc["shortlist"]["knn"], lc["shortlist"]["kmu"]) == tuple(want)
    test = corpus()[0][480:]
    for how in ("max", "mean"):
        model.ensemble = p.ensemble = how
        ids_t, sc_t = model.predict(test, k=10)
        ids_p, sc_p = p.predict(test, k=10)
        same5, close = parity(ids_t, sc_t, ids_p, sc_p)
        assert same5 >= 0.99 and close >= 0.99, (how, same5, close)
        one = [p.predict_one(t, 10) for t in test]  # the ensemble on the single-text path
        same5, close = parity(ids_p, sc_p, [o[0] for o in one], [o[1] for o in one])
        assert same5 >= 0.99 and close >= 0.99, (how, same5, close)
    # the two joins really differ: max keeps a label one learner alone shortlists at full score
    model.ensemble = "max"
    assert not np.allclose(model.predict(test, k=10)[1], sc_t)


def test_api_shapes_padding_and_edge_texts(built):
    model, d, test = built
    p = Predictor.load(d / "predictor")
    L, D = p.num_labels, p.dim
    ids, sc = p.predict(["", "zzzz qqqq"], k=L + 7)  # more slots than candidates: padded
    assert ids.shape == (2, L + 7) and ids.dtype == np.int64 and sc.dtype == np.float32
    assert (ids[:, -1] == -1).all() and (sc[:, -1] == 0).all()
    assert (ids[:, 0] >= 0).all()  # empty texts still get frequent labels
    assert (np.diff(sc[ids >= 0].reshape(2, -1), axis=1) <= 0).all()
    i1, _s1 = p.predict_one("", k=5)
    assert i1.shape == (5,) and (i1 == ids[0, :5]).all()
    z = p.features(test[:3])
    assert z.shape == (3, D) and z.dtype == np.float32
    i2, _s2, z2 = p.predict_with_features(test[:3], k=4)
    assert (i2 == p.predict(test[:3], k=4)[0]).all()
    np.testing.assert_allclose(z2, z, atol=1e-6)
    rows = p.classifier_rows(np.array([0, 5, L - 1]))
    W = model.learners[0].clf.weight.weight.detach().numpy()
    np.testing.assert_array_equal(rows, W[[0, 5, L - 1]])
    with pytest.raises(IndexError):
        p.classifier_rows([L])
    assert len(p.label_names) == L and p.label_names[3] == corpus()[2][3]
    assert p.version.startswith("astec-") and p.version == p.manifest.data["version"]


def test_predict_path_never_imports_torch(built):
    _, d, _test = built
    code = (
        "import sys, engine.predictor as m; assert 'torch' not in sys.modules, 'import';"
        f"p = m.Predictor.load({str(d / 'predictor')!r}); p.predict_one('gnome editor');"
        "p.predict(['a b', '']); p.features(['x']); p.classifier_rows([0]);"
        "assert 'torch' not in sys.modules, 'predict'; print('ok')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _copy(d: Path, tmp: Path) -> Path:
    dst = tmp / "p"
    shutil.copytree(d / "predictor", dst)
    return dst


@pytest.mark.parametrize(
    "damage", ["missing", "truncated", "tampered", "no-manifest", "bad-manifest", "bit-flip"]
)
def test_corrupt_predictor_is_refused(built, tmp_path, damage):
    _, d, _ = built
    p = _copy(d, tmp_path)
    target = p / "learner_0" / "classifier_w.npy"
    if damage == "missing":
        target.unlink()
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[:-100])
    elif damage == "tampered":  # same size, one byte changed
        b = bytearray(target.read_bytes())
        b[-1] ^= 0xFF
        target.write_bytes(bytes(b))
    elif damage == "no-manifest":
        (p / "manifest.json").unlink()
    elif damage == "bad-manifest":
        (p / "manifest.json").write_text('{"format": "astec-predictor", ')
    elif damage == "bit-flip":  # one bit deep inside a memory-mapped table
        target = p / "learner_0" / "reranker_embeddings.npy"
        b = bytearray(target.read_bytes())
        b[len(b) // 2] ^= 0x01
        target.write_bytes(bytes(b))
    with pytest.raises(ManifestError) as e:
        Predictor.load(p)
    msg = str(e.value)
    want = "manifest.json" if damage in ("no-manifest", "bad-manifest") else target.name
    assert want in msg, msg


def test_cli_export_and_bench_predict(built, tmp_path):
    from infra.cli import cli

    _, d, _ = built
    runner = CliRunner()
    out = tmp_path / "exported"
    r = runner.invoke(cli, ["export", "--model", str(d / "model"), "--out", str(out)])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output[r.output.index("{") :])
    assert info["labels"] == 1880 and Path(info["predictor"]) == out
    r = runner.invoke(cli, ["export", "--model", str(d / "model"), "--out", str(out)])
    assert r.exit_code != 0 and "--overwrite" in r.output  # never clobbers silently
    tsv = tmp_path / "test.tsv"
    tsv.write_text(
        "".join(
            line + "\n"
            for line in (Path(STREAM_DATA) / "train.tsv")
            .read_text(encoding="utf-8")
            .splitlines()[480:]
        )
    )
    r = runner.invoke(
        cli,
        [
            "bench",
            "predict",
            "--predictor",
            str(out),
            "--input",
            str(tsv),
            "--model",
            str(d / "model"),
            "--systems",
            "predictor,torch",
            "--n",
            "64",
            "--n-latency",
            "32",
        ],
    )
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    pr = rep["systems"]["predictor"]
    assert pr["latency_one_text"]["p50_ms"] > 0 and set(pr["throughput_texts_per_s"]) == {
        "1",
        "32",
        "256",
    }
    assert pr["rss_mb"]["after_run"] > 0 and pr["load_s"] > 0
    assert rep["parity_vs_torch"]["top5_same_set"] >= 0.99
    assert "ratio_to_predictor" in rep["systems"]["torch"]


def test_prediction_search_is_chosen_on_validation_and_exported(built):
    """Training picks the cheapest prediction search within tolerance of the full one on its
    validation split; the model predicts with it and the export searches exactly as much."""
    model, d, _ = built
    cfg = model.config
    sel = model.train_log["learners"][0]["search_selection"]
    objective = {(r["knn"], r["kmu"]): r["objective"] for r in sel["table"]}
    full = (cfg.shortlist.knn_neighbours, cfg.shortlist.centroid_neighbours)
    ok = [c for c, v in objective.items() if v >= objective[full] - cfg.search.tolerance]
    chosen = tuple(sel["chosen"])
    assert full in objective and len(objective) >= 2
    assert chosen in ok and sum(chosen) == min(sum(c) for c in ok)
    assert (model.learners[0].search or full) == chosen
    sc = json.loads((d / "predictor" / "predictor.json").read_text())["learners"][0]["shortlist"]
    assert (sc["knn"], sc["kmu"]) == chosen


def test_single_text_path_is_repeatable_and_thread_safe(built):
    """The single-text path keeps per-thread scratch state: answers must not depend on what was
    predicted before or on other threads predicting at the same time (e.g. a dashboard)."""
    from concurrent.futures import ThreadPoolExecutor

    _, d, test = built
    p = Predictor.load(d / "predictor")
    want = [p.predict_one(t, 10) for t in test]
    again = [p.predict_one(t, 10) for t in reversed(test)][::-1]
    with ThreadPoolExecutor(4) as ex:
        threaded = list(ex.map(lambda t: p.predict_one(t, 10), test * 3))[: len(test)]
    for a, b, c in zip(want, again, threaded, strict=True):
        assert (a[0] == b[0]).all() and (a[0] == c[0]).all()
        np.testing.assert_array_equal(a[1], b[1])
        np.testing.assert_array_equal(a[1], c[1])


def test_single_text_path_splits_a_title_once(built):
    """The single-text path splits a title once for both vectorizers and the name match and
    runs two compiled calls around the graph searches; the answers equal those of the path
    that goes stage by stage with each consumer analysing the text itself (the path of a
    vectorizer with character n-grams)."""
    _, d, test = built
    p = Predictor.load(d / "predictor")
    assert p.title_words is not None and p.label_text is not None and p._fused is not None
    shared = [p.predict_one(t, 10) for t in test]
    p.title_words, p._fused = None, None
    for t, (ids, sc) in zip(test, shared, strict=True):
        ids_o, sc_o = p.predict_one(t, 10)
        np.testing.assert_array_equal(ids, ids_o)
        np.testing.assert_array_equal(sc, sc_o)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_single_text_kernels_agree_with_batch_path(built, tmp_path, dtype):
    """predict_one (compiled kernels) and predict (numpy batch path) are two implementations of
    one algorithm: same top-10 labels and scores, also when the shortlist is cut (prior labels
    kept) and when classifier rows are stored as float16."""
    _, d, test = built
    src = d / "predictor"
    if dtype == "float16":
        src = export_model(
            d / "model", tmp_path / "p16", ExportOptions(dtype="float16"), progress=False
        )
    p = Predictor.load(src)
    for cut in (None, 3):
        if cut:
            for lr in p.learners:
                lr.shortlist_size = cut
        assert len(test) >= 16  # predict takes the batch path (smaller batches: the kernels)
        ids_b, sc_b = p.predict(test, k=10)
        ids_s, _sc_s, z_s = p.predict_with_features(test[:5], k=10)
        assert (ids_s == ids_b[:5]).all()
        np.testing.assert_allclose(z_s, p.features(test[:5]), atol=1e-5)
        one = [p.predict_one(t, 10) for t in test]
        ids_o = np.stack([o[0] for o in one])
        sc_o = np.stack([o[1] for o in one])
        assert (ids_o == ids_b).all(axis=1).mean() >= 0.99, (dtype, cut)
        np.testing.assert_allclose(sc_o, sc_b, atol=1e-5)
        if cut:  # a cut shortlist scores at most `cut` labels plus the prior ones
            n_prior = p.learners[0].prior.size
            assert ((ids_o >= 0).sum(1) <= cut + n_prior).all()
    assert p.predict_one("gnome editor", 0)[0].shape == (0,)


def test_sparse_ranker_kernels_agree_with_scipy():
    """The predictor serves long ranker rows through their transpose and the model merges or
    bisects them: all three must give w_l . x exactly (same terms, same order)."""
    import scipy.sparse as sp

    from engine.kernels import sparse_entry_scores, sparse_mix_dense, sparse_scores_split
    from engine.predictor import _split_ranker

    L, F, n = 300, 3000, 40
    rng = np.random.default_rng(0)
    W = sp.random(L, F - 1, density=0.02, format="csr", random_state=1, dtype=np.float32)
    W = sp.csr_matrix(sp.hstack([W, sp.csr_matrix(rng.normal(size=(L, 1)).astype(np.float32))]))
    long_rows = sp.random(20, F, density=0.3, format="csr", random_state=2, dtype=np.float32)
    W = sp.csr_matrix(sp.vstack([long_rows, W[20:]]))
    W.sort_indices()
    X = sp.random(n, F - 1, density=0.005, format="csr", random_state=3, dtype=np.float32)
    X = sp.csr_matrix(sp.hstack([X, sp.csr_matrix(np.ones((n, 1), np.float32))]))
    X.sort_indices()
    C = sp.csr_matrix(np.ones((n, L), np.float32))
    i64 = lambda a: a.astype(np.int64)  # noqa: E731
    a = sparse_entry_scores(
        i64(C.indptr),
        i64(C.indices),
        i64(X.indptr),
        i64(X.indices),
        X.data,
        i64(W.indptr),
        i64(W.indices),
        W.data,
    )
    b = sparse_scores_split(
        i64(C.indptr),
        i64(C.indices),
        i64(X.indptr),
        i64(X.indices),
        X.data,
        *_split_ranker(W.indptr, W.indices, W.data, L, F),
    )
    assert (np.diff(W.indptr) > 128).sum() >= 10  # the transposed path is exercised
    assert np.array_equal(a, b)
    assert np.allclose(a, (X @ W.T).toarray().ravel(), atol=1e-5)
    # the single-text path scatters x into a dense scratch: the same sums, and the scratch
    # left zeroed for the next text
    xd = np.zeros(F, np.float32)
    gamma = np.float32(0.3)
    for i in range(n):
        x0, x1 = X.indptr[i], X.indptr[i + 1]
        y = rng.random(L).astype(np.float32)
        want = gamma * y + (1 - gamma) * (1 / (1 + np.exp(-b[i * L : (i + 1) * L])))
        got = sparse_mix_dense(
            np.arange(L, dtype=np.int64),
            y,
            i64(X.indices[x0:x1]),
            X.data[x0:x1],
            xd,
            *_split_ranker(W.indptr, W.indices, W.data, L, F),
            float(gamma),
        )
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert not xd.any()


def test_export_without_sparse_ranker_serves_gamma_one(built, tmp_path):
    """`astec export --no-sparse-ranker` leaves the ranker out; the predictor then gives the
    model's predictions with gamma = 1 (the paper's combination), which bench predict's parity
    compares it against."""
    from engine.export import ExportOptions

    _model, d, test = built
    export_model(d / "model", tmp_path / "p", ExportOptions(sparse_ranker=False), progress=False)
    assert not (tmp_path / "p" / "ranker_vectorizer").exists()
    p = Predictor.load(tmp_path / "p")
    assert p.ranker_vectorizer is None and p.learners[0].sparse is None
    from engine.astec import Astec

    m = model_like(Astec.load(d / "model"), tmp_path / "p")
    assert m.learners[0].gamma == 1.0
    ids_t, sc_t = m.predict(test, k=10)
    ids_p, sc_p = p.predict(test, k=10)
    same5, close = parity(ids_t, sc_t, ids_p, sc_p)
    assert same5 >= 0.99 and close >= 0.99, (same5, close)
    ids_r, _ = Predictor.load(d / "predictor").predict(test, k=10)
    assert not np.array_equal(ids_r, ids_p)  # the ranker did change the answers


def test_single_query_hits_match_the_batch_search(tmp_path):
    """The single-text path searches the graph and expands duplicates in one compiled kernel;
    the batch path expands with numpy. Both must give the same ids in the same order and the
    same similarities, also when duplicate vectors map one graph node to several ids (a group
    cut at k) and for an exact table."""
    import hnswlib

    from engine.hnsw_graph import read_graph
    from engine.predictor import AnnSearch

    rng = np.random.default_rng(3)
    U, D = 400, 24
    X = rng.normal(size=(U, D)).astype(np.float32)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    sizes = rng.integers(1, 4, U)  # 1-3 original ids per distinct vector
    indptr = np.zeros(U + 1, np.int64)
    np.cumsum(sizes, out=indptr[1:])
    members = rng.permutation(int(indptr[-1])).astype(np.int64)
    for a, b in itertools.pairwise(indptr):
        members[a:b].sort()  # ascending original ids per distinct vector
    graph = hnswlib.Index(space="ip", dim=D)
    graph.init_index(max_elements=U, M=8, ef_construction=50, random_seed=0)
    graph.add_items(X, np.arange(U))
    graph.save_index(str(tmp_path / "g.hnsw"))
    graph = read_graph(tmp_path / "g.hnsw", D)
    searches = [
        AnnSearch(count=int(indptr[-1]), graph=graph, members_indptr=indptr, members=members),
        AnnSearch(count=U, graph=graph),
        AnnSearch(count=U, vectors=X),
    ]
    Q = rng.normal(size=(30, D)).astype(np.float32)
    Q /= np.linalg.norm(Q, axis=1, keepdims=True)
    for ann in searches:
        for k in (1, 5, 14, U + 50):
            for q in Q:
                ids, sims = ann.query(q[None], k)
                ids1, sims1 = ann.query_one(q[None], k)
                assert ids1.dtype == np.int64 and sims1.dtype == np.float32
                np.testing.assert_array_equal(ids1, ids[0])
                np.testing.assert_array_equal(sims1, sims[0])
