"""Text features for short texts (page titles): a tokenizer and a TF-IDF vectoriser.

One module serves training (batch `transform`) and the latency-critical predictor
(`transform_one`, a few microseconds per title), so both paths share the same analyser.

Tokens (deterministic, unicode-aware):
* text is lower-cased with `str.lower` (what scikit-learn does; `casefold` would also fold
  e.g. German sharp s, which changes nothing for our corpora and breaks the sklearn check);
* words are runs of `\\w` (unicode letters, digits, underscore) followed by any trailing `+`
  or `#`: `c++`, `g++`, `gtk+`, `c#`, `x86_64`, `libc6`, `ä` stay single tokens; hyphens,
  dots, slashes and other punctuation split (`python3.11` -> `python3`, `11`; `e-mail` ->
  `e`, `mail`). Single characters are kept (`c`, `r`, `x` are meaningful in package titles);
* with `word_ngrams=2`, adjacent word pairs are added as `"w1 w2"` (space-joined);
* with `char_ngrams=(lo, hi)`, each word wrapped in boundary markers `<word>` contributes its
  character n-grams of length lo..hi, prefixed with `~` so they never collide with a word
  (`libc6`, (3, 3) -> `~<li`, `~lib`, `~ibc`, `~bc6`, `~c6>`), as the paper did for queries.

Weights: tf (raw count, or 1 + ln tf with `sublinear_tf`) times the scikit-learn smooth idf
ln((1 + n) / (1 + df)) + 1, rows L2-normalised; unknown tokens are ignored and a text with no
known token gives an all-zero row. Saved as JSON (parameters + vocabulary in index order) plus
an .npz with the idf vector: no pickle.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from tqdm import tqdm

__all__ = ["TOKEN_PATTERN", "TfidfVectorizer", "analyze", "words"]

TOKEN_PATTERN = r"\w+[+#]*"
_WORD_RE = re.compile(TOKEN_PATTERN)
_FORMAT = "astec-tfidf"
_VERSION = 1
_CACHE_MAX = 200_000


def words(text: str) -> list[str]:
    """Lower-cased word tokens of `text` (see the module docstring for the rules)."""
    return _WORD_RE.findall(text.lower())


def analyze(
    text: str, word_ngrams: int = 1, char_ngrams: tuple[int, ...] | None = None
) -> list[str]:
    """All features of `text` in a fixed order: words, then bigrams, then char n-grams."""
    ws = _WORD_RE.findall(text.lower())
    out = list(ws)
    if word_ngrams >= 2 and len(ws) > 1:
        out.extend([a + " " + b for a, b in itertools.pairwise(ws)])
    if char_ngrams is not None:
        lo, hi = char_ngrams
        for w in ws:
            m = "<" + w + ">"
            lm = len(m)
            for n in range(lo, min(hi, lm) + 1):
                out.extend(["~" + m[i : i + n] for i in range(lm - n + 1)])
    return out


@dataclass
class TfidfVectorizer:
    """TF-IDF over `analyze` features; fit / transform / transform_one / save / load.

    min_df: int = minimum document count, float in (0, 1) = minimum fraction of documents.
    max_df: float in (0, 1] = maximum fraction of documents (or int count).
    max_features: keep the features with the highest df (ties by token) after the df filters.
    Vocabulary order is deterministic: df descending, then token.
    """

    min_df: int | float = 1
    max_df: int | float = 1.0
    max_features: int | None = None
    sublinear_tf: bool = False
    word_ngrams: int = 1
    char_ngrams: tuple[int, ...] | None = None  # (lo, hi)
    vocabulary_: dict[str, int] = field(default_factory=dict, repr=False)
    idf_: np.ndarray | None = field(default=None, repr=False)
    n_docs_: int = 0

    def __post_init__(self):
        if self.word_ngrams not in (1, 2):
            raise ValueError(f"word_ngrams must be 1 or 2, got {self.word_ngrams}")
        if self.char_ngrams is not None:
            ok = len(self.char_ngrams) == 2
            lo, hi = (int(v) for v in self.char_ngrams) if ok else (0, 0)
            if not ok or not 1 <= lo <= hi:
                raise ValueError(
                    f"char_ngrams must be (lo, hi) with 1 <= lo <= hi, got {self.char_ngrams}"
                )
            self.char_ngrams = (lo, hi)
        if self.idf_ is not None:
            self._compile()
        if self.max_features is not None and self.max_features < 1:
            raise ValueError(f"max_features must be >= 1, got {self.max_features}")

    # ---- analysis -------------------------------------------------------------------------
    def analyze(self, text: str) -> list[str]:
        """The features of one text, before vocabulary lookup."""
        return analyze(text, self.word_ngrams, self.char_ngrams)

    @property
    def num_features(self) -> int:
        return len(self.vocabulary_)

    @property
    def feature_names(self) -> list[str]:
        """Tokens in index order."""
        names = [""] * len(self.vocabulary_)
        for tok, i in self.vocabulary_.items():
            names[i] = tok
        return names

    # ---- fitting --------------------------------------------------------------------------
    def fit(self, texts, progress: bool = False) -> TfidfVectorizer:
        """Learn the vocabulary and idf from an iterable of texts."""
        df: Counter[str] = Counter()
        n = 0
        an = self.analyze
        for text in tqdm(texts, desc="tfidf fit", unit="doc", disable=not progress):
            df.update(set(an(text)))
            n += 1
        self._choose(list(df), np.fromiter(df.values(), np.int64, len(df)), n)
        return self

    def _choose(self, tokens: list[str], df: np.ndarray, n: int) -> np.ndarray:
        """The vocabulary and idf from the tokens' document counts df over n texts; returns the
        kept tokens' positions in `tokens`, in index order (df descending, then token)."""
        if n == 0:
            raise ValueError("TfidfVectorizer.fit: no texts given")
        lo = self.min_df if isinstance(self.min_df, int) else math.ceil(self.min_df * n)
        hi = self.max_df if isinstance(self.max_df, int) else math.floor(self.max_df * n)
        rank = np.empty(len(tokens), np.int64)  # each token's place in code-point order
        rank[sorted(range(len(tokens)), key=tokens.__getitem__)] = np.arange(len(tokens))
        kept = np.flatnonzero((df >= lo) & (df <= hi))
        kept = kept[np.lexsort((rank[kept], -df[kept]))][: self.max_features]
        if not kept.size:
            raise ValueError(
                f"TfidfVectorizer.fit: no token left after min_df={self.min_df}, "
                f"max_df={self.max_df} over {n} texts"
            )
        self.vocabulary_ = {tokens[i]: j for j, i in enumerate(kept.tolist())}
        self.idf_ = np.log((1.0 + n) / (1.0 + df[kept].astype(np.float64))) + 1.0
        self.n_docs_ = n
        self._compile()
        return kept

    def _compile(self) -> None:
        self._idf = self._fitted_idf()
        self._idf32 = self._idf.astype(np.float32)
        self._idf_list = self._idf.tolist()
        self._word_cache: dict[str, list[int]] = {}

    def _word_ids(self, w: str) -> list[int]:
        """Known feature ids of one word (itself + its char n-grams), memoised per word.

        Words repeat across titles, so the char n-gram work is done once per distinct word;
        the cache is dropped when it grows past _CACHE_MAX words to bound memory.
        """
        vocab_get = self.vocabulary_.get
        feats = [w]
        if self.char_ngrams is not None:
            lo, hi = self.char_ngrams
            m = "<" + w + ">"
            lm = len(m)
            for n in range(lo, min(hi, lm) + 1):
                feats.extend(["~" + m[i : i + n] for i in range(lm - n + 1)])
        ids = [i for i in map(vocab_get, feats) if i is not None]
        cache = self._word_cache
        if len(cache) >= _CACHE_MAX:
            cache.clear()
        cache[w] = ids
        return ids

    def _ids(self, text: str) -> list[int]:
        """Known feature ids of a text, with repeats (same multiset as looking up `analyze`)."""
        ws = _WORD_RE.findall(text.lower())
        cache_get = self._word_cache.get
        out: list[int] = []
        for w in ws:
            ids = cache_get(w)
            out.extend(ids if ids is not None else self._word_ids(w))
        if self.word_ngrams >= 2 and len(ws) > 1:
            vocab_get = self.vocabulary_.get
            out.extend(
                [
                    i
                    for i in map(vocab_get, [a + " " + b for a, b in itertools.pairwise(ws)])
                    if i is not None
                ]
            )
        return out

    def _check_fitted(self) -> None:
        self._fitted_idf()

    def _fitted_idf(self) -> np.ndarray:
        if self.idf_ is None:
            raise RuntimeError("TfidfVectorizer is not fitted: call fit() or load()")
        return self.idf_

    # ---- transforming ---------------------------------------------------------------------
    def transform(self, texts, progress: bool = False) -> sp.csr_matrix:
        """CSR float32 [n, V] with L2-normalised rows (all-zero rows for unknown-only texts)."""
        self._check_fitted()
        return self._weigh(_counts(texts, self._ids, lambda: len(self.vocabulary_), progress))

    def _weigh(self, X: sp.csr_matrix) -> sp.csr_matrix:
        """Term counts (csr float32, sorted indices) -> tf-idf rows, L2-normalised in place."""
        n = X.shape[0]
        if self.sublinear_tf:
            np.log(X.data, out=X.data)
            X.data += 1.0
        X.data *= self._idf32[X.indices]
        row_len = np.diff(X.indptr)
        rows = np.repeat(np.arange(n), row_len)
        norms = np.sqrt(np.bincount(rows, weights=X.data.astype(np.float64) ** 2, minlength=n))
        norms[norms == 0] = 1.0
        X.data /= norms[rows].astype(np.float32)
        return X

    def fit_transform(self, texts, progress: bool = False) -> sp.csr_matrix:
        """fit, then transform of the same texts (the same vocabulary, idf and matrix), with each
        text analysed once: its features take ids in order of first sight, counted per text,
        then renumbered into the vocabulary's order (the word-pair vectoriser of a training set
        spent two thirds of its time analysing the texts a second time)."""
        first: dict[str, int] = {}
        get = first.setdefault
        an = self.analyze
        X = _counts(
            texts, lambda t: [get(f, len(first)) for f in an(t)], lambda: len(first), progress
        )
        n = X.shape[0]
        kept = self._choose(list(first), np.bincount(X.indices, minlength=len(first)), n)
        new = np.full(max(len(first), 1), -1, np.int64)
        new[kept] = np.arange(kept.size)
        col = new[X.indices]
        keep = col >= 0
        kept_before = np.concatenate([[0], np.cumsum(keep)])  # kept entries before each entry
        indptr = kept_before[X.indptr]
        Xk = sp.csr_matrix((X.data[keep], col[keep].astype(np.int32), indptr), shape=(n, kept.size))
        Xk.sort_indices()
        return self._weigh(Xk)

    def transform_one(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """One text -> (indices int32 ascending, values float32), same values as `transform`.

        The predictor's hot path: plain dict/list work on ~10 tokens, no sparse matrices.
        """
        self._check_fitted()
        counts = Counter(self._ids(text))
        if not counts:
            return np.empty(0, dtype=np.int32), np.empty(0, dtype=np.float32)
        if len(counts) > 24:  # many char n-grams: numpy beats Python lists
            idx = np.fromiter(counts.keys(), dtype=np.int32, count=len(counts))
            tf = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
            order = np.argsort(idx)
            idx, tf = idx[order], tf[order]
            if self.sublinear_tf:
                tf = 1.0 + np.log(tf)
            vals = tf * self._idf[idx]
            vals /= math.sqrt(float(vals @ vals))
            return idx, vals.astype(np.float32)
        ids = sorted(counts)
        idf = self._idf_list
        if self.sublinear_tf:
            weights = [(1.0 + math.log(counts[i])) * idf[i] for i in ids]
        else:
            weights = [counts[i] * idf[i] for i in ids]
        norm = math.sqrt(sum(v * v for v in weights))
        return (
            np.array(ids, dtype=np.int32),
            np.array([v / norm for v in weights], dtype=np.float32),
        )

    # ---- persistence ----------------------------------------------------------------------
    @staticmethod
    def _paths(path) -> tuple[Path, Path]:
        p = Path(path)
        if p.suffix == ".json":
            return p, p.with_suffix(".npz")
        return p / "tfidf.json", p / "tfidf.npz"

    def save(self, path) -> Path:
        """Write `<dir>/tfidf.json` + `<dir>/tfidf.npz` (or `<name>.json` + `<name>.npz`)."""
        self._check_fitted()
        jpath, npath = self._paths(path)
        jpath.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": _FORMAT,
            "version": _VERSION,
            "token_pattern": TOKEN_PATTERN,
            "min_df": self.min_df,
            "max_df": self.max_df,
            "max_features": self.max_features,
            "sublinear_tf": self.sublinear_tf,
            "word_ngrams": self.word_ngrams,
            "char_ngrams": list(self.char_ngrams) if self.char_ngrams else None,
            "n_docs": self.n_docs_,
            "vocabulary": self.feature_names,
        }
        jpath.write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
        np.savez(npath, idf=self._fitted_idf())
        return jpath

    @classmethod
    def load(cls, path) -> TfidfVectorizer:
        """Read what `save` wrote; errors name the file and the bad field."""
        jpath, npath = cls._paths(path)
        try:
            meta = json.loads(jpath.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"{jpath}: TF-IDF vectoriser file not found") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{jpath}: not valid JSON ({e})") from None
        if meta.get("format") != _FORMAT or meta.get("version") != _VERSION:
            raise ValueError(
                f"{jpath}: field 'format'/'version' is "
                f"{meta.get('format')!r}/{meta.get('version')!r}, expected "
                f"{_FORMAT!r}/{_VERSION}"
            )
        if meta.get("token_pattern") != TOKEN_PATTERN:
            raise ValueError(
                f"{jpath}: field 'token_pattern' {meta.get('token_pattern')!r} "
                f"differs from this code's {TOKEN_PATTERN!r}"
            )
        try:
            vocab = meta["vocabulary"]
            v = cls(
                min_df=meta["min_df"],
                max_df=meta["max_df"],
                max_features=meta["max_features"],
                sublinear_tf=bool(meta["sublinear_tf"]),
                word_ngrams=int(meta["word_ngrams"]),
                char_ngrams=tuple(meta["char_ngrams"]) if meta["char_ngrams"] else None,
            )
            v.n_docs_ = int(meta["n_docs"])
        except KeyError as e:
            raise ValueError(f"{jpath}: missing field {e.args[0]!r}") from None
        with np.load(npath, allow_pickle=False) as z:
            if "idf" not in z:
                raise ValueError(f"{npath}: missing array 'idf'")
            idf = np.asarray(z["idf"], dtype=np.float64)
        if idf.shape != (len(vocab),):
            raise ValueError(
                f"{npath}: 'idf' has shape {idf.shape} but {jpath} has "
                f"{len(vocab)} vocabulary entries"
            )
        v.vocabulary_ = {t: i for i, t in enumerate(vocab)}
        if len(v.vocabulary_) != len(vocab):
            raise ValueError(f"{jpath}: field 'vocabulary' has duplicate tokens")
        v.idf_ = idf
        v._compile()
        return v


def _counts(texts, ids_of, width, progress: bool) -> sp.csr_matrix:
    """Feature counts of each text (csr float32, ascending columns, one entry per feature):
    ids_of(text) its feature ids with repeats, width() the number of columns once all are read
    (at least 1)."""
    cols: list[int] = []
    lengths: list[int] = []
    for text in tqdm(texts, desc="tfidf", unit="doc", disable=not progress):
        ids = ids_of(text)
        cols.extend(ids)
        lengths.append(len(ids))
    n = len(lengths)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    X = sp.csr_matrix(
        (np.ones(len(cols), dtype=np.float32), np.asarray(cols, dtype=np.int32), indptr),
        shape=(n, max(width(), 1)),
    )
    X.sum_duplicates()  # counts repeated features, sorts indices
    return X
