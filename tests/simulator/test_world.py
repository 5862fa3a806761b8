"""The simulated world has the statistics the paper describes, deterministically, on disk and
back."""

import collections
import hashlib

import numpy as np
import pytest

from simulator.world import generate_world, load_world, save_world, world_from_dataset


@pytest.fixture(scope="module")
def world():
    return generate_world(n_queries=20_000, n_pages=30_000, n_users=500, seed=3)


def _slope(freq):
    """Least-squares slope of log frequency against log rank over the head (ranks 1..n/10)."""
    f = np.sort(np.asarray(freq, float))[::-1]
    f = f[f > 0][: max(10, len(f) // 10)]
    r = np.arange(1, len(f) + 1)
    return np.polyfit(np.log(r), np.log(f), 1)[0]


def test_text_lengths_and_unique_queries(world):
    tl = np.array([len(t.split()) for t in world.page_title])
    ql = np.array([len(q.split()) for q in world.query_text])
    assert tl.min() == 3 and tl.max() == 12 and 5 <= tl.mean() <= 8
    assert ql.min() == 1 and ql.max() == 6 and 2 <= ql.mean() <= 4
    assert len(set(world.query_text)) == world.n_queries
    assert all(len(set(q.split())) == len(q.split()) for q in world.query_text)


def test_zipfian_popularity(world):
    assert -1.3 < _slope(world.query_pop) < -0.7
    assert -1.1 < _slope(world.page_pop) < -0.5
    # head queries lead to many pages, the median one to a handful
    deg = np.bincount(world.link_query, minlength=world.n_queries)
    assert deg.max() > 50 * max(np.median(deg[deg > 0]), 1)


def test_many_rare_words(world):
    counts = collections.Counter(w for t in world.page_title + world.query_text for w in t.split())
    c = np.array(list(counts.values()))
    assert (c <= 2).mean() > 0.4, "most of the vocabulary should be seen at most twice"


def test_queries_paraphrase_titles(world):
    overlap, contained = [], 0
    for p in range(3000):
        title = set(world.page_title[p].split())
        for q in world.link_query[world.link_indptr[p] : world.link_indptr[p + 1]]:
            words = set(world.query_text[q].split())
            o = len(words & title) / len(words)
            overlap.append(o)
            contained += o == 1.0
    overlap = np.array(overlap)
    assert 0.1 < overlap.mean() < 0.6
    assert contained / len(overlap) < 0.25  # titles rarely copy a query whole
    assert (overlap > 0).mean() > 0.3  # but often share words with it
    # the strongest query of a page shares words with its title more than a weaker one
    firsts = world.link_query[world.link_indptr[:-1]]
    o1 = np.mean(
        [
            len(set(world.query_text[q].split()) & set(world.page_title[p].split())) > 0
            for p, q in enumerate(firsts[:3000])
        ]
    )
    assert o1 > 0.6


def test_pages_and_queries_organised_by_subtopic(world):
    lp = world.link_pages()
    same = world.page_subtopic[lp] == world.query_subtopic[world.link_query]
    assert 0.7 < same.mean() < 0.95  # mostly its subtopic, some cross-links
    assert len(np.unique(world.query_subtopic)) > 0.9 * world.n_subtopics
    assert (world.subtopic_topic[world.query_subtopic] == world.query_topic).all()


def test_deterministic_and_round_trips(tmp_path):
    a = generate_world(2000, 3000, 50, seed=11)
    b = generate_world(2000, 3000, 50, seed=11)
    c = generate_world(2000, 3000, 50, seed=12)
    assert a.query_text == b.query_text and a.page_title == b.page_title
    assert np.array_equal(a.link_query, b.link_query)
    assert a.page_title != c.page_title
    save_world(a, tmp_path / "w1")
    save_world(b, tmp_path / "w2")
    for name in ["queries.tsv", "pages.jsonl", "users.jsonl", "truth/user_interests.jsonl"]:
        h1 = hashlib.sha1((tmp_path / "w1" / name).read_bytes()).hexdigest()
        h2 = hashlib.sha1((tmp_path / "w2" / name).read_bytes()).hexdigest()
        assert h1 == h2, name
    r = load_world(tmp_path / "w1")
    assert r.query_text == a.query_text and r.page_url == a.page_url
    assert np.array_equal(r.link_indptr, a.link_indptr) and np.array_equal(
        r.link_query, a.link_query
    )
    assert np.array_equal(r.interest_subtopic, a.interest_subtopic)
    assert np.allclose(r.page_pop, a.page_pop, rtol=1e-4)


def test_world_from_dataset_clusters_cooccurring_labels(tmp_path):
    rng = np.random.default_rng(0)
    lines = []
    for i in range(400):  # labels 0-9 co-occur, 10-19 co-occur, never across the groups
        g = i % 2
        labels = sorted(set((g * 10 + rng.choice(10, 3, replace=False)).tolist()))
        lines.append(f"point {i} group{g}\t{','.join(map(str, labels))}")
    (tmp_path / "train.tsv").write_text("\n".join(lines[:300]) + "\n")
    (tmp_path / "test.tsv").write_text("\n".join(lines[300:]) + "\n")
    (tmp_path / "labels.txt").write_text("\n".join(f"label {j}" for j in range(20)) + "\n")
    w = world_from_dataset(tmp_path, n_users=20, seed=0, n_topics=2, subtopics_per_topic=2)
    assert w.n_pages == 400 and w.n_queries == 20 and w.query_text[5] == "label 5"
    assert w.page_split[:300] == ["train"] * 300 and w.page_split[300] == "test"
    assert sorted(w.link_query[w.link_indptr[0] : w.link_indptr[1]].tolist()) == [
        int(x) for x in lines[0].split("\t")[1].split(",")
    ]
    assert len(set(w.query_topic[:10])) == 1 and len(set(w.query_topic[10:])) == 1
    assert w.query_topic[0] != w.query_topic[10]
    assert (w.page_topic[::2] == w.query_topic[0]).all()
    save_world(w, tmp_path / "world")
    assert load_world(tmp_path / "world").page_split == w.page_split
