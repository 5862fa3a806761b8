"""Tokenizer and TF-IDF vectoriser: token rules, idf/normalisation, fast path, persistence."""

import json
from math import log, sqrt

import numpy as np
import pytest

from engine.text import TfidfVectorizer, analyze, words

CORPUS = [
    "C++ bindings for GTK+",
    "GNU C library: shared libraries (libc6) for x86_64",
    "GTK+ graphical user interface library",
    "Python 3 bindings for the GNU C library",
    "e-mail client written in C#",
    "Übersetzungen für GNU gettext",
    "library library library of shared code",
]

SETTINGS = [
    {},
    {"word_ngrams": 2},
    {"word_ngrams": 2, "char_ngrams": (3, 5)},
    {"char_ngrams": (2, 4), "sublinear_tf": True},
    {"min_df": 2, "max_df": 0.5},
]


def test_words_keep_programming_names_and_split_punctuation():
    assert words("C++ and GTK+ on x86_64, libc6 e-mail C# python3.11 Übersetzung") == [
        "c++",
        "and",
        "gtk+",
        "on",
        "x86_64",
        "libc6",
        "e",
        "mail",
        "c#",
        "python3",
        "11",
        "übersetzung",
    ]


def test_analyze_bigrams_and_marked_char_ngrams():
    assert analyze("GNU C library", word_ngrams=2) == ["gnu", "c", "library", "gnu c", "c library"]
    assert analyze("libc6", char_ngrams=(3, 3)) == ["libc6", "~<li", "~lib", "~ibc", "~bc6", "~c6>"]
    # a short word yields only the n-grams that fit inside its markers
    assert analyze("C", char_ngrams=(3, 5)) == ["c", "~<c>"]


def test_idf_is_smooth_and_rows_are_l2_normalised():
    v = TfidfVectorizer().fit(["a b", "a c", "a"])
    # vocabulary order: df descending, then token
    assert v.feature_names == ["a", "b", "c"]
    assert v.idf_ == pytest.approx([log(4 / 4) + 1, log(4 / 2) + 1, log(4 / 2) + 1])
    X = v.transform(["b b a"]).toarray()[0]
    raw = np.array([1 * v.idf_[0], 2 * v.idf_[1], 0.0])
    assert X == pytest.approx(raw / np.linalg.norm(raw), rel=1e-6)
    s = TfidfVectorizer(sublinear_tf=True).fit(["a b", "a c", "a"])
    raw = np.array([s.idf_[0], (1 + log(2)) * s.idf_[1], 0.0])
    assert s.transform(["b b a"]).toarray()[0] == pytest.approx(raw / np.linalg.norm(raw), rel=1e-6)


def test_empty_and_unknown_texts_give_zero_rows_not_nan():
    v = TfidfVectorizer(word_ngrams=2, char_ngrams=(3, 4)).fit(CORPUS)
    X = v.transform(["", "!!! ???", "zzqx", "GNU library"])
    assert X.dtype == np.float32 and X.shape == (4, v.num_features)
    assert not np.isnan(X.data).any()
    assert X[:2].nnz == 0
    assert X[3].nnz > 0 and sqrt(float(X[3].multiply(X[3]).sum())) == pytest.approx(1, rel=1e-6)
    idx, val = v.transform_one("")
    assert idx.dtype == np.int32 and val.dtype == np.float32 and idx.size == 0


def test_df_filters_and_max_features():
    v = TfidfVectorizer(min_df=2).fit(CORPUS)
    assert "gnu" in v.vocabulary_ and "gettext" not in v.vocabulary_
    v = TfidfVectorizer(max_df=0.4).fit(CORPUS)  # drops tokens in > 2.8 of 7 docs
    assert "gnu" not in v.vocabulary_ and "gettext" in v.vocabulary_
    v = TfidfVectorizer(max_features=3).fit(CORPUS)
    # highest df first: library (4 docs), then for / gnu (3 each) with ties broken by token
    assert v.feature_names == ["library", "for", "gnu"]
    with pytest.raises(ValueError, match="no token left"):
        TfidfVectorizer(min_df=100).fit(CORPUS)


@pytest.mark.parametrize("params", SETTINGS)
def test_transform_one_matches_batch_transform(params):
    v = TfidfVectorizer(**params).fit(CORPUS)
    texts = [*CORPUS, "GNU GNU gtk+ bindings, unknownword", "", "C"]
    X = v.transform(texts)
    for i, t in enumerate(texts):
        idx, val = v.transform_one(t)
        assert idx.tolist() == X[i].indices.tolist()
        np.testing.assert_allclose(val, X[i].data, rtol=1e-6)
    # the per-word memo must not change results: repeat the batch after the cache is warm
    assert (v.transform(texts) != X).nnz == 0


@pytest.mark.parametrize(
    "params", [*SETTINGS, {"max_features": 5}, {"min_df": 0.3, "word_ngrams": 2}, {"max_df": 2}]
)
def test_fit_transform_is_fit_then_transform(params):
    # one analysis per text (ids by first sight, renumbered) must give the very same model and
    # matrix as fitting and then transforming; with empty texts first, inside and last
    texts = ["", *CORPUS[:3], "!!!", *CORPUS[3:], "zzqx unique words here", ""]
    a = TfidfVectorizer(**params)
    Xa = a.fit_transform(texts)
    b = TfidfVectorizer(**params).fit(texts)
    Xb = b.transform(texts)
    assert a.vocabulary_ == b.vocabulary_ and list(a.vocabulary_) == list(b.vocabulary_)
    assert np.array_equal(a.idf_, b.idf_) and a.n_docs_ == b.n_docs_ == len(texts)
    assert Xa.shape == Xb.shape and Xa.dtype == Xb.dtype == np.float32
    assert np.array_equal(Xa.indptr, Xb.indptr) and np.array_equal(Xa.indices, Xb.indices)
    assert np.array_equal(Xa.data, Xb.data)
    with pytest.raises(ValueError, match="no texts given"):
        TfidfVectorizer(**params).fit_transform([])
    with pytest.raises(ValueError, match="no token left"):
        TfidfVectorizer(**params).fit_transform(["", "!!!"])


@pytest.mark.parametrize("params", SETTINGS)
def test_save_load_roundtrip_gives_identical_transforms(tmp_path, params):
    v = TfidfVectorizer(**params).fit(CORPUS)
    v.save(tmp_path / "vec")
    w = TfidfVectorizer.load(tmp_path / "vec")
    assert w.feature_names == v.feature_names
    a, b = v.transform(CORPUS), w.transform(CORPUS)
    assert (a != b).nnz == 0
    assert np.array_equal(v.transform_one(CORPUS[1])[1], w.transform_one(CORPUS[1])[1])
    # a .json path names the files directly
    v.save(tmp_path / "named.json")
    assert (TfidfVectorizer.load(tmp_path / "named.json").transform(CORPUS) != a).nnz == 0


def test_load_errors_name_the_file_and_field(tmp_path):
    v = TfidfVectorizer().fit(CORPUS)
    v.save(tmp_path)
    meta = json.loads((tmp_path / "tfidf.json").read_text())
    meta["vocabulary"] = meta["vocabulary"][:-1]
    (tmp_path / "tfidf.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"tfidf.npz: 'idf' has shape"):
        TfidfVectorizer.load(tmp_path)
    del meta["sublinear_tf"]
    (tmp_path / "tfidf.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"tfidf.json: missing field 'sublinear_tf'"):
        TfidfVectorizer.load(tmp_path)
    (tmp_path / "tfidf.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tfidf.json: not valid JSON"):
        TfidfVectorizer.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        TfidfVectorizer.load(tmp_path / "nowhere")


def test_fit_is_deterministic_regardless_of_input_hashing():
    a = TfidfVectorizer(word_ngrams=2).fit(CORPUS)
    b = TfidfVectorizer(word_ngrams=2).fit(list(reversed(CORPUS)))
    assert a.feature_names == b.feature_names
    assert np.array_equal(a.idf_, b.idf_)


@pytest.mark.parametrize(
    "params,ngram_range",
    [({}, (1, 1)), ({"word_ngrams": 2}, (1, 2)), ({"sublinear_tf": True}, (1, 1))],
)
def test_matches_scikit_learn(params, ngram_range):
    sk = pytest.importorskip("sklearn.feature_extraction.text")
    from engine.text import TOKEN_PATTERN

    ref = sk.TfidfVectorizer(
        token_pattern=TOKEN_PATTERN,
        ngram_range=ngram_range,
        sublinear_tf=params.get("sublinear_tf", False),
        dtype=np.float64,
    )
    R = ref.fit_transform(CORPUS)
    v = TfidfVectorizer(**params).fit(CORPUS)
    assert set(ref.vocabulary_) == set(v.vocabulary_)
    perm = [ref.vocabulary_[t] for t in v.feature_names]
    np.testing.assert_allclose(
        v.transform(CORPUS).toarray(), R.toarray()[:, perm], rtol=1e-5, atol=1e-7
    )


def test_unfitted_vectoriser_says_so():
    with pytest.raises(RuntimeError, match="not fitted"):
        TfidfVectorizer().transform_one("gnu")
    with pytest.raises(RuntimeError, match="not fitted"):
        TfidfVectorizer().transform(["gnu"])
