"""engine.hnsw_graph: hnswlib's saved graphs searched by the predictor's own kernel give
hnswlib's answers, and a damaged or foreign file is refused with what is wrong."""

from __future__ import annotations

import numpy as np
import pytest

hnswlib = pytest.importorskip("hnswlib")

from engine.hnsw_graph import GraphFileError, read_graph  # noqa: E402


def _saved_graph(path, n=3000, dim=32, m=12, seed=0, labels=None):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, dim)).astype(np.float32)
    X[:, :4] += 2.0 * rng.normal(size=(n // 100 + 1, 4)).repeat(100, 0)[:n]  # clusters
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    index = hnswlib.Index(space="ip", dim=dim)
    index.init_index(max_elements=n, M=m, ef_construction=80, random_seed=seed)
    index.add_items(X, np.arange(n) if labels is None else labels, num_threads=2)
    index.save_index(str(path))
    return index, X


def test_searches_give_hnswlibs_neighbours_and_similarities(tmp_path):
    """Same graph, same search: the neighbours hnswlib returns, in its order, with the
    similarities to int16 rounding; labels given out of order (several insert threads) are
    answered as labels, not internal node numbers."""
    n, dim = 3000, 32
    labels = np.random.default_rng(5).permutation(n)
    index, X = _saved_graph(tmp_path / "g.hnsw", n, dim, labels=labels)
    g = read_graph(tmp_path / "g.hnsw", dim)
    assert g.count == n and g.m == 12 and g.codes.dtype == np.int16
    rng = np.random.default_rng(1)
    Q = rng.normal(size=(200, dim)).astype(np.float32)
    Q /= np.linalg.norm(Q, axis=1, keepdims=True)
    for k, ef in ((10, 1), (50, 1), (10, 64)):
        index.set_ef(ef)
        g.ef = ef
        want, dist = index.knn_query(Q, k=k)
        got, sims = g.search(Q, k)
        assert got.shape == (200, k) and got.dtype == np.int64 and sims.dtype == np.float32
        same = np.mean([np.array_equal(a, b) for a, b in zip(want, got, strict=True)])
        overlap = np.mean([len(set(a) & set(b)) / k for a, b in zip(want, got, strict=True)])
        assert same >= 0.9 and overlap >= 0.995, (k, ef, same, overlap)
        rows = (want == got).all(axis=1)
        np.testing.assert_allclose(sims[rows], 1.0 - dist[rows], atol=1e-4)
        by_label = X[np.argsort(labels)]
        exact = np.einsum("nd,nkd->nk", Q, by_label[got])
        np.testing.assert_allclose(sims, exact, atol=1e-4)
        assert np.all(np.diff(sims, axis=1) <= 1e-6)  # best first


def test_a_search_repeats_itself_and_asks_for_more_than_the_graph_holds(tmp_path):
    _saved_graph(tmp_path / "g.hnsw", n=150, dim=8, m=8)
    g = read_graph(tmp_path / "g.hnsw", 8)
    q = np.ones((1, 8), np.float32) / np.sqrt(8)
    a = g.search(q, 20)
    for _ in range(3):  # visited stamps, not a cleared array: answers must not drift
        b = g.search(q, 20)
        np.testing.assert_array_equal(a[0], b[0])
    ids, sims = g.search(q, 500)  # more than it holds: every node, once, best first
    assert sorted(ids[0].tolist()) == list(range(150))
    assert np.all(np.diff(sims[0]) <= 1e-6)


def _bytes(path):
    return bytearray(path.read_bytes())


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[:50], "shorter than"),
        (lambda b: b[: len(b) // 2], "do not fit"),
        (lambda b: b + b"\0\0\0\0", "do not end"),
    ],
)
def test_a_truncated_or_padded_file_is_refused_by_name(tmp_path, damage, message):
    _saved_graph(tmp_path / "g.hnsw", n=300, dim=8, m=8)
    bad = tmp_path / "bad.hnsw"
    bad.write_bytes(bytes(damage(_bytes(tmp_path / "g.hnsw"))))
    with pytest.raises(GraphFileError, match=message) as e:
        read_graph(bad, 8)
    assert str(bad) in str(e.value)


def test_wrong_dimension_links_outside_and_deleted_marks_are_refused(tmp_path):
    index, _ = _saved_graph(tmp_path / "g.hnsw", n=300, dim=8, m=8)
    with pytest.raises(GraphFileError, match="element layout"):
        read_graph(tmp_path / "g.hnsw", 16)
    head = 8 * 6 + 4 + 4 + 8 * 3 + 8 + 8  # the header's bytes
    b = _bytes(tmp_path / "g.hnsw")
    b[head + 4 : head + 8] = (10**6).to_bytes(4, "little")  # node 0's first neighbour
    (tmp_path / "links.hnsw").write_bytes(bytes(b))
    with pytest.raises(GraphFileError, match="outside the graph"):
        read_graph(tmp_path / "links.hnsw", 8)
    index.mark_deleted(3)
    index.save_index(str(tmp_path / "deleted.hnsw"))
    with pytest.raises(GraphFileError, match="deleted"):
        read_graph(tmp_path / "deleted.hnsw", 8)
    (tmp_path / "nan.hnsw").write_bytes(bytes(_nan_vector(_bytes(tmp_path / "g.hnsw"), head)))
    with pytest.raises(GraphFileError, match="NaN"):
        read_graph(tmp_path / "nan.hnsw", 8)


def _nan_vector(b: bytearray, head: int) -> bytearray:
    m0 = int.from_bytes(b[64:72], "little")  # maxM0 follows maxlevel, entry and maxM
    at = head + 4 + 4 * m0  # node 0's vector
    b[at : at + 4] = np.array([np.nan], np.float32).tobytes()
    return b


def test_random_damage_is_refused_or_searched_safely(tmp_path):
    """The search runs without bounds checks, so every byte the reader accepts must keep it in
    bounds: flip bytes anywhere in a small graph file (header, links, vectors, upper layers);
    each result is either refused with GraphFileError or a graph every search of which
    returns in-range labels."""
    _saved_graph(tmp_path / "g.hnsw", n=200, dim=8, m=6)
    clean = _bytes(tmp_path / "g.hnsw")
    rng = np.random.default_rng(7)
    Q = rng.normal(size=(5, 8)).astype(np.float32)
    refused = 0
    for trial in range(300):
        b = bytearray(clean)
        for at in rng.integers(0, len(b), size=int(rng.integers(1, 4))):
            b[at] = int(rng.integers(0, 256))
        path = tmp_path / f"d{trial % 3}.hnsw"
        path.write_bytes(bytes(b))
        try:
            g = read_graph(path, 8)
        except GraphFileError as e:
            assert str(path) in str(e)
            refused += 1
            continue
        try:
            ids, sims = g.search(Q, min(10, g.count))
        except GraphFileError as e:  # links that cut the graph into islands: said, not crashed
            assert "islands" in str(e)
            continue
        assert ids.min() >= 0 and np.isin(ids, g.labels).all()
        assert np.isfinite(sims).all()
    assert refused > 0
