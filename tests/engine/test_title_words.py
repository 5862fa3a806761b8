"""One split of a title serves both vectorizers and the label-name match: the shared word ids
must give exactly the arrays each consumer computes from the text on its own."""

from __future__ import annotations

import numpy as np
import pytest

from engine import kernels
from engine.label_text import LabelText
from engine.text import TfidfVectorizer
from engine.title_words import TitleWords

CORPUS = [
    "C++ bindings for GTK+",
    "GNU C library: shared libraries (libc6) for x86_64",
    "GTK+ graphical user interface library",
    "Python 3 bindings for the GNU C library",
    "e-mail client written in C#",
    "Übersetzungen für GNU gettext",
    "library library library of shared code",
    "shared library bindings for python3",
]
NAMES = ["python3-gtk", "libc6", "gettext", "gnu-library", "c++-bindings", "mail-client"]
TEXTS = [
    *CORPUS,
    "",
    "   ",
    "unknown words only zzz",
    "GNU gnu GNU library library shared shared shared C++ C++",
    "python3 bindings for gtk+ and the gnu c library, for x86_64 e-mail",
    "ÜBERSETZUNGEN FÜR gnu",
    " ".join(CORPUS),  # more than 24 distinct features
]

SETTINGS = [
    ({}, {"word_ngrams": 2}),
    ({"sublinear_tf": True}, {"word_ngrams": 2, "sublinear_tf": True}),
    ({"min_df": 2}, {"word_ngrams": 2, "max_df": 0.3}),  # words of kept pairs filtered out
    ({"word_ngrams": 2, "max_features": 12}, {"word_ngrams": 2, "max_features": 20}),
]


@pytest.mark.parametrize(("vec_args", "ranker_args"), SETTINGS)
def test_shared_split_gives_each_consumers_own_arrays(vec_args, ranker_args):
    vec = TfidfVectorizer(**vec_args).fit(CORPUS)
    ranker = TfidfVectorizer(**ranker_args).fit(CORPUS)
    lt = LabelText(NAMES)
    tw = TitleWords.build(vec, ranker, lt)
    assert tw.ranker is not None and tw.name_ids is not None
    bias = ranker.num_features
    for text in TEXTS:
        wids = tw.word_ids(text)
        for v, table, b in ((vec, tw.vec, -1), (ranker, tw.ranker, bias)):
            want_i, want_v = v.transform_one(text)
            got_i, got_v = kernels.title_tfidf(
                wids, table.unigram, table.pair_keys, table.pair_ids, table.idf, table.sublinear, b
            )
            if b >= 0:  # the ranker's bias feature closes its row
                assert got_i[-1] == b and got_v[-1] == 1.0
                got_i, got_v = got_i[:-1], got_v[:-1]
            np.testing.assert_array_equal(got_i, want_i)
            np.testing.assert_array_equal(got_v, want_v)  # bit for bit
        np.testing.assert_array_equal(kernels.title_name_ids(wids, tw.name_ids), lt.title_ids(text))


def test_char_ngram_vectorizers_are_not_covered():
    """An unknown word still has known character n-grams: such a vectorizer keeps its own
    analyser, and building the shared split for it is refused."""
    vec = TfidfVectorizer(char_ngrams=(3, 4)).fit(CORPUS)
    assert not TitleWords.covers(vec)
    assert TitleWords.covers(TfidfVectorizer(word_ngrams=2).fit(CORPUS))
    with pytest.raises(ValueError, match="words and word pairs"):
        TitleWords.build(vec)
