"""One tokenisation of a title shared by the predictor's single-title path.

The TF-IDF vectorizer, the sparse ranker's vectorizer (words + word pairs) and the label-name
match all split a title with the same word rule (`engine.text.words`). Splitting it three times
and looking each word up in three dicts was a fifth of a title's time. Here every word that any
of them knows gets one id in a joint dictionary; a title becomes one array of word ids
(`word_ids`, -1 for a word none of them knows) and compiled kernels
(`engine.kernels.title_tfidf`, `title_name_ids`) derive each vectorizer's TF-IDF row and the
label-name ids from it: the same ids and weights as `TfidfVectorizer.transform_one` and
`LabelText.title_ids` (weights to float64 summation order, which differs only in the last bit of
a float32 for titles of more than 24 distinct features).

Vectorizers with character n-grams are not covered (an unknown word still has known n-grams):
`TitleWords.covers` says whether a vectorizer can take this path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.label_text import LabelText
from engine.text import TfidfVectorizer, words

__all__ = ["TitleWords", "VocabTable"]


@dataclass(frozen=True)
class VocabTable:
    """One vectorizer's vocabulary over the joint word ids, as kernels.title_tfidf reads it."""

    unigram: np.ndarray  # int64 [W]: feature id of word w, -1 if not a feature
    pair_keys: np.ndarray  # int64, ascending: a * W + b for each word-pair feature "a b"
    pair_ids: np.ndarray  # int64: their feature ids
    idf: np.ndarray  # float64 [F]
    sublinear: bool


@dataclass(frozen=True)
class TitleWords:
    """The joint word dictionary and each consumer's table (None where a consumer is absent)."""

    index: dict[str, int]
    vec: VocabTable
    ranker: VocabTable | None
    name_ids: np.ndarray | None  # int64 [W]: LabelText vocabulary id of word w, -1 if none

    @staticmethod
    def covers(vec: TfidfVectorizer) -> bool:
        """Whether a vectorizer's features are all words or word pairs (no char n-grams)."""
        return vec.char_ngrams is None and vec.word_ngrams in (1, 2)

    @classmethod
    def build(
        cls,
        vec: TfidfVectorizer,
        ranker: TfidfVectorizer | None = None,
        label_text: LabelText | None = None,
    ) -> TitleWords:
        vecs = [v for v in (vec, ranker) if v is not None]
        for v in vecs:
            if not cls.covers(v):
                raise ValueError("TitleWords needs vectorizers of words and word pairs only")
        index: dict[str, int] = {}
        for v in vecs:
            for tok in v.vocabulary_:
                for w in tok.split(" "):
                    index.setdefault(w, len(index))
        if label_text is not None:
            for w in label_text.vocab:
                index.setdefault(w, len(index))
        name_ids = None
        if label_text is not None:
            name_ids = np.full(len(index), -1, np.int64)
            for w, i in label_text.vocab.items():
                name_ids[index[w]] = i
        return cls(
            index=index,
            vec=_table(vec, index),
            ranker=_table(ranker, index) if ranker is not None else None,
            name_ids=name_ids,
        )

    def word_ids(self, text: str) -> np.ndarray:
        """Joint ids of the title's words in order (-1: a word no consumer knows)."""
        get = self.index.get
        return np.array([get(w, -1) for w in words(text)], np.int64)


def _table(vec: TfidfVectorizer, index: dict[str, int]) -> VocabTable:
    W = len(index)
    unigram = np.full(W, -1, np.int64)
    keys, ids = [], []
    for tok, f in vec.vocabulary_.items():
        a, sep, b = tok.partition(" ")
        if sep:
            keys.append(index[a] * W + index[b])
            ids.append(f)
        else:
            unigram[index[tok]] = f
    order = np.argsort(np.array(keys, np.int64), kind="stable")
    return VocabTable(
        unigram=unigram,
        pair_keys=np.array(keys, np.int64)[order],
        pair_ids=np.array(ids, np.int64)[order],
        idf=np.ascontiguousarray(vec.idf_, np.float64),
        sublinear=bool(vec.sublinear_tf),
    )
