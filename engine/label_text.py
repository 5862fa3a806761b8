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

`candidates` finds the labels a title matches at least `theta` (they join the shortlist: the
indexes miss ~20% of the positives that have training points). An inverted index lists each
label under its heaviest components only, those without one of which the match stays below
theta, so a common word (`python`) does not pull in every label that contains it.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np

from engine.text import words

__all__ = ["MAX_COMPONENTS", "NAME_ONLY_S", "LabelText"]

MAX_COMPONENTS = 8
# base similarity s of a candidate that only its name brought in: ~0 (the indexes did not find
# it), but non-zero so a sparse candidate pattern keeps it
NAME_ONLY_S = 1e-9
_TRAILING_DIGITS = re.compile(r"\d+$")


def _components(name: str) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
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
            for c, (spellings, w) in enumerate(zip(cs, idf, strict=True)):
                for a, (s, x) in enumerate(zip(spellings, w, strict=True)):
                    self.piece[l, c, a] = self.vocab[s]
                    self.weight[l, c, a] = x / total
        self._inverted: dict[float, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def num_labels(self) -> int:
        return self.piece.shape[0]

    def title_ids(self, text: str) -> np.ndarray:
        """Sorted unique vocabulary ids of the title's words (words no name uses drop out)."""
        ids = {self.vocab[w] for w in words(text) if w in self.vocab}
        return np.array(sorted(ids), np.int64)

    def scores(self, titles: list[np.ndarray], rows: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """match(titles[rows[j]], labels[j]) for every candidate j (float32 [len(labels)]).

        titles: each row's `title_ids`. Membership of a (candidate, spelling) pair is one gather
        from a [rows, V] bitmap of the titles' ids (16 MB at most; larger batches go by chunks
        of rows): no search, no per-candidate Python."""
        rows = np.asarray(rows, np.int64)
        labels = np.asarray(labels, np.int64)
        lens = np.fromiter((t.size for t in titles), np.int64, len(titles))
        if not labels.size or not lens.sum():
            return np.zeros(labels.size, np.float32)
        P = self.piece[labels]  # [n, C, 2], -1 pads
        V, n = len(self.vocab), len(titles)
        step = max(1, (1 << 24) // (V + 1))
        hit = np.empty(P.shape, bool)
        for a in range(0, n, step):
            b = min(n, a + step)
            # flat [rows, V + 1] bitmap; column V stays False, and a pad (-1) lands on the pad
            # column of the row before (of the last row for row 0)
            bitmap = np.zeros((b - a) * (V + 1), bool)
            bitmap[
                np.repeat(np.arange(b - a) * (V + 1), lens[a:b]) + np.concatenate(titles[a:b])
            ] = True
            if a == 0 and b == n:
                hit = bitmap[P + (rows * (V + 1))[:, None, None]]
            else:
                sel = (rows >= a) & (rows < b)
                hit[sel] = bitmap[P[sel] + ((rows[sel] - a) * (V + 1))[:, None, None]]
        got = hit * self.weight[labels]  # [n, C, 2] float32
        return np.maximum(got[..., 0], got[..., 1]).sum(axis=1, dtype=np.float32)

    def _index(self, theta: float) -> tuple[np.ndarray, np.ndarray]:
        """CSR (indptr [V+1], labels) from spelling to the labels it is a key component of."""
        if theta not in self._inverted:
            cw = self.weight.max(axis=2)  # component weights [L, C]
            order = np.argsort(-cw, axis=1, kind="stable")
            cws = np.take_along_axis(cw, order, axis=1)
            before = np.cumsum(cws, axis=1) - cws  # weight of heavier components
            key = np.zeros(cw.shape, bool)
            np.put_along_axis(key, order, (before <= 1.0 - theta + 1e-6) & (cws > 0), axis=1)
            lab, comp = np.nonzero(key)
            pieces = self.piece[lab, comp]  # [n, 2]
            lab = np.repeat(lab, 2)[pieces.ravel() >= 0]
            pieces = pieces.ravel()[pieces.ravel() >= 0]
            pairs = np.unique(pieces * self.num_labels + lab)
            pieces, lab = np.divmod(pairs, self.num_labels)
            indptr = np.zeros(len(self.vocab) + 1, np.int64)
            np.cumsum(np.bincount(pieces, minlength=len(self.vocab)), out=indptr[1:])
            self._inverted[theta] = (indptr, lab.astype(np.int64))
        return self._inverted[theta]

    def candidates(self, titles: list[np.ndarray], theta: float) -> tuple[np.ndarray, np.ndarray]:
        """(rows, labels), grouped by row with ascending labels: every label whose match with
        titles[row] (`title_ids`) is at least theta (> 0)."""
        empty = np.zeros(0, np.int64)
        lens = np.fromiter((t.size for t in titles), np.int64, len(titles))
        if not lens.sum():
            return empty, empty
        indptr, ilab = self._index(float(theta))
        ids = np.concatenate(titles)
        start, cnt = indptr[ids], indptr[ids + 1] - indptr[ids]
        total = int(cnt.sum())
        if not total:
            return empty, empty
        pos = np.repeat(start - np.cumsum(cnt) + cnt, cnt) + np.arange(total)
        L = self.num_labels
        keys = np.unique(
            np.repeat(np.repeat(np.arange(len(titles), dtype=np.int64), lens), cnt) * L + ilab[pos]
        )
        rows, labels = np.divmod(keys, L)
        keep = self.scores(titles, rows, labels) >= np.float32(theta) - 1e-6
        return rows[keep], labels[keep]

    def add_to(
        self, texts: list[str], rows: np.ndarray, labels: np.ndarray, y: np.ndarray, weight: float
    ) -> np.ndarray:
        """y + weight * match on candidates (rows, labels) of texts; y unchanged at weight 0."""
        if weight <= 0:
            return y
        m = self.scores([self.title_ids(t) for t in texts], rows, labels)
        return (y + np.float32(weight) * m).astype(np.float32)
