"""Label-name match: the share of a label's name that a title contains, idf-weighted.

Why: in short-text extreme classification the labels are often named with the words their
titles use (a package named after its library, a search query repeating a product's words).
A rare label's classifiers have seen one or two titles; its name is evidence they cannot
learn. The final score adds `weight * match` on each candidate, the weight chosen on the
validation split like alpha/beta/gamma (0, the first grid value, leaves the model unchanged,
as for label names that are ids).

A name is split into components, its words (`engine.text.words`, the titles' tokeniser); each
component has two spellings, the word and the word without trailing digits (`python3` ->
`python`, `libssl3` -> `libssl`), and counts once, with its best-matching spelling's idf:

    match(title, label) = sum over the label's components of max idf(spelling in title)
                          / sum over the label's components of max idf(spelling)

idf is computed over the label names (how many names use a spelling). Only the first
`MAX_COMPONENTS` words of a name count. Built from the label names alone, so a model or a
predictor rebuilds it from its checksummed labels.json.
"""
from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np

from engine.text import words

__all__ = ["MAX_COMPONENTS", "LabelText"]

MAX_COMPONENTS = 8
_TRAILING_DIGITS = re.compile(r"\d+$")


def _components(name: str) -> list[tuple[str, ...]]:
    out = []
    for w in words(name)[:MAX_COMPONENTS]:
        short = _TRAILING_DIGITS.sub("", w)
        out.append((w, short) if short and short != w else (w,))
    return out


class LabelText:
    """Label names as padded arrays: `piece[l, c, a]` is the vocabulary id of spelling a of
    component c of label l (-1 pads), `weight[l, c, a]` its idf over the label's total."""

    def __init__(self, names: list[str]):
        comps = [_components(str(n)) for n in names]
        df = Counter(s for cs in comps for s in {s for c in cs for s in c})
        self.vocab = {s: i for i, s in enumerate(sorted(df))}
        L, C = len(names), max([len(cs) for cs in comps] + [1])
        self.piece = np.full((L, C, 2), -1, np.int64)
        self.weight = np.zeros((L, C, 2), np.float32)
        for l, cs in enumerate(comps):
            idf = [[math.log((L + 1) / (df[s] + 1)) + 1.0 for s in c] for c in cs]
            total = sum(max(x) for x in idf)
            for c, (spellings, w) in enumerate(zip(cs, idf)):
                for a, (s, x) in enumerate(zip(spellings, w)):
                    self.piece[l, c, a] = self.vocab[s]
                    self.weight[l, c, a] = x / total

    @property
    def num_labels(self) -> int:
        return self.piece.shape[0]

    def title_ids(self, text: str) -> np.ndarray:
        """Sorted unique vocabulary ids of the title's words (words no name uses drop out)."""
        ids = {self.vocab[w] for w in words(text) if w in self.vocab}
        return np.array(sorted(ids), np.int64)

    def scores(self, titles: list[np.ndarray], rows: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """match(titles[rows[j]], labels[j]) for every candidate j (float32 [len(labels)]).

        titles: each row's `title_ids`. One sorted key array (row * V + id) answers every
        (candidate, spelling) membership test with a binary search: no per-candidate Python."""
        rows = np.asarray(rows, np.int64)
        labels = np.asarray(labels, np.int64)
        out = np.zeros(labels.size, np.float32)
        lens = np.fromiter((t.size for t in titles), np.int64, len(titles))
        if not labels.size or not lens.sum():
            return out
        V = len(self.vocab)
        keys = np.concatenate(titles) + np.repeat(np.arange(len(titles), dtype=np.int64) * V, lens)
        P = self.piece[labels]                                 # [n, C, 2]
        K = P + (rows * V)[:, None, None]
        pos = np.minimum(np.searchsorted(keys, K), keys.size - 1)
        hit = (keys[pos] == K) & (P >= 0)
        return np.where(hit, self.weight[labels], 0.0).max(axis=2).sum(axis=1).astype(np.float32)

    def add_to(self, texts: list[str], rows: np.ndarray, labels: np.ndarray, y: np.ndarray,
               weight: float) -> np.ndarray:
        """y + weight * match on candidates (rows, labels) of texts; y unchanged at weight 0."""
        if weight <= 0:
            return y
        m = self.scores([self.title_ids(t) for t in texts], rows, labels)
        return (y + np.float32(weight) * m).astype(np.float32)
